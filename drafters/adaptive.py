"""Adaptive draft length (SpecDec++, Huang et al. 2024): an acceptance head that tells a chain drafter when to stop.

At each drafted token Y_i the head reads the drafter's last hidden state, the one Y_i was drafted from, and predicts
P_i = P(Y_i accepted | Y_1..Y_{i-1} accepted). (The paper reads the state after the drafter consumed Y_i; that costs a
drafter forward per step that a stopped chain does not need, about a fifth of a target step on CPU, and for a greedy
chain, whose Y_i is the argmax of that state, it carries no more information.) The drafter stops once
the chance of at least one rejection, 1 - prod(P_1..P_i), exceeds the threshold h (the paper's Theorem 3.1 shows the
optimal stopping policy has this form), or at its cap. The threshold is a per-deployment value measured on the machine:
where a verify row is cheap against a drafter forward it pays to draft on at lower odds, and the other way round.

Inputs besides the hidden state (all known when the drafter decides): the request's temperature (0 for greedy; the
acceptance rule differs), the depth i (the drafter's view of the target's KV lags i tokens behind), and the drafter's
own probability of Y_i. The head: ``num_blocks`` residual blocks x + SiLU(Linear(x)), each with its own weights, then
Linear(width -> 1), a logit. ``hidden_only`` drops the extra inputs (the paper's head; kept for the ablation).

:class:`AdaptiveStop` is the stopping rule; :class:`AdaptiveLength` is the one wrapper a chain drafter mixes in to get
it (`glide-adaptive`, `falcon-adaptive`): it loads the head and turns a drafted token into P_i; the drafter calls
``stop.more(P_i)`` after each token and verifies what it has drafted when that says no.
"""
from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from drafters.checkpoint import CHECKPOINT_DIR, default_path, read_checkpoint, save_checkpoint
NUM_EXTRA = 3  # temperature, depth / 8, log q(Y)


class AcceptHeadError(RuntimeError):
    """An acceptance head checkpoint is missing or does not fit the drafter."""


@dataclass
class AcceptHeadConfig:
    target_id: str
    drafter: str          # the drafter whose hidden states it reads ("glide", "falcon")
    hidden_size: int
    num_blocks: int = 3
    hidden_only: bool = False
    # The drafter checkpoint whose states it learned: a file name in the target's checkpoint folder (the adaptive
    # drafter's default checkpoint) and the file's digest (a head never reads another checkpoint's states).
    drafter_checkpoint: str = ""
    drafter_digest: str = ""


class AcceptHead(nn.Module):
    def __init__(self, c: AcceptHeadConfig):
        super().__init__()
        self.c = c
        width = c.hidden_size + (0 if c.hidden_only else NUM_EXTRA)
        self.norm = nn.LayerNorm(width)
        self.blocks = nn.ModuleList(nn.Linear(width, width) for _ in range(c.num_blocks))
        self.out = nn.Linear(width, 1)
        for b in self.blocks:  # residual blocks start near the identity
            nn.init.normal_(b.weight, std=0.01)
            nn.init.zeros_(b.bias)

    @staticmethod
    def extra(temperature: torch.Tensor, depth: torch.Tensor, q_token: torch.Tensor) -> torch.Tensor:
        """The inputs besides the hidden state, [N, NUM_EXTRA] float32."""
        return torch.stack([temperature.float(), depth.float() / 8.0,
                            torch.log(q_token.float().clamp(min=1e-6))], dim=-1)

    def forward(self, hidden: torch.Tensor, extra: torch.Tensor) -> torch.Tensor:
        """hidden [N, H], extra [N, NUM_EXTRA] -> acceptance logits [N]."""
        x = hidden.float() if self.c.hidden_only else torch.cat([hidden.float(), extra.float()], dim=-1)
        x = self.norm(x)
        for b in self.blocks:
            x = x + F.silu(b(x))
        return self.out(x)[:, 0]

    def save(self, path: Path, card: dict | None = None) -> None:
        save_checkpoint(path, self.state_dict(), "accept_head_config", self.c, card, dtype=torch.float32)

    @classmethod
    def load(cls, path: Path) -> "AcceptHead":
        config, state = read_checkpoint(path, "accept_head_config", AcceptHeadError, "acceptance head")
        head = cls(AcceptHeadConfig(**config))
        head.load_state_dict(state)
        return head.eval().requires_grad_(False)


