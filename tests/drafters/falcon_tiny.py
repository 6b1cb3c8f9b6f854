"""The tiny target's helpers shared by the Falcon drafter tests: its config and prompts, random Falcon heads for it,
and the cache-free reference the drafter's trees are checked against (``reference_block``, ``reference_tree``).

The fixtures built on them (``tiny``, ``tiny_ckpt``) are in tests/drafters/conftest.py."""
from __future__ import annotations

import torch

from core.sampling import SamplingParams
from drafters.falcon.drafter import load_falcon
from drafters.falcon.model import FalconConfig, FalconModel, block_ids, relaxed_mask
from server.config import config_from_dict
from server.engine import Engine

V = 16                                               # the tiny target's vocabulary (write_tiny_llama)
TINY_PROMPTS = [[3, 7, 1, 12, 5, 9, 3, 7],           # n = 8 and n = 11 after the first token: both block alignments
                [2, 9, 4, 4, 13, 6, 2, 9, 4, 15, 8]]

OPTS = {"top_m": (3, 2), "forwards": 3, "width": 2, "max_rows": 32}


def _tiny_config(tiny_dir, slots: int = 2):
    return config_from_dict({"model": {"source": str(tiny_dir), "dtype": "float32", "device": "cpu"},
                             "cache": {"num_slots": slots, "max_seq_len": 64}})


def _random_checkpoint(target, path, k: int = 2, vocab_subset: int = 12, scale: float | None = 0.3, seed: int = 0,
                       taps: tuple[int, ...] = ()):
    """A random Falcon head for ``target`` over a random ``vocab_subset`` of its vocabulary, saved in float32;
    ``scale``: the matrices' std (None: the model's own init, with noise added); ``taps``: lower layers it reads."""
    gen = torch.Generator().manual_seed(seed)
    m = FalconModel(FalconConfig.for_target(target.args, target.model_id, k=k, vocab_subset=vocab_subset,
                                            taps=list(taps)))
    m.vocab_ids = torch.randperm(target.args.vocab_size, generator=gen)[:vocab_subset]
    m.init_from_target(target.model)
    with torch.no_grad():
        for p in m.parameters():
            if p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=gen) * scale if scale else
                        p + torch.randn(p.shape, generator=gen) * 0.02)
    m.save(path, {"note": "random weights, for tests"}, dtype=torch.float32)
    return path


def _start(engine: Engine, prompt, sampling: SamplingParams | None = None, max_new_tokens: int = 24):
    seq = engine.add(prompt, sampling, max_new_tokens=max_new_tokens)
    engine.prefill(seq)
    return seq


def _reference_model(target, path, weights: str = "auto") -> FalconModel:
    """The drafter's own head (its matrices as ``weights`` chooses them, as the drafter's did), run without its
    cache."""
    return load_falcon(target, path, weights)


@torch.no_grad()
def reference_block(model: FalconModel, view, chain) -> torch.Tensor:
    """Without a cache: the predicted features [k, hidden] of the block after the verified text and the drafted blocks
    ``chain`` [(tokens, features)] (the first block -- the last k verified positions -- when ``chain`` is empty), from
    one training-style forward over the whole context under the relaxed mask, blocks aligned to end at the root."""
    k, toks = model.c.k, view.tokens
    n = len(toks) - 1
    feats = view.target.final_norm(view.target_hidden())  # f_0 .. f_{n-1}: the inputs of positions 1 .. n
    ids = list(toks[1:]) + [t for block, _ in chain for t in block]
    drafted = sum(len(block) for block, _ in chain)
    feats = torch.cat([feats, *[f for _, f in chain]])
    taps = None
    if model.c.taps:  # the target's lower layers where it ran, zeros where the drafter guessed
        t = view.target_taps()
        taps = torch.cat([t, t.new_zeros(drafted, *t.shape[1:])])
    pos = torch.arange(1, len(ids) + 1)
    blocks = block_ids(pos, k, (-(n - k + 1)) % k)
    return model(torch.tensor(ids), feats, pos, relaxed_mask(blocks), taps=taps)[-k:]


def reference_tree(model: FalconModel, view, top_m, forwards: int, width: int, max_rows: int, next_top_m=None):
    """The greedy tree by its definition, each block from ``reference_block``: (tokens, parents)."""
    vocab = model.vocab_ids.tolist()
    tokens, parents, leaves = [view.tokens[-1]], [-1], []

    def grow(chain, parent, score):
        out = reference_block(model, view, chain)
        probs = torch.softmax(model.logits(out).float(), -1)
        level = [([], parent, score)]
        for i, m in enumerate(top_m if not chain or next_top_m is None else next_top_m):
            nxt = []
            for block, row, s in level:
                for loc in torch.topk(probs[i], m).indices.tolist():
                    if len(tokens) >= max_rows:
                        break
                    tokens.append(vocab[loc])
                    parents.append(row)
                    nxt.append((block + [vocab[loc]], len(tokens) - 1, s * float(probs[i, loc])))
            level = nxt
        leaves.extend((s, row, chain + [(block, out)]) for block, row, s in level)

    grow([], 0, 1.0)
    for _ in range(forwards - 1):
        if len(tokens) >= max_rows or not leaves:
            break
        leaves.sort(key=lambda leaf: -leaf[0])
        chosen = leaves[:width]
        del leaves[:width]
        for s, row, chain in chosen:
            grow(chain, row, s)
    return tokens, parents
