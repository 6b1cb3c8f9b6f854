"""The second real model served: Gemma 3 270M (base, Q4_K_M; ``model.source: gemma3-270m``) through the official
`openai` client, streaming and not, with n-gram drafting; a chat call to this base model (no chat template) is a
clear 400, not a 500."""
from __future__ import annotations

import openai
import pytest
from openai import OpenAI

from tests.server.conftest import ServerProcess

pytestmark = pytest.mark.server

PROMPT = "The three primary colors are"


@pytest.fixture(scope="module")
def gemma_server(tmp_path_factory):
    s = ServerProcess(tmp_path_factory.mktemp("gemma-srv"), drafter="ngram", num_slots=2, source="gemma3-270m",
                      dtype="float32").wait_ready(timeout=600)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(gemma_server):
    return OpenAI(base_url=gemma_server.url + "/v1", api_key=gemma_server.api_key, max_retries=0, timeout=300)


def test_it_serves_gemma_by_its_name(client):
    assert [m.id for m in client.models.list().data] == ["gemma3-270m"]


def test_streaming_equals_non_streaming(client):
    r = client.completions.create(model="gemma3-270m", prompt=PROMPT, max_tokens=24, temperature=0)
    text = r.choices[0].text
    assert r.usage.completion_tokens == 24 or r.choices[0].finish_reason == "stop"
    assert r.usage.model_extra["drafter"] == "ngram"
    pieces = [c.choices[0].text for c in client.completions.create(model="gemma3-270m", prompt=PROMPT,
                                                                   max_tokens=24, temperature=0, stream=True)
              if c.choices]
    assert "".join(pieces) == text
    assert any(w in text.lower() for w in ("red", "blue", "yellow", "green")), text  # the real model answers


def test_a_chat_call_to_a_model_without_a_template_is_a_clear_400(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="gemma3-270m", messages=[{"role": "user", "content": "Hi"}],
                                       max_tokens=4)
    assert "no chat template" in str(e.value) and "/v1/completions" in str(e.value)
    r = client.completions.create(model="gemma3-270m", prompt=PROMPT, max_tokens=2)  # and it still serves
    assert r.choices[0].text
