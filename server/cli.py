"""`specserve` command line: serve, generate, bench offline/serve, train prompts/data/glide/falcon/accept-head/bigram/
eval-glide.

Every command that loads the model takes ``--config`` and the overrides ``--dtype`` / ``--device``; the ones that run a
drafter (serve, generate, bench offline) also take ``--drafter``. ``bench serve`` only talks to a running server over
HTTP. Environment variables are read here, at the entry point, and nowhere below.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

from core.ops import DTYPES, QUANTIZATIONS
from server.config import ConfigError, EngineConfig, load_config


def _common(p: argparse.ArgumentParser, drafter_help: str | None = "drafter name (overrides the config)") -> None:
    """--config, --dtype, --device, and --drafter unless ``drafter_help`` is None (commands that run no drafter)."""
    p.add_argument("--config", default=None, help="YAML config (default: embedded model, drafter none)")
    if drafter_help is not None:
        p.add_argument("--drafter", default=None, help=drafter_help)
    p.add_argument("--dtype", default=None, choices=["auto", *DTYPES],
                   help="serving dtype (auto: the fastest measured on this machine)")
    p.add_argument("--quantization", default=None, choices=list(QUANTIZATIONS), help="weight-only quantization")
    p.add_argument("--device", default=None, help="auto | cpu | cuda | cuda:N")


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _emit(text: str, report, json_path: str | None) -> None:
    """Print a benchmark's table; write its full report as JSON when asked."""
    print(text)
    if json_path:
        with open(json_path, "w") as f:
            json.dump(report, f, indent=1)


def _choices(arg: str, valid: tuple[str, ...], flag: str) -> list[str]:
    """A comma-separated flag value, each item checked against ``valid``."""
    items = [x.strip() for x in arg.split(",") if x.strip()]
    for x in items:
        if x not in valid:
            raise ConfigError(f"{flag}: {x!r} is not one of {', '.join(valid)}")
    return items


def _config(a: argparse.Namespace, drafter: str | None = None) -> EngineConfig:
    return load_config(a.config).with_overrides(drafter=drafter, dtype=a.dtype, device=a.device,
                                                quantization=a.quantization)


def cmd_generate(a: argparse.Namespace) -> int:
    from core.sampling import SamplingParams
    from server.engine import Engine
    from server.model_files import load_tokenizer
    from server.tokenization import encode_chat, encode_text, stop_token_ids

    cfg = _config(a, a.drafter)
    engine = Engine(cfg)
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

    cfg = _config(a)
    sampling = SamplingParams(temperature=a.temperature, top_p=a.top_p, seed=a.seed)
    rep = run_offline(cfg, [a.drafter or "none"], a.prompts, a.max_tokens, a.baseline, a.repeats, log=_log,
                      sampling=sampling)
    _emit(format_report(rep), rep, a.json)
    return 0


def cmd_bench_steps(a: argparse.Namespace) -> int:
    from server.bench.steps import format_steps, run_steps

    cfg = load_config(a.config).with_overrides(device=a.device)
    dtypes = _choices(a.dtypes or cfg.model.dtype, ("auto", *DTYPES), "--dtypes")
    quants = _choices(a.quantizations or cfg.model.quantization, QUANTIZATIONS, "--quantizations")
    rows = tuple(int(r) for r in a.rows.split(","))
    if any(not 1 <= r <= 4096 for r in rows):
        raise ConfigError("--rows: each row count must be in [1, 4096] (past 64: causal rows, as a batch of sequences)")
    rep = run_steps(cfg, dtypes, quants, rows, a.cached, a.repeats, a.profile, log=_log)
    _emit(format_steps(rep), rep, a.json)
    return 0


def cmd_serve(a: argparse.Namespace) -> int:
    from server.api.app import serve

    cfg = _config(a, a.drafter)
    host = a.host or cfg.server.host
    port = a.port if a.port is not None else cfg.server.port
    api_key = a.api_key or os.environ.get("SPECSERVE_API_KEY") or None
    return serve(cfg, host, port, api_key, drain_timeout=a.drain_timeout)


