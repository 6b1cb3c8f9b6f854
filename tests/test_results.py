"""Benchmark records and the page generated from them: docs/benchmarks.md is current, a newer record of a table
replaces the older one, records group by machine, and a stale page is caught."""
import json

from server.bench import records
from server.bench.report import PAGE, render, render_record, run

EPYC = {"cpu": "AMD EPYC", "cpu_features": ["avx2"], "cores": 2, "gpu": None}
XEON = {"cpu": "Intel Xeon", "cpu_features": ["amx_bf16", "avx512_bf16", "avx512f", "avx2"], "cores": 2, "gpu": None}


def _steps(ms1: float, date: str, machine: dict) -> dict:
    rec = records.make("steps", {"threads": 2, "cached": 300, "repeats": 7, "curves": [
        {"dtype": "float32", "quantization": "int4", "device": "cpu", "ms": {"1": ms1, "8": 2 * ms1},
         "profile": {"1": "a long table"}}]}, argv=["specserve", "bench", "steps", "--record"], date=date)
    return {**rec, "machine": machine}


def test_the_benchmarks_page_is_generated_from_the_records_and_stays_short():
    assert run(str(records.RESULTS), str(PAGE), check=True) == 0, "run `specserve bench report`"
    text = PAGE.read_text()
    assert text.count("\n") <= 250
    for rec in records.load():
        assert rec["machine"]["cpu"] and rec["command"] and rec["date"][:4] == "2026"
        section, title, _ = render_record(rec)
        assert f"**{title}** ({rec['date']}" in text  # every record's table is on the page, under its machine


def test_newest_record_of_a_table_is_current_and_machines_are_apart(tmp_path):
    res, page = tmp_path / "results", tmp_path / "benchmarks.md"
    records.write(_steps(11.0, "2026-01-01", EPYC), res)
    records.write(_steps(22.0, "2026-02-01", EPYC), res)
    assert run(str(res), str(page), check=True) == 1  # no page yet
    assert run(str(res), str(page), check=False) == 0 and run(str(res), str(page), check=True) == 0
    text = page.read_text()
    assert "| float32 | int4 | 22.0 (1.00) | 44.0 (2.00) |" in text and "11.0" not in text
    assert "## AMD EPYC, 2 cores, AVX2" in text and "a long table" not in text  # profiles stay out of records
    assert "`specserve bench steps --record`" in text and "(2026-02-01" in text
    records.write(_steps(5.0, "2026-03-01", XEON), res)  # a record added, the page not regenerated
    assert run(str(res), str(page), check=True) == 1
    text = render(records.load(res))
    assert text.index("## Intel Xeon, 2 cores, AMX") < text.index("## AMD EPYC")  # newest machine first
    assert "22.0 (1.00)" in text and "5.0 (1.00)" in text


def test_a_record_names_this_machine_and_commit(tmp_path):
    path = records.write(records.make("table", {"columns": ["a"], "rows": [[1]]}, argv=["x"]), tmp_path)
    rec = json.loads(path.read_text())
    assert list(rec) == list(records.KEYS) and rec["machine"]["cores"] >= 1 and rec["command"] == "x"
    assert rec["commit"] is None or len(rec["commit"].removesuffix("+dirty")) >= 7
    assert records.machine_label({**EPYC, "gpu": "NVIDIA H200"}) == "NVIDIA H200 (host: AMD EPYC, 2 cores, AVX2)"
