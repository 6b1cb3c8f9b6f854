"""The OpenAI response models (pydantic v2): the models list of ``GET /v1/models``.

Completions and chunks are built as plain dicts in routes.py (the e2e tests parse them with the openai client); only
/v1/models uses a response model, which also documents it in the OpenAPI schema.
"""
from __future__ import annotations

import time
from typing import Literal

from pydantic import BaseModel, Field


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "specserve"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
