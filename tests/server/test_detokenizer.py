"""Incremental detokenization with the default model's real tokenizer, and stop-string matching."""
from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from server.api.detokenizer import IncrementalDetokenizer, StopStringMatcher

TEXTS = [
    "Hello, world! This is a plain ASCII sentence.\nWith a second line.",
    "Emoji: 😀😃🎉 family 👨‍👩‍👧‍👦 flags 🇫🇷🇯🇵 skin 👍🏽 and a keycap 1️⃣.",
    "中文测试：你好，世界！日本語のテキスト。한국어 문장입니다.",
    "Ünïcödé àccents, combining e\u0301 and ligatures ﬁ; math ∑∫√∞ ≠ ≤; arrows ← → ⇒.",
    "def f(x):\n    return {'a': [1, 2, 3]}  # code with    spaces\n\t\ttabs",
    "  leading spaces, trailing spaces   ",
    "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𝕞𝕒𝕥𝕙 and ancient 𓀀𓁐 hieroglyphs, plus a lone \ufffd replacement char.",
]


@pytest.fixture(scope="session")
def tok():
    from server.model_files import load_tokenizer, resolve_model

    return load_tokenizer(resolve_model("embedded", progress=False).hf_dir)


def stream(tok, ids, batch_sizes=None, skip=True) -> tuple[list[str], str]:
    detok = IncrementalDetokenizer(tok, skip_special_tokens=skip)
    pieces, i = [], 0
    sizes = iter(batch_sizes or [])
    while i < len(ids):
        n = next(sizes, 1)
        pieces.append(detok.add(ids[i:i + n]))
        i += n
    return pieces, detok.finish()


@pytest.mark.parametrize("text", TEXTS)
def test_token_by_token_matches_decode(tok, text):
    ids = tok(text, add_special_tokens=False)["input_ids"]
    pieces, tail = stream(tok, ids)
    assert "".join(pieces) + tail == tok.decode(ids, skip_special_tokens=True) == text
    if "\ufffd" not in text:
        assert all("\ufffd" not in p for p in pieces), pieces


@pytest.mark.parametrize("seed", range(5))
def test_random_batches_match_decode(tok, seed):
    rng = random.Random(seed)
    clean = [t for t in TEXTS if "\ufffd" not in t]
    text = "".join(rng.sample(clean, len(clean)))
    ids = tok(text, add_special_tokens=False)["input_ids"]
    pieces, tail = stream(tok, ids, [rng.randint(1, 7) for _ in ids])
    assert "".join(pieces) + tail == text
    assert all("\ufffd" not in p for p in pieces)


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens(tok, skip):
    messages = [{"role": "system", "content": "Be nice 🙂"}, {"role": "user", "content": "写一首诗"},
                {"role": "assistant", "content": "好的！🌸 Here it is."}]
    text = tok.apply_chat_template(messages, tokenize=False)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    pieces, tail = stream(tok, ids, [3, 1, 2] * len(ids), skip=skip)
    assert "".join(pieces) + tail == tok.decode(ids, skip_special_tokens=skip)
    assert ("<|im_start|>" in "".join(pieces)) is not skip


@pytest.mark.parametrize("seed", range(4))
def test_random_token_ids_match_decode(tok, seed):
    """Arbitrary ids (invalid byte sequences, special tokens) still add up to the full decode."""
    rng = random.Random(seed)
    ids = [rng.randrange(len(tok)) for _ in range(1500)]
    for skip in (True, False):
        pieces, tail = stream(tok, ids, [rng.randint(1, 5) for _ in ids], skip=skip)
        assert "".join(pieces) + tail == tok.decode(ids, skip_special_tokens=skip)


def test_split_character_is_held_then_flushed(tok):
    ids = tok("😀", add_special_tokens=False)["input_ids"]
    assert len(ids) > 1  # byte-level BPE splits the emoji's four bytes
    detok = IncrementalDetokenizer(tok)
    assert [detok.add([i]) for i in ids[:-1]] == [""] * (len(ids) - 1)
    assert detok.add(ids[-1:]) == "😀" and detok.finish() == ""
    # A model that stops in the middle of a character: the bytes come out at the end, as decode() has them.
    cut = IncrementalDetokenizer(tok)
    assert cut.add(ids[:1]) == ""
    assert cut.finish() == tok.decode(ids[:1]) and "\ufffd" in tok.decode(ids[:1])
    assert IncrementalDetokenizer(tok).add([]) == ""


def test_work_is_linear(tok):
    """Each add() decodes a bounded window, not the whole output."""
    decoded = []

    class Counting:
        def decode(self, ids, **kw):
            decoded.append(len(ids))
            return tok.decode(ids, **kw)

    ids = tok(" ".join(TEXTS) * 20, add_special_tokens=False)["input_ids"]
    detok = IncrementalDetokenizer(Counting())
    out = "".join(detok.add([i]) for i in ids) + detok.finish()
    assert out == tok.decode(ids)
    assert len(ids) > 2000 and max(decoded) <= 2 * IncrementalDetokenizer.SLIDE_AT + 8
    assert sum(decoded) < 40 * len(ids)


