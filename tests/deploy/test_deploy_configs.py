"""deploy/configs: every file loads, serves a registered drafter with options it accepts, and every key is documented."""
from __future__ import annotations

import dataclasses
import importlib
import inspect
import re

import pytest

from drafters import base as drafters_base
from drafters import drafter_names
from server.config import CacheConfig, ModelConfig, ServerConfig, load_config
from tests.deploy.deployfiles import DEPLOY, ROOT

CONFIGS = sorted((DEPLOY / "configs").glob("*.yaml"))


def drafter_params(name: str) -> set[str]:
    module, cls_name = drafters_base._REGISTRY[name].split(":")
    cls = getattr(importlib.import_module(module), cls_name)
    return set(inspect.signature(cls.__init__).parameters) - {"self", "target"}


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_config_loads_with_a_registered_drafter(path):
    cfg = load_config(path)
    assert cfg.drafter.name in drafter_names(), f"{path.name}: drafter {cfg.drafter.name!r} is not registered"
    for name, opts in cfg.drafter.options.items():
        assert name in drafter_names(), f"{path.name}: options for unknown drafter {name!r}"
        assert set(opts) <= drafter_params(name), f"{path.name}: {name} does not take {set(opts) - drafter_params(name)}"


def test_one_config_per_registered_drafter():
    served = {load_config(p).drafter.name for p in CONFIGS}
    assert set(drafter_names()) <= served


def test_readme_documents_every_key_and_file():
    text = (DEPLOY / "configs" / "README.md").read_text()
    for section, cls in (("model", ModelConfig), ("cache", CacheConfig), ("server", ServerConfig)):
        for f in dataclasses.fields(cls):
            assert f"`{section}.{f.name}`" in text, f"{section}.{f.name} is not documented"
    assert "`drafter.name`" in text
    for name in drafter_names():
        for opt in drafter_params(name):
            assert f"`drafter.{name}.{opt}`" in text, f"drafter.{name}.{opt} is not documented"
    for path in CONFIGS:
        assert f"`{path.name}`" in text, f"{path.name} is not listed"


def test_makefile_default_config_exists():
    m = re.search(r"^CONFIG \?= (\S+)", (ROOT / "Makefile").read_text(), re.M)
    assert m and (ROOT / m.group(1)).is_file()
