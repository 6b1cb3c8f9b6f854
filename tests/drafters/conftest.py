"""The default model's prompts for the drafters' lossless tests (test_adaptive, test_glide, test_falcon)."""
from __future__ import annotations

import pytest

from tests.conftest import encode_prompts
from tests.lossless import DRAFTER_PROMPTS


@pytest.fixture(scope="module")
def prompt_ids(tokenizer):
    """DRAFTER_PROMPTS encoded for the default model: a chat answer with code, a prose answer, a code completion."""
    return encode_prompts(tokenizer, DRAFTER_PROMPTS)
