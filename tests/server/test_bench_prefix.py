"""`specserve bench serve --workload multi-turn | shared-prefix`: the workload builders, the cache fields and the hit
rate, a whole run of each against a scripted OpenAI server (httpx mock transport), and one tiny run of each against a
real server on loopback."""
from __future__ import annotations

import hashlib
import json
import math

import httpx
import pytest
from openai.types import CompletionUsage

from server.bench import prefix, records
from server.bench.report import render_record
from server.bench.prefix import (MESSAGE_TOKENS, cache_fields, estimate_tokens, hit_rate, mode_summary, padding_text,
                                 plan_multi_turn, plan_shared_prefix, questions_of, run_salt)
from server.bench.serve import cached_tokens
from specserve.cli import main
from tests.server.conftest import API_KEY, ServerProcess

QUESTIONS = [f"Question number {i}: what is {i} squared?" for i in range(5)]


# -- builders ------------------------------------------------------------------------------------------------------
def test_padding_is_deterministic_and_distinct_from_its_first_words():
    text = padding_text(3000, 5)
    assert 2900 < len(text) <= 3000 and not text.endswith(" ")
    # the same text on every machine and Python version (no hash(), no random): pinned
    assert hashlib.sha256(text.encode()).hexdigest()[:16] == "bb5e4cb104e5b85e"
    assert padding_text(3000, 5) == text and padding_text(1000, 5) == text[:len(padding_text(1000, 5))]
    assert padding_text(0, 1) == "" and padding_text(-5, 1) == ""
    assert len({padding_text(400, s).split()[0] for s in range(14)}) == 14  # 14 different first words
    # the first two lines (at most 26 words) differ for seeds 0-265
    assert len({" ".join(padding_text(600, s).split()[:30]) for s in range(266)}) == 266


def test_questions_of_a_prompts_file():
    recs = [{"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "first?"},
                          {"role": "assistant", "content": "yes"}, {"role": "user", "content": "second?"}]},
            {"prompt": "The history of"},
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]}]
    assert questions_of(recs) == ["second?", "The history of", "a\nb"]


def test_multi_turn_histories_grow_to_the_target():
    cpt, base, turns, max_tokens = 4.0, 30.0, 6, 64
    plan = plan_multi_turn(QUESTIONS, 3, turns, 1800, max_tokens, cpt, base)
    assert plan == plan_multi_turn(QUESTIONS, 3, turns, 1800, max_tokens, cpt, base)  # deterministic
    assert len({c.document.split()[0] for c in plan}) == 3  # each conversation its own document from its first word
    reply = "y" * (max_tokens * int(cpt))  # a reply of max_tokens tokens at cpt
    for c in plan:
        assert c.questions == tuple(QUESTIONS[(c.index * turns + t) % len(QUESTIONS)] for t in range(turns))
        sizes = []
        for t in range(turns):
            msgs = c.messages([f"{reply[:-1]}{k}" for k in range(t)])
            assert [m["role"] for m in msgs] == ["user"] + ["assistant", "user"] * t
            assert msgs[0]["content"] == f"{c.document}\n\n{c.questions[0]}"
            assert [m["content"] for m in msgs[2::2]] == list(c.questions[1:t + 1])
            assert [m["content"][-1] for m in msgs[1::2]] == [str(k) for k in range(t)]  # the replies, in order
            sizes.append(estimate_tokens(msgs, cpt, base))
        assert all(a < b for a, b in zip(sizes, sizes[1:]))
        assert sizes[-1] == pytest.approx(1800, rel=0.01)
        assert sizes[0] == pytest.approx(1800 - (turns - 1) * (max_tokens + 2 * MESSAGE_TOKENS)
                                         - sum(len(q) for q in c.questions[1:]) / cpt, rel=0.01)
    # a longer target, a longer document; a target the turns alone reach, none
    longer = plan_multi_turn(QUESTIONS, 3, turns, 3000, max_tokens, cpt, base)
    assert all(len(b.document) - len(a.document) == pytest.approx(1200 * cpt, abs=120) for a, b in zip(plan, longer))
    bare = plan_multi_turn(QUESTIONS, 1, turns, 100, max_tokens, cpt, base)[0]
    assert bare.document == "" and bare.messages([])[0]["content"] == QUESTIONS[0]


