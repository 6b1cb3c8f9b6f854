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
    assert over.drafter.name == "none" and over.model.dtype == "float32" and cfg.model.dtype == "auto"
    for bad in ({"model": {"dtype": "int8"}}, {"model": {"quantization": "int3"}}, {"model": {"colour": 1}},
                {"cache": {"num_slots": 0}}, {"extra": {}}, {"drafter": {"name": "ngram", "num_tokens": 3}}):
        with pytest.raises(ConfigError):
            config_from_dict(bad)
    with pytest.raises(ConfigError, match="not found"):
        load_config("/nonexistent.yaml")


def write(tmp_path, text: str) -> Path:
    p = tmp_path / "deploy.yaml"
    p.write_text(text)
    return p


def test_misspelled_drafter_section_names_key_file_and_valid_keys(tmp_path):
    path = write(tmp_path, "drafter:\n  name: ngram\n  ngarm: {num_tokens: 3}\n")
    with pytest.raises(ConfigError) as e:
        load_config(path)
    msg = str(e.value)
    assert str(path) in msg and "drafter.ngarm" in msg and "ngram" in msg and "cascade" in msg


def test_unknown_or_mistyped_drafter_option(tmp_path):
    path = write(tmp_path, "drafter:\n  name: ngram\n  ngram: {num_token: 3}\n")
    with pytest.raises(ConfigError, match=r"drafter\.ngram.*'num_token'.*valid options: num_tokens, max_ngram"):
        load_config(path)
    path = write(tmp_path, "drafter:\n  name: glide\n  glide: {gamma: two}\n")
    with pytest.raises(ConfigError, match=r"deploy\.yaml: drafter\.glide: .*'gamma' must be int, got 'two'"):
        load_config(path)
    with pytest.raises(ConfigError, match=r"'cape' must be bool"):
        config_from_dict({"drafter": {"name": "glide", "glide": {"cape": 1}}})


@pytest.mark.parametrize("section,key,value", [("cache", "num_slots", "4"), ("cache", "max_seq_len", 1.5),
                                               ("server", "port", True), ("model", "dtype", 16),
                                               ("model", "cache_dir", 3)])
def test_bad_value_types_are_config_errors(tmp_path, section, key, value):
    path = write(tmp_path, f"{section}:\n  {key}: {value!r}\n".replace("True", "true"))
    with pytest.raises(ConfigError, match=rf"{path}: {section}\.{key} must be"):
        load_config(path)


def test_unknown_drafter_name_lists_the_valid_ones():
    with pytest.raises(ConfigError, match="valid drafters: .*glide-cape"):
        config_from_dict({"drafter": {"name": "glide_cape"}})
