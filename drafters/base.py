"""The contract between drafters and the engine: the drafter Protocol, the views it reads, and the registry.

A drafter proposes a ``core.tree.DraftTree`` rooted at the last accepted token (the tree's contract, including what
sampled exactness needs of q rows and sibling order, is in ``core/tree.py``); the engine verifies all of its rows in
one target forward, accepts a path losslessly, and tells the drafter what happened through :meth:`Drafter.observe`.
Drafters read the target only through the read-only :class:`SequenceView` / :class:`TargetView` the engine hands them,
and import only ``core`` (the shared vocabulary), never the engine. Nothing outside this package branches on which
drafter is running.
"""
from __future__ import annotations

import importlib
import inspect
import types
import typing
from typing import Any, Protocol, runtime_checkable

import torch

from core.ops import LlamaArgs
from core.sampling import SamplingParams
from core.tree import DraftTree, VerifyResult


class TargetView(Protocol):
    """Frozen, read-only pieces of the target model that drafters may share."""

    args: LlamaArgs
    device: torch.device
    dtype: torch.dtype
    model_id: str

    def embed(self, ids: torch.Tensor) -> torch.Tensor: ...           # [N] -> [N, hidden]
    def lm_head(self, hidden: torch.Tensor) -> torch.Tensor: ...      # [N, hidden] pre-norm -> [N, V] logits
    def final_norm(self, hidden: torch.Tensor) -> torch.Tensor: ...   # [N, hidden] pre-norm -> post-norm features
    def rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor: ...  # [N, heads, D] rotated
    @property
    def embed_weight(self) -> torch.Tensor: ...    # [V, hidden] input embedding (frozen; do not modify)
    @property
    def lm_head_weight(self) -> torch.Tensor: ...  # [V, hidden] output projection (frozen; do not modify)


class SequenceView(Protocol):
    """Read-only view of one running sequence."""

    seq_id: int
    prompt_len: int
    target: TargetView

    @property
    def tokens(self) -> list[int]: ...     # prompt + accepted tokens; the last one is the next tree's root
    @property
    def cache_len(self) -> int: ...        # tokens whose target KV is cached (= len(tokens) - 1)
    def target_kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]: ...  # post-RoPE K, V [H_kv, cache_len, D]
    def target_hidden(self) -> torch.Tensor: ...  # last-layer hidden states of cached tokens [cache_len, hidden]
    def target_taps(self) -> torch.Tensor: ...  # [cache_len, n, hidden]: the residual stream after each layer count
    # the drafter's ``target_taps`` names (its attribute, default none), for the cached tokens
    @property
    def sampling(self) -> SamplingParams: ...  # the request's sampling parameters
    @property
    def max_rows(self) -> int: ...  # the row budget of this step's tree (root included, >= 2): rows past it are not
    # verified, so a drafter stops drafting there (the load-aware budget lowers it when the server is busy)


@runtime_checkable
class Drafter(Protocol):
    """Per-deployment drafter; keeps per-sequence state keyed by ``seq.seq_id``. A drafter that reads lower target
    layers names them in a ``target_taps`` attribute (layer counts; absent: none), and the engine keeps them beside
    the hidden states for ``SequenceView.target_taps``."""

    name: str

    def prefill(self, seq: SequenceView) -> None: ...
    def propose(self, seq: SequenceView) -> DraftTree: ...
    def observe(self, seq: SequenceView, result: VerifyResult) -> None: ...
    def release(self, seq_id: int) -> None: ...


# name -> "module:Class". Modules load lazily, so a deployment imports only the drafter it runs.
_REGISTRY: dict[str, str] = {
    "none": "drafters.none:NoneDrafter",
    "ngram": "drafters.ngram:NgramDrafter",
    "glide": "drafters.glide.drafter:GlideDrafter",
    "glide-cape": "drafters.glide.drafter:GlideCapeDrafter",
    "glide-adaptive": "drafters.glide.drafter:GlideAdaptiveDrafter",
    "maxgram": "drafters.cascade.maxgram:MaxGramDrafter",
    "cascade": "drafters.cascade.drafter:CascadeDrafter",
    "falcon": "drafters.falcon.drafter:FalconDrafter",
    "falcon-adaptive": "drafters.falcon.drafter:FalconAdaptiveDrafter",
}


def drafter_names() -> list[str]:
    return sorted(_REGISTRY)


def drafter_class(name: str) -> type:
    """The class registered as ``name`` (imports its module); unknown names fail with the valid ones."""
    if name not in _REGISTRY:
        raise ValueError(f"unknown drafter {name!r}; valid drafters: {', '.join(drafter_names())}")
    module, cls_name = _REGISTRY[name].split(":")
    return getattr(importlib.import_module(module), cls_name)


def check_options(name: str, options: dict[str, Any]) -> None:
    """Raise ValueError naming the option at fault: an option the drafter does not take (with the valid ones), or a
    value whose type does not match a plain annotation (int, float, bool, str, optional str) of its constructor."""
    cls = drafter_class(name)
    params = [p for p in inspect.signature(cls.__init__).parameters if p not in ("self", "target")]
    unknown = sorted(set(options) - set(params))
    if unknown:
        raise ValueError(f"drafter {name!r} has no option {', '.join(map(repr, unknown))}; valid options: "
                         f"{', '.join(params) or '(none)'}")
    hints = typing.get_type_hints(cls.__init__)
    for key, value in options.items():
        wanted = type_mismatch(value, hints.get(key))
        if wanted:
            raise ValueError(f"drafter {name!r} option {key!r} must be {wanted}, got {value!r}")


def type_mismatch(value: Any, annotation: Any) -> str | None:
    """For a config value and a plain annotation (int, float, bool, str, optional ones): the expected types in words
    when the value does not fit (a bool is no int, an int is a float), else None. None too for other annotations,
    which the code they configure checks."""
    plain = {int: (int,), float: (int, float), bool: (bool,), str: (str,), type(None): (type(None),)}
    args = typing.get_args(annotation) if isinstance(annotation, types.UnionType) else (annotation,)
    if not all(a in plain for a in args):
        return None
    allowed = tuple(t for a in args for t in plain[a])
    if isinstance(value, allowed) and not (isinstance(value, bool) and bool not in allowed):
        return None
    return " or ".join("null" if t is type(None) else t.__name__ for t in allowed)


def create_drafter(name: str, target: TargetView, options: dict[str, Any] | None = None) -> Drafter:
    """Build the drafter called ``name``; unknown names and options fail with the valid choices."""
    options = options or {}
    check_options(name, options)
    try:
        return drafter_class(name)(target, **options)
    except TypeError as e:
        raise ValueError(f"drafter {name!r}: bad options {sorted(options)}: {e}") from None