def test_shared_prefix_groups_share_their_own_system_prompt():
    plan = plan_shared_prefix(QUESTIONS, 3, 4, 256, 4.0)
    assert plan == plan_shared_prefix(QUESTIONS, 3, 4, 256, 4.0)
    # round-robin: question j of every group before question j + 1 of any
    assert [(p["group"], p["question"]) for p in plan] == [(g, j) for j in range(4) for g in range(3)]
    systems = {}
    for p in plan:
        system, user = p["messages"]
        assert system["role"] == "system" and user["role"] == "user"
        assert user["content"] == QUESTIONS[(p["group"] * 4 + p["question"]) % len(QUESTIONS)]
        assert systems.setdefault(p["group"], system["content"]) == system["content"]  # shared within a group
        assert 1024 - 80 < len(system["content"]) <= 1024
    assert len({s.split()[0] for s in systems.values()}) == 3  # distinct across groups from the first word


def test_cache_on_shares_the_run_salt_and_cache_off_never_repeats_one():
    salt = run_salt()
    assert salt != run_salt()
    assert cache_fields(True, salt) == {"cache_salt": salt, "cache_prompt": True}
    off = [cache_fields(False, salt) for _ in range(200)]
    assert all(f["cache_prompt"] is False for f in off)
    salts = [f["cache_salt"] for f in off]
    assert len(set(salts)) == 200 and salt not in salts
    assert all(0 < len(s) <= 256 for s in salts)  # the server's cache_salt limit


def test_hit_rate_and_mode_figures():
    rs = [{"prompt_tokens": 100, "cached_tokens": 60, "tokens": 4, "ttft_s": 0.1, "e2e_s": 0.5},
          {"prompt_tokens": 300, "cached_tokens": None, "tokens": 2, "ttft_s": 0.3, "e2e_s": 0.7},  # not reported
          {"prompt_tokens": None, "cached_tokens": None, "tokens": 3, "ttft_s": 0.2, "e2e_s": 0.6}]  # no usage
    assert hit_rate(rs) == pytest.approx(60 / 400)
    assert hit_rate([]) is None and hit_rate(rs[2:]) is None
    assert hit_rate([{"prompt_tokens": 50, "cached_tokens": 50}]) == 1.0
    m = mode_summary(rs, ["E: x", "E: x", "F: y"], 2.0, 4)
    assert (m["completed"], m["num_requests"], m["errors"], m["error_samples"]) == (3, 4, 3, ["E: x", "F: y"])
    assert m["requests_per_s"] == 1.5 and m["output_tokens_per_s"] == 4.5 and m["output_tokens"] == 9
    assert (m["prompt_tokens"], m["cached_tokens"], m["cached_tokens_reported"]) == (400, 60, 1)
    assert m["token_hit_rate"] == pytest.approx(0.15) and m["ttft_s"]["median"] == pytest.approx(0.2)


def test_cached_tokens_from_the_usage():
    assert cached_tokens(None) is None
    assert cached_tokens(CompletionUsage(prompt_tokens=9, completion_tokens=1, total_tokens=10)) is None
    u = CompletionUsage.model_validate({"prompt_tokens": 9, "completion_tokens": 1, "total_tokens": 10,
                                        "prompt_tokens_details": {"cached_tokens": 7}})
    assert cached_tokens(u) == 7
    assert cached_tokens(type("U", (), {"prompt_tokens_details": {"cached_tokens": 3}})()) == 3


@pytest.mark.parametrize("argv, message", [
    (["--turns", "3"], "--turns applies to --workload multi-turn"),
    (["--workload", "multi-turn", "--groups", "2"], "--groups applies to --workload shared-prefix"),
    (["--workload", "multi-turn", "--turns", "1"], "--turns must be at least 2"),
    (["--workload", "shared-prefix", "--prefix-tokens", "0"], "--prefix-tokens must be at least 1"),
    (["--workload", "multi-turn", "--concurrency", "2"], "multi-turn runs its --conversations all at once"),
    (["--workload", "shared-prefix", "--concurrency", "1,2"], "shared-prefix runs at one level"),
    (["--workload", "shared-prefix", "--num-requests", "4"], "--num-requests applies to --workload prompts"),
    (["--workload", "multi-turn", "--plot", "x.png"], "--plot applies to --workload prompts"),
])
def test_options_of_another_workload_are_refused_before_anything_is_sent(argv, message, capsys):
    # nothing listens on port 1, which would be a different error
    assert main(["bench", "serve", "--url", "http://127.0.0.1:1", "--prompts", "p.jsonl", *argv]) == 2
    assert message in capsys.readouterr().err


