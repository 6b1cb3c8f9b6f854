"""Several API keys (`--api-key` repeated, `--api-key-file`), each its own prefix-cache partition unless a key file
puts keys in one tenant; on the in-process app with the scripted worker, plus the command line's parsing."""
from __future__ import annotations

import pytest

from server.api.auth import ApiKeys
from server.api.generation import cache_namespace
from tests.server.fake_worker import MODEL, PROMPT, FakeWorker, make_client


def _post(c, key: str | None):
    headers = {"Authorization": f"Bearer {key}"} if key is not None else {}
    return c.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 1}, headers=headers)


def test_every_key_is_accepted_and_is_its_own_partition(tmp_path):
    f = tmp_path / "keys"
    f.write_text("# team keys\nsk-c1 team\n\nsk-c2   team\nsk-d\n")
    keys = ApiKeys.of(["sk-a", "sk-b"], f)
    worker = FakeWorker()
    with make_client(worker, api_key=keys) as c:
        for key in ("sk-a", "sk-b", "sk-a", "sk-c1", "sk-c2", "sk-d"):
            assert _post(c, key).status_code == 200, key
        for bad in ("sk-c", "Sk-a", "", None, "team", "sk-aa"):
            r = _post(c, bad)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", bad
    a, b, a2, c1, c2, d = (g.namespace for g in worker.generates)
    assert a == a2 and c1 == c2  # one key's requests share; one tenant's keys share
    assert len({a, b, c1, d}) == 4  # every other pair is apart
    assert all(k not in ns for ns in (a, b, c1, d) for k in ("sk-a", "sk-b", "sk-c1", "team", "sk-d"))
    assert a == cache_namespace("sk-a", None, True, "")  # one key alone: as when it is the server's only key


def test_key_file_and_key_errors(tmp_path):
    assert ApiKeys.of([], None) is None
    bad = tmp_path / "bad"
    bad.write_text("k1 tenant extra\n")
    with pytest.raises(ValueError, match="bad:1"):
        ApiKeys.of(None, bad)
    for key in ("", "k\x00", "k\u00e9", " k"):
        with pytest.raises(ValueError):
            ApiKeys.of([key])
    empty = tmp_path / "empty"
    empty.write_text("# no key yet\n\n")
    with pytest.raises(ValueError, match="holds no key"):  # not a server without keys
        ApiKeys.of(["k"], empty)
    twice = tmp_path / "twice"
    twice.write_text("k a\nk b\n")
    with pytest.raises(ValueError, match="twice"):
        ApiKeys.of(None, twice)


def test_serve_takes_repeated_keys_and_a_key_file(tmp_path, monkeypatch):
    seen = {}
    monkeypatch.setattr("server.api.app.serve", lambda cfg, host, port, keys, drain_timeout: seen.update(keys=keys))
    f = tmp_path / "keys"
    f.write_text("k3 t\n")
    from specserve.cli import main

    monkeypatch.delenv("SPECSERVE_API_KEY", raising=False)
    assert main(["serve", "--api-key", "k1", "--api-key", "k2", "--api-key-file", str(f)]) is None
    keys = seen["keys"]
    assert set(keys.partitions) == {"k1", "k2", "k3"}
    assert keys.partitions["k3"] != keys.partitions["k1"] != keys.partitions["k2"]
