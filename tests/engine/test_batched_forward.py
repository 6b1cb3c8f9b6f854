"""One target forward over several sequences (``Engine.run`` / ``forward_rows``) against each sequence alone.

- CPU: decode steps of several sequences attend in one batched call; trees and prompt chunks per sequence;
- CUDA layout: every row of the step through the batched Triton kernel (run here under the Triton interpreter on a
  tiny random Llama, whose head dim the kernel takes), against the per-sequence path.
"""
from __future__ import annotations

import pytest
import torch

from core.tree import DraftTree
from server.config import config_from_dict
from server.engine import Engine, StepPlan, load_target
from tests.conftest import write_tiny_llama
from tests.engine.test_perf_paths import attention16, engine16, needs_row_invariance  # noqa: F401 (a fixture)


@pytest.fixture(scope="module")
def tiny_engine(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny-llama-d16")
    write_tiny_llama(d, vocab_size=32, hidden=64, heads=4, kv_heads=2)  # head dim 16
    cfg = config_from_dict({"model": {"source": str(d), "dtype": "float32", "device": "cpu"},
                            "cache": {"num_slots": 4, "max_seq_len": 128}})
    return Engine(cfg, target=load_target(cfg, progress=False))


def _parts(engine: Engine):
    """Three sequences mid-generation and their next rows: a decode step, a branching tree, a prompt chunk."""
    g = torch.Generator().manual_seed(0)
    seqs = []
    for n in (9, 70, 40):
        seq = engine.add(torch.randint(32, (n,), generator=g).tolist(), max_new_tokens=8)
        seqs.append(seq)
    for seq in seqs[:2]:
        engine.prefill(seq)
    engine.run(StepPlan(prefill=[(seqs[2], 17)]))  # the third is part way through its prompt
    tree = DraftTree([seqs[1].token_ids[-1], 3, 4, 5, 6], [-1, 0, 0, 1, 2])
    parts = [engine._tree_rows(seqs[0], DraftTree.root_only(seqs[0].token_ids[-1])), engine._tree_rows(seqs[1], tree),
             (seqs[2], seqs[2].token_ids[17:30], torch.arange(17, 30), None)]
    return seqs, parts


def test_the_batched_kernel_layout_equals_each_sequence_alone(tiny_engine):
    engine = tiny_engine
    seqs, parts = _parts(engine)
    try:
        with torch.inference_mode():
            alone = torch.cat([engine.forward_rows([p]) for p in parts])
            batched = engine.forward_rows(parts)  # CPU path: the decode row on its own, others per sequence
            ids = torch.tensor([t for p in parts for t in p[1]])
            kernel = engine.model(ids, torch.cat([p[2] for p in parts]), [], engine.layout.kernel_group(parts))
    finally:
        for seq in seqs:
            engine.release(seq)
    torch.testing.assert_close(batched, alone, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(kernel, alone, atol=1e-5, rtol=1e-5)


@pytest.mark.slow
@needs_row_invariance
def test_decode_steps_of_several_sequences_attend_together_bitwise_in_bf16(attention16):
    cfg = config_from_dict({"model": {"dtype": "bfloat16", "device": "cpu"},
                            "cache": {"num_slots": 5, "max_seq_len": 512}})
    _decode_steps_together_bitwise(engine16(cfg, load_target(cfg, progress=False), attention16))


@pytest.mark.slow
@needs_row_invariance
def test_oneDNNs_linear_on_a_transposed_input_keeps_rows_bitwise():
    """The kernel choice is measured at load, so under load it can differ from run to run: with F.linear chosen for
    the down projection (its input, the SwiGLU output, handed over transposed by weight @ x.T) and the LM head, rows
    in a group of 5 got other bits than alone until linear() gave F.linear its input in rows, as it was checked."""
    import core.ops as ops

    cfg = config_from_dict({"model": {"dtype": "bfloat16", "device": "cpu"},
                            "cache": {"num_slots": 5, "max_seq_len": 512}})
    target = load_target(cfg, progress=False)
    saved = dict(ops._chosen)
    try:
        for key in list(ops._chosen):
            if key[:2] == ("cpu", "bfloat16"):  # the gate/up kernel hands its output over transposed
                ops.use_linear_kernel(key, "linear" if key[2:] in ((576, 1536), (49152, 576)) else "mv+mm")
        _decode_steps_together_bitwise(engine16(cfg, target, "matmuls"))
    finally:
        ops._chosen.clear()
        ops._chosen.update(saved)


def _decode_steps_together_bitwise(engine) -> None:
    g = torch.Generator().manual_seed(0)
    seqs = []
    for n in (5, 63, 64, 100, 130):  # padded key counts 64, 64, 128, 128, 192
        seq = engine.add(torch.randint(1000, (n,), generator=g).tolist(), max_new_tokens=8)
        engine.prefill(seq)
        seqs.append(seq)
    with torch.inference_mode():
        alone = [engine.verify(s, DraftTree.root_only(s.token_ids[-1]))[0] for s in seqs]
        group = engine.model.logits(engine.forward_rows(
            [engine._tree_rows(s, DraftTree.root_only(s.token_ids[-1])) for s in seqs]))
    for seq in seqs:
        engine.release(seq)
    assert torch.equal(torch.cat(alone), group)