def cmd_bench_serve(a: argparse.Namespace) -> int:
    from server.bench.serve import (format_serve_report, parse_levels, plot_serve_report, require_matplotlib,
                                    run_serve_bench)

    levels = parse_levels(a.concurrency)
    if a.num_requests is not None and a.num_requests < 1:
        raise ValueError("--num-requests must be at least 1")
    if a.plot:
        require_matplotlib()  # before the sweep, not after minutes of it
    api_key = a.api_key or os.environ.get("SPECSERVE_API_KEY") or None
    try:
        rep = run_serve_bench(a.url, api_key, a.prompts, levels, a.num_requests, a.max_tokens, a.warmup, log=_log)
    except ConnectionError as e:
        print(f"specserve: error: {e}", file=sys.stderr)
        return 2
    _emit(format_serve_report(rep), rep, a.json)
    if a.plot:
        plot_serve_report(rep, a.plot)
    return 0 if rep["errors"] == 0 else 1


def cmd_train_glide(a: argparse.Namespace) -> int:
    from training.glide import TrainOptions, run_train_glide

    weights = []
    for part in (a.source_weight or "").split(","):
        if not part.strip():
            continue
        src, _, w = part.partition("=")
        if not src.strip() or not w.strip().isdigit() or int(w) < 1:
            raise ConfigError(f"--source-weight: SOURCE=N pairs with N >= 1, got {part!r}")
        weights.append((src.strip(), int(w)))
    if a.train_tokens < 0:
        raise ConfigError("--train-tokens must be >= 0")
    opts = TrainOptions(steps=a.steps, batch_tokens=a.batch_tokens, lr=a.lr, loss=a.loss, block_len=a.block_len,
                        max_len=a.max_len, seed=a.seed, train_tokens=a.train_tokens, source_weights=tuple(weights))
    overrides = {k: getattr(a, k) for k in ("num_layers", "hidden_size", "num_heads", "num_kv_heads",
                                             "intermediate_size") if getattr(a, k) is not None}
    run_train_glide(_config(a), out=a.out, vanilla=a.vanilla, data_path=a.data, opts=opts,
                    vocab_subset=a.vocab_subset, max_new_tokens=a.max_new_tokens, gen_batch=a.gen_batch,
                    limit=a.limit, text_tokens=a.text_tokens, log=_log,
                    **overrides)
    return 0


def cmd_train_falcon(a: argparse.Namespace) -> int:
    from training.falcon import FalconTrainOptions, run_train_falcon

    opts = FalconTrainOptions(steps=a.steps, batch_tokens=a.batch_tokens, lr=a.lr, max_len=a.max_len, seed=a.seed,
                              csgd=not a.teacher_forcing, glance=a.glance, w_dist=a.w_dist)
    run_train_falcon(_config(a), out=a.out, data_path=a.data, opts=opts, k=a.k, vocab_subset=a.vocab_subset,
                     max_new_tokens=a.max_new_tokens, gen_batch=a.gen_batch, limit=a.limit,
                     text_tokens=a.text_tokens, log=_log)
    return 0


def cmd_train_accept_head(a: argparse.Namespace) -> int:
    from training.accept_head import AcceptTrainOptions, run_train_accept_head

    temps = tuple(float(t) for t in a.temperatures.split(",") if t.strip())
    if not temps or any(not 0 < t <= 2 for t in temps):
        raise ConfigError("--temperatures: comma-separated temperatures in (0, 2]")
    opts = AcceptTrainOptions(max_depth=a.max_depth, temperatures=temps, keep=a.keep, num_blocks=a.num_blocks,
                              hidden_only=a.hidden_only, reject_weight=a.reject_weight, steps=a.steps, batch=a.batch,
                              lr=a.lr, max_len=a.max_len, seed=a.seed)
    run_train_accept_head(_config(a), a.drafter, out=a.out, data_path=a.data, checkpoint=a.checkpoint, opts=opts,
                          max_new_tokens=a.max_new_tokens, gen_batch=a.gen_batch, limit=a.limit, log=_log)
    return 0


