"""The `specserve train ...` commands: training prompts, the target's answers, GLIDE, Falcon, the acceptance heads,
the Max-Gram bigram table, and GLIDE's acceptance on a prompt file."""
from __future__ import annotations

import argparse
import json

from server.cli import common_options, config_from_args, log_stderr
from server.config import ConfigError


def cmd_train_glide(a: argparse.Namespace) -> int:
    from training.glide import TrainOptions, run_train_glide

    weights = _source_pairs(a.source_weight, "--source-weight", "")
    if a.train_tokens < 0:
        raise ConfigError("--train-tokens must be >= 0")
    opts = TrainOptions(steps=a.steps, batch_tokens=a.batch_tokens, lr=a.lr, loss=a.loss, block_len=a.block_len,
                        max_len=a.max_len, seed=a.seed, train_tokens=a.train_tokens, source_weights=tuple(weights))
    overrides = {k: getattr(a, k) for k in ("num_layers", "hidden_size", "num_heads", "num_kv_heads",
                                             "intermediate_size") if getattr(a, k) is not None}
    if a.read_layers:
        try:
            overrides["read_layers"] = [int(n) for n in a.read_layers.split(",")]
        except ValueError:
            raise ConfigError(f"--read-layers: comma-separated target layer numbers, got {a.read_layers!r}") from None
    run_train_glide(config_from_args(a), out=a.out, vanilla=a.vanilla, data_path=a.data, opts=opts,
                    vocab_subset=a.vocab_subset, max_new_tokens=a.max_new_tokens, gen_batch=a.gen_batch,
                    limit=a.limit, text_tokens=a.text_tokens, init=a.init, log=log_stderr, **overrides)
    return 0


def cmd_train_falcon(a: argparse.Namespace) -> int:
    from training.falcon import run_train_falcon
    from training.falcon_loss import FalconTrainOptions

    opts = FalconTrainOptions(steps=a.steps, batch_tokens=a.batch_tokens, lr=a.lr, max_len=a.max_len, seed=a.seed,
                              csgd=not a.teacher_forcing, glance=a.glance, w_dist=a.w_dist,
                              w_reg=a.w_reg, ttt=a.training_time_test, pack_rows=a.pack_rows, seconds=a.seconds,
                              save_every=a.save_every)
    opts.source_tokens = tuple(_source_pairs(a.source_tokens, "--source-tokens", " answer tokens"))
    if a.seconds is not None and a.seconds <= 0:
        raise ConfigError(f"--seconds: a positive wall time, got {a.seconds:g}")
    if a.save_every < 1:
        raise ConfigError(f"--save-every: at least 1 step, got {a.save_every}")
    if a.training_time_test and a.teacher_forcing:
        raise ConfigError("--training-time-test trains the second block's stream: not with --teacher-forcing")
    try:
        taps = [int(n) for n in a.taps.split(",") if n.strip()] if a.taps is not None else None
    except ValueError:
        raise ConfigError(f"--taps: comma-separated layer counts, got {a.taps!r}") from None
    run_train_falcon(config_from_args(a), out=a.out, data_path=a.data, opts=opts, k=a.k, vocab_subset=a.vocab_subset,
                     max_new_tokens=a.max_new_tokens, gen_batch=a.gen_batch, limit=a.limit,
                     text_tokens=a.text_tokens, init=a.init, taps=taps, log=log_stderr)
    return 0


def cmd_train_accept_head(a: argparse.Namespace) -> int:
    from training.accept_head import AcceptTrainOptions, run_train_accept_head

    temps = tuple(float(t) for t in a.temperatures.split(",") if t.strip())
    if not temps or any(not 0 < t <= 2 for t in temps):
        raise ConfigError("--temperatures: comma-separated temperatures in (0, 2]")
    opts = AcceptTrainOptions(max_depth=a.max_depth, temperatures=temps, keep=a.keep, num_blocks=a.num_blocks,
                              hidden_only=a.hidden_only, reject_weight=a.reject_weight, steps=a.steps, batch=a.batch,
                              lr=a.lr, max_len=a.max_len, seed=a.seed)
    run_train_accept_head(config_from_args(a), a.drafter, out=a.out, data_path=a.data, checkpoint=a.checkpoint,
                          opts=opts, max_new_tokens=a.max_new_tokens, gen_batch=a.gen_batch, limit=a.limit,
                          log=log_stderr)
    return 0


