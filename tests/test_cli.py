"""The CLI contract: `specserve generate` and `specserve bench offline` on the default model."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from server.bench import records
from server.bench.report import render_record
from specserve.cli import main


def test_generate_json_subprocess(tmp_path):
    cmd = [sys.executable, "-m", "specserve", "generate", "--config", "deploy/configs/ngram.yaml",
           "--dtype", "float32", "--messages", '[{"role": "user", "content": "Say hello."}]',
           "--max-tokens", "8", "--json"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert set(out) == {"text", "token_ids", "stats"} and 1 <= len(out["token_ids"]) <= 8
    assert out["stats"]["drafter"] == "ngram" and out["stats"]["verify_steps"] >= 1
    assert isinstance(out["text"], str) and out["text"]


def test_generate_bad_drafter_is_a_clear_error(capsys):
    assert main(["generate", "--drafter", "nope", "--prompt", "x", "--max-tokens", "2"]) == 2
    assert "valid drafters" in capsys.readouterr().err


@pytest.mark.slow
def test_bench_offline_json(tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"messages": [{"role": "user", "content": "Count from 1 to 10."}]}) + "\n"
                       + json.dumps({"prompt": "def add(a, b):\n"}) + "\n")
    out = tmp_path / "bench.json"
    rc = main(["bench", "offline", "--dtype", "float32", "--drafter", "ngram", "--prompts", str(prompts),
               "--max-tokens", "12", "--baseline", "hf", "--json", str(out), "--record", str(tmp_path / "rec")])
    assert rc == 0
    printed = capsys.readouterr().out
    [rec] = records.load(tmp_path / "rec")
    assert rec["kind"] == "offline" and "outputs" not in json.dumps(rec["figures"])
    section, title, lines = render_record(rec)
    assert section.startswith("Offline") and "2 prompts x 12 tokens, greedy" in title
    assert [x.split(" | ")[0] for x in lines[2:]] == ["| none", "| ngram", "| HF generate"]
    assert "ngram" in printed and "hf generate" in printed
    rep = json.loads(out.read_text())
    assert rep["prompts"] == 2 and rep["max_tokens"] == 12
    by = {r["drafter"]: r for r in rep["results"]}
    assert set(by) == {"none", "ngram"} and by["none"]["speedup_vs_none"] == 1.0
    assert by["ngram"]["lossless"] and by["ngram"]["outputs"] == by["none"]["outputs"]
    assert rep["baseline_hf"]["outputs"] == by["none"]["outputs"]  # fp32: token for token
    assert rep["baseline_hf"]["tokens_per_s"] > 0 and "speedup_vs_hf" in by["ngram"]
    # standardized walltime improvement: no drafter model -> c = 0, SWI = tokens per target forward
    assert "SWI" in printed and rep["target_forward_ms"] > 0
    for r in by.values():
        n_tokens = sum(len(o) for o in r["outputs"])
        assert r["drafter_forwards"] == 0 and r["cost_coefficient"] == 0.0
        assert r["swi"] == round(n_tokens / r["target_forwards"], 4)
    assert by["none"]["swi"] == 1.0 and by["none"]["target_forwards"] == sum(len(o) for o in by["none"]["outputs"])


@pytest.mark.slow
def test_bench_offline_reports_drafter_forwards_and_cost(tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "def add(a, b):\n"}) + "\n")
    out = tmp_path / "bench.json"
    assert main(["bench", "offline", "--dtype", "float32", "--drafter", "cascade,maxgram", "--prompts", str(prompts),
                 "--max-tokens", "8", "--json", str(out)]) == 0
    by = {r["drafter"]: r for r in json.loads(out.read_text())["results"]}
    assert by["cascade"]["lossless"] and by["maxgram"]["lossless"] and by["maxgram"]["drafter_forwards"] == 0
    r = by["cascade"]
    # GLIDE's prompt prefill plus at least one review per verify step
    assert r["drafter_forwards"] >= r["target_forwards"] and r["drafter_forward_ms"] > 0
    assert 0 < r["cost_coefficient"] < 10
    want = sum(len(o) for o in r["outputs"]) / (r["target_forwards"] + r["drafter_forwards"] * r["cost_coefficient"])
    assert r["swi"] == pytest.approx(want, rel=1e-3)


@pytest.mark.parametrize("argv", [["train", "glide", "--drafter", "glide"], ["train", "data", "--drafter", "x"],
                                  ["train", "bigram", "--drafter", "x"],
                                  ["bench", "serve", "--url", "http://127.0.0.1:1", "--prompts", "p", "--dtype", "float32"]])
def test_commands_refuse_flags_they_would_ignore(argv, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2 and "unrecognized arguments" in capsys.readouterr().err


def test_model_commands_take_config_dtype_device():
    from specserve.cli import build_parser

    p = build_parser()
    for argv in (["generate", "--prompt", "x"], ["serve"], ["bench", "offline", "--prompts", "p"],
                 ["train", "glide"], ["train", "data"], ["train", "bigram"], ["train", "accept-head"],
                 ["train", "eval-glide", "--checkpoint", "c", "--prompts", "p"]):
        a = p.parse_args([*argv, "--config", "c.yaml", "--dtype", "float32", "--device", "cpu"])
        assert (a.config, a.dtype, a.device) == ("c.yaml", "float32", "cpu")


def test_train_accept_head_checks_its_temperatures(capsys):
    assert main(["train", "accept-head", "--temperatures", "0"]) == 2
    assert "--temperatures" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["train", "accept-head", "--drafter", "ngram"])
    assert e.value.code == 2


def test_train_falcon_refuses_two_objectives(capsys):
    assert main(["train", "falcon", "--teacher-forcing", "--training-time-test"]) == 2
    assert "--training-time-test" in capsys.readouterr().err


@pytest.mark.parametrize("argv,says", [(["--seconds", "0"], "--seconds: a positive wall time"),
                                       (["--seconds", "-5"], "--seconds: a positive wall time"),
                                       (["--save-every", "0"], "--save-every: at least 1 step"),
                                       (["--source-tokens", "synth"], "--source-tokens: SOURCE=N"),
                                       (["--source-tokens", "synth=0"], "--source-tokens: SOURCE=N")])
def test_train_falcon_checks_its_time_budget_and_evaluation_interval(argv, says, capsys):
    assert main(["train", "falcon", *argv]) == 2
    assert says in capsys.readouterr().err


@pytest.mark.parametrize("reuse", ["float32", "int4/float32", "float32/int4,bf16/none"])
def test_train_data_checks_the_targets_it_reuses_before_loading_one(reuse, capsys):
    assert main(["train", "data", "--reuse", reuse, "--config", "missing.yaml"]) == 2
    err = capsys.readouterr().err
    assert "--reuse" in err and "dtype/quantization" in err


@pytest.mark.parametrize("argv,says", [(["--set", "Bad Name", "--prompts", "p.jsonl"], "--set: a name"),
                                       (["--set", "people", "--data", "x.pt"], "not with --data"),
                                       (["--set", "people", "--prompts", "a.jsonl,b.jsonl"], "one JSONL file")])
def test_train_data_checks_its_answer_set_before_loading_a_target(argv, says, capsys):
    assert main(["train", "data", *argv, "--config", "missing.yaml"]) == 2
    assert says in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["--source-weight", "chat"], ["--source-weight", "chat=0"],
                                  ["--source-weight", "=2"], ["--train-tokens", "-1"]])
def test_train_glide_checks_its_data_options(argv, capsys):
    assert main(["train", "glide", *argv]) == 2
    assert argv[0] in capsys.readouterr().err


def test_bench_steps_prints_the_step_cost_curve(tiny_dir, tmp_path, capsys):
    cfg = tmp_path / "tiny.yaml"
    cfg.write_text(f"model: {{source: {tiny_dir}, device: cpu}}\ncache: {{max_seq_len: 64}}\n")
    out = tmp_path / "steps.json"
    assert main(["bench", "steps", "--config", str(cfg), "--dtypes", "float32,bfloat16", "--quantizations",
                 "none,int8", "--rows", "1,2,4", "--cached", "16", "--repeats", "2", "--profile", "4",
                 "--json", str(out), "--record", str(tmp_path / "rec")]) == 0
    printed = capsys.readouterr().out
    assert "ms per target forward vs rows" in printed and "top operators, float32 int8, 4 row(s)" in printed
    [rec] = records.load(tmp_path / "rec")  # the results record: the command as typed, the curves without profiles
    assert rec["kind"] == "steps" and rec["command"].startswith("specserve bench steps --config ")
    assert rec["machine"] == records.machine() and "profile" not in json.dumps(rec["figures"])
    section, _, lines = render_record(rec)
    assert section == "Target speed" and lines[2].startswith("| float32 | none | ") and len(lines) == 2 + 4
    rep = json.loads(out.read_text())
    assert [(c["dtype"], c["quantization"]) for c in rep["curves"]] == [
        ("float32", "none"), ("float32", "int8"), ("bfloat16", "none"), ("bfloat16", "int8")]
    for c in rep["curves"]:
        assert set(c["ms"]) == {"1", "2", "4"} and all(v > 0 for v in c["ms"].values())
    assert main(["bench", "steps", "--config", str(cfg), "--rows", "0,5000"]) == 2
    # a config's `quantization: auto` is measured as what it resolves to (a Hugging Face directory: unquantized)
    auto = tmp_path / "auto.yaml"
    auto.write_text(f"model: {{source: {tiny_dir}, device: cpu, quantization: auto}}\ncache: {{max_seq_len: 64}}\n")
    assert main(["bench", "steps", "--config", str(auto), "--dtypes", "float32", "--rows", "1", "--cached", "8",
                 "--repeats", "1", "--json", str(out)]) == 0
    assert [c["quantization"] for c in json.loads(out.read_text())["curves"]] == ["none"]
