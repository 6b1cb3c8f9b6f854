"""`specserve bench serve`: a concurrency sweep against a real server on loopback, its JSON and plot, and the stats."""
from __future__ import annotations

import json
import math
import sys

import pytest

from server.bench import records
from server.bench.report import render_record
from server.bench.serve import _pct, _summary, default_num_requests, parse_levels
from specserve.cli import main
from tests.server.conftest import API_KEY, ServerProcess

MAX_TOKENS = 4


@pytest.fixture(scope="module")
def bench_server(open_server):
    """The session's server without an API key (tests/conftest.py): the bench's key is accepted as any key is."""
    return open_server


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
    p = tmp_path_factory.mktemp("bench-prompts") / "prompts.jsonl"
    p.write_text("\n".join(json.dumps(r) for r in (
        {"messages": [{"role": "user", "content": "Write a Python function that reverses a string."}]},
        {"messages": [{"role": "user", "content": "Explain in three sentences why the sky is blue."}]},
        {"prompt": "The history of the printing press begins"})) + "\n")
    return p


def _bench(server: ServerProcess, prompts, *extra: str) -> int:
    return main(["bench", "serve", "--url", server.url, "--api-key", API_KEY, "--prompts", str(prompts),
                 "--max-tokens", str(MAX_TOKENS), *extra])


def _positive(x) -> bool:
    return isinstance(x, float) and math.isfinite(x) and x > 0


def test_percentiles_and_summary_on_known_numbers():
    xs = [7.0, 1.0, 10.0, 4.0, 2.0, 9.0, 3.0, 6.0, 8.0, 5.0]  # 1..10, unsorted
    assert _pct(xs, 50) == pytest.approx(5.5)
    assert _pct(xs, 90) == pytest.approx(9.1)
    assert _pct(xs, 99) == pytest.approx(9.91)
    assert (_pct(xs, 0), _pct(xs, 100)) == (1.0, 10.0)
    assert _pct([3.0], 99) == 3.0 and _pct([], 50) is None
    s = _summary([0.010, 0.020, 0.030, 0.040])
    assert s["median"] == pytest.approx(0.025) and s["p90"] == pytest.approx(0.037)
    assert s["p99"] == pytest.approx(0.0397) and s["mean"] == pytest.approx(0.025) and s["count"] == 4
    assert _summary([]) == {"median": None, "p90": None, "p99": None, "mean": None, "count": 0}
    json.dumps(_summary([]), allow_nan=False)  # an empty level still writes strict JSON


def test_concurrency_levels_and_default_request_count(capsys):
    assert parse_levels("4") == [4] and parse_levels("1, 4,16,64") == [1, 4, 16, 64]
    for bad in ("0", "1,-2", "two", ""):
        with pytest.raises(ValueError):
            parse_levels(bad)
    assert [default_num_requests(c) for c in (1, 4, 5, 64)] == [8, 8, 10, 128]
    # refused before anything is sent (nothing listens on port 1, which would be a different error)
    assert main(["bench", "serve", "--url", "http://127.0.0.1:1", "--prompts", "p", "--concurrency", "1,0"]) == 2
    assert "--concurrency" in capsys.readouterr().err


@pytest.mark.server
def test_sweep_reports_every_level(bench_server, prompts, tmp_path, capsys):
    out = tmp_path / "sweep.json"
    assert _bench(bench_server, prompts, "--concurrency", "1,2", "--json", str(out), "--record", str(tmp_path / "rec")) == 0
    printed, log = capsys.readouterr()
    [rec] = records.load(tmp_path / "rec")  # the results record names the server's drafter (from its /metrics)
    assert rec["kind"] == "serve" and rec["figures"]["drafter"] == "ngram"
    assert "requests" not in rec["figures"]["levels"][0]
    section, title, lines = render_record(rec)
    assert section == "Serving" and "drafter ngram" in title and [x.split(" | ")[0] for x in lines[2:]] == ["| 1", "| 2"]
    rep = json.loads(out.read_text(), parse_constant=lambda c: pytest.fail(f"{c} in the JSON report"))
    assert rep["concurrency"] == [1, 2] and rep["errors"] == 0 and rep["max_tokens"] == MAX_TOKENS
    assert rep["workload"] == "prompts"
    assert [lv["concurrency"] for lv in rep["levels"]] == [1, 2]
    for lv in rep["levels"]:
        n = default_num_requests(lv["concurrency"])
        assert lv["num_requests"] == lv["completed"] == len(lv["requests"]) == n and lv["errors"] == 0
        assert lv["output_tokens"] == n * MAX_TOKENS and _positive(lv["output_tokens_per_s"])
        for key in ("ttft_s", "tpot_s", "itl_s", "e2e_s"):
            assert all(_positive(lv[key][s]) for s in ("median", "p90", "p99", "mean")), (key, lv[key])
            assert lv[key]["median"] <= lv[key]["p99"]
        reqs = lv["requests"]
        # ITL: one gap per pair of consecutive text chunks of each request, over all requests
        assert lv["itl_s"]["count"] == sum(r["chunks"] - 1 for r in reqs) > 0
        assert lv["itl_s"]["mean"] * lv["itl_s"]["count"] == pytest.approx(sum(r["itl_sum_s"] for r in reqs))
        assert lv["tpot_s"]["count"] == lv["ttft_s"]["count"] == lv["e2e_s"]["count"] == n
        for r in reqs:
            assert r["tokens"] == MAX_TOKENS and 2 <= r["chunks"] <= MAX_TOKENS
            assert 0 < r["ttft_s"] < r["e2e_s"]
            assert r["tpot_s"] == pytest.approx((r["e2e_s"] - r["ttft_s"]) / (MAX_TOKENS - 1))
            # the gaps lie between the first and the last text chunk, inside (TTFT, E2E]
            assert 0 < r["itl_sum_s"] <= r["e2e_s"] - r["ttft_s"]
    # one table, one row per level, readable at 120 columns
    lines = printed.strip().splitlines()
    assert max(len(x) for x in lines) <= 120
    assert "TTFT p50" in lines[1] and "TPOT p50" in lines[1] and "ITL p50" in lines[1]
    assert [x.split()[0] for x in lines[2:]] == ["1", "2"]
    assert lines[2].split()[1] == "8/8" and lines[3].split()[1] == "8/8"
    assert "concurrency 1: 8 requests" in log and "concurrency 2: 8 requests" in log


@pytest.mark.server
def test_plot_writes_a_png(bench_server, prompts, tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "sweep.png"
    assert _bench(bench_server, prompts, "--concurrency", "1,2", "--num-requests", "2", "--warmup", "0",
                  "--plot", str(png)) == 0
    data = png.read_bytes()
    assert data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) > 5000


def test_plot_without_matplotlib_fails_before_the_sweep(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` raise ImportError
    # nothing listens on port 1 and the prompts file does not exist: either would be a different error
    assert main(["bench", "serve", "--url", "http://127.0.0.1:1", "--prompts", "missing.jsonl", "--concurrency",
                 "1,2", "--plot", "x.png"]) == 2
    err = capsys.readouterr().err
    assert "pip install 'specserve[plot]'" in err and "concurrency 1" not in err