def checkpoint_digest(path: Path) -> str:
    """The first 16 hex digits of a file's SHA-256: which drafter weights a head was trained on."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()[:16]


def default_checkpoint(target_id: str, drafter: str) -> Path:
    return default_path(target_id, f"accept-{drafter}")


def load_accept_head(target, drafter: str, hidden_size: int, checkpoint: str | Path | None = None) -> AcceptHead:
    """The head for this target and drafter (default: drafters/checkpoints/<target>/accept-<drafter>.safetensors)."""
    path = Path(checkpoint) if checkpoint else default_checkpoint(target.model_id, drafter)
    if not path.is_file():
        raise AcceptHeadError(
            f"no acceptance head for drafter {drafter!r} of target {target.model_id!r} at {path}; train one with "
            f"`specserve train accept-head --drafter {drafter}` or set the drafter's `accept_head` option")
    head = AcceptHead.load(path)
    c = head.c
    if (c.target_id, c.drafter, c.hidden_size) != (target.model_id, drafter, hidden_size):
        raise AcceptHeadError(f"{path} was trained for drafter {c.drafter!r} of target {c.target_id!r} (hidden "
                              f"{c.hidden_size}), not {drafter!r} of {target.model_id!r} (hidden {hidden_size})")
    return head.to(target.device)


class AdaptiveStop:
    """The stopping rule for one round of drafting: after each drafted token, ``more(P_i)`` says whether to draft
    another; stop once 1 - prod(P) > threshold."""

    def __init__(self, threshold: float):
        if not 0.0 < threshold < 1.0:
            raise ValueError("adaptive drafting: threshold must be in (0, 1)")
        self.log_threshold = math.log1p(-threshold)  # draft on while log prod(P) >= log(1 - h)
        self.log_prod = 0.0

    def more(self, p_accept: float) -> bool:
        self.log_prod += math.log(max(p_accept, 1e-12))
        return self.log_prod >= self.log_threshold


class AdaptiveLength:
    """Mixed into a chain drafter: its acceptance head and threshold. The drafter calls ``_new_stop()`` at the start
    of a proposal and ``stop.more(self._accept_prob(...))`` after each drafted token."""

    head: AcceptHead
    threshold: float

    @staticmethod
    def _head_and_checkpoint(target, drafter: str, accept_head: str | None, checkpoint: str | None,
                             default: Path) -> tuple[AcceptHead, Path]:
        """The head, and the drafter checkpoint to load: the one given, else the one the head was trained on, else
        the drafter's ``default``."""
        head = load_accept_head(target, drafter, target.args.hidden_size, accept_head)
        if checkpoint is not None:
            return head, Path(checkpoint)
        if head.c.drafter_checkpoint:
            return head, CHECKPOINT_DIR / target.model_id / head.c.drafter_checkpoint
        return head, default

    def _init_adaptive(self, head: AcceptHead, drafter_file: Path, threshold: float) -> None:
        AdaptiveStop(threshold)  # validates it
        if head.c.drafter_digest and checkpoint_digest(drafter_file) != head.c.drafter_digest:
            trained_on = head.c.drafter_checkpoint or "digest " + head.c.drafter_digest
            raise AcceptHeadError(
                f"the {head.c.drafter} acceptance head was trained on the states of another {head.c.drafter} "
                f"checkpoint ({trained_on}), not {drafter_file}; retrain it with `specserve train accept-head "
                f"--drafter {head.c.drafter} --checkpoint {drafter_file}` or set the drafter's `checkpoint` option to "
                "the checkpoint it was trained on")
        self.threshold = threshold
        self.head = head

    def _new_stop(self) -> AdaptiveStop:
        return AdaptiveStop(self.threshold)

    def _accept_prob(self, h: torch.Tensor, sampling, depth: int, q_token: float) -> float:
        """P(the token drafted from state ``h`` [1, hidden] at ``depth`` with draft probability ``q_token`` is
        accepted, given the ones before it were), for a request with ``sampling``."""
        temp = 0.0 if sampling.greedy else sampling.temperature
        extra = AcceptHead.extra(torch.tensor([temp]), torch.tensor([depth]), torch.tensor([q_token])).to(h.device)
        return float(torch.sigmoid(self.head(h, extra))[0])
