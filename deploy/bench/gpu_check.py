"""`make gpu-check`: one script that checks and measures the GPU path within a time budget (ten minutes on one GPU).

Stages, each run as a subprocess under its own time budget; a stage that fails or runs out of time is recorded as
such and the next one runs, so a cut run still leaves a record:

  env        the GPU (nvidia-smi), torch, Triton and CUDA versions, the CPU
  kernels    the Triton kernel tests compiled on CUDA (bfloat16 included)
  exactness  sampled exactness through two drafters' trees on CUDA (tests/drafters/test_sampled_exactness.py)
  lossless   greedy output of every drafter equals plain decoding, bfloat16 and float32 (`bench offline`)
  batched    every drafter's batch of sequences equals each sequence run alone, float32
  steps      the step-cost curve, 1..256 rows (`bench steps`)
  serve      `bench serve` at concurrency 1, 4, 16, 64 against `specserve serve` in bfloat16, plain and the best
             drafter of the bfloat16 `lossless` run

It writes gpu-check.json (every stage: status, seconds, figures, the command, the output's tail) and gpu-check.md
under $OUT, else docs/gpu/<date>-<device>/. Without CUDA it is a dry run on the CPU: the GPU-only stages say
they are skipped and why, and the others run small (fewer prompts, tokens and rows) so the record holds the CPU's
figures and shows the script works end to end.

    python deploy/bench/gpu_check.py [--budget SECONDS] [--out DIR]
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PY = sys.executable
DRAFTERS = ("ngram", "maxgram", "glide", "glide-cape", "cascade", "falcon", "glide-adaptive", "falcon-adaptive")

# each stage's share of the budget still left when it starts (plus 0.04 kept back: start-up and writing the record)
SHARES = {"env": 0.01, "kernels": 0.12, "exactness": 0.15, "lossless": 0.25, "batched": 0.08, "steps": 0.1,
          "serve": 0.25}


def _cuda() -> tuple[bool, str]:
    try:
        import torch
    except ImportError as e:
        return False, f"torch does not import: {e}"
    if not torch.cuda.is_available():
        return False, "no CUDA device (torch.cuda.is_available() is false)"
    return True, torch.cuda.get_device_name(0)


def _run(cmd: list[str], budget: float, env: dict | None = None, log: Path | None = None) -> dict:
    """Run ``cmd`` in its own process group for at most ``budget`` seconds; its whole output goes to ``log``."""
    t0 = time.monotonic()
    with tempfile.TemporaryFile("w+") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})},
                                start_new_session=True)
        try:
            rc = proc.wait(timeout=max(1.0, budget))
            status = "ok" if rc == 0 else f"failed (exit {rc})"
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            status = f"timed out after {budget:.0f} s"
        out.seek(0)
        text = out.read()
    if log is not None:
        log.write_text(text)
    shown = [os.path.relpath(c, ROOT) if os.path.isabs(c) and c.startswith(str(ROOT)) else c for c in cmd]
    return {"status": status, "seconds": round(time.monotonic() - t0, 1), "command": shlex.join(shown),
            "tail": text[-1500:]}


def stage_env(gpu: bool, out: Path, budget: float, small: bool) -> dict:
    info = {"python": platform.python_version(), "machine": platform.machine()}
    try:
        import torch

        info.update(torch=torch.__version__, cuda=torch.version.cuda, threads=torch.get_num_threads())
        if gpu:
            p = torch.cuda.get_device_properties(0)
            info.update(gpu=p.name, gpu_memory_gib=round(p.total_memory / 2 ** 30, 1),
                        compute_capability=f"{p.major}.{p.minor}")
    except ImportError:
        pass
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    try:
        from server.bench.records import machine  # what the results records name a machine by

        m = machine()
        info.update(cpu=m["cpu"], cpu_features=m["cpu_features"], cpu_cores=m["cores"])
    except ImportError:
        pass
    if gpu:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                             capture_output=True, text=True)
        info["nvidia_smi"] = smi.stdout.strip()
    return {"status": "ok", "seconds": 0.0, "figures": info}


def stage_kernels(gpu: bool, out: Path, budget: float, small: bool) -> dict:
    if not gpu:
        return {"status": "skipped: no CUDA device (`make test` runs these kernels under TRITON_INTERPRET=1)"}
    r = _run([PY, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/kernels"], budget,
             env={"TRITON_INTERPRET": "0"}, log=out / "kernels.log")
    r["figures"] = {"summary": _pytest_summary(r["tail"])}
    return r


def stage_exactness(gpu: bool, out: Path, budget: float, small: bool) -> dict:
    if not gpu:
        return {"status": "skipped: no CUDA device (`make test` runs sampled exactness on the CPU)"}
    r = _run([PY, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/drafters/test_sampled_exactness.py", "-k",
              "(matches_the_target and (glide-cape or falcon)) or negative_control_bonus"], budget,
             env={"SPECSERVE_TEST_DEVICE": "cuda", "TRITON_INTERPRET": "0"}, log=out / "exactness.log")
    r["figures"] = {"summary": _pytest_summary(r["tail"])}
    return r


def _pytest_summary(tail: str) -> str:
    lines = [line for line in tail.splitlines() if " passed" in line or " failed" in line or " error" in line]
    return lines[-1].strip("= ") if lines else ""


def prompts(out: Path, small: bool) -> str:
    """The bench prompts (deploy/prompts/bench.jsonl); small: its first three."""
    if not small:
        return "deploy/prompts/bench.jsonl"
    path = out / "prompts-small.jsonl"
    path.write_text("".join((ROOT / "deploy/prompts/bench.jsonl").read_text().splitlines(keepends=True)[:3]))
    return str(path)


def stage_lossless(gpu: bool, out: Path, budget: float, small: bool) -> dict:
    device = "cuda" if gpu else "cpu"
    drafters = DRAFTERS[:2] if small else DRAFTERS
    figures, results = {}, []
    for dtype in ("bfloat16", "float32"):
        report = out / f"offline-{dtype}.json"
        cmd = [PY, "-m", "specserve", "bench", "offline", "--device", device, "--dtype", dtype,
               "--quantization", "none", "--drafter", ",".join(drafters), "--prompts", prompts(out, small),
               "--max-tokens", "16" if small else "96", "--repeats", "1" if small else "3", "--json", str(report)]
        r = _run(cmd, budget / 2, log=out / f"offline-{dtype}.log")
        results.append(r)
        if report.is_file():
            rep = json.loads(report.read_text())
            figures[dtype] = {row["drafter"]: {k: row.get(k) for k in ("tokens_per_s", "speedup_vs_none",
                                                                      "mean_accepted_length", "lossless")}
                              for row in rep["results"]}
    bad = [f"{d} {n}" for d, rows in figures.items() for n, row in rows.items() if row["lossless"] is False]
    status = next((r["status"] for r in results if r["status"] != "ok"), "ok")
    if status == "ok" and bad:
        status = "failed: outputs differ from plain decoding: " + ", ".join(bad)
    return {"status": status, "seconds": round(sum(r["seconds"] for r in results), 1),
            "command": "; ".join(r["command"] for r in results), "tail": results[-1]["tail"], "figures": figures}


BATCHED = r"""
import json, sys
from drafters.base import create_drafter
from server.config import config_from_dict
from server.engine import Engine, StepPlan, load_target
from server.model_files import load_tokenizer
from server.tokenization import encode_chat, stop_token_ids

