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
(``torch.OutOfMemoryError``) and ``error`` (``RuntimeError``); and ``hold``, no fault: the stage blocks (the first
time only) until a test lets it go, as a long prefill or a hung device would. It writes ``held`` into the folder
``SPECSERVE_FAULT_HOLD_DIR`` names and waits for a file ``release`` there, so a test knows, without timing anything,
that the worker is inside that stage while it checks what must go on meanwhile.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

ENV = "SPECSERVE_INJECT_FAULTS"
HOLD_DIR_ENV = "SPECSERVE_FAULT_HOLD_DIR"
KINDS = ("panic", "oom", "error", "hold")
HOLD_MAX_S = 600.0  # a hold nobody releases ends by itself (a test that died must not leave a worker hung forever)
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
    hold_dir: Path | None = None       # where a hold says it holds and waits to be released

    @classmethod
    def parse(cls, spec: str | None) -> "FaultPlan | None":
        if not spec:
            return None
        rules = {}
        for item in spec.split(","):
            token, _, rest = item.strip().partition("=")
            stage, _, kind = rest.partition(":")
            if stage not in STAGES or kind not in KINDS or not token.strip().isdigit():
                raise ValueError(f"{ENV}: {item!r} is not TOKEN=STAGE:KIND with a stage of {STAGES} and a kind of "
                                 f"{', '.join(KINDS)}")
            rules[int(token)] = (stage, kind)
        hold_dir = os.environ.get(HOLD_DIR_ENV)
        if any(kind == "hold" for _, kind in rules.values()) and not hold_dir:
            raise ValueError(f"{ENV}: a hold needs {HOLD_DIR_ENV} (the folder it signals through)")
        return cls(rules, hold_dir=Path(hold_dir) if hold_dir else None)

    def check(self, stage: str, prompts: list[list[int]]) -> None:
        """Raise the fault planted for ``stage`` if one of ``prompts`` (the sequences concerned) carries its token."""
        if stage == "forward" and self.sticky:
            _raise(self.sticky, "forward (sticky)")
        for token, (want, kind) in self.rules.items():
            if FIRES_AT.get(want, want) == stage and any(token in p for p in prompts):
                if kind == "hold":
                    if f"{want}:hold:{token}" not in self.fired:  # once: later steps of the request run on
                        self.fired.append(f"{want}:hold:{token}")
                        self._hold()
                    continue
                self.fired.append(f"{want}:{kind}")
                if want == "exit":
                    os._exit(70)
                if want == "sticky":
                    self.sticky = kind
                _raise(kind, want)


    def _hold(self) -> None:
        held, release = self.hold_dir / "held", self.hold_dir / "release"
        held.write_text(str(os.getpid()))
        deadline = time.monotonic() + HOLD_MAX_S
        while not release.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        held.unlink(missing_ok=True)
        release.unlink(missing_ok=True)


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
