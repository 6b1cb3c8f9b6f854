"""`make gpu-check`'s record logic (deploy/bench/gpu_check.py): what it skips without CUDA, how it picks the drafter
it serves, and that its summary names every stage. (The stages themselves run only in `make gpu-check`.)"""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

PATH = Path(__file__).resolve().parents[1] / "deploy" / "bench" / "gpu_check.py"


@pytest.fixture(scope="module")
def gc():
    spec = importlib.util.spec_from_file_location("gpu_check", PATH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_without_cuda_the_gpu_only_stages_say_they_are_skipped(gc, tmp_path):
    for stage in (gc.stage_kernels, gc.stage_exactness):
        assert stage(False, tmp_path, 60, True)["status"].startswith("skipped: no CUDA device")


def test_every_registered_drafter_is_checked(gc):
    from drafters.base import drafter_names

    assert sorted(gc.DRAFTERS) == sorted(set(drafter_names()) - {"none"})


def test_the_served_drafter_is_the_fastest_lossless_one_that_beats_plain(gc):
    def rows(**speed):
        return {"figures": {"bfloat16": {"none": {"speedup_vs_none": 1.0, "lossless": True},
                                         **{n: {"speedup_vs_none": s, "lossless": n != "glide"}
                                            for n, s in speed.items()}}}}

    assert gc.best_drafter(rows(ngram=1.2, falcon=1.6, glide=2.5)) == "falcon"  # glide is not lossless
    assert gc.best_drafter(rows(ngram=0.8, falcon=0.9)) is None
    assert gc.best_drafter({"status": "timed out"}) is None


def test_the_summary_names_every_stage_and_its_status(gc):
    record = {"date": "2026-11-29", "device": "CPU dry run", "commit": "abc", "budget_s": 600, "seconds": 12.0,
              "stages": {"env": {"status": "ok", "figures": {"torch": "2.13.0"}},
                         "kernels": {"status": "skipped: no CUDA device"},
                         "lossless": {"status": "ok", "figures": {"float32": {"none": {
                             "tokens_per_s": 10.0, "speedup_vs_none": 1.0, "mean_accepted_length": 1.0,
                             "lossless": None}}}}}}
    md = gc.markdown(record)
    assert "| kernels | skipped: no CUDA device |" in md and "| lossless | ok |" in md and "| none | 10.0 |" in md
