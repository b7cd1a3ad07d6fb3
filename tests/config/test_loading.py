"""Reading recipes (smelt_ds/config/loading.py): --set overrides, files, YAML load and dump, duplicate
keys."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from smelt_ds.config.loading import apply_overrides, dump_config, load_config, read_yaml_mapping
from smelt_ds.config.run import RunConfig
from smelt_ds.errors import ConfigError
from tests.config.recipe_helpers import custom_ranges, write

# --------------------------------------------------------------------------------------------
# overrides, files
# --------------------------------------------------------------------------------------------


def test_set_overrides_take_precedence_over_yaml(tmp_path):
    path = write(tmp_path, {"name": "r", "model": {"hidden_size": 64, "num_layers": 8}, "moe": {"top_k": 2}})
    cfg = load_config(path)
    assert (cfg.model.hidden_size, cfg.model.num_layers, cfg.moe.top_k) == (64, 8, 2)
    cfg = load_config(path, ["model.hidden_size=32", "moe.top_k=1", "model.tie_embeddings=true", "name=x y",
                             "loop.position=custom", "loop.ranges=[{start: 2, end: 4, repeats: 3}]",
                             "train.aux_loss_coef=1e-3", "model.head_dim=", "moe.score_func=sigmoid"])
    assert cfg.model.hidden_size == 32 and cfg.model.num_layers == 8  # untouched YAML value kept
    assert cfg.moe.top_k == 1 and cfg.model.tie_embeddings is True and cfg.name == "x y"
    assert cfg.train.aux_loss_coef == pytest.approx(1e-3) and cfg.model.head_dim is None
    assert cfg.moe.score_func == "sigmoid"
    assert [(r.start, r.end, r.repeats) for r in cfg.loop.ranges] == [(2, 4, 3)]
    # a later override wins over an earlier one; a new section is created
    cfg = load_config(path, ["moe.top_k=1", "moe.top_k=3", "eval.eval_batches=2"])
    assert cfg.moe.top_k == 3 and cfg.eval.eval_batches == 2


def test_set_values_are_yaml_typed():
    out = apply_overrides({"model": {"hidden_size": 64}}, ["model.hidden_size=128", "a.b=[1, 2]", "a.c=no",
                                                            "a.d='7'", "a.e=null"])
    assert out == {"model": {"hidden_size": 128}, "a": {"b": [1, 2], "c": False, "d": "7", "e": None}}


def test_set_does_not_mutate_its_input():
    raw = {"model": {"hidden_size": 64}}
    apply_overrides(raw, ["model.hidden_size=32"])
    assert raw == {"model": {"hidden_size": 64}}


def test_set_indexes_lists(tmp_path):
    raw = {"loop": {"position": "custom", "ranges": [{"start": 0, "end": 1, "repeats": 2},
                                                     {"start": 1, "end": 2, "repeats": 3}]}}
    out = apply_overrides(raw, ["loop.ranges.1.repeats=4", "loop.ranges.0={start: 0, end: 1, repeats: 3}",
                                "loop.ranges.2={start: 3, end: 4, repeats: 2}"])
    assert out["loop"]["ranges"] == [{"start": 0, "end": 1, "repeats": 3}, {"start": 1, "end": 2, "repeats": 4},
                                     {"start": 3, "end": 4, "repeats": 2}]
    assert raw["loop"]["ranges"][1]["repeats"] == 3            # input untouched
    # through load_config: the indexed value is validated like any other
    cfg = load_config(Path(__file__).resolve().parents[2] / "recipes/tiny/asymmetric.yaml", ["loop.ranges.1.repeats=2"])
    assert [r.repeats for r in cfg.loop.ranges] == [2, 2]


@pytest.mark.parametrize("item,expect", [
    ("loop.ranges.5.repeats=2", "index 5 is out of range for `loop.ranges` (1 items; use 0..0, or 1 to append)"),
    ("loop.ranges.1.repeats=2", "index 1 is out of range"),
    ("loop.ranges.first.repeats=2", "`loop.ranges` is a list; index it with a number from 0 "
                                    "(e.g. loop.ranges.0.repeats), got 'first'"),
    ("loop.ranges.-1.repeats=2", "(e.g. loop.ranges.0.repeats), got '-1'"),
    ("loop.ranges.0.repeats.x=2", "`loop.ranges.0.repeats` is a value (2)"),
])
def test_set_bad_list_index(item, expect):
    with pytest.raises(ConfigError, match=re.escape(expect)):
        apply_overrides({"loop": {"ranges": [{"start": 0, "end": 1, "repeats": 2}]}}, [item])


@pytest.mark.parametrize("item,expect", [
    ("model.hidden_size", "expected KEY.PATH=VALUE"),
    ("=3", "empty key path"),
    ("model..hidden_size=3", "empty key path"),
    ("name.x=1", "`name` is a value"),
])
def test_malformed_override(item, expect):
    with pytest.raises(ConfigError, match=re.escape(expect)) as info:
        apply_overrides({"name": "r"}, [item])
    assert repr(item) in str(info.value)


def test_override_of_unknown_field_is_rejected_with_its_path(tmp_path):
    with pytest.raises(ConfigError, match=r"^--set model.hiden_size=3: unknown key `hiden_size` in `model`: "
                                          r"did you mean `hidden_size`\?$"):
        load_config(write(tmp_path, {}), ["model.hiden_size=3"])
    with pytest.raises(ConfigError, match=r"`model.hidden_size` \('big'\)"):
        load_config(write(tmp_path, {}), ["model.hidden_size=big"])


def test_missing_recipe_file(tmp_path):
    missing = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError, match=re.escape(str(missing))):
        load_config(missing)


def test_bad_yaml_and_non_mapping(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("model: {hidden_size: 3\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(p)
    p.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(p)


def test_errors_from_a_file_name_the_file(tmp_path):
    path = write(tmp_path, {"moe": {"num_experts": 2, "top_k": 3}})
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(path) in str(info.value) and "`moe.top_k` (3)" in str(info.value)


def test_empty_file_gives_defaults(tmp_path):
    p = tmp_path / "empty.yaml"
    p.write_text("")
    assert load_config(p) == RunConfig()


def test_dump_reloads_to_an_equal_config(tmp_path):
    cfg = load_config(write(tmp_path, {"name": "smelt-s", "model": {"num_layers": 8, "tie_embeddings": True},
                                       "moe": {"score_func": "sigmoid", "shared_expert_ffn_size": 32},
                                       "loop": custom_ranges((0, 2, 3), (5, 7, 2))}))
    out = tmp_path / "resolved.yaml"
    text = dump_config(cfg, out)
    assert out.read_text() == text
    again = load_config(out)
    assert again == cfg
    assert again.loop.ranges[1].repeats == 2 and again.moe.score_func == "sigmoid"
    assert dump_config(again) == text


@pytest.mark.parametrize("item,path", [("model.hidden_size=true", "model.hidden_size"),
                                       ("train.grad_clip=yes", "train.grad_clip"),
                                       ("train.gradient_accumulation_steps=off", "train.gradient_accumulation_steps")])
def test_yaml_booleans_are_not_numbers(tmp_path, item, path):
    """pydantic's lax mode would read `true` as 1 (hidden_size 1, then a confusing num_heads error)."""
    with pytest.raises(ConfigError, match=rf"`{re.escape(path)}` \((True|False)\): .*needs a number, got a boolean"):
        load_config(write(tmp_path, {}), [item])
    assert load_config(write(tmp_path, {}), ["model.tie_embeddings=yes"]).model.tie_embeddings is True