def cmd_train_eval_glide(a: argparse.Namespace) -> int:
    from training.glide import measure_acceptance
    from server.bench.offline import read_prompts
    from server.engine import load_target
    from server.model_files import load_tokenizer
    from server.tokenization import encode_record, stop_token_ids

    cfg = _config(a)
    target = load_target(cfg)
    tok = load_tokenizer(target.hf_dir)
    prompts = [encode_record(tok, r) for r in read_prompts(a.prompts)]
    stops = stop_token_ids(tok, target.args.eos_token_ids)
    rows = []
    for ckpt in a.checkpoint:
        for t in (float(x) for x in a.temperatures.split(",")):
            r = measure_acceptance(cfg, ckpt, prompts, a.gamma, t, a.max_tokens, a.cape, target, stops)
            rows.append({"checkpoint": ckpt, **r})
            print(f"{ckpt}  T={t:g}  acceptance {r['acceptance_rate']:.3f}  mean accepted length "
                  f"{r['mean_accepted_length']:.3f}", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


def _replay_command(a: argparse.Namespace) -> str:
    """The command that repeats this run, every option spelled out (a data card's record of how it was made)."""
    import shlex

    argv = ["specserve", "train", a.train]
    for action in a.train_parser._actions:
        value = getattr(a, action.dest, None)
        if not action.option_strings or action.dest == "help" or value is None or value is False:
            continue
        argv += [action.option_strings[-1]] if value is True else [action.option_strings[-1], str(value)]
    return shlex.join(argv)


def _floats(arg: str, flag: str) -> tuple[float, ...]:
    try:
        return tuple(float(x) for x in arg.split(",") if x.strip())
    except ValueError:
        raise ConfigError(f"{flag}: expected comma-separated numbers, got {arg!r}") from None


def cmd_train_prompts(a: argparse.Namespace) -> int:
    from pathlib import Path

    from training.synth import SynthSettings, default_out_dir, synthesize_prompts
    from server.engine import load_target

    settings = SynthSettings(count=a.count, seed=a.seed, max_prompt_tokens=a.max_prompt_tokens,
                             max_answer_tokens=a.max_answer_tokens, temperature=a.temperature, top_p=a.top_p,
                             multi_turn_share=a.multi_turn_share, heldout_fraction=a.heldout,
                             shard_size=a.shard_size, max_generated=a.max_generated)
    cfg = _config(a)
    target = load_target(cfg)
    out = Path(a.out) if a.out else default_out_dir(cfg, target.model_id)
    st = synthesize_prompts(cfg, target, out, settings, batch=a.batch, step_tokens=a.step_tokens, log=_log,
                            command=_replay_command(a))
    g = st["generation"]
    print(f"{out}: {st['kept']} prompts kept of {st['generated']} generated ({st['train']} train, {st['heldout']} "
          f"held out, {st['multi_turn']} multi-turn); {g['prompts_per_s']:.2f} prompts/s, {g['tokens_per_s']:.0f} "
          f"tokens/s")
    print("categories: " + ", ".join(f"{c} {v:.1%}" for c, v in st["category_shares"].items()))
    print("rejected: " + (", ".join(f"{r} {n}" for r, n in st["rejected"].items()) or "none"))
    return 0


def cmd_train_data(a: argparse.Namespace) -> int:
    from pathlib import Path

    from training.data import AnswerSettings, answer_records, prompt_records
    from training.glide import work_dir
    from training.synth import default_out_dir
    from server.engine import load_target

    settings = AnswerSettings(max_new_tokens=a.max_new_tokens, temperatures=_floats(a.temperatures, "--temperatures"),
                              sampled_share=a.sampled_share, seed=a.seed, shard_size=a.shard_size)
    cfg = _config(a)
    target = load_target(cfg)
    records = prompt_records(a.prompts, default_out_dir(cfg, target.model_id) / "train.jsonl", _log)
    records = records[:a.limit] if a.limit else records
    path = Path(a.data) if a.data else work_dir(cfg, target.model_id) / "responses.pt"
    path.parent.mkdir(parents=True, exist_ok=True)
    data = answer_records(cfg, target, records, path, settings, batch=a.gen_batch, step_tokens=a.step_tokens,
                          log=_log, command=_replay_command(a))
    items = data["items"]
    print(f"{path}: {len(items)} answers, {sum(len(i['response_ids']) for i in items)} tokens; data card "
          f"{path.with_suffix('.card.md')}")
    return 0


def cmd_train_bigram(a: argparse.Namespace) -> int:
    from training.bigram import run_train_bigram

    run_train_bigram(_config(a), out=a.out, data_path=a.data, max_new_tokens=a.max_new_tokens,
                     gen_batch=a.gen_batch, limit=a.limit, log=_log)
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="specserve", description="OpenAI-compatible server with lossless "
                                "speculative decoding")
    sub = p.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate one completion offline and print it")
    _common(g)
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
    _common(s)
    s.add_argument("--host", default=None, help="bind address (default: the config's server.host)")
    s.add_argument("--port", type=int, default=None, help="port (default: the config's server.port)")
    s.add_argument("--api-key", default=None, help="require `Authorization: Bearer KEY` (also $SPECSERVE_API_KEY)")
    s.add_argument("--drain-timeout", type=float, default=30.0,
                   help="seconds in-flight requests may take to finish after SIGTERM")
    s.set_defaults(func=cmd_serve)

    b = sub.add_parser("bench", help="benchmarks")
    bsub = b.add_subparsers(dest="bench", required=True)
    bo = bsub.add_parser("offline", help="drafters vs plain decoding (and HF generate) on one prompt set")
    _common(bo, "comma-separated drafters to compare with `none`, each optionally with option overrides: "
                "name:key=value[:key=value...] (YAML values), e.g. glide:gamma=1,glide:gamma=2,falcon:top_m=[2,1]")
    bo.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (0: greedy)")
    bo.add_argument("--top-p", type=float, default=1.0)
    bo.add_argument("--seed", type=int, default=None, help="seed prompt i with seed + i (outputs stay comparable)")
    bo.add_argument("--prompts", required=True, help="JSONL: one {messages} or {prompt} per line")
    bo.add_argument("--max-tokens", type=int, default=64)
    bo.add_argument("--baseline", choices=["hf"], default=None)
    bo.add_argument("--repeats", type=int, default=1, help="passes over the prompts; tok/s is their median")
    bo.add_argument("--json", default=None, metavar="OUT", help="write the full report as JSON")
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
    bt.set_defaults(func=cmd_bench_steps)
    bs = bsub.add_parser("serve", help="drive a running server through the OpenAI streaming API")
    bs.add_argument("--url", required=True, help="server base URL, e.g. http://127.0.0.1:8000")
    bs.add_argument("--api-key", default=None, help="bearer key (also $SPECSERVE_API_KEY)")
    bs.add_argument("--prompts", required=True, help="JSONL: one {messages} or {prompt} per line")
    bs.add_argument("--concurrency", default="1", metavar="N[,N...]",
                    help="requests in flight; a comma-separated list (e.g. 1,4,16,64) runs a sweep, one level after "
                    "another against the same server")
    bs.add_argument("--num-requests", type=int, default=None,
                    help="requests per level (default: max(2 * concurrency, 8) for each level)")
    bs.add_argument("--max-tokens", type=int, default=64)
    bs.add_argument("--warmup", type=int, default=1, metavar="N",
                    help="untimed requests of --max-tokens before the first level (default 1; 0: none)")
    bs.add_argument("--json", default=None, metavar="OUT", help="write the full report (all levels) as JSON")
    bs.add_argument("--plot", default=None, metavar="FILE.png",
                    help="plot output tok/s and TTFT/TPOT p50/p99 vs concurrency (needs matplotlib: "
                    "pip install 'specserve[plot]')")
    bs.set_defaults(func=cmd_bench_serve)

    t = sub.add_parser("train", help="train drafters for the configured target (self-distilled, offline)")
    tsub = t.add_subparsers(dest="train", required=True)
    tp = tsub.add_parser("prompts", help="synthesize training prompts with the target itself (Magpie: the chat "
                         "template up to a user turn, sampled; filtered, deduplicated; cached, resumable)")
    _common(tp, drafter_help=None)
    tp.add_argument("--count", type=int, default=20_000, help="prompts to keep after filtering and deduplication")
    tp.add_argument("--seed", type=int, default=0, help="the same seed gives the same prompts")
    tp.add_argument("--max-prompt-tokens", type=int, default=128,
                    help="token cap of a user turn; one without its end-of-turn token by then is dropped")
    tp.add_argument("--max-answer-tokens", type=int, default=256,
                    help="token cap of the target's answer before a multi-turn follow-up")
    tp.add_argument("--batch", type=int, default=64, help="sequences per batched target forward (KV slots)")
    tp.add_argument("--step-tokens", type=int, default=512, help="rows per target forward: decode steps, then "
                    "prompt chunks")
    tp.add_argument("--temperature", type=float, default=0.8, help="sampling temperature of the user turns")
    tp.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling of the user turns (1 = off)")
    tp.add_argument("--multi-turn-share", type=float, default=0.25,
                    help="share of prompts that get the target's answer and a synthesized follow-up turn")
    tp.add_argument("--heldout", type=float, default=0.02, help="share of prompts kept out of training "
                    "(heldout.jsonl), by a hash of the text")
    tp.add_argument("--shard-size", type=int, default=512, help="prompts generated per resumable shard")
    tp.add_argument("--max-generated", type=int, default=None,
                    help="stop after this many generated prompts whatever survives (default: 10 x --count)")
    tp.add_argument("--out", default=None, help="output directory (default: <cache>/train/<target>/synth)")
    tp.set_defaults(func=cmd_train_prompts, train_parser=tp)
    td = tsub.add_parser("data", help="have the target answer the training prompts with the batched engine "
                         "(cached, resumable, with a data card)")
    tg = tsub.add_parser("glide", help="train a GLIDE draft model (runs `train data` first when needed)")
    tf = tsub.add_parser("falcon", help="train the Falcon drafting head with CSGD (runs `train data` first when "
                         "needed)")
    tb = tsub.add_parser("bigram", help="build the Max-Gram bigram table from the same data (runs `train data` "
                         "first when needed)")
    ta = tsub.add_parser("accept-head", help="train the acceptance head that stops an adaptive drafter's chain "
                         "(runs `train data` first when needed)")
    for q in (td, tg, tf, tb, ta):
        _common(q, drafter_help=None)  # they train drafters for the configured target; none runs
        q.add_argument("--data", default=None, help="answers file (default: <cache>/train/<target>/responses.pt)")
        q.add_argument("--max-new-tokens", type=int, default=256, help="answer length when generating data")
        q.add_argument("--gen-batch", type=int, default=64, help="sequences per batched target forward when "
                       "generating data (KV slots)")
        q.add_argument("--limit", type=int, default=None, help="use only the first N prompts (smoke runs)")
    td.add_argument("--prompts", default=None, help="comma-separated prompt sources: `project` (training/"
                    "prompts.py), `synth` (what `train prompts` wrote) or JSONL files (default: project, plus synth "
                    "when it exists)")
    td.add_argument("--temperatures", default="0.7,1.0", help="comma-separated temperatures of the sampled answers")
    td.add_argument("--sampled-share", type=float, default=0.25,
                    help="share of prompts answered by sampling at one of --temperatures (the rest greedy)")
    td.add_argument("--seed", type=int, default=0, help="picks the sampled prompts and seeds their answers")
    td.add_argument("--shard-size", type=int, default=512, help="prompts per resumable shard")
    td.add_argument("--step-tokens", type=int, default=512, help="rows per target forward: decode steps, then "
                    "prompt chunks")
    td.set_defaults(func=cmd_train_data, train_parser=td)
    tg.add_argument("--out", default=None, help="checkpoint path (default: drafters/checkpoints/<target>/"
                    "glide.safetensors, or vanilla.safetensors with --vanilla)")
    tg.add_argument("--vanilla", action="store_true", help="train without cross-attention (the ablation)")
    tg.add_argument("--steps", type=int, default=1200)
    tg.add_argument("--batch-tokens", type=int, default=4096, help="answer tokens per optimizer step")
    tg.add_argument("--lr", type=float, default=1e-3)
    tg.add_argument("--loss", choices=["kl", "ce"], default="kl")
    tg.add_argument("--block-len", type=int, default=5, help="block length of the cross-attention training mask")
    tg.add_argument("--max-len", type=int, default=768, help="training sequences are cut to this many tokens")
    tg.add_argument("--vocab-subset", type=int, default=8192,
                    help="LM head rows kept, most frequent answer tokens first (0 = whole vocabulary)")
    tg.add_argument("--text-tokens", type=int, default=600_000,
                    help="tokens of shipped text (stdlib sources, /usr/share/doc Markdown) added for teacher forcing")
    tg.add_argument("--train-tokens", type=int, default=0,
                    help="train on a seeded subset of about this many answer tokens, shipped text apart (0 = all; "
                    "the validation set stays the same: a learning curve)")
    tg.add_argument("--source-weight", default="",
                    help="comma-separated SOURCE=N: that prompt source's answers come N times per epoch "
                    "(sources: chat, humaneval, synth, ...; see the data card)")
    tg.add_argument("--seed", type=int, default=0)
    for k in ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "intermediate_size"):
        tg.add_argument("--" + k.replace("_", "-"), type=int, default=None, dest=k,
                        help=f"drafter {k.replace('_', ' ')} (default: the target's, one layer)")
    tg.set_defaults(func=cmd_train_glide)
    tf.add_argument("--out", default=None, help="checkpoint path (default: drafters/checkpoints/<target>/"
                    "falcon.safetensors)")
    tf.add_argument("--steps", type=int, default=1200)
    tf.add_argument("--batch-tokens", type=int, default=4096, help="loss rows per optimizer step")
    tf.add_argument("--lr", type=float, default=1e-3)
    tf.add_argument("--k", type=int, default=2, help="tokens per block (per drafter forward)")
    tf.add_argument("--teacher-forcing", action="store_true", help="plain teacher forcing instead of CSGD (the "
                    "ablation)")
    tf.add_argument("--glance", type=float, default=0.4, help="glancing ratio lambda at the first step (decays to 0)")
    tf.add_argument("--w-dist", type=float, default=1.0, help="weight of the distillation loss (KL + CE) against "
                    "the feature regression (the paper: 0.1)")
    tf.add_argument("--max-len", type=int, default=768, help="training sequences are cut to this many tokens")
    tf.add_argument("--vocab-subset", type=int, default=8192,
                    help="LM head rows kept, most frequent answer tokens first (0 = whole vocabulary)")
    tf.add_argument("--text-tokens", type=int, default=0,
                    help="tokens of shipped text (stdlib sources, /usr/share/doc Markdown) added to the data")
    tf.add_argument("--seed", type=int, default=0)
    tf.set_defaults(func=cmd_train_falcon)
    ta.add_argument("--drafter", choices=["glide", "falcon"], default="glide",
                    help="the chain drafter whose states it reads")
    ta.add_argument("--checkpoint", default=None, help="that drafter's checkpoint (default: the shipped one)")
    ta.add_argument("--out", default=None, help="head path (default: drafters/checkpoints/<target>/"
                    "accept-<drafter>.safetensors)")
    ta.add_argument("--max-depth", type=int, default=8, help="drafted depths 1..N per answer position")
    ta.add_argument("--temperatures", default="0.6,0.8,1.0",
                    help="sampled labels at one of these per sequence (greedy labels always)")
    ta.add_argument("--keep", type=float, default=0.25, help="share of drafted positions kept as examples")
    ta.add_argument("--num-blocks", type=int, default=3, help="residual blocks of the head")
    ta.add_argument("--hidden-only", action="store_true", help="the paper's inputs: the hidden state alone")
    ta.add_argument("--reject-weight", type=float, default=3.0, help="BCE weight of rejections (the paper's w)")
    ta.add_argument("--steps", type=int, default=3000)
    ta.add_argument("--batch", type=int, default=2048, help="examples per optimizer step")
    ta.add_argument("--lr", type=float, default=1e-3)
    ta.add_argument("--max-len", type=int, default=768, help="training sequences are cut to this many tokens")
    ta.add_argument("--seed", type=int, default=0)
    ta.set_defaults(func=cmd_train_accept_head)
    te = tsub.add_parser("eval-glide", help="acceptance of GLIDE checkpoints (chain or CAPE) on a prompt file")
    _common(te, drafter_help=None)
    te.add_argument("--checkpoint", action="append", required=True, help="checkpoint path (repeatable)")
    te.add_argument("--prompts", required=True, help="JSONL: one {messages} or {prompt} per line")
    te.add_argument("--gamma", type=int, default=5)
    te.add_argument("--cape", action="store_true", help="expand proposals with CAPE (paper bins, 32 rows)")
    te.add_argument("--temperatures", default="0,1", help="comma-separated; 0 = greedy")
    te.add_argument("--max-tokens", type=int, default=128)
    te.add_argument("--json", default=None, metavar="OUT")
    te.set_defaults(func=cmd_train_eval_glide)
    tb.add_argument("--out", default=None, help="table path (default: drafters/checkpoints/<target>/"
                    "bigram.safetensors)")
    tb.set_defaults(func=cmd_train_bigram)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ConfigError, ValueError, FileNotFoundError) as e:
        print(f"specserve: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
