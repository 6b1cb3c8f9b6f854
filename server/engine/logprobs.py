"""Log probabilities the engine returns: each emitted token's (with the most likely alternatives), read from the row
it was chosen at, and the prompt's, in slices through the LM head."""
from __future__ import annotations

from typing import Callable

import torch

from server.engine.sequence import Sequence

PROMPT_LOGPROB_ROWS = 256  # prompt rows per LM-head call when a request wants prompt logprobs


def token_logprobs(mode: str, seq: Sequence, logits: torch.Tensor, rows, path: list[int], tokens: list[int]
                   ) -> list[tuple[float, list[tuple[int, float]]]]:
    """Each emitted token's logprob, read from the row it was chosen at (``path[j]`` for ``tokens[j]``: a drafted
    token's parent, the bonus token's last accepted row), never from a drafter's q: the model's log-softmax
    (``mode`` raw: ``server.logprobs_mode``), or of what the token was chosen from after the request's shaping
    (``processed``: shaped logits for greedy requests, the sampling distribution for sampled ones)."""
    if mode == "raw" or (rows is logits and seq.sampling.greedy):
        lp = torch.log_softmax(logits[path].float(), -1)
    elif seq.sampling.greedy:  # shaped rows
        lp = torch.log_softmax(torch.stack([rows[r] for r in path]), -1)
    else:
        lp = torch.log(torch.stack([rows[r] for r in path]))
    return logprob_entries(lp, tokens, seq.sampling.logprobs)


def prompt_logprobs(logits: Callable[[torch.Tensor], torch.Tensor], seq: Sequence, start: int, hidden: torch.Tensor
                    ) -> None:
    """Prompt rows [start, start + n) were computed: the logprob of each next prompt token under the model
    (raw: prompt tokens are given, not drawn), in slices of PROMPT_LOGPROB_ROWS rows through the LM head."""
    ids = seq.token_ids
    n = min(hidden.shape[0], seq.prompt_len - 1 - start)  # the last prompt row predicts a generated token
    for i in range(0, n, PROMPT_LOGPROB_ROWS):
        j = min(n, i + PROMPT_LOGPROB_ROWS)
        lp = torch.log_softmax(logits(hidden[i:j]).float(), -1)
        seq.prompt_logprobs += logprob_entries(lp, ids[start + i + 1:start + j + 1], seq.sampling.prompt_logprobs)


def logprob_entries(lp: torch.Tensor, tokens: list[int], top: int) -> list[tuple[float, list[tuple[int, float]]]]:
    """[k, V] log probabilities and the k tokens chosen -> per token (its logprob, the ``top`` most likely tokens
    at that position with theirs, most likely first)."""
    idx = torch.tensor(tokens, device=lp.device)
    chosen = lp.gather(1, idx[:, None])[:, 0].tolist()
    if not top:
        return [(c, []) for c in chosen]
    vals, ids = lp.topk(min(top, lp.shape[-1]), dim=-1)
    return [(c, list(zip(i, v))) for c, i, v in zip(chosen, ids.tolist(), vals.tolist())]
