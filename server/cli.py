"""The server's commands of the `specserve` command line: generate, serve, cluster, bench offline/steps/serve (the
`train` commands are ``training.cli``'s; ``specserve.cli`` puts both together), and the option helpers both use.

Every command that loads the model takes ``--config`` and the overrides ``--dtype`` / ``--device``; the ones that run a
drafter (serve, generate, bench offline) also take ``--drafter``. ``bench serve`` only talks to a running server over
HTTP. Environment variables are read here, at the entry points, and nowhere below.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from core.ops import DTYPES, QUANTIZATIONS
from server.bench.records import RESULTS
from server.config import ConfigError, EngineConfig, load_config

RECORD_HELP = "also write a results record (JSON) into DIR (default docs/results); then `specserve bench report`"


def common_options(p: argparse.ArgumentParser,
                   drafter_help: str | None = "drafter name (overrides the config)") -> None:
    """--config, --dtype, --device, and --drafter unless ``drafter_help`` is None (commands that run no drafter)."""
    p.add_argument("--config", default=None, help="YAML config (default: embedded model, drafter none)")
    if drafter_help is not None:
        p.add_argument("--drafter", default=None, help=drafter_help)
    p.add_argument("--dtype", default=None, choices=["auto", *DTYPES],
                   help="serving dtype (auto: the fastest measured on this machine)")
    p.add_argument("--quantization", default=None, choices=[*QUANTIZATIONS, "auto"],
                   help="weight-only quantization (auto: a GGUF source's own on CPU, else none)")
    p.add_argument("--device", default=None, help="auto | cpu | cuda | cuda:N")


def log_stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def emit(text: str, report, json_path: str | None, record: str | None = None, kind: str = "",
         argv: list[str] | None = None) -> None:
    """Print a benchmark's table; write its full report as JSON, and a results record of the command ``argv`` into
    the folder ``record``, when asked."""
    print(text)
    if json_path:
        with open(json_path, "w") as f:
            json.dump(report, f, indent=1)
    if record:
        from server.bench import records

        log_stderr(f"record: {records.write(records.make(kind, report, argv), record)}")


def _choices(arg: str, valid: tuple[str, ...], flag: str) -> list[str]:
    """A comma-separated flag value, each item checked against ``valid``."""
    items = [x.strip() for x in arg.split(",") if x.strip()]
    for x in items:
        if x not in valid:
            raise ConfigError(f"{flag}: {x!r} is not one of {', '.join(valid)}")
    return items


def config_from_args(a: argparse.Namespace, drafter: str | None = None) -> EngineConfig:
    return load_config(a.config).with_overrides(drafter=drafter, dtype=a.dtype, device=a.device,
                                                quantization=a.quantization)


def cmd_generate(a: argparse.Namespace) -> int:
    from core.sampling import SamplingParams
    from server.engine import load_engine
    from server.model_files import load_tokenizer
    from server.tokenization import encode_chat, encode_text, stop_token_ids

    cfg = config_from_args(a, a.drafter)
    engine = load_engine(cfg)
    tok = load_tokenizer(engine.target.hf_dir)
    if a.messages is not None:
        messages = json.loads(a.messages)
        if not isinstance(messages, list) or not messages:
            raise ConfigError("--messages must be a non-empty JSON list of {role, content}")
        ids = encode_chat(tok, messages)
    else:
        ids = encode_text(tok, a.prompt)
    sampling = SamplingParams(temperature=a.temperature, top_p=a.top_p, top_k=a.top_k, seed=a.seed)
    out = engine.generate(ids, sampling, a.max_tokens, stop_token_ids(tok, engine.model.args.eos_token_ids))
    text = tok.decode(out.token_ids, skip_special_tokens=True)
    if a.json:
        stats = {"drafter": engine.drafter.name, **out.stats.as_dict(), "finish_reason": out.finish_reason,
                 "prompt_tokens": len(ids), "completion_tokens": len(out.token_ids),
                 "prefill_s": round(out.prefill_s, 4), "decode_s": round(out.decode_s, 4)}
        print(json.dumps({"text": text, "token_ids": out.token_ids, "stats": stats}))
    else:
        print(text)
    return 0


def cmd_bench_offline(a: argparse.Namespace) -> int:
    from core.sampling import SamplingParams
    from server.bench.offline import format_report, run_offline

    cfg = config_from_args(a)
    sampling = SamplingParams(temperature=a.temperature, top_p=a.top_p, seed=a.seed, min_p=a.min_p,
                              presence_penalty=a.presence_penalty, frequency_penalty=a.frequency_penalty,
                              repetition_penalty=a.repetition_penalty)
    rep = run_offline(cfg, [a.drafter or "none"], a.prompts, a.max_tokens, a.baseline, a.repeats, log=log_stderr,
                      sampling=sampling, grammar=not a.no_grammar, free_baseline=a.free_baseline)
    emit(format_report(rep), rep, a.json, a.record, "offline", getattr(a, "argv", None))
    return 0


def cmd_bench_steps(a: argparse.Namespace) -> int:
    from server.bench.steps import format_steps, run_steps

    cfg = load_config(a.config).with_overrides(device=a.device)
    dtypes = _choices(a.dtypes or cfg.model.dtype, ("auto", *DTYPES), "--dtypes")
    quants = _choices(a.quantizations or cfg.model.quantization, (*QUANTIZATIONS, "auto"), "--quantizations")
    rows = tuple(int(r) for r in a.rows.split(","))
    if any(not 1 <= r <= 4096 for r in rows):
        raise ConfigError("--rows: each row count must be in [1, 4096] (past 64: causal rows, as a batch of sequences)")
    rep = run_steps(cfg, dtypes, quants, rows, a.cached, a.repeats, a.profile, log=log_stderr)
    emit(format_steps(rep), rep, a.json, a.record, "steps", getattr(a, "argv", None))
    return 0


def cmd_bench_report(a: argparse.Namespace) -> int:
    from server.bench.report import PAGE, run

    return run(a.results, a.out or str(PAGE), a.check)


def cmd_serve(a: argparse.Namespace) -> int:
    from server.api.app import serve

    cfg = config_from_args(a, a.drafter)
    host = a.host or cfg.server.host
    port = a.port if a.port is not None else cfg.server.port
    from server.api.auth import ApiKeys

    env_key = os.environ.get("SPECSERVE_API_KEY")
    try:
        keys = ApiKeys.of(a.api_key or ([env_key] if env_key else []),
                          a.api_key_file or os.environ.get("SPECSERVE_API_KEY_FILE") or None)
    except (OSError, ValueError) as e:
        raise ConfigError(f"API keys: {e}") from None
    return serve(cfg, host, port, keys, drain_timeout=a.drain_timeout)


def parse_cores(text: str) -> list[int]:
    """"0-3,6" -> [0, 1, 2, 3, 6]."""
    cores = []
    for part in text.split(","):
        lo, _, hi = part.strip().partition("-")
        cores += range(int(lo), int(hi or lo) + 1)
    if not cores:
        raise ValueError(f"--cores {text!r} names no core")
    return cores


def cmd_cluster(a: argparse.Namespace) -> int:
    from server.cluster import Cluster, ClusterError, load_raw_config

    cluster = Cluster(load_raw_config(a.config), a.replicas, a.router, a.policy, a.host, a.port, a.base_port,
                      Path(a.run_dir), a.drain_timeout, parse_cores(a.cores) if a.cores else None,
                      a.router_metrics_port)
    try:
        cluster.start(log=log_stderr)
    except ClusterError as e:
        print(f"specserve cluster: error: {e}", file=sys.stderr)
        return 1
    log_stderr(f"cluster ready: {cluster.url}/v1 ({a.replicas} replicas behind {a.router}-router)")
    return cluster.serve_forever()


# `bench serve` options that belong to one workload: flag -> (attribute, workload, default)
_WORKLOAD_OPTIONS = {"--conversations": ("conversations", "multi-turn", 4), "--turns": ("turns", "multi-turn", 6),
                     "--history-tokens": ("history_tokens", "multi-turn", 1800),
                     "--groups": ("groups", "shared-prefix", 8), "--questions": ("questions", "shared-prefix", 8),
                     "--prefix-tokens": ("prefix_tokens", "shared-prefix", 1024)}


def _bench_serve_workload_args(a: argparse.Namespace) -> dict:
    """The chosen workload's options, defaults filled in and checked; an option of another workload is an error."""
    opts = {}
    for flag, (attr, workload, default) in _WORKLOAD_OPTIONS.items():
        value = getattr(a, attr)
        if workload != a.workload:
            if value is not None:
                raise ValueError(f"{flag} applies to --workload {workload}")
            continue
        opts[attr] = default if value is None else value
        if opts[attr] < (2 if attr == "turns" else 1):
            raise ValueError(f"{flag} must be at least {2 if attr == 'turns' else 1}")
    if a.workload != "prompts":
        for flag, given in (("--num-requests", a.num_requests is not None), ("--plot", a.plot)):
            if given:
                raise ValueError(f"{flag} applies to --workload prompts")
    return opts