# --------------------------------------------------------------------------------------------
# duplicate YAML keys (issue 13 G): the last one must not silently win
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("text,key,lines", [
    ("model:\n  num_layers: 4\ntrain:\n  lr: 0.001\nmodel:\n  hidden_size: 64\n", "model", (1, 5)),
    ("model:\n  num_layers: 4\n  hidden_size: 64\n  num_layers: 6\n", "model.num_layers", (2, 4)),
    ("data:\n  sources:\n    - path: a.txt\n      domain: x\n      domain: y\n", "data.sources[0].domain", (4, 5)),
])
def test_duplicate_yaml_keys_are_rejected_with_both_lines(tmp_path, text, key, lines):
    path = tmp_path / "dup.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    msg = str(info.value)
    assert str(path) in msg and f"`{key}`" in msg
    assert f"(lines {lines[0]} and {lines[1]})" in msg, msg


def test_duplicate_keys_on_one_line_are_rejected(tmp_path):
    path = tmp_path / "flow.yaml"
    path.write_text("train: {lr: 0.1, lr: 0.2}\n")
    with pytest.raises(ConfigError, match=r"key `train.lr` is given twice \(lines 1 and 1\)"):
        load_config(path)


def test_duplicate_keys_in_a_sweep_file_are_rejected(tmp_path):
    path = tmp_path / "sweep.yaml"
    path.write_text("name: a\nvariants: []\nname: b\n")
    with pytest.raises(ConfigError, match=r"sweep file '.*sweep.yaml': key `name` is given twice \(lines 1 and 3\)"):
        read_yaml_mapping(path, "sweep file")


def test_yaml_merge_keys_and_distinct_nested_keys_are_accepted(tmp_path):
    path = tmp_path / "ok.yaml"
    path.write_text("base: &b {x: 1, y: 2}\nuse:\n  <<: *b\n  y: 3\nother:\n  x: 5\n")
    assert read_yaml_mapping(path) == {"base": {"x": 1, "y": 2}, "use": {"x": 1, "y": 3}, "other": {"x": 5}}