device, drafters, n, max_new = sys.argv[1], sys.argv[2].split(","), int(sys.argv[3]), int(sys.argv[4])
cfg = config_from_dict({"model": {"dtype": "float32", "device": device, "quantization": "none"},
                        "cache": {"num_slots": n, "max_seq_len": 512}})
target = load_target(cfg, progress=False)
tok = load_tokenizer(target.hf_dir)
stops = stop_token_ids(tok, target.args.eos_token_ids)
lines = [json.loads(x) for x in open("deploy/prompts/bench.jsonl")]
ids = [encode_chat(tok, lines[i % len(lines)]["messages"]) for i in range(n)]
plain = Engine(cfg, create_drafter("none", target), target)
alone = [plain.generate(x, max_new_tokens=max_new, stop_token_ids=stops).token_ids for x in ids]
result = {}
for name in ["none"] + drafters:
    engine = Engine(cfg, create_drafter(name, target, cfg.drafter.options_for(name)), target)
    seqs = [engine.add(x, max_new_tokens=max_new, stop_token_ids=stops) for x in ids]
    engine.run(StepPlan(prefill=[(s, s.prompt_len) for s in seqs]))
    while any(s.finish_reason is None for s in seqs):
        engine.run(StepPlan([s for s in seqs if s.finish_reason is None]))
    got = [s.output_ids for s in seqs]
    for s in seqs:
        engine.release(s)
    result[name] = sum(a == b for a, b in zip(got, alone)) / n