def cmd_bench_serve(a: argparse.Namespace) -> int:
    from server.bench.serve import (format_serve_report, parse_levels, plot_serve_report, require_matplotlib,
                                    run_serve_bench)

    opts = _bench_serve_workload_args(a)
    if a.workload == "multi-turn" and a.concurrency is not None:
        raise ValueError("--concurrency: multi-turn runs its --conversations all at once")
    levels = parse_levels(a.concurrency or "1")
    if a.workload == "shared-prefix" and len(levels) != 1:
        raise ValueError("--concurrency: shared-prefix runs at one level")
    if a.workload == "prompts" and a.prompts is None:
        raise ValueError("--prompts is required with --workload prompts")
    if a.num_requests is not None and a.num_requests < 1:
        raise ValueError("--num-requests must be at least 1")
    if a.plot:
        require_matplotlib()  # before the sweep, not after minutes of it
    api_key = a.api_key or os.environ.get("SPECSERVE_API_KEY") or None
    try:
        if a.workload == "prompts":
            rep = run_serve_bench(a.url, api_key, a.prompts, levels, a.num_requests, a.max_tokens, a.warmup,
                                  log=log_stderr)
            text = format_serve_report(rep)
        else:
            from server.bench import prefix

            prompts = a.prompts or prefix.DEFAULT_QUESTIONS
            if a.workload == "multi-turn":
                rep = prefix.run_multi_turn_bench(a.url, api_key, prompts, max_tokens=a.max_tokens, warmup=a.warmup,
                                                  log=log_stderr, **opts)
                text = prefix.format_multi_turn_report(rep)
            else:
                rep = prefix.run_shared_prefix_bench(a.url, api_key, prompts, concurrency=levels[0],
                                                     max_tokens=a.max_tokens, warmup=a.warmup, log=log_stderr, **opts)
                text = prefix.format_shared_prefix_report(rep)
    except ConnectionError as e:
        print(f"specserve: error: {e}", file=sys.stderr)
        return 2
    if a.record:
        from server.bench.serve import server_drafter

        rep["drafter"] = server_drafter(a.url, api_key)
    emit(text, rep, a.json, a.record, "serve", getattr(a, "argv", None))
    if a.plot:
        plot_serve_report(rep, a.plot)
    return 0 if rep["errors"] == 0 else 1


