"""The engine's public API: what the worker, the benchmarks and the training pipeline use.

- ``load_engine`` / ``load_target``: start-up (``startup.py``): the target loaded in the dtype and kernels measured
  fastest here, and an engine on it.
- ``Target``: the loaded target model (``target.py``); ``Target.forward`` runs one causal pass over a whole sequence
  and returns its hidden states and K/V (training's teacher passes).
- ``Engine``: KV slots and the batched speculative step (``engine.py``), driven by a ``StepPlan`` and answering a
  ``StepResult`` (``step.py``); ``Sequence`` is one request's state (``sequence.py``).
- ``prefill_chunks``: how a step's rows go to prompt chunks, for every loop that drives ``Engine.run``.
"""
from server.engine.engine import Engine
from server.engine.kv_cache import NoFreeSlotError
from server.engine.sequence import GenerationOutput, RequestError, Sequence, SeqStats
from server.engine.step import MIN_PREFILL_CHUNK, SeqStep, StepPlan, StepResult, prefill_chunks
from server.engine.startup import load_engine, load_target
from server.engine.target import Target, TargetPass

__all__ = ["Engine", "GenerationOutput", "MIN_PREFILL_CHUNK", "NoFreeSlotError", "RequestError", "SeqStats",
           "SeqStep", "Sequence", "StepPlan", "StepResult", "Target", "TargetPass", "load_engine", "load_target",
           "prefill_chunks"]
