"""A chat call the model's template cannot render is the client's error, said in the template's own words."""
from __future__ import annotations

import copy

import pytest

from server.tokenization import ChatTemplateError, encode_chat

HI = [{"role": "user", "content": "Hi"}]


def test_a_template_that_refuses_the_messages(tokenizer):
    tok = copy.copy(tokenizer)
    tok.chat_template = "{% if messages[0]['role'] != 'system' %}{{ raise_exception('a system turn comes first') }}" \
                        "{% endif %}{{ messages[0]['content'] }}"
    with pytest.raises(ChatTemplateError, match="refused these messages: a system turn comes first"):
        encode_chat(tok, HI)
    assert encode_chat(tok, [{"role": "system", "content": "Hi"}])


def test_a_model_without_a_template(tokenizer):
    tok = copy.copy(tokenizer)
    tok.chat_template = None
    with pytest.raises(ChatTemplateError, match="no chat template .*/v1/completions"):
        encode_chat(tok, HI)
    assert encode_chat(tokenizer, HI)