def cmd_train_eval_glide(a: argparse.Namespace) -> int:
    from server.engine import load_target
    from server.model_files import load_tokenizer
    from server.tokenization import encode_record, read_prompts, stop_token_ids
    from training.glide import measure_acceptance

    cfg = config_from_args(a)
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


def _source_pairs(arg: str | None, flag: str, unit: str) -> list[tuple[str, int]]:
    """``chat=4,humaneval=4`` -> [("chat", 4), ("humaneval", 4)]: prompt sources with a count >= 1 each."""
    pairs = []
    for part in (arg or "").split(","):
        if not part.strip():
            continue
        src, _, n = part.partition("=")
        if not src.strip() or not n.strip().isdigit() or int(n) < 1:
            raise ConfigError(f"{flag}: SOURCE=N pairs with N >= 1{unit}, got {part!r}")
        pairs.append((src.strip(), int(n)))
    return pairs


def _floats(arg: str, flag: str) -> tuple[float, ...]:
    try:
        return tuple(float(x) for x in arg.split(",") if x.strip())
    except ValueError:
        raise ConfigError(f"{flag}: expected comma-separated numbers, got {arg!r}") from None


def cmd_train_prompts(a: argparse.Namespace) -> int:
    from pathlib import Path

    from server.engine import load_target
    from training.paths import synth_dir
    from training.synth import synthesize_prompts
    from training.synth_jobs import SynthSettings

    settings = SynthSettings(count=a.count, seed=a.seed, max_prompt_tokens=a.max_prompt_tokens,
                             max_answer_tokens=a.max_answer_tokens, temperature=a.temperature, top_p=a.top_p,
                             multi_turn_share=a.multi_turn_share, heldout_fraction=a.heldout,
                             shard_size=a.shard_size, max_generated=a.max_generated)
    cfg = config_from_args(a)
    target = load_target(cfg)
    if not a.out:  # continue the shards the repository keeps (training/corpus.py)
        from training import corpus

        corpus.restore(cfg, target.model_id, log=log_stderr)
    out = Path(a.out) if a.out else synth_dir(cfg, target.model_id)
    st = synthesize_prompts(cfg, target, out, settings, batch=a.batch, step_tokens=a.step_tokens, log=log_stderr,
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

    from server.engine import load_target
    from server.tokenization import read_prompts
    from training.paths import SET_NAME, answer_set_path, answers_path, synth_dir
    from training.data import AnswerSettings, answer_records, parse_target, prompt_records

    settings = AnswerSettings(max_new_tokens=a.max_new_tokens, temperatures=_floats(a.temperatures, "--temperatures"),
                              sampled_share=a.sampled_share, seed=a.seed, shard_size=a.shard_size)
    reuse = [n.strip() for n in (a.reuse or "").split(",") if n.strip()]
    for name in reuse:
        try:
            parse_target(name)
        except ValueError as e:
            raise ConfigError(f"--reuse: {e}") from None
    if a.set is not None and (a.data or not SET_NAME.fullmatch(a.set)):
        raise ConfigError("--set: a name of 1-40 lower-case letters, digits, '-' or '_' (its answers have their own "
                          f"file: not with --data), got {a.set!r}")
    if a.set is not None and a.prompts and "," in a.prompts:
        raise ConfigError("--set: one JSONL file of prompts in --prompts")
    cfg = config_from_args(a)
    target = load_target(cfg)
    if not a.data:
        from training import corpus

        corpus.restore(cfg, target.model_id, log=log_stderr)
    if a.set:
        # A set of its own: its prompts are numbered from 0 and kept beside its answers (the corpus keeps them too), so
        # a later run extends it from the same list, whatever the main set does meanwhile.
        path = answer_set_path(cfg, target.model_id, a.set)
        kept = path.with_suffix(".jsonl")
        if not a.prompts and not kept.exists():
            raise ConfigError(f"--set {a.set}: no such answer set yet; its first run names its prompts (--prompts)")
        records = [dict(r, source=r.get("source", a.set)) for r in read_prompts(a.prompts or kept)]
        if a.prompts:
            kept.parent.mkdir(parents=True, exist_ok=True)
            kept.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
    else:
        records = prompt_records(a.prompts, synth_dir(cfg, target.model_id) / "train.jsonl", log_stderr)
        path = Path(a.data) if a.data else answers_path(cfg, target.model_id)
    records = records[:a.limit] if a.limit else records
    path.parent.mkdir(parents=True, exist_ok=True)
    data = answer_records(cfg, target, records, path, settings, batch=a.gen_batch, step_tokens=a.step_tokens,
                          log=log_stderr, command=_replay_command(a), reuse=reuse)
    items = data["items"]
    print(f"{path}: {len(items)} answers, {sum(len(i['response_ids']) for i in items)} tokens; data card "
          f"{path.with_suffix('.card.md')}")
    return 0


def cmd_train_save_data(a: argparse.Namespace) -> int:
    from pathlib import Path

    from server.config import load_config
    from server.model_files import resolve_model
    from training import corpus

    cfg = load_config(a.config)
    model_id = resolve_model(cfg.model.source, cfg.model.cache_dir).model_id
    corpus.save(cfg, model_id, root=Path(a.to) if a.to else None, log=print)
    return 0


def cmd_train_bigram(a: argparse.Namespace) -> int:
    from training.bigram import run_train_bigram

    run_train_bigram(config_from_args(a), out=a.out, data_path=a.data, max_new_tokens=a.max_new_tokens,
                     gen_batch=a.gen_batch, limit=a.limit, log=log_stderr)
    return 0


def add_commands(sub) -> None:
    """`train` and its subcommands, on the subparsers of the `specserve` parser."""
    t = sub.add_parser("train", help="train drafters for the configured target (self-distilled, offline)")
    tsub = t.add_subparsers(dest="train", required=True)
    tp = tsub.add_parser("prompts", help="synthesize training prompts with the target itself (Magpie: the chat "
                         "template up to a user turn, sampled; filtered, deduplicated; cached, resumable)")
    common_options(tp, drafter_help=None)
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
        common_options(q, drafter_help=None)  # they train drafters for the configured target; none runs
        q.add_argument("--data", default=None, help="answers file (default: <cache>/train/<target>/responses.pt)")
        q.add_argument("--max-new-tokens", type=int, default=256, help="answer length when generating data")
        q.add_argument("--gen-batch", type=int, default=64, help="sequences per batched target forward when "
                       "generating data (KV slots)")
        q.add_argument("--limit", type=int, default=None, help="use only the first N prompts (smoke runs)")
    td.add_argument("--prompts", default=None, help="comma-separated prompt sources: `project` (training/"
                    "prompts.py), `synth` (what `train prompts` wrote) or JSONL files (default: project, plus synth "
                    "when it exists)")
    td.add_argument("--set", default=None, metavar="NAME",
                    help="answer a prompt source as a set of its own (prompts numbered from 0, shards and corpus "
                    "folder apart; the trainers read every complete set after the main one): --prompts names its "
                    "JSONL file the first time, later runs extend it from the prompts it kept")
    td.add_argument("--temperatures", default="0.7,1.0", help="comma-separated temperatures of the sampled answers")
    td.add_argument("--sampled-share", type=float, default=0.25,
                    help="share of prompts answered by sampling at one of --temperatures (the rest greedy)")
    td.add_argument("--seed", type=int, default=0, help="picks the sampled prompts and seeds their answers")
    td.add_argument("--shard-size", type=int, default=512, help="prompts per resumable shard")
    td.add_argument("--step-tokens", type=int, default=512, help="rows per target forward: decode steps, then "
                    "prompt chunks")
    td.add_argument("--reuse", default=None, help="comma-separated dtype/quantization of other targets of the same "
                    "weights (e.g. float32/int4) whose answer shards count as done: a run on another device or dtype "
                    "answers only the prompts they lack")
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
    tg.add_argument("--init", default=None, metavar="CHECKPOINT",
                    help="continue training that checkpoint (its shape and kept vocabulary) on this run's data, with "
                    "a fresh optimizer; step 0 of the log is its agreement on this run's validation split")
    tg.add_argument("--seed", type=int, default=0)
    for k in ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "intermediate_size"):
        tg.add_argument("--" + k.replace("_", "-"), type=int, default=None, dest=k,
                        help=f"drafter {k.replace('_', ' ')} (default: the target's, one layer)")
    tg.add_argument("--read-layers", default=None, metavar="L[,L...]",
                    help="the target layer (0-based) whose K/V each draft layer's cross-attention reads, one per draft "
                    "layer (default: the top --num-layers layers, in order)")
    tg.set_defaults(func=cmd_train_glide)
    tf.add_argument("--out", default=None, help="checkpoint path (default: drafters/checkpoints/<target>/"
                    "falcon.safetensors)")
    tf.add_argument("--steps", type=int, default=1200)
    tf.add_argument("--seconds", type=float, default=None,
                    help="train for this wall time instead of --steps: the steps (and the learning-rate schedule) "
                    "come from the pace of steps 5-25 and the first evaluation; such a run does not resume")
    tf.add_argument("--save-every", type=int, default=100, metavar="N",
                    help="evaluate on the held-out answers (and save the resumable state) every N steps")
    tf.add_argument("--batch-tokens", type=int, default=4096, help="loss rows per optimizer step")
    tf.add_argument("--lr", type=float, default=1e-3)
    tf.add_argument("--k", type=int, default=2, help="tokens per block (per drafter forward)")
    tf.add_argument("--teacher-forcing", action="store_true", help="plain teacher forcing instead of CSGD (the "
                    "ablation)")
    tf.add_argument("--training-time-test", action="store_true",
                    help="the second block's stream reads the true tokens with the head's own predicted features "
                    "(EAGLE-3's training-time test: what a second drafted block reads once the first is accepted) "
                    "instead of CSGD's guessed tokens; no glancing")
    tf.add_argument("--pack-rows", type=int, default=None, metavar="N",
                    help="rows per training forward: a step's sequences are packed into forwards of at most N rows, "
                    "each sequence seeing its own (default: 16384 on CUDA, where one short sequence per forward "
                    "leaves the GPU idle; 0 = one sequence per forward, the default elsewhere)")
    tf.add_argument("--source-tokens", default="", metavar="SOURCE=N[,...]",
                    help="cut each named prompt source's answers to a seeded subset of about N answer tokens, held-out "
                    "ones alike (sources: chat, humaneval, synth, people, ...): a short teacher pass on a CPU, and "
                    "more weight for the sources left whole")
    tf.add_argument("--glance", type=float, default=0.4, help="glancing ratio lambda at the first step (decays to 0)")
    tf.add_argument("--w-dist", type=float, default=1.0, help="weight of the distillation loss (KL + CE) against "
                    "the feature regression (the paper: 0.1)")
    tf.add_argument("--w-reg", type=float, default=1.0,
                    help="weight of the feature regression (SmoothL1); 0 drops it, as EAGLE-3 does")
    tf.add_argument("--max-len", type=int, default=768, help="training sequences are cut to this many tokens")
    tf.add_argument("--vocab-subset", type=int, default=8192,
                    help="LM head rows kept, most frequent answer tokens first (0 = whole vocabulary)")
    tf.add_argument("--text-tokens", type=int, default=0,
                    help="tokens of shipped text (stdlib sources, /usr/share/doc Markdown) added to the data")
    tf.add_argument("--init", default=None, metavar="CHECKPOINT",
                    help="continue training that checkpoint (its k and kept vocabulary) on this run's data, with a "
                    "fresh optimizer; step 0 of the log is its agreement on this run's validation split")
    tf.add_argument("--taps", default=None, metavar="N,N",
                    help="also read the target's residual stream after these layer counts (EAGLE-3's low and middle "
                    "layers), e.g. 3,15; with --init, a checkpoint without taps gains them (starting as itself); "
                    "default: none for a new head, the checkpoint's with --init")
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
    ts = tsub.add_parser("save-data", help="write the cached prompt and answer shards the repository's corpus "
                         "lacks into it (training/corpus/<target>/), to be committed")
    ts.add_argument("--config", default=None, help="YAML config (default: embedded model)")
    ts.add_argument("--to", default=None, help="corpus root (default: training/corpus)")
    ts.set_defaults(func=cmd_train_save_data)
    te = tsub.add_parser("eval-glide", help="acceptance of GLIDE checkpoints (chain or CAPE) on a prompt file")
    common_options(te, drafter_help=None)
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
