"""A GGUF file's tensors, memory-mapped, under transformers' names: what the engine loads a GGUF model from.

The ``gguf`` package's reader parses every metadata array element by element (a 262k-token vocabulary: ~12 s on a
2-core machine), so the index is read by a header walk of our own (``_parse``: it steps over arrays without building
them, ~0.2 s; tested equal to the reader's on the real files), once per file: the tensors' names, types, shapes and
byte offsets and the few metadata fields the weights need are kept as a small JSON index
(``GGUFFile.open(path, index_dir)``), and later loads map the file and slice it by offset (milliseconds).

Weights come out as transformers' GGUF loader gives them (``transformers.modeling_gguf_pytorch_utils``), tensor by
tensor and bit for bit: de-quantized with the ``gguf`` package's own ``dequantize`` in float32; llama.cpp's "llama"
converter interleaves q_proj's and k_proj's rows for its RoPE layout, undone here; its Gemma converter stores norm
weights as 1 + w, so w = stored - 1 (in float32, as transformers computes it).
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterator

import numpy as np
import torch

INDEX_NAME = "gguf-tensors.json"
INDEX_VERSION = 2  # 2: general.name kept

# llama.cpp's tensor names -> transformers' (every supported family; Mistral files say "llama")
_TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_BLOCK = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
          "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
          "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
          "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
# Gemma 3 norms both sides of each sublayer: its "ffn_norm" is the pre-feed-forward one
_BLOCK_GEMMA3 = {**_BLOCK, "ffn_norm": "pre_feedforward_layernorm", "post_attention_norm": "post_attention_layernorm",
                 "post_ffw_norm": "post_feedforward_layernorm"}
BLOCK_NAMES = {"llama": _BLOCK, "qwen2": _BLOCK, "qwen3": _BLOCK, "gemma3": _BLOCK_GEMMA3}
ARCHITECTURES = tuple(BLOCK_NAMES)  # general.architecture values whose tensors are read


@dataclass(frozen=True)
class TensorInfo:
    name: str         # llama.cpp's name (blk.0.attn_q.weight)
    type: str         # GGML type name (Q4_K, F32, ...)
    shape: tuple      # the numpy shape of the stored data: [rows, bytes per row] for block types, else the values'
    dtype: str        # numpy dtype of the stored data (uint8 for block types)
    offset: int       # byte offset in the file


@dataclass(frozen=True)
class GGUFFile:
    path: Path
    architecture: str | None
    head_count: int | None
    head_count_kv: int | None
    tensors: tuple[TensorInfo, ...]
    name: str | None = None  # general.name: the checkpoint's own name, where the file gives one

    @classmethod
    def open(cls, path: Path, index_dir: Path | None = None) -> "GGUFFile":
        """The file's tensor index: read from ``index_dir``/gguf-tensors.json where it was written for this very
        file (size and modification time), else parsed with the ``gguf`` package (and written there)."""
        path = Path(path)
        st = path.stat()
        stamp = {"version": INDEX_VERSION, "size": st.st_size, "mtime_ns": st.st_mtime_ns}
        index = Path(index_dir) / INDEX_NAME if index_dir is not None else None
        if index is not None and index.is_file():
            saved = json.loads(index.read_text())
            if saved.get("stamp") == stamp:
                return cls(path, saved["architecture"], saved["head_count"], saved["head_count_kv"],
                           tuple(TensorInfo(**{**t, "shape": tuple(t["shape"])}) for t in saved["tensors"]),
                           saved["name"])
        f = cls._parse(path)
        if index is not None:
            index.parent.mkdir(parents=True, exist_ok=True)
            tmp = index.with_suffix(f".{os.getpid()}.tmp")  # a process of its own each (replicas starting together)
            tmp.write_text(json.dumps({"stamp": stamp, "architecture": f.architecture, "head_count": f.head_count,
                                       "head_count_kv": f.head_count_kv, "tensors": [asdict(t) for t in f.tensors],
                                       "name": f.name}))
            tmp.replace(index)
        return f

    @classmethod
    def _parse(cls, path: Path) -> "GGUFFile":
        """The index by a walk over the file's header (GGUF v2 and v3: 64-bit counts), the reader's for older ones."""
        import struct

        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        with open(path, "rb") as fh:
            head = fh.read(24)
            if len(head) < 24 or head[:4] != b"GGUF":
                raise ValueError(f"{path}: not a GGUF file")
            version, n_tensors, n_kv = struct.unpack_from("<IQQ", head, 4)
            if version < 2:
                return cls._parse_with_reader(path)
        mm = np.memmap(path, dtype=np.uint8, mode="r")
        buf = memoryview(mm)
        pos = 24
        scalar = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}

        def string() -> str:
            nonlocal pos
            (n,) = struct.unpack_from("<Q", buf, pos)
            pos += 8 + n
            return bytes(buf[pos - n:pos]).decode("utf-8", errors="replace")

        def value(kind: int, keep: bool):
            nonlocal pos
            if kind == 8:
                return string()
            if kind == 9:  # array: item type, count, items (stepped over unless kept)
                item, count = struct.unpack_from("<IQ", buf, pos)
                pos += 12
                if item in scalar and not keep:
                    pos += count * struct.calcsize("<" + scalar[item])
                    return None
                return [value(item, keep) for _ in range(count)]
            fmt = "<" + scalar[kind]
            (v,) = struct.unpack_from(fmt, buf, pos)
            pos += struct.calcsize(fmt)
            return v

        fields = {}
        wanted = ("general.architecture", "general.name", "general.alignment")
        for _ in range(n_kv):
            key = string()
            (kind,) = struct.unpack_from("<I", buf, pos)
            pos += 4
            keep = key in wanted or key.endswith((".attention.head_count", ".attention.head_count_kv"))
            v = value(kind, keep)
            if keep:
                fields[key] = v
        infos = []
        for _ in range(n_tensors):
            name = string()
            (n_dims,) = struct.unpack_from("<I", buf, pos)
            dims = struct.unpack_from(f"<{n_dims}Q", buf, pos + 4)
            kind, offset = struct.unpack_from("<IQ", buf, pos + 4 + 8 * n_dims)
            pos += 4 + 8 * n_dims + 12
            infos.append((name, dims, kind, offset))
        align = int(fields.get("general.alignment") or 32)
        start = -(-pos // align) * align  # the tensor data begins at the next multiple of the alignment
        plain = {"F16": "float16", "F32": "float32", "F64": "float64", "I8": "int8", "I16": "int16", "I32": "int32",
                 "I64": "int64"}
        tensors = []
        for name, dims, kind, offset in infos:
            qtype = GGMLQuantizationType(kind)
            shape = tuple(int(d) for d in reversed(dims))
            if qtype.name not in plain:  # block types: [rows..., bytes per row], as the reader shapes them
                block, size = GGML_QUANT_SIZES[qtype]
                shape = (*shape[:-1], shape[-1] // block * size)
            tensors.append(TensorInfo(name, qtype.name, shape, plain.get(qtype.name, "uint8"), start + int(offset)))
        arch = fields.get("general.architecture")
        heads = [fields.get(f"{arch}.attention.{k}") for k in ("head_count", "head_count_kv")]
        name = fields.get("general.name")
        return cls(path, arch, *(None if h is None else int(h) for h in heads), tuple(tensors),
                   str(name).strip() or None if name is not None else None)

    @classmethod
    def _parse_with_reader(cls, path: Path) -> "GGUFFile":
        """The index as the ``gguf`` package's reader gives it (what ``_parse`` is tested against)."""
        from gguf import GGUFReader

        reader = GGUFReader(path)

        def field(key: str):
            f = reader.fields.get(key)
            return None if f is None else f.contents()

        arch = field("general.architecture")
        heads = [field(f"{arch}.attention.{k}") for k in ("head_count", "head_count_kv")]
        tensors = tuple(TensorInfo(t.name, t.tensor_type.name, tuple(int(n) for n in t.data.shape), t.data.dtype.name,
                                   int(t.data_offset)) for t in reader.tensors)
        name = field("general.name")
        return cls(path, arch, *(None if h is None else int(h) for h in heads), tensors,
                   str(name).strip() or None if name is not None else None)

    def raw(self, t: TensorInfo) -> np.ndarray:
        """The tensor's stored data, mapped from the file (read-only; nothing is read until used)."""
        dtype = np.dtype(t.dtype)
        return np.memmap(self.path, dtype=dtype, mode="r", offset=t.offset, shape=t.shape)

    def hf_name(self, t: TensorInfo) -> str | None:
        """transformers' name of a weight this file holds, or None (a tensor no supported family reads, such as
        Llama 3.1's rope_freqs, or any tensor of an architecture not in ``ARCHITECTURES``)."""
        if self.architecture not in BLOCK_NAMES:
            return None
        parts = t.name.split(".")
        if parts[-1] not in ("weight", "bias"):
            return None
        if len(parts) == 2 and parts[0] in _TOP:
            return f"{_TOP[parts[0]]}.{parts[1]}"
        block = BLOCK_NAMES[self.architecture]
        if len(parts) == 4 and parts[0] == "blk" and parts[2] in block:
            return f"model.layers.{parts[1]}.{block[parts[2]]}.{parts[3]}"
        return None

    def rope_row_heads(self, t: TensorInfo) -> int | None:
        """The head count whose rows llama.cpp's "llama" converter interleaved in this tensor (q_proj, k_proj), or
        None where it did not. transformers undoes it only when both head counts are known; so do we."""
        kind = t.name.split(".")[2] if t.name.startswith("blk.") else ""
        if self.architecture != "llama" or kind not in ("attn_q", "attn_k") or None in (self.head_count,
                                                                                      self.head_count_kv):
            return None
        return self.head_count if kind == "attn_q" else self.head_count_kv

    def state_dict(self, dtype: torch.dtype = torch.float32) -> Iterator[tuple[str, torch.Tensor]]:
        """(transformers' name, weight) for every tensor a supported family reads, de-quantized one at a time in
        float32 and then matrices cast to ``dtype`` (so at most one float32 matrix is alive besides those yielded).
        Vectors (norms, biases) stay float32: the model computes Gemma's 1 + w in float32 before its own cast."""
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        for t in self.tensors:
            name = self.hf_name(t)
            if name is None:
                continue
            w = np.asarray(dequantize(self.raw(t), GGMLQuantizationType[t.type]), dtype=np.float32)
            if not w.flags.writeable:  # F32 de-quantizes to a view of the read-only map: the tensor gets a copy
                w = w.copy()
            heads = self.rope_row_heads(t)
            if heads is not None:
                w = unpermute_rope_rows(w, heads)
            if self.architecture == "gemma3" and "norm.weight" in t.name:
                w = w - np.float32(1)
            x = torch.from_numpy(w)
            yield name, (x if dtype == torch.float32 or x.dim() < 2 else x.to(dtype))


def open_gguf(f: "GGUFFile | str | Path") -> GGUFFile:
    """A GGUF file given as opened or as a path (a path is parsed, without an index)."""
    return f if isinstance(f, GGUFFile) else GGUFFile.open(Path(f))


def unpermute_rope_rows(x: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's per-head row interleave of q_proj / k_proj (transformers' ``_reverse_permute_weights``)."""
    half = x.shape[0] // n_head // 2
    return np.ascontiguousarray(x.reshape(n_head, half, 2, *x.shape[1:]).swapaxes(1, 2).reshape(x.shape))
