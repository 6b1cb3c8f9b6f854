"""Benchmark records: one JSON file per run under ``docs/results/``, from which ``docs/benchmarks.md`` is generated.

A record holds what a reader needs to trust and repeat a figure: the command, the machine (CPU model and the vector
extensions the kernels choose by, GPU), the commit and date, and the figures themselves (the benchmark's report with
per-request outputs left out). ``specserve bench offline|steps|serve --record`` writes one; `server.bench.report`
renders the current ones per machine.
"""
from __future__ import annotations

import datetime as _dt
import hashlib
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "docs" / "results"
CPU_FEATURES = ("amx_bf16", "avx512_bf16", "avx512_vnni", "avx512f", "avx2")  # what the kernels choose paths by
KEYS = ("kind", "section", "title", "date", "commit", "command", "machine", "source", "figures")


def machine() -> dict:
    """The CPU's model name, its vector extensions among `CPU_FEATURES`, its cores, and the GPU if torch sees one."""
    from specserve_kernels.cpu import cpu_flags, cpu_model

    flags = cpu_flags()
    info = {"cpu": cpu_model(), "cpu_features": [f for f in CPU_FEATURES if f in flags], "cores": os.cpu_count(),
            "gpu": None}
    try:
        import torch

        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name(0)
    except ImportError:
        pass
    return info


def machine_label(m: dict) -> str:
    """``AMD EPYC, 2 cores, AVX2`` / ``... AMX`` / ``NVIDIA H200 (host: ...)``: the heading results are grouped by."""
    feats = m.get("cpu_features") or []
    isa = ("AMX" if "amx_bf16" in feats else "AVX-512 BF16" if "avx512_bf16" in feats
           else "AVX-512" if "avx512f" in feats else "AVX2" if "avx2" in feats else "no AVX2")
    cpu = f"{m.get('cpu') or 'unknown CPU'}, {m.get('cores')} cores, {isa}"
    return f"{m['gpu']} (host: {cpu})" if m.get("gpu") else cpu


def commit() -> str | None:
    """The checkout's short commit hash, with ``+dirty`` when tracked files differ from it; None outside git."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return head + ("+dirty" if dirty else "")


def _strip(x):
    """The report without per-request payloads (generated token ids, request lists): figures only."""
    if isinstance(x, dict):
        return {k: _strip(v) for k, v in x.items() if k not in ("outputs", "requests", "error_samples", "profile")}
    if isinstance(x, list):
        return [_strip(v) for v in x]
    return x


def make(kind: str, figures: dict, argv: list[str] | None = None, title: str | None = None,
         section: str | None = None, date: str | None = None) -> dict:
    """A record of ``figures`` measured just now on this machine by the command ``argv`` (default: this process's)."""
    argv = list(sys.argv if argv is None else argv)
    if argv and os.path.basename(argv[0]) in ("specserve", "__main__.py"):
        argv[0] = "specserve"
    return {"kind": kind, "section": section, "title": title,
            "date": date or _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d"), "commit": commit(),
            "command": shlex.join(argv), "machine": machine(), "source": None, "figures": _strip(figures)}


def write(rec: dict, out_dir: str | os.PathLike = RESULTS) -> Path:
    """``<out_dir>/<date>-<kind>-<8 hex of the record>.json`` (a new file per run: records are never overwritten)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    body = json.dumps({k: rec.get(k) for k in KEYS}, indent=1, ensure_ascii=False) + "\n"
    slug = re.sub(r"[^a-z0-9]+", "-", rec["kind"].lower()).strip("-")
    path = out / f"{rec['date']}-{slug}-{hashlib.sha256(body.encode()).hexdigest()[:8]}.json"
    path.write_text(body)
    return path


def load(directory: str | os.PathLike = RESULTS) -> list[dict]:
    """Every record under ``directory`` (``*.json``), oldest first; each carries its file name as ``"file"``."""
    recs = []
    for p in sorted(Path(directory).glob("*.json")):
        rec = json.loads(p.read_text())
        missing = [k for k in ("kind", "date", "command", "machine", "figures") if k not in rec]
        if missing:
            raise ValueError(f"{p.name}: not a benchmark record (missing {', '.join(missing)})")
        recs.append({**rec, "file": p.name})
    return sorted(recs, key=lambda r: (r["date"], r["file"]))
