"""Fault isolation in the worker's scheduler, on the real default model (float32), through the engine's test hook
(server.engine.faults): a fault in one request's admission, drafting, acceptance or first token fails that request
alone (its slot freed, not cached) while the others of the same step finish exactly as they would alone; a fault of
the step's shared forward fails that step's requests and the scheduler goes on; consecutive failing steps are
counted and reported (health)."""
from __future__ import annotations

import pytest

from drafters.base import create_drafter
from server.engine import Engine
from server.engine.faults import FaultPlan, InjectedPanic
from server.worker import messages as m
from server.worker.scheduler import Scheduler
from tests.server.test_batching import Client, alone, run, submit  # noqa: F401 (alone: a fixture)

MARKER = 12345  # a token id none of the well-formed prompts holds: the faulty request's prompt ends with it


@pytest.fixture(scope="module")
def cfg(fp32_config):
    return fp32_config.with_overrides(drafter="ngram")


@pytest.fixture(scope="module")
def case(cfg, target32, alone):
    ids, stops, want = alone
    assert all(MARKER not in p for p in ids)
    return ids[:2], stops, want[:2]


def _scheduler(cfg, target32, spec: str):
    from dataclasses import replace

    cfg = replace(cfg, cache=replace(cfg.cache, num_slots=3))
    engine = Engine(cfg, create_drafter("ngram", target32, {"num_tokens": 4}), target32)
    engine.faults = FaultPlan.parse(spec)
    client = Client()
    statuses = []
    sched = Scheduler(engine, lambda msg: (client.send(msg), isinstance(msg, m.Status) and statuses.append(msg)),
                      max_waiting=8, max_step_tokens=256)
    return engine, sched, client, statuses


@pytest.mark.parametrize("stage,kind", [("admit", "panic"), ("admit", "oom"), ("propose", "oom"),
                                        ("accept", "panic"), ("first", "error")])
def test_a_fault_in_one_request_fails_it_alone(cfg, target32, case, stage, kind):
    ids, stops, want = case
    engine, sched, client, _ = _scheduler(cfg, target32, f"{MARKER}={stage}:{kind}")
    submit(sched, "a", ids[0], 12, stops)
    submit(sched, "bad", ids[1] + [MARKER], 12, stops)
    submit(sched, "b", ids[1], 12, stops)
    run(sched, client)
    failed = client.done["bad"]
    assert isinstance(failed, m.Failed) and failed.kind == "server_error", failed
    expected = {"panic": "InjectedPanic", "oom": "OutOfMemoryError", "error": "RuntimeError"}[kind]
    assert expected in failed.message and "injected fault" in failed.message, failed.message
    assert engine.faults.fired == [f"{stage}:{kind}"]
    # the others of the same steps: exactly their outputs alone
    assert [client.tokens["a"], client.tokens["b"]] == want
    assert sched.failed_steps == 0 and sched.idle
    # every slot is free or holds a cached prefix of a request that finished well, never the failed one's rows
    assert engine.slots_running == 0 and engine.slots_available == engine.pool.num_slots
    assert engine.prefix_hit(ids[1] + [MARKER, 7]).length <= len(ids[1])


def test_a_fault_of_the_shared_forward_fails_that_step_only(cfg, target32, case):
    ids, stops, want = case
    engine, sched, client, statuses = _scheduler(cfg, target32, f"{MARKER}=forward:panic")
    submit(sched, "a", ids[0], 12, stops)
    submit(sched, "bad", ids[1] + [MARKER], 12, stops)
    sched.tick()  # both prompts in one step: nobody can be blamed alone
    for rid in ("a", "bad"):
        assert isinstance(client.done[rid], m.Failed) and "InjectedPanic" in client.done[rid].message
        assert "not in any one request's part" in client.done[rid].message
    assert sched.failed_steps == 1 and engine.slots_running == 0
    sched.status()
    assert statuses[-1].failed_steps == 1
    submit(sched, "b", ids[1], 12, stops)
    run(sched, client)
    assert client.tokens["b"] == want[1]
    assert sched.failed_steps == 0  # a step ran


def test_a_sticky_fault_is_counted_step_after_step(cfg, target32, case):
    ids, stops, _ = case
    engine, sched, client, statuses = _scheduler(cfg, target32, f"{MARKER}=sticky:error")
    submit(sched, "bad", ids[0] + [MARKER], 12, stops)
    sched.tick()
    for i in range(3):  # from now on every step fails, whoever is in it
        submit(sched, str(i), ids[1], 12, stops)
        sched.tick()
        assert isinstance(client.done[str(i)], m.Failed)
        sched.status()
        assert statuses[-1].failed_steps == i + 2
    assert sched.failed_steps == 4 and engine.slots_running == 0


def test_panics_are_base_exceptions():
    """What the isolation must catch: pyo3's PanicException (and so the injected one) derives from BaseException."""
    assert not issubclass(InjectedPanic, Exception)
    with pytest.raises(ValueError):
        FaultPlan.parse("7=nowhere:panic")
