from pathlib import Path

import pytest

from server.config import ConfigError, config_from_dict, load_config

CONFIGS = sorted((Path(__file__).parent.parent / "deploy" / "configs").glob("*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_shipped_configs_load(path):
    from drafters.base import drafter_names

    cfg = load_config(path)
    assert cfg.drafter.name in drafter_names()


def test_overrides_and_errors():
    cfg = config_from_dict({"drafter": {"name": "ngram", "ngram": {"num_tokens": 4}}})
    assert cfg.drafter.options_for() == {"num_tokens": 4}
    over = cfg.with_overrides(drafter="none", dtype="float32")
    assert over.drafter.name == "none" and over.model.dtype == "float32" and cfg.model.dtype == "bfloat16"
    for bad in ({"model": {"dtype": "int8"}}, {"model": {"colour": 1}}, {"cache": {"num_slots": 0}},
                {"extra": {}}, {"drafter": {"name": "ngram", "num_tokens": 3}}):
        with pytest.raises(ConfigError):
            config_from_dict(bad)
    with pytest.raises(ConfigError, match="not found"):
        load_config("/nonexistent.yaml")