def add_commands(sub) -> None:
    """generate, serve and bench, on the subparsers of the `specserve` parser."""
    g = sub.add_parser("generate", help="generate one completion offline and print it")
    common_options(g)
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="raw text prompt")
    src.add_argument("--messages", help='chat messages as JSON, e.g. \'[{"role":"user","content":"hi"}]\'')
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--json", action="store_true", help='print {"text", "token_ids", "stats"}')
    g.set_defaults(func=cmd_generate)

    s = sub.add_parser("serve", help="serve the OpenAI-compatible API (API process + one worker process)")
    common_options(s)
    s.add_argument("--host", default=None, help="bind address (default: the config's server.host)")
    s.add_argument("--port", type=int, default=None, help="port (default: the config's server.port)")
    s.add_argument("--api-key", action="append", default=None,
                   help="require `Authorization: Bearer KEY`; repeat for several keys, each its own prefix-cache "
                        "partition (also $SPECSERVE_API_KEY, one key)")
    s.add_argument("--api-key-file", default=None,
                   help="a file of keys, one per line, each optionally followed by a tenant name whose keys share "
                        "one prefix-cache partition (also $SPECSERVE_API_KEY_FILE)")
    s.add_argument("--drain-timeout", type=float, default=30.0,
                   help="seconds in-flight requests may take to finish after SIGTERM")
    s.set_defaults(func=cmd_serve)

    c = sub.add_parser("cluster", help="N serve replicas on this host, each on its own cores, behind sglang-router "
                       "or vllm-router (pip install 'specserve[cluster]')")
    c.add_argument("--config", default=None, help="YAML config every replica serves (default: embedded model)")
    c.add_argument("--replicas", type=int, default=2)
    c.add_argument("--router", choices=["sglang", "vllm"], default="sglang",
                   help="sglang: SGLang's model gateway (sglang-router); vllm: vLLM's router (vllm-router)")
    c.add_argument("--policy", default="cache_aware", help="the router's policy: cache_aware (a request to the "
                   "replica it shares the longest text prefix with), round_robin, random, power_of_two; vllm also "
                   "consistent_hash and sticky_least_loaded (by the X-Session-ID header or the request's `user`)")
    c.add_argument("--host", default="127.0.0.1", help="the router's bind address")
    c.add_argument("--port", type=int, default=8000, help="the router's port")
    c.add_argument("--base-port", type=int, default=None, help="replica i listens on 127.0.0.1:BASE_PORT+i "
                   "(default: --port + 1)")
    c.add_argument("--cores", default=None, help="the cores to split among the replicas, e.g. 0-7 or 0,2,4,6 "
                   "(default: all this process may use)")
    c.add_argument("--router-metrics-port", type=int, default=29000,
                   help="the router's own Prometheus metrics on 127.0.0.1 (default 29000)")
    c.add_argument("--run-dir", default="cluster-run", help="replica configs and logs (default ./cluster-run)")
    c.add_argument("--drain-timeout", type=float, default=30.0,
                   help="seconds a replica's streams may take to finish when the cluster stops")
    c.set_defaults(func=cmd_cluster)

    b = sub.add_parser("bench", help="benchmarks")
    bsub = b.add_subparsers(dest="bench", required=True)
    bo = bsub.add_parser("offline", help="drafters vs plain decoding (and HF generate) on one prompt set")
    common_options(bo, "comma-separated drafters to compare with `none`, each optionally with option overrides: "
                "name:key=value[:key=value...] (YAML values), e.g. glide:gamma=1,glide:gamma=2,falcon:top_m=[2,1]")
    bo.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (0: greedy)")
    bo.add_argument("--top-p", type=float, default=1.0)
    bo.add_argument("--seed", type=int, default=None, help="seed prompt i with seed + i (outputs stay comparable)")
    bo.add_argument("--min-p", type=float, default=0.0)
    bo.add_argument("--presence-penalty", type=float, default=0.0, help="over generated tokens (-2..2)")
    bo.add_argument("--frequency-penalty", type=float, default=0.0, help="per occurrence in generated tokens (-2..2)")
    bo.add_argument("--repetition-penalty", type=float, default=1.0, help="over prompt and generated tokens (> 0)")
    bo.add_argument("--prompts", required=True, help="JSONL: one {messages} or {prompt} per line, optionally with "
                    "an OpenAI response_format the output is constrained to")
    bo.add_argument("--no-grammar", action="store_true", help="ignore the prompts' response_format (unconstrained)")
    bo.add_argument("--free-baseline", action="store_true",
                    help="also time `none` without the prompts' response_format, in the same run (row none-free)")
    bo.add_argument("--max-tokens", type=int, default=64)
    bo.add_argument("--baseline", choices=["hf"], default=None)
    bo.add_argument("--repeats", type=int, default=1, help="passes over the prompts; tok/s is their median")
    bo.add_argument("--json", default=None, metavar="OUT", help="write the full report as JSON")
    bo.add_argument("--record", nargs="?", const=str(RESULTS), default=None, metavar="DIR", help=RECORD_HELP)
    bo.set_defaults(func=cmd_bench_offline)
    bt = bsub.add_parser("steps", help="step-cost curve: ms per target forward vs rows verified, per dtype")
    bt.add_argument("--config", default=None, help="YAML config (model source, device)")
    bt.add_argument("--device", default=None, help="auto | cpu | cuda | cuda:N")
    bt.add_argument("--dtypes", default=None, help="comma-separated, e.g. bfloat16,float32 (default: the config's)")
    bt.add_argument("--quantizations", default=None, help="comma-separated, e.g. none,int8,int4 (default: the "
                    "config's)")
    bt.add_argument("--rows", default="1,2,4,8,16,32,64", help="comma-separated row counts: a draft chain up to 64, causal rows past it (a batch)")
    bt.add_argument("--cached", type=int, default=300, help="tokens in the KV cache before the verified rows")
    bt.add_argument("--repeats", type=int, default=7, help="forwards per point; the median is reported")
    bt.add_argument("--profile", type=int, default=None, metavar="ROWS",
                    help="also print torch.profiler's top operators for 1 row and ROWS rows")
    bt.add_argument("--json", default=None, metavar="OUT")
    bt.add_argument("--record", nargs="?", const=str(RESULTS), default=None, metavar="DIR", help=RECORD_HELP)
    bt.set_defaults(func=cmd_bench_steps)
    bs = bsub.add_parser("serve", help="drive a running server through the OpenAI streaming API")
    bs.add_argument("--url", required=True, help="server base URL, e.g. http://127.0.0.1:8000")
    bs.add_argument("--api-key", default=None, help="bearer key (also $SPECSERVE_API_KEY)")
    bs.add_argument("--workload", choices=["prompts", "multi-turn", "shared-prefix"], default="prompts",
                    help="prompts: the prompts file at each --concurrency (default); multi-turn, shared-prefix: "
                    "prefix caching, each request sent with the cache on and off (docs/benchmarks.md)")
    bs.add_argument("--prompts", default=None, help="JSONL: one {messages} or {prompt} per line (required for "
                    "prompts; the questions of multi-turn and shared-prefix, default deploy/prompts/bench.jsonl)")
    bs.add_argument("--concurrency", default=None, metavar="N[,N...]",
                    help="requests in flight (default 1); a comma-separated list (e.g. 1,4,16,64) runs a sweep, one "
                    "level after another against the same server (prompts only; shared-prefix takes one level, "
                    "multi-turn runs --conversations at once)")
    bs.add_argument("--num-requests", type=int, default=None,
                    help="requests per level (default: max(2 * concurrency, 8) for each level)")
    bs.add_argument("--max-tokens", type=int, default=64)
    bs.add_argument("--warmup", type=int, default=1, metavar="N",
                    help="untimed requests of --max-tokens before the first level (default 1; 0: none)")
    bs.add_argument("--conversations", type=int, default=None, metavar="C",
                    help="multi-turn: conversations, all in flight at once (default 4)")
    bs.add_argument("--turns", type=int, default=None, metavar="T", help="multi-turn: turns per conversation "
                    "(default 6, at least 2)")
    bs.add_argument("--history-tokens", type=int, default=None, metavar="N",
                    help="multi-turn: about how long the history gets by the last turn (default 1800)")
    bs.add_argument("--groups", type=int, default=None, metavar="G",
                    help="shared-prefix: system prompts, one per group (default 8)")
    bs.add_argument("--questions", type=int, default=None, metavar="Q",
                    help="shared-prefix: questions per group (default 8)")
    bs.add_argument("--prefix-tokens", type=int, default=None, metavar="N",
                    help="shared-prefix: about how long each system prompt is (default 1024)")
    bs.add_argument("--json", default=None, metavar="OUT", help="write the full report (all levels) as JSON")
    bs.add_argument("--plot", default=None, metavar="FILE.png",
                    help="plot output tok/s and TTFT/TPOT p50/p99 vs concurrency (needs matplotlib: "
                    "pip install 'specserve[plot]')")
    bs.add_argument("--record", nargs="?", const=str(RESULTS), default=None, metavar="DIR", help=RECORD_HELP)
    bs.set_defaults(func=cmd_bench_serve)
    br = bsub.add_parser("report", help="docs/benchmarks.md from the results records (current results per machine)")
    br.add_argument("--results", default=str(RESULTS), help="the records' folder")
    br.add_argument("--out", default=None, help="the page to write (default docs/benchmarks.md)")
    br.add_argument("--check", action="store_true", help="write nothing; exit 1 when the page is out of date")
    br.set_defaults(func=cmd_bench_report)
