"""Paths in a recipe mean one thing: relative paths are read from the working directory, never
from the recipe file's directory (only ``base:`` is relative to the recipe, tests/config/
test_recipe_base.py), for every path field; an error about a missing relative path names the rule
and the directory."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from smelt_ds.config.loading import load_config
from smelt_ds.data.prepare import prepare_from_config
from smelt_ds.errors import ConfigError
from tests.data.data_test_utils import prose, write_jsonl
from tests.data.token_test_utils import word_tokenizer

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def layout(tmp_path, monkeypatch):
    """A recipe in ``recipes/`` and a working directory ``work/``; each holds a ``corpora/``."""
    recipes, work = tmp_path / "recipes", tmp_path / "work"
    for d in (recipes / "corpora", work / "corpora"):
        d.mkdir(parents=True)
    write_jsonl(work / "corpora" / "web.jsonl", prose(40, seed=1))
    word_tokenizer(work / "corpora" / "tok.json", 300)
    recipe = recipes / "mine.yaml"
    recipe.write_text(f"base: {ROOT / 'recipes' / 'tiny' / 'smelt.yaml'}\n")
    monkeypatch.chdir(work)
    return recipe, recipes, work


def test_relative_paths_are_read_from_the_working_directory(layout):
    recipe, _, work = layout
    cfg = load_config(recipe, ["data.sources=[{path: corpora/web.jsonl}]", "data.tokenizer.path=corpora/tok.json",
                               "model.vocab_size=300", f"data.cache_dir={work / 'cache'}"])
    prepared = prepare_from_config(cfg.data)  # the files of work/corpora, not recipes/corpora (empty)
    assert prepared.meta["sources"][0]["domain"] == "web" and prepared.vocab_size == 300


@pytest.mark.parametrize("field,value,expected", [
    ("data.sources", "[{path: corpora/next-to-the-recipe.jsonl}]", r"`data.sources\[0\].path`"),
    ("data.sources", "[{megatron: corpora/next-to-the-recipe}]", r"`data.sources\[0\].megatron`"),
    ("data.tokenizer.path", "corpora/next-to-the-recipe.json", r"`data.tokenizer.path`"),
])
def test_a_path_that_exists_only_next_to_the_recipe_is_refused_naming_the_rule(layout, field, value, expected):
    recipe, recipes, work = layout
    name = value.split("corpora/")[1].rstrip("}]")
    for suffix in ("", ".bin", ".idx"):
        (recipes / "corpora" / (name + suffix)).write_text("x")
    sets = [f"{field}={value}", f"data.cache_dir={work / 'cache'}"]
    if field != "data.tokenizer.path" and "megatron" in value:
        sets.append(f"data.tokenizer.path={work / 'corpora' / 'tok.json'}")
    rule = f"relative paths are read from the working directory {str(work)!r}, not from the recipe's directory"
    with pytest.raises(ConfigError, match=expected + ".*" + re.escape(rule)):
        prepare_from_config(load_config(recipe, sets).data)


@pytest.mark.parametrize("name", ["../../etc", "x/y", "", " ", ".hidden"])
def test_a_name_that_would_leave_the_run_directory_is_refused(name):
    """`name` fills {name} in train.run_dir: a name with '/', starting with '.', or empty would put
    the run somewhere else (runs/../../etc)."""
    with pytest.raises(ConfigError, match=r"`name` .*must be a name without '/'"):
        load_config(ROOT / "recipes" / "tiny" / "smelt.yaml", [f"name={name}"] if name.strip() else ["name=' '"])
