"""`bench offline`: drafter specs with option overrides, and sampled runs (seeded: still compared with `none`)."""
from __future__ import annotations

import json

import pytest

from server.bench.offline import parse_specs
from specserve.cli import main


def test_specs_split_on_commas_outside_brackets_and_read_yaml_values():
    assert parse_specs("glide, glide:gamma=2,falcon:top_m=[2,1]:max_rows=8,none") == [
        ("glide", "glide", {}), ("glide:gamma=2", "glide", {"gamma": 2}),
        ("falcon:top_m=[2,1]:max_rows=8", "falcon", {"top_m": [2, 1], "max_rows": 8}), ("none", "none", {})]
    with pytest.raises(ValueError, match="name:key=value"):
        parse_specs("glide:gamma")


def _prompts(tmp_path):
    p = tmp_path / "p.jsonl"
    p.write_text(json.dumps({"prompt": "def add(a, b):\n    return"}) + "\n"
                 + json.dumps({"messages": [{"role": "user", "content": "Name a colour."}]}) + "\n")
    return p


@pytest.mark.slow
def test_one_run_sweeps_a_drafters_options(tmp_path, capsys):
    out = tmp_path / "r.json"
    assert main(["bench", "offline", "--dtype", "float32", "--drafter", "ngram:num_tokens=1,ngram:num_tokens=6",
                 "--prompts", str(_prompts(tmp_path)), "--max-tokens", "12", "--json", str(out)]) == 0
    by = {r["drafter"]: r for r in json.loads(out.read_text())["results"]}
    one, six = by["ngram:num_tokens=1"], by["ngram:num_tokens=6"]
    assert one["lossless"] and six["lossless"]
    assert one["draft_tokens"] < six["draft_tokens"]  # the override reached the drafter
    assert "ngram:num_tokens=6" in capsys.readouterr().out
    assert main(["bench", "offline", "--drafter", "ngram:gamma=3", "--prompts", str(_prompts(tmp_path))]) == 2
    assert "no option 'gamma'" in capsys.readouterr().err


@pytest.mark.slow
def test_sampled_runs_compare_outputs_only_when_seeded(tmp_path):
    out = tmp_path / "r.json"
    common = ["bench", "offline", "--dtype", "float32", "--drafter", "ngram", "--prompts", str(_prompts(tmp_path)),
              "--max-tokens", "12", "--temperature", "0.8", "--top-p", "0.9", "--json", str(out)]
    assert main([*common, "--seed", "3"]) == 0
    rep = json.loads(out.read_text())
    assert (rep["temperature"], rep["top_p"], rep["seed"]) == (0.8, 0.9, 3)
    by = {r["drafter"]: r for r in rep["results"]}
    assert by["ngram"]["lossless"] is True  # a seeded request's tokens do not depend on the drafter
    assert main(common) == 0
    by = {r["drafter"]: r for r in json.loads(out.read_text())["results"]}
    assert by["ngram"]["lossless"] is None