def test_the_prompts_workload_still_needs_its_prompts(capsys):
    assert main(["bench", "serve", "--url", "http://127.0.0.1:1"]) == 2
    assert "--prompts is required" in capsys.readouterr().err


# -- whole runs against a scripted server --------------------------------------------------------------------------
class ScriptedServer:
    """An OpenAI chat server in a mock transport: records every request body; prompt_tokens = characters / 3 + 10
    + 5 per message after the first (`MESSAGE_TOKENS`), and a prefix cache per salt: cached_tokens = the longest common character prefix with an earlier prompt of the
    same salt, / 3 (none under cache_prompt false); the reply names the request's number."""

    def __init__(self):
        self.bodies: list[dict] = []
        self.prompts: dict[str, list[str]] = {}

    def __call__(self, request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("/models"):
            return httpx.Response(200, json={"object": "list", "data": [
                {"id": "scripted", "object": "model", "created": 0, "owned_by": "test"}]})
        body = json.loads(request.content)
        self.bodies.append(body)
        prompt = "\x00".join(m["content"] for m in body["messages"])
        seen = self.prompts.setdefault(body.get("cache_salt", ""), [])
        common = max((len(_common_prefix(prompt, p)) for p in seen), default=0)
        if body.get("cache_prompt") is not False:
            seen.append(prompt)
        else:
            common = 0
        reply = [f"reply {len(self.bodies)}", "."][:body["max_tokens"]]
        n = len(body["messages"])
        tokens = (len(prompt) - (n - 1)) // 3 + 10 + MESSAGE_TOKENS * (n - 1)
        usage = {"prompt_tokens": tokens, "completion_tokens": len(reply), "total_tokens": tokens + len(reply),
                 "prompt_tokens_details": {"cached_tokens": common // 3}}
        head = {"id": "c", "object": "chat.completion.chunk", "created": 0, "model": "scripted"}
        events = [{**head, "choices": [{"index": 0, "delta": {"content": piece}, "finish_reason": None}]}
                  for piece in reply]
        events.append({**head, "choices": [], "usage": usage})
        sse = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
        return httpx.Response(200, content=sse.encode(), headers={"content-type": "text/event-stream"})


def _common_prefix(a: str, b: str) -> str:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return a[:n]


@pytest.fixture
def scripted(monkeypatch):
    from openai import AsyncOpenAI

    srv = ScriptedServer()
    monkeypatch.setattr(prefix, "make_client", lambda url, api_key: AsyncOpenAI(
        base_url="http://scripted/v1", api_key="k", max_retries=0,
        http_client=httpx.AsyncClient(transport=httpx.MockTransport(srv))))
    return srv


@pytest.fixture
def questions_file(tmp_path):
    p = tmp_path / "q.jsonl"
    p.write_text("".join(json.dumps({"messages": [{"role": "user", "content": q}]}) + "\n" for q in QUESTIONS))
    return p


def test_multi_turn_run_sends_histories_and_replays_them_cold(scripted, questions_file):
    rep = prefix.run_multi_turn_bench("http://scripted", None, questions_file, conversations=2, turns=3,
                                      history_tokens=400, max_tokens=2, warmup=0)
    probes, bodies = scripted.bodies[:2], scripted.bodies[2:]
    assert all(b["max_tokens"] == 1 and b["cache_prompt"] is False for b in probes)  # calibration, cold
    # the scripted server's 3 characters a token and 10 tokens around one message, measured
    assert rep["chars_per_token"] == pytest.approx(3, rel=0.02) and rep["base_tokens"] == pytest.approx(10, abs=2)
    on = [b for b in bodies if b["cache_salt"] == rep["cache_salt"]]
    off = [b for b in bodies if b["cache_salt"] != rep["cache_salt"]]
    assert len(on) == len(off) == 6 and bodies[:6] == on  # cache on first, then cache off
    assert all(b["cache_prompt"] is True for b in on) and all(b["cache_prompt"] is False for b in off)
    assert len({b["cache_salt"] for b in off + probes}) == 8
    for b in bodies:
        assert b["stream"] and b["stream_options"] == {"include_usage": True}
        assert b["temperature"] == 0 and b["max_tokens"] == 2
    # each turn sends the whole history: the earlier turn's request, its reply (the server's), the next question
    for b in on:
        n = len(b["messages"])
        if n > 1:
            earlier = next(e for e in on if e["messages"] == b["messages"][:n - 2])
            assert b["messages"][n - 2] == {"role": "assistant", "content": f"reply {scripted.bodies.index(earlier) + 1}."}
    # cache off: the same messages, turn by turn
    assert sorted(json.dumps(b["messages"]) for b in off) == sorted(json.dumps(b["messages"]) for b in on)
    assert [len(b["messages"]) for b in off] == [1, 1, 3, 3, 5, 5]
    assert rep["errors"] == 0 and rep["concurrency"] == 2
    m_on, m_off = rep["modes"]["on"], rep["modes"]["off"]
    assert m_on["completed"] == m_off["completed"] == 6 and m_off["cached_tokens"] == 0
    assert m_on["token_hit_rate"] == pytest.approx(m_on["cached_tokens"] / m_on["prompt_tokens"])
    assert m_on["later_turns_token_hit_rate"] > 0.8 and m_off["token_hit_rate"] == 0
    assert [r["turn"] for r in rep["per_turn"]] == [1, 2, 3]
    last = rep["per_turn"][-1]["on"]["prompt_tokens_mean"]
    assert last == pytest.approx(400, rel=0.05)
    assert rep["per_turn"][0]["on"]["prompt_tokens_mean"] < rep["per_turn"][1]["on"]["prompt_tokens_mean"] < last
    q = rep["on_over_off"]
    assert q["ttft_later_turns_median"] == pytest.approx(
        m_on["ttft_later_turns_s"]["median"] / m_off["ttft_later_turns_s"]["median"])
    assert m_on["ttft_later_turns_s"]["count"] == 4 and m_on["ttft_first_turn_s"]["count"] == 2
    json.dumps(rep, allow_nan=False)


def test_shared_prefix_run_compares_one_salt_with_unique_salts(scripted, questions_file):
    rep = prefix.run_shared_prefix_bench("http://scripted", None, questions_file, groups=3, questions=2,
                                         prefix_tokens=100, concurrency=2, max_tokens=2, warmup=0)
    bodies = scripted.bodies[2:]
    on, off = bodies[:6], bodies[6:]
    assert {b["cache_salt"] for b in on} == {rep["cache_salt"]} and all(b["cache_prompt"] is True for b in on)
    assert len({b["cache_salt"] for b in off}) == 6 and all(b["cache_prompt"] is False for b in off)
    assert rep["cache_salt"] not in {b["cache_salt"] for b in off}
    assert [b["messages"] for b in on] == [b["messages"] for b in off]
    assert len({b["messages"][0]["content"] for b in on}) == 3
    m_on, m_off = rep["modes"]["on"], rep["modes"]["off"]
    # the second question of each group reuses its system prompt; nothing is reused with the cache off
    for r in m_on["requests"]:
        assert (r["cached_tokens"] > 90) == (r["question"] == 1)
    assert m_off["cached_tokens"] == 0 and m_on["token_hit_rate"] > 0.3
    assert m_on["completed"] == m_off["completed"] == 6 and rep["errors"] == 0
    q = rep["on_over_off"]
    assert q["requests_per_s"] == pytest.approx(m_on["requests_per_s"] / m_off["requests_per_s"])
    assert q["ttft_median"] == pytest.approx(m_on["ttft_s"]["median"] / m_off["ttft_s"]["median"])
    text = prefix.format_shared_prefix_report(rep)
    assert [x.split()[0] for x in text.splitlines()[3:5]] == ["on", "off"]


# -- against a real server ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def prefix_server(open_server):
    """The session's server without an API key (tests/conftest.py)."""
    return open_server


def _bench(server: ServerProcess, out, *extra: str) -> int:
    return main(["bench", "serve", "--url", server.url, "--api-key", API_KEY, "--warmup", "0", "--json", str(out),
                 *extra])


def _report(path) -> dict:
    return json.loads(path.read_text(), parse_constant=lambda c: pytest.fail(f"{c} in the JSON report"))


def _positive(x) -> bool:
    return isinstance(x, float) and math.isfinite(x) and x > 0


@pytest.mark.server
def test_multi_turn_against_a_server(prefix_server, tmp_path, capsys):
    out = tmp_path / "mt.json"
    assert _bench(prefix_server, out, "--workload", "multi-turn", "--conversations", "2", "--turns", "2",
                  "--history-tokens", "120", "--max-tokens", "3", "--record", str(tmp_path / "rec")) == 0
    printed = capsys.readouterr().out
    section, title, lines = render_record(records.load(tmp_path / "rec")[0])
    assert section == "Prefix caching" and "2 conversations x 2 turns" in title
    assert [x.split(" | ")[0] for x in lines[2:]] == ["| on", "| off"]
    rep = _report(out)
    assert rep["workload"] == "multi-turn" and rep["errors"] == 0 and (rep["conversations"], rep["turns"]) == (2, 2)
    assert _positive(rep["chars_per_token"])
    for name in ("on", "off"):
        m = rep["modes"][name]
        assert m["completed"] == m["num_requests"] == 4
        assert {(r["conversation"], r["turn"]) for r in m["requests"]} == {(0, 1), (1, 1), (0, 2), (1, 2)}
        assert _positive(m["ttft_later_turns_s"]["median"]) and _positive(m["requests_per_s"])
    on = {(r["conversation"], r["turn"]): r for r in rep["modes"]["on"]["requests"]}
    off = {(r["conversation"], r["turn"]): r for r in rep["modes"]["off"]["requests"]}
    for key in on:  # cache off resent the same messages
        assert on[key]["prompt_tokens"] == off[key]["prompt_tokens"] > 0
    for c in (0, 1):  # the history grew, to about the target
        assert on[(c, 1)]["prompt_tokens"] < on[(c, 2)]["prompt_tokens"]
        assert on[(c, 2)]["prompt_tokens"] == pytest.approx(120, rel=0.25)
    if rep["modes"]["on"]["cached_tokens_reported"]:  # a server with a prefix cache
        assert rep["modes"]["on"]["later_turns_token_hit_rate"] > 0.5 and rep["modes"]["off"]["cached_tokens"] == 0
    lines = printed.strip().splitlines()
    assert max(len(x) for x in lines) <= 120
    assert [x.split()[0] for x in lines[3:5]] == ["on", "off"] and [x.split()[0] for x in lines[6:8]] == ["1", "2"]
    assert lines[-1].startswith("on/off, turns >= 2: TTFT p50")


@pytest.mark.server
def test_shared_prefix_against_a_server(prefix_server, tmp_path, capsys):
    out = tmp_path / "sp.json"
    assert _bench(prefix_server, out, "--workload", "shared-prefix", "--groups", "2", "--questions", "2",
                  "--prefix-tokens", "64", "--concurrency", "2", "--max-tokens", "2") == 0
    printed = capsys.readouterr().out
    rep = _report(out)
    assert rep["workload"] == "shared-prefix" and rep["errors"] == 0 and rep["concurrency"] == 2
    for name in ("on", "off"):
        m = rep["modes"][name]
        assert m["completed"] == m["num_requests"] == 4 and m["output_tokens"] == 8
        assert {(r["group"], r["question"]) for r in m["requests"]} == {(0, 0), (1, 0), (0, 1), (1, 1)}
        assert _positive(m["ttft_s"]["median"]) and _positive(m["output_tokens_per_s"])
    assert all(_positive(v) for v in rep["on_over_off"].values())
    if rep["modes"]["on"]["cached_tokens_reported"]:
        on = rep["modes"]["on"]["requests"]
        # the group's system prompt, for at least the question sent after its group's first one finished
        assert any(r["cached_tokens"] >= 40 for r in on if r["question"] == 1)
        assert rep["modes"]["off"]["cached_tokens"] == 0
    lines = printed.strip().splitlines()
    assert max(len(x) for x in lines) <= 120
    assert [x.split()[0] for x in lines[3:5]] == ["on", "off"] and lines[-1].startswith("on/off: req/s")
