"""Recipe errors point at the right place: the line of a typo in the file with the closest allowed
key, and the `--set` argument (not the recipe file) for a bad override."""

from __future__ import annotations

import pytest

from smelt_ds.config.loading import config_from_dict, load_config, read_yaml_with_lines
from smelt_ds.errors import ConfigError

RECIPE = """\
name: t
model:
  hidden_size: 32
  num_layers: 4
  hiden_size: 64
train:
  max_steps: 100
  warmup_steps: 50
loop:
  position: custom
  ranges:
    - {start: 1, end: 3, repeats: 2}
"""


@pytest.fixture()
def recipe(tmp_path):
    path = tmp_path / "x.yaml"
    path.write_text(RECIPE)
    return path


def error(path, overrides=None) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(path, overrides)
    return str(info.value)


def test_yaml_reader_knows_the_line_of_every_key(recipe):
    raw, lines = read_yaml_with_lines(recipe)
    assert raw == {"name": "t", "model": {"hidden_size": 32, "num_layers": 4, "hiden_size": 64},
                   "train": {"max_steps": 100, "warmup_steps": 50},
                   "loop": {"position": "custom", "ranges": [{"start": 1, "end": 3, "repeats": 2}]}}
    assert (lines["name"], lines["model"], lines["model.hiden_size"], lines["train.warmup_steps"]) == (1, 2, 5, 8)
    assert lines["loop.ranges[0].repeats"] == 12


def test_typo_in_the_file_names_its_line_and_the_closest_key(recipe):
    assert error(recipe) == (f"{recipe}: invalid configuration:\n  unknown key `hiden_size` in `model` "
                             f"(line 5 of {recipe}): did you mean `hidden_size`?")


def test_unknown_key_without_a_close_match_lists_the_allowed_keys(tmp_path):
    path = tmp_path / "y.yaml"
    path.write_text("loop:\n  position: custom\n  ranges:\n    - start: 1\n      end: 3\n      repeats: 2\n"
                    "      zzz: 1\n")
    assert error(path) == (f"{path}: invalid configuration:\n  unknown keys in `loop.ranges[0]`: ['zzz'] (line 7 of "
                           f"{path}); allowed keys: ['end', 'repeats', 'start']: remove or rename it")


def test_top_level_typo_and_a_bad_value_in_the_file_name_their_lines(tmp_path):
    path = tmp_path / "z.yaml"
    path.write_text("modle: {}\ntrain:\n  max_steps: abc\n")
    msg = error(path)
    assert f"unknown key `modle` at the top level (line 1 of {path}): did you mean `model`?" in msg
    assert f"`train.max_steps` ('abc') (line 3 of {path}): Input should be a valid integer" in msg


def test_bad_set_key_is_blamed_on_the_set_argument(tmp_path):
    path = tmp_path / "ok.yaml"
    path.write_text("name: t\n")
    assert error(path, ["model.hiden_size=64"]) == ("--set model.hiden_size=64: unknown key `hiden_size` in `model`: "
                                                    "did you mean `hidden_size`?")
    # a whole section set on the command line: the same --set is blamed, quoted as a shell takes it
    assert error(path, ["model={hiden_size: 64}"]) == ("--set 'model={hiden_size: 64}': unknown key `hiden_size` "
                                                       "in `model`: did you mean `hidden_size`?")


def test_bad_set_value_is_blamed_on_the_set_argument(tmp_path):
    path = tmp_path / "ok.yaml"
    path.write_text("name: t\ntrain:\n  max_steps: 100\n")
    msg = error(path, ["train.max_steps=abc"])
    assert msg.startswith("--set train.max_steps=abc: `train.max_steps` ('abc'): Input should be a valid integer")
    assert str(path) not in msg                                   # the file holds a good value
    with pytest.raises(ConfigError, match=r"^--set 'train.max_steps=\[a': the value '\[a' is not valid YAML"):
        load_config(path, ["train.max_steps=[a"])


def test_problems_from_file_and_set_are_each_blamed_on_their_origin(recipe):
    msg = error(recipe, ["train.max_steps=abc"])
    assert msg.splitlines() == [
        f"{recipe}: invalid configuration:",
        f"  unknown key `hiden_size` in `model` (line 5 of {recipe}): did you mean `hidden_size`?",
        "  --set train.max_steps=abc: `train.max_steps` ('abc'): Input should be a valid integer, unable to parse "
        "string as an integer"]


def test_cross_field_error_names_the_set_that_caused_it(tmp_path):
    path = tmp_path / "w.yaml"
    path.write_text("train:\n  max_steps: 100\n  warmup_steps: 50\n")
    assert error(path, ["train.max_steps=20"]) == (
        "--set train.max_steps=20: `train.warmup_steps` (50) must be <= `train.max_steps` (20): shorten the warmup "
        f"or train longer (`train.warmup_steps` at line 3 of {path})")
    # every --set of a field it names, in command-line order; not the unrelated one
    assert error(path, ["train.lr=0.01", "model.hidden_size=48", "model.num_heads=5"]).startswith(
        "--set model.hidden_size=48 --set model.num_heads=5: `model.num_heads` (5) must divide `model.hidden_size`")
    # without an override involved the recipe file is named, as before
    path.write_text("train:\n  max_steps: 20\n  warmup_steps: 50\n")
    assert error(path, ["train.lr=0.01"]) == (f"{path}: `train.warmup_steps` (50) must be <= `train.max_steps` (20): "
                                              "shorten the warmup or train longer")


def test_dict_configs_keep_the_source_and_suggest_keys():
    with pytest.raises(ConfigError) as info:
        config_from_dict({"moe": {"num_expert": 4}}, source="<dict>")
    assert str(info.value) == ("<dict>: invalid configuration:\n  unknown key `num_expert` in `moe`: did you mean "
                               "`num_experts`?")
