"""Prometheus metrics of the API process (`GET /metrics`), serving and speculation.

Every series is prefixed `specserve_` and labelled by model and drafter. Worker-side figures (speculation per verify
step, running / waiting requests, KV-cache usage, the prefix cache) arrive as worker messages and are folded in here,
so one scrape of the API process sees everything; the worker's cumulative prefix-cache counts move their counters by
the difference since its previous Status. Rates (acceptance rate, tokens/s) come from counters, never from last-batch
gauges.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from server.worker import messages as m

OUTCOMES = ("completed", "client_error", "server_error", "aborted")
_LATENCY = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
_ITL = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)
_POWERS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
MAX_POSITIONS = 16  # accepted-per-position series for draft depths 1..16 (deeper ones count in the last)


class Metrics:
    def __init__(self, model: str, drafter: str):
        self.registry = r = CollectorRegistry()
        self._children: dict[tuple, object] = {}  # (metric id, extra labels) -> its series, for of()
        self.labels = {"model": model, "drafter": drafter}
        ln = ["model", "drafter"]
        self.received = Counter("specserve_requests_received", "Requests received on the generation endpoints",
                                ln, registry=r)
        self.requests = Counter("specserve_requests", "Finished requests by outcome", ln + ["outcome"], registry=r)
        self.e2e = Histogram("specserve_request_latency_seconds", "End-to-end request latency", ln,
                             buckets=_LATENCY, registry=r)
        self.ttft = Histogram("specserve_time_to_first_token_seconds", "Time to first token", ln,
                              buckets=_LATENCY, registry=r)
        self.itl = Histogram("specserve_inter_token_latency_seconds",
                             "Latency per generated token after the first (a step's gap shared by its tokens)", ln,
                             buckets=_ITL, registry=r)
        self.prompt_tokens = Counter("specserve_prompt_tokens", "Prompt tokens processed", ln, registry=r)
        self.generation_tokens = Counter("specserve_generation_tokens", "Tokens generated", ln, registry=r)
        self.running = Gauge("specserve_requests_running", "Requests holding a KV slot", ln, registry=r)
        self.waiting = Gauge("specserve_requests_waiting", "Requests queued for a KV slot", ln, registry=r)
        self.kv_usage = Gauge("specserve_kv_cache_usage_ratio",
                              "Fraction of KV-cache token capacity held by running sequences", ln, registry=r)
        self.kv_cached_usage = Gauge("specserve_kv_cache_cached_usage_ratio",
                                     "Fraction of KV-cache token capacity held by idle prefix-cache slots "
                                     "(evictable)", ln, registry=r)
        self.prefix_queries = Counter("specserve_prefix_cache_queries",
                                      "Prompt tokens looked up in the prefix cache", ln, registry=r)
        self.prefix_hits = Counter("specserve_prefix_cache_hits",
                                   "Prompt tokens found in the prefix cache (their KV reused)", ln, registry=r)
        self.prefix_evictions = Counter("specserve_prefix_cache_evictions",
                                        "Idle prefix-cache slots evicted to make room", ln, registry=r)
        # the worker's cumulative prefix-cache counters as of its last Status; the Counters move by the difference
        self._prefix_seen = {"prefix_queries": 0, "prefix_hits": 0, "prefix_evictions": 0}
        self.verify_steps = Counter("specserve_spec_verify_steps", "Target verification forwards", ln, registry=r)
        self.drafts = Counter("specserve_spec_drafts", "Verify steps that carried at least one draft token", ln,
                              registry=r)
        self.draft_tokens = Counter("specserve_spec_draft_tokens", "Draft tokens proposed", ln, registry=r)
        self.accepted_tokens = Counter("specserve_spec_accepted_tokens", "Draft tokens accepted", ln, registry=r)
        self.accepted_per_position = Counter("specserve_spec_accepted_tokens_per_position",
                                             "Accepted draft tokens by draft depth (1 = first after the root)",
                                             ln + ["position"], registry=r)
        self.accepted_length = Histogram("specserve_spec_accepted_length",
                                         "Tokens emitted per verify step (accepted drafts + bonus)", ln,
                                         buckets=tuple(range(1, MAX_POSITIONS + 2)), registry=r)
        self.draft_length = Histogram("specserve_spec_draft_length", "Draft tokens proposed per verify step", ln,
                                      buckets=(0, 1, 2, 3, 4, 5, 6, 8, 12, 16, 24, 32, 48, 63), registry=r)
        self.step_sequences = Histogram("specserve_step_batch_size", "Sequences stepping together in one target forward",
                                        ln, buckets=_POWERS[:7], registry=r)
        self.step_rows = Histogram("specserve_step_rows", "Rows of one target forward (tree rows + prompt-chunk tokens)",
                                   ln, buckets=_POWERS, registry=r)
        self.step_seconds = Histogram("specserve_step_duration_seconds", "Wall time of one batched step", ln,
                                      buckets=_ITL, registry=r)
        self.step_draft_rows = Counter("specserve_step_draft_rows", "Draft rows verified (the draft budget's grants)",
                                       ln, registry=r)
        self.step_prefill_tokens = Counter("specserve_step_prefill_tokens", "Prompt tokens prefilled in steps", ln,
                                           registry=r)
        self.worker_restarts = Counter("specserve_worker_restarts",
                                       "Times the API process restarted a dead worker, or one whose engine failed "
                                       "every step", ln, registry=r)
        self.engine_failed_steps = Gauge("specserve_engine_failed_steps",
                                         "Consecutive steps that failed in the engine as a whole (0 after a step ran)",
                                         ln, registry=r)
        for o in OUTCOMES:  # export zeros so dashboards and balance checks see every outcome from the start
            self.requests.labels(**self.labels, outcome=o)
        for p in range(1, MAX_POSITIONS + 1):
            self.accepted_per_position.labels(**self.labels, position=str(p))
        for series in (self.kv_usage, self.kv_cached_usage, self.prefix_queries, self.prefix_hits,
                       self.prefix_evictions, self.worker_restarts, self.engine_failed_steps):
            series.labels(**self.labels)

    def of(self, metric, **extra):
        """``metric``'s series for this server's labels (plus ``extra``), looked up once: ``labels()`` costs several
        microseconds and runs for every streamed token and worker message."""
        key = (id(metric), *extra.items())
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(**self.labels, **extra)
        return child

    def on_worker_message(self, msg: m.FromWorker) -> None:
        if isinstance(msg, m.Status):
            self.of(self.running).set(msg.running)
            self.of(self.waiting).set(msg.waiting)
            self.of(self.kv_usage).set(msg.kv_usage)
            self.of(self.kv_cached_usage).set(msg.kv_cached_usage)
            self.of(self.engine_failed_steps).set(msg.failed_steps)
            for name, counter in (("prefix_queries", self.prefix_queries), ("prefix_hits", self.prefix_hits),
                                  ("prefix_evictions", self.prefix_evictions)):
                now, before = getattr(msg, name), self._prefix_seen[name]
                if now > before:
                    self.of(counter).inc(now - before)
                self._prefix_seen[name] = now
        elif isinstance(msg, m.Step):
            if msg.sequences:
                self.of(self.step_sequences).observe(msg.sequences)
            self.of(self.step_rows).observe(msg.rows)
            self.of(self.step_seconds).observe(msg.seconds)
            self.of(self.step_draft_rows).inc(msg.draft_rows)
            self.of(self.step_prefill_tokens).inc(msg.prefill_tokens)
        elif isinstance(msg, m.Tokens):
            for st in msg.steps:
                self.of(self.verify_steps).inc()
                if st.draft_tokens:
                    self.of(self.drafts).inc()
                    self.of(self.draft_tokens).inc(st.draft_tokens)
                    self.of(self.accepted_tokens).inc(st.accepted_tokens)
                for p in range(1, st.accepted_tokens + 1):
                    self.of(self.accepted_per_position, position=str(min(p, MAX_POSITIONS))).inc()
                self.of(self.accepted_length).observe(st.accepted_tokens + 1)
                self.of(self.draft_length).observe(st.draft_tokens)

    def worker_restarted(self) -> None:
        """A new worker: its cumulative counters start again from zero."""
        self.of(self.worker_restarts).inc()
        self.of(self.engine_failed_steps).set(0)
        self._prefix_seen = dict.fromkeys(self._prefix_seen, 0)

    def outcome(self, outcome: str) -> None:
        self.of(self.requests, outcome=outcome).inc()

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