print(json.dumps(result))
"""


def stage_batched(gpu: bool, out: Path, budget: float, small: bool) -> dict:
    device = "cuda" if gpu else "cpu"
    drafters = DRAFTERS[:2] if small else DRAFTERS
    r = _run([PY, "-c", BATCHED, device, ",".join(drafters), "4" if small else "16", "8" if small else "32"], budget,
             log=out / "batched.log")
    try:
        equal = json.loads(r["tail"].strip().splitlines()[-1])
        r["figures"] = {"equal_fraction": equal}
        bad = [k for k, v in equal.items() if v != 1.0]
        if r["status"] == "ok" and bad:
            r["status"] = "failed: batched outputs differ from alone for " + ", ".join(bad)
    except (ValueError, IndexError):
        pass
    return r


def stage_steps(gpu: bool, out: Path, budget: float, small: bool) -> dict:
    device = "cuda" if gpu else "cpu"
    rows = "1,2,4,8,16" if small else "1,2,4,8,16,32,64,128,256"
    report = out / "steps.json"
    r = _run([PY, "-m", "specserve", "bench", "steps", "--device", device, "--dtypes", "bfloat16,float32",
              "--quantizations", "none", "--rows", rows, "--json", str(report)], budget, log=out / "steps.log")
    if report.is_file():
        r["figures"] = json.loads(report.read_text())
    return r


def stage_serve(gpu: bool, out: Path, budget: float, small: bool, best: str | None) -> dict:
    device = "cuda" if gpu else "cpu"
    levels = "1,4" if small else "1,4,16,64"
    dtype = "bfloat16" if gpu else "float32"  # a CPU without AMX runs bfloat16 several times slower
    figures, runs = {}, []
    t_end = time.monotonic() + budget
    for drafter in ["none"] + ([best] if best and best != "none" else []):
        left = t_end - time.monotonic()
        if left < 30:
            runs.append({"status": f"timed out before {drafter} started", "seconds": 0.0, "command": "", "tail": ""})
            break
        port = _free_port()
        server = subprocess.Popen([PY, "-m", "specserve", "serve", "--device", device, "--dtype", dtype,
                                   "--quantization", "none", "--drafter", drafter, "--host", "127.0.0.1",
                                   "--port", str(port)], cwd=ROOT, stdout=open(out / f"serve-{drafter}.log", "w"),
                                  stderr=subprocess.STDOUT, start_new_session=True)
        try:
            if not _wait_ready(port, server, left * 0.6):
                runs.append({"status": f"{drafter}: server not ready", "seconds": 0.0, "command": "", "tail": ""})
                continue
            report = out / f"serve-{drafter}.json"
            r = _run([PY, "-m", "specserve", "bench", "serve", "--url", f"http://127.0.0.1:{port}", "--prompts",
                      prompts(out, small), "--concurrency", levels, "--max-tokens", "16" if small else "64",
                      "--json", str(report)], t_end - time.monotonic(), log=out / f"bench-serve-{drafter}.log")
            runs.append(r)
            if report.is_file():
                figures[drafter] = json.loads(report.read_text())
        finally:
            os.killpg(server.pid, signal.SIGTERM)
            try:
                server.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(server.pid, signal.SIGKILL)
    status = next((r["status"] for r in runs if r["status"] != "ok"), "ok")
    return {"status": status, "seconds": round(sum(r["seconds"] for r in runs), 1),
            "command": "; ".join(r["command"] for r in runs), "tail": runs[-1]["tail"] if runs else "",
            "figures": figures}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_ready(port: int, proc: subprocess.Popen, timeout: float) -> bool:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    return False


def best_drafter(lossless: dict) -> str | None:
    """The fastest lossless drafter of the bfloat16 offline run (None where none of them beat plain decoding)."""
    rows = lossless.get("figures", {}).get("bfloat16", {})
    good = {n: r["speedup_vs_none"] for n, r in rows.items() if n != "none" and r["lossless"] and r["speedup_vs_none"]}
    if not good:
        return None
    name = max(good, key=good.get)
    return name if good[name] > 1.0 else None


def markdown(record: dict) -> str:
    env = record["stages"]["env"].get("figures", {})
    lines = [f"# gpu-check {record['date']}: {record['device']}", "",
             f"Commit {record['commit']}, torch {env.get('torch')}, Triton {env.get('triton')}, CUDA {env.get('cuda')}; "
             f"CPU {env.get('cpu')} ({env.get('cpu_cores')} cores; {' '.join(env.get('cpu_features') or []) or 'none'} "
             f"of AMX / AVX-512 / AVX2). Budget {record['budget_s']} s, "
             f"ran {record['seconds']} s.", "", "| stage | status | seconds |", "|---|---|---|"]
    for name, st in record["stages"].items():
        lines.append(f"| {name} | {st['status']} | {st.get('seconds', '')} |")
    off = record["stages"].get("lossless", {}).get("figures", {})
    for dtype, rows in off.items():
        lines += ["", f"Offline, {dtype} (`bench offline`):", "", "| drafter | tok/s | vs none | accepted length | "
                  "lossless |", "|---|---|---|---|---|"]
        for n, r in rows.items():
            lines.append(f"| {n} | {r['tokens_per_s']} | {r['speedup_vs_none']} | {r['mean_accepted_length']} | "
                         f"{r['lossless']} |")
    serve = record["stages"].get("serve", {}).get("figures", {})
    for drafter, rep in serve.items():
        lines += ["", f"Served, `{drafter}` (`bench serve`):", "", "| concurrency | output tok/s | "
                  "TTFT p50 ms | TPOT p50 ms |", "|---|---|---|---|"]
        for lv in rep.get("levels", []):
            ms = [None if (lv.get(k) or {}).get("median") is None else round(1000 * lv[k]["median"], 1)
                  for k in ("ttft_s", "tpot_s")]
            lines.append(f"| {lv.get('concurrency')} | {round(lv.get('output_tokens_per_s') or 0, 1)} | {ms[0]} | "
                         f"{ms[1]} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budget", type=float, default=float(os.environ.get("GPU_CHECK_BUDGET", 600)),
                    help="seconds for the whole run (default 600)")
    ap.add_argument("--out", default=os.environ.get("OUT"), help="record directory (default docs/gpu/DATE-DEVICE)")
    ap.add_argument("--small", action="store_true", help="small sizes even on a GPU (always so without one)")
    args = ap.parse_args(argv)
    t0 = time.monotonic()
    gpu, device = _cuda()
    small = args.small or not gpu
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    slug = "".join(c if c.isalnum() else "-" for c in (device if gpu else "cpu-dry-run")).strip("-").lower()
    out = Path(args.out) if args.out else ROOT / "docs" / "gpu" / f"{date}-{slug}"
    out.mkdir(parents=True, exist_ok=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    record = {"date": date, "device": device if gpu else f"CPU dry run ({device})", "commit": commit,
              "budget_s": args.budget, "small": small, "stages": {}}
    stages = {"env": stage_env, "kernels": stage_kernels, "exactness": stage_exactness, "lossless": stage_lossless,
              "batched": stage_batched, "steps": stage_steps}

    def save():
        record["seconds"] = round(time.monotonic() - t0, 1)
        (out / "gpu-check.json").write_text(json.dumps(record, indent=1))
        (out / "gpu-check.md").write_text(markdown(record))

    order = list(stages.items()) + [("serve", None)]
    for i, (name, fn) in enumerate(order):
        left = args.budget - (time.monotonic() - t0)
        # this stage's share of what is left: time a stage did not use (skipped, or done early) goes to the rest
        budget = left * SHARES[name] / (sum(SHARES[n] for n, _ in order[i:]) + 0.04)
        print(f"gpu-check: {name} ({budget:.0f} s budget)", flush=True)
        if budget < 5:
            record["stages"][name] = {"status": "skipped: the run's budget is spent"}
        elif fn is None:
            record["stages"][name] = stage_serve(gpu, out, budget, small, best_drafter(record["stages"]["lossless"]))
        else:
            record["stages"][name] = fn(gpu, out, budget, small)
        print(f"gpu-check: {name}: {record['stages'][name]['status']}", flush=True)
        save()
    print(markdown(record))
    print(f"gpu-check: record in {out}")
    failed = [n for n, s in record["stages"].items() if not (s["status"] == "ok" or s["status"].startswith("skipped"))]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
