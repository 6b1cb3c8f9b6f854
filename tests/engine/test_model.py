"""The runner reproduces transformers: logits on the default model, greedy generate, rope scaling variants."""
from __future__ import annotations

import pytest
import torch

from server.config import config_from_dict
from server.engine import Engine, load_engine
from server.tokenization import encode_chat, stop_token_ids
from tests.conftest import write_tiny_llama

PROMPTS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a Python function that reverses a string."}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name three primary colors."}],
]


def _logits(engine: Engine, ids: list[int]) -> torch.Tensor:
    seq = engine.add(ids)
    try:
        hidden = engine.forward(seq, ids, torch.arange(len(ids)))
        return engine.model.logits(hidden)
    finally:
        engine.release(seq)


def test_logits_match_transformers_default_model(fp32_config, target32, tokenizer, hf_model32):
    engine = Engine(fp32_config, target=target32)
    ids = encode_chat(tokenizer, PROMPTS[1])
    with torch.inference_mode():
        ref = hf_model32(torch.tensor([ids])).logits[0]
    ours = _logits(engine, ids)
    # Bit for bit: the same float32 GEMMs and transformers' order of operations in RMSNorm and RoPE (core/ops.py).
    assert torch.equal(ours, ref), f"max |diff| {(ours - ref).abs().max().item():.3g}"


def test_greedy_equals_transformers_generate(fp32_config, target32, tokenizer, hf_model32):
    engine = Engine(fp32_config, target=target32)
    stops = stop_token_ids(tokenizer, target32.args.eos_token_ids)
    for messages in PROMPTS:
        ids = encode_chat(tokenizer, messages)
        ours = engine.generate(ids, max_new_tokens=32, stop_token_ids=stops).token_ids
        with torch.inference_mode():
            x = torch.tensor([ids])
            ref = hf_model32.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=32, do_sample=False,
                                      eos_token_id=list(stops), pad_token_id=stops[0], temperature=None,
                                      top_p=None, top_k=None)[0, len(ids):].tolist()
        assert ours == ref, (messages, ours, ref)


@pytest.mark.parametrize("rope_scaling,tie", [
    (None, True),
    ({"rope_type": "linear", "factor": 2.0}, False),
    ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
      "original_max_position_embeddings": 32}, False),
])
def test_tiny_llama_variants_match_transformers(tmp_path, rope_scaling, tie):
    from transformers import AutoModelForCausalLM

    write_tiny_llama(tmp_path, vocab_size=64, hidden=64, layers=2, heads=4, kv_heads=1,
                     rope_scaling=rope_scaling, tie=tie)
    cfg = config_from_dict({"model": {"source": str(tmp_path), "dtype": "float32", "device": "cpu"},
                            "cache": {"num_slots": 1, "max_seq_len": 200}})
    engine = load_engine(cfg)
    ids = torch.randint(0, 64, (150,), generator=torch.Generator().manual_seed(0)).tolist()
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    with torch.inference_mode():
        ref = hf(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(_logits(engine, ids), ref, atol=2e-4, rtol=1e-4)


def test_cached_load_reuses_the_files_metadata(fp32_config, target32):
    """The second load reads the GGUF file's metadata from the cache (same directory, nothing read again), and
    the cache holds no weights: those are read from the file."""
    from server.model_files import resolve_model

    files = ("config.json", "tokenizer.json", "gguf-tensors.json")
    before = {n: (target32.hf_dir / n).stat().st_mtime_ns for n in files}
    again = resolve_model(fp32_config.model.source, fp32_config.model.cache_dir, progress=False)
    assert again.hf_dir == target32.hf_dir and again.gguf == target32.gguf
    assert {n: (again.hf_dir / n).stat().st_mtime_ns for n in files} == before
    assert not [p for p in again.hf_dir.iterdir() if p.suffix in (".safetensors", ".bin", ".pt")]


def test_unsupported_architecture_is_rejected(tmp_path):
    from core.ops import LlamaArgs

    with pytest.raises(ValueError, match="unsupported"):
        LlamaArgs.from_hf({"model_type": "gpt2", "vocab_size": 8})
    cfg = write_tiny_llama(tmp_path)
    with pytest.raises(ValueError, match="rope scaling"):
        from core.ops import rope_inv_freq
        rope_inv_freq(LlamaArgs.from_hf({**cfg, "rope_scaling": {"rope_type": "yarn", "factor": 2.0}}))