# -- stop strings ------------------------------------------------------------------------------------------------
def run_matcher(stops, chunks) -> tuple[str, bool]:
    matcher = StopStringMatcher(stops)
    out = []
    for chunk in chunks:
        text, stopped = matcher.feed(chunk)
        out.append(text)
        if stopped:
            return "".join(out), True
    out.append(matcher.finish())
    return "".join(out), matcher.stopped


def expected_cut(text, stops) -> tuple[str, bool]:
    found = [i for i in (text.find(s) for s in stops) if i >= 0]
    return (text[:min(found)], True) if found else (text, False)


def test_no_stops_pass_through():
    matcher = StopStringMatcher([])
    assert matcher.feed("abc") == ("abc", False) and matcher.feed("") == ("", False) and matcher.finish() == ""


def test_stop_spanning_feeds_never_leaks():
    matcher = StopStringMatcher(["</end>"])
    outs = [matcher.feed(c) for c in ["Hello </", "e", "nd", "> world"]]
    assert outs == [("Hello ", False), ("", False), ("", False), ("", True)]
    assert matcher.feed("more") == ("", True) and matcher.finish() == ""


def test_held_text_released_on_mismatch_and_finish():
    matcher = StopStringMatcher(["STOP"])
    assert matcher.feed("abc ST") == ("abc ", False)
    assert matcher.feed("O") == ("", False)
    assert matcher.feed("x") == ("STOx", False)
    assert matcher.feed("ST") == ("", False)
    assert matcher.finish() == "ST" and not matcher.stopped


def test_earliest_match_wins_even_when_it_completes_later():
    assert run_matcher(["abcd", "bc"], "abcd") == ("", True)
    assert run_matcher(["abcd", "bc"], "abcx") == ("a", True)
    assert run_matcher(["abcd", "bc"], "abc") == ("a", True)  # decided by finish()
    assert run_matcher(["\n\n", "\n"], ["x\n", "\ny"]) == ("x", True)


def test_empty_stop_rejected():
    with pytest.raises(ValueError):
        StopStringMatcher(["ok", ""])


ALPHABET = "ab\n😀"


@settings(max_examples=300, deadline=None)
@given(text=st.text(alphabet=ALPHABET, max_size=40),
       stops=st.lists(st.text(alphabet=ALPHABET, min_size=1, max_size=4), max_size=4),
       cuts=st.lists(st.integers(min_value=0, max_value=40), max_size=12))
def test_stop_matching_is_chunking_independent(text, stops, cuts):
    bounds = sorted({c for c in cuts if c <= len(text)} | {0, len(text)})
    chunks = [text[a:b] for a, b in zip(bounds, bounds[1:])]
    assert run_matcher(stops, chunks) == expected_cut(text, stops)
    # Never emits anything beyond the final answer, at any point of the stream.
    want, _ = expected_cut(text, stops)
    matcher, emitted = StopStringMatcher(stops), ""
    for chunk in chunks:
        emitted += matcher.feed(chunk)[0]
        assert want.startswith(emitted)


@settings(max_examples=300, deadline=None)
@given(text=st.text(alphabet=ALPHABET, max_size=40),
       stops=st.lists(st.text(alphabet=ALPHABET, min_size=1, max_size=4), min_size=1, max_size=4),
       cuts=st.lists(st.integers(min_value=0, max_value=40), max_size=12))
def test_stop_end_is_where_the_first_stop_string_ends(text, stops, cuts):
    """`end`: the offset in the whole fed text where the stop string that cut it ends (the API counts the tokens
    up to there)."""
    bounds = sorted({c for c in cuts if c <= len(text)} | {0, len(text)})
    matcher = StopStringMatcher(stops)
    for a, b in zip(bounds, bounds[1:]):
        if matcher.feed(text[a:b])[1]:
            break
    matcher.finish()
    found = [i for i in (text.find(s) for s in stops) if i >= 0]
    if not found:
        assert not matcher.stopped and matcher.end is None
    else:
        i = min(found)
        assert matcher.stopped and matcher.end == i + min(len(s) for s in stops if text.startswith(s, i))


@pytest.mark.parametrize("skip", [True, False])
def test_the_backend_decode_equals_the_tokenizers_own_on_random_ids(tok, skip):
    """The detokenizer decodes through the fast tokenizer's backend (transformers' decode costs a third of its time
    per token in argument handling); on any ids, special tokens included, that is what tokenizer.decode returns."""
    detok = IncrementalDetokenizer(tok, skip_special_tokens=skip)
    assert detok._backend_decode is not None
    rng = random.Random(0)
    special = list(tok.all_special_ids)
    for _ in range(300):
        ids = [rng.choice(special) if rng.random() < 0.1 else rng.randrange(len(tok)) for _ in range(rng.randint(1, 20))]
        assert detok._decode(ids) == tok.decode(ids, skip_special_tokens=skip), ids


def test_a_tokenizer_that_cleans_up_spaces_decodes_through_transformers(tok):
    import copy

    cleaning = copy.copy(tok)
    cleaning.clean_up_tokenization_spaces = True
    assert IncrementalDetokenizer(cleaning)._backend_decode is None
