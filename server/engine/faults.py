"""Faults raised on purpose inside the engine, to test that the serving path isolates them (a test hook: never set
in production).

The worker reads ``SPECSERVE_INJECT_FAULTS`` at start: a comma-separated list of ``TOKEN=STAGE:KIND``. A sequence
whose prompt contains token id ``TOKEN`` raises ``KIND`` at ``STAGE``:

- ``admit``: while the scheduler admits it (its KV slot taken); ``propose``: while its draft tree is built;
  ``accept``: while its tree's rows are read (shaping, sampling); ``first``: while its first token is sampled;
  all four belong to that one request.
- ``forward``: in the step's shared target forward, which no single request can be blamed for (every request of
  the step fails); ``sticky``: that, and every later forward of the process too (a sticky device error);
- ``exit``: the worker process ends at once (``os._exit``), as a crash in native code would end it.

Kinds: ``panic`` (a ``BaseException``, as a Rust panic crossing into Python through pyo3 is), ``oom``
(``torch.OutOfMemoryError``) and ``error`` (``RuntimeError``).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

ENV = "SPECSERVE_INJECT_FAULTS"
STAGES = ("admit", "propose", "accept", "first", "forward", "sticky", "exit")
FIRES_AT = {"sticky": "forward", "exit": "admit"}  # the stage these two fire at; every other fires at its own


class InjectedPanic(BaseException):
    """Like pyo3's PanicException: derives from BaseException, so ``except Exception`` does not catch it."""


def _raise(kind: str, where: str) -> None:
    msg = f"injected fault at {where}"
    if kind == "panic":
        raise InjectedPanic(msg)
    if kind == "oom":
        raise torch.OutOfMemoryError(msg)
    raise RuntimeError(msg)


@dataclass
class FaultPlan:
    rules: dict[int, tuple[str, str]]  # token id -> (stage, kind)
    sticky: str | None = None          # the kind every forward raises once a sticky fault fired
    fired: list[str] = field(default_factory=list)

    @classmethod
    def parse(cls, spec: str | None) -> "FaultPlan | None":
        if not spec:
            return None
        rules = {}
        for item in spec.split(","):
            token, _, rest = item.strip().partition("=")
            stage, _, kind = rest.partition(":")
            if stage not in STAGES or kind not in ("panic", "oom", "error") or not token.strip().isdigit():
                raise ValueError(f"{ENV}: {item!r} is not TOKEN=STAGE:KIND with a stage of {STAGES} and a kind of "
                                 "panic, oom, error")
            rules[int(token)] = (stage, kind)
        return cls(rules)

    def check(self, stage: str, prompts: list[list[int]]) -> None:
        """Raise the fault planted for ``stage`` if one of ``prompts`` (the sequences concerned) carries its token."""
        if stage == "forward" and self.sticky:
            _raise(self.sticky, "forward (sticky)")
        for token, (want, kind) in self.rules.items():
            if FIRES_AT.get(want, want) == stage and any(token in p for p in prompts):
                self.fired.append(f"{want}:{kind}")
                if want == "exit":
                    os._exit(70)
                if want == "sticky":
                    self.sticky = kind
                _raise(kind, want)


def from_env() -> FaultPlan | None:
    """The plan the worker's environment names (None: no fault is ever injected)."""
    return FaultPlan.parse(os.environ.get(ENV))


def fault_of(e: BaseException) -> bool:
    """Whether ``e`` is a fault to isolate (fail the request or step it came from and go on): any exception short of
    the process being told to stop (KeyboardInterrupt, SystemExit) or a generator closing."""
    return not isinstance(e, (KeyboardInterrupt, SystemExit, GeneratorExit))


def isolate(failed: dict, key, fn, *args):
    """``fn(*args)``, or None when it raised a fault (``fault_of``), which is recorded as ``failed[key]``: the work
    of one request fails that request alone."""
    try:
        return fn(*args)
    except BaseException as e:
        if not fault_of(e):
            raise
        failed[key] = e
        return None
