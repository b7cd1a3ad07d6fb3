"""The `data` recipe section: defaults, documented fields, checks that name the field path."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import BaseModel

from smelt_ds.config.data import DataConfig, SourceConfig, TokenizerConfig
from smelt_ds.config.loading import config_from_dict, load_config
from smelt_ds.errors import ConfigError

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_defaults_are_the_builtin_corpus_with_a_4096_vocabulary():
    cfg = config_from_dict({}).data
    assert [(s.builtin, s.resolved_domain()) for s in cfg.sources] == [("code", "code"), ("text", "text")]
    assert cfg.tokenizer.vocab_size == 4096 and cfg.tokenizer.path is None
    assert (cfg.validation_share, cfg.non_utf8, cfg.bad_jsonl_lines) == (0.05, "replace", "error")


@pytest.mark.parametrize("model", [DataConfig, SourceConfig, TokenizerConfig])
def test_every_field_is_documented(model):
    for name, field in model.model_fields.items():
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            continue  # a nested section documents its own fields
        assert field.description, f"{model.__name__}.{name} has no description"


def test_shipped_recipes_carry_a_valid_data_section():
    recipes = [p for p in sorted((REPO_ROOT / "recipes").rglob("*.yaml")) if "sweeps" not in p.parts]
    assert len(recipes) >= 30  # 6 tiny + 4 sizes x 6 (sweep definitions are not recipes)
    for recipe in recipes:
        cfg = load_config(recipe)
        assert cfg.data.tokenizer.vocab_size == cfg.model.vocab_size or cfg.data.tokenizer.path


def test_yaml_keys_set_sources_and_tokenizer():
    sources = [{"path": "corpus/", "domain": "web", "weight": 2},
               {"dataset": "user/name", "dataset_config": "en", "text_field": "body"}]
    cfg = config_from_dict({"data": {"sources": sources, "tokenizer": {"vocab_size": 8000}, "num_proc": 4}}).data
    assert cfg.sources[0].weight == 2.0 and cfg.sources[1].resolved_domain() == "name"
    assert cfg.tokenizer.vocab_size == 8000 and cfg.num_proc == 4


@pytest.mark.parametrize("source, match", [
    ({"path": "a.txt", "dataset": "x/y"}, r"`data.sources\[1\]` \(.*'path': 'a.txt', 'dataset': 'x/y'.*\) must set "
                                          r"exactly one of path, dataset, builtin"),
    ({"domain": "x"}, r"`data.sources\[1\]` \(nothing\) must set exactly one"),
    ({"path": "a.txt", "domain": "web/x"}, r"`data.sources\[1\].domain` \('web/x'\) must match"),
])
def test_bad_sources_name_the_field_path(source, match):
    with pytest.raises(ConfigError, match=match):
        config_from_dict({"data": {"sources": [{"builtin": "code"}, source]}})


def test_unknown_key_lists_allowed_keys():
    with pytest.raises(ConfigError, match=r"unknown keys in `data`: \['vocab'\]; allowed keys: \[.*'validation_share'"):
        config_from_dict({"data": {"vocab": 5}})


def test_value_errors_name_the_field():
    with pytest.raises(ConfigError, match=r"`data.validation_share` \(1.5\)"):
        config_from_dict({"data": {"validation_share": 1.5}})
    with pytest.raises(ConfigError, match=r"`data.tokenizer.pad_token` \('<\|endoftext\|>'\) equals"):
        config_from_dict({"data": {"tokenizer": {"pad_token": "<|endoftext|>"}}})
    with pytest.raises(ConfigError, match=r"`data.sources` \(\[\]\) is empty"):
        config_from_dict({"data": {"sources": []}})


@pytest.mark.parametrize("model", [DataConfig, SourceConfig, TokenizerConfig])
def test_every_field_is_in_the_data_readme(model):
    readme = (REPO_ROOT / "docs" / "data.md").read_text()
    missing = [name for name in model.model_fields if f"| `{name}` |" not in readme]
    assert missing == [], f"docs/data.md does not document {missing}"
