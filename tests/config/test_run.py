"""The recipe schema: validation messages, --set overrides, YAML load and dump."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from smelt_ds.config.run import RunConfig, apply_overrides, config_from_dict, dump_config, load_config
from smelt_ds.errors import ConfigError


def bad(raw: dict) -> str:
    with pytest.raises(ConfigError) as info:
        config_from_dict(raw)
    return str(info.value)


def ranges(*items):
    return {"position": "custom", "ranges": [{"start": a, "end": b, "repeats": r} for a, b, r in items]}


def test_defaults_validate():
    cfg = config_from_dict({})
    assert cfg == RunConfig()
    assert cfg.loop.position == "middle" and cfg.loop.repeats == 2 and cfg.loop.order == "block"


def test_config_error_is_not_a_value_error():
    assert not issubclass(ConfigError, ValueError)


def test_unknown_keys_top_level_listed():
    msg = bad({"modle": {}, "foo": 1, "model": {"hidden_size": 32}})
    assert "unknown key `modle` at the top level: did you mean `model`?" in msg
    assert "unknown keys in `<top level>`: ['foo']" in msg
    assert "'model'" in msg and "'moe'" in msg  # allowed keys are listed


def test_unknown_keys_nested_listed():
    msg = bad({"model": {"hidden": 3, "layers": 2}, "moe": {"experts": 4}})
    assert "unknown key `hidden` in `model`: did you mean `hidden_size`?" in msg
    assert "unknown key `layers` in `model`: did you mean `num_layers`?" in msg
    assert "unknown key `experts` in `moe`: did you mean `num_experts`?" in msg


def test_unknown_key_in_a_list_item_names_the_item_and_its_allowed_keys():
    loop = ranges((1, 3, 2))
    loop["ranges"][0]["times"] = 3
    msg = bad({"loop": loop})
    assert "unknown keys in `loop.ranges[0]`: ['times']" in msg
    assert "allowed keys: ['end', 'repeats', 'start']" in msg


def test_num_heads_must_divide_hidden_size():
    msg = bad({"model": {"hidden_size": 64, "num_heads": 6, "num_kv_heads": 2}})
    assert "`model.num_heads` (6)" in msg and "`model.hidden_size` (64)" in msg
    # an explicit head_dim lifts the constraint
    assert config_from_dict({"model": {"hidden_size": 64, "num_heads": 6, "num_kv_heads": 2,
                                       "head_dim": 16}}).model.resolved_head_dim == 16


def test_num_kv_heads_must_divide_num_heads():
    msg = bad({"model": {"num_heads": 4, "num_kv_heads": 3}})
    assert "`model.num_kv_heads` (3)" in msg and "`model.num_heads` (4)" in msg


def test_top_k_at_most_num_experts():
    msg = bad({"moe": {"num_experts": 4, "top_k": 5}})
    assert "`moe.top_k` (5)" in msg and "`moe.num_experts` (4)" in msg
    assert config_from_dict({"moe": {"num_experts": 4, "top_k": 4}}).moe.top_k == 4


@pytest.mark.parametrize("sizes,paths", [
    ({"hidden_size": 0}, ["`model.hidden_size` (0)"]),
    ({"vocab_size": -1}, ["`model.vocab_size` (-1)"]),
    ({"hidden_size": 0, "vocab_size": -1}, ["`model.hidden_size` (0)", "`model.vocab_size` (-1)"]),
    ({"num_layers": 0}, ["`model.num_layers` (0)"]),
    ({"num_heads": -4}, ["`model.num_heads` (-4)"]),
])
def test_non_positive_sizes(sizes, paths):
    msg = bad({"model": sizes})
    for p in paths:
        assert p in msg
    assert "greater than 0" in msg


def test_non_positive_moe_sizes():
    msg = bad({"moe": {"num_experts": 0, "expert_ffn_size": -8}})
    assert "`moe.num_experts` (0)" in msg and "`moe.expert_ffn_size` (-8)" in msg


@pytest.mark.parametrize("items,expect", [
    ([(2, 9, 2)], r"`loop.ranges\[0\]` \(\[2, 9\)\) is out of bounds .*`model.num_layers` \(8\)"),
    ([(-1, 2, 2)], r"`loop.ranges\[0\]` \(\[-1, 2\)\) is out of bounds"),
    ([(0, 4, 2), (3, 6, 2)], r"`loop.ranges\[1\]` \(\[3, 6\)\) overlaps `loop.ranges\[0\]` \(\[0, 4\)\)"),
    ([(3, 3, 2)], r"`loop.ranges\[0\]` \(\[3, 3\)\) is empty"),
    ([(5, 4, 2)], r"`loop.ranges\[0\]` \(\[5, 4\)\) is empty"),
    ([(0, 2, 2), (4, 6, 0)], r"`loop.ranges\[1\].repeats` \(0\) must be >= 1"),
    # the message names the range by its index in the recipe, not after sorting
    ([(6, 9, 2), (0, 2, 2)], r"`loop.ranges\[0\]` \(\[6, 9\)\) is out of bounds"),
    ([(4, 7, 2), (0, 5, 2)], r"`loop.ranges\[0\]` \(\[4, 7\)\) overlaps `loop.ranges\[1\]` \(\[0, 5\)\)"),
])
def test_bad_loop_ranges(items, expect):
    msg = bad({"model": {"num_layers": 8}, "loop": ranges(*items)})
    assert re.search(expect, msg), msg


def test_custom_without_ranges_and_ranges_with_a_preset():
    assert "`loop.ranges` ([])" in bad({"loop": {"position": "custom", "ranges": []}})
    assert "`loop.ranges` (None)" in bad({"loop": {"position": "custom"}})
    msg = bad({"loop": {"position": "middle", "ranges": [{"start": 0, "end": 1, "repeats": 2}]}})
    assert "`loop.ranges`" in msg and "'middle'" in msg


def test_preset_repeats_below_one():
    assert "`loop.repeats` (0)" in bad({"loop": {"repeats": 0}})


@pytest.mark.parametrize("layers,position", [(1, "middle"), (1, "bottom"), (1, "top"), (3, "asymmetric")])
def test_preset_with_empty_range_for_depth(layers, position):
    msg = bad({"model": {"num_layers": layers, "first_k_dense": 0}, "loop": {"position": position}})
    assert f"`loop.position` ('{position}')" in msg and f"`model.num_layers` ({layers})" in msg


def test_preset_uniform_and_none_fine_at_depth_one():
    for position in ("uniform", "none"):
        assert config_from_dict({"model": {"num_layers": 1}, "loop": {"position": position}})


def test_layer_order_rejects_input_injection():
    msg = bad({"loop": {"order": "layer", "input_injection": "add"}})
    assert "`loop.input_injection` ('add')" in msg and "'block'" in msg


def test_literal_fields_reject_unknown_values():
    msg = bad({"moe": {"score_func": "relu"}, "loop": {"position": "center"}})
    assert "`moe.score_func` ('relu')" in msg and "`loop.position` ('center')" in msg


# --------------------------------------------------------------------------------------------
# overrides, files
# --------------------------------------------------------------------------------------------


def write(tmp_path, raw: dict):
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


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
    with pytest.raises(ConfigError, match=r"^--set model.hiden_size=3: unknown key `hiden_size` in `model`: did you mean `hidden_size`\?$"):
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
                                       "loop": ranges((0, 2, 3), (5, 7, 2))}))
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
    from smelt_ds.config.run import read_yaml_mapping

    path = tmp_path / "sweep.yaml"
    path.write_text("name: a\nvariants: []\nname: b\n")
    with pytest.raises(ConfigError, match=r"sweep file '.*sweep.yaml': key `name` is given twice \(lines 1 and 3\)"):
        read_yaml_mapping(path, "sweep file")


def test_yaml_merge_keys_and_distinct_nested_keys_are_accepted(tmp_path):
    from smelt_ds.config.run import read_yaml_mapping

    path = tmp_path / "ok.yaml"
    path.write_text("base: &b {x: 1, y: 2}\nuse:\n  <<: *b\n  y: 3\nother:\n  x: 5\n")
    assert read_yaml_mapping(path) == {"base": {"x": 1, "y": 2}, "use": {"x": 1, "y": 3}, "other": {"x": 5}}


# --------------------------------------------------------------------------------------------
# the MoE section holds the architecture only; runtime knobs and loss coefficients live elsewhere
# --------------------------------------------------------------------------------------------


def test_runtime_knobs_and_loss_coefficients_have_their_own_sections():
    cfg = config_from_dict({"moe": {"num_experts": 4, "top_k": 2},
                            "moe_runtime": {"backend": "deepspeed", "ep_size": 2, "capacity_factor": 1.5},
                            "train": {"aux_loss_coef": 0.02, "z_loss_coef": 0.0}})
    assert (cfg.moe_runtime.backend, cfg.moe_runtime.ep_size, cfg.moe_runtime.capacity_factor) == ("deepspeed", 2, 1.5)
    assert (cfg.train.aux_loss_coef, cfg.train.z_loss_coef) == (0.02, 0.0)
    d = RunConfig()
    assert (d.train.aux_loss_coef, d.train.z_loss_coef) == (0.01, 0.001)
    assert (d.moe_runtime.backend, d.moe_runtime.ep_size, d.moe_runtime.min_capacity) == ("reference", 1, 4)
    assert "backend" not in type(d.moe).model_fields and "aux_loss_coef" not in type(d.moe).model_fields
    assert "`train.z_loss_coef` (-1.0)" in bad({"train": {"z_loss_coef": -1.0}})  # same validation as before


@pytest.mark.parametrize("moe,new", [
    ({"backend": "autoep"}, ["`moe.backend` moved to `moe_runtime.backend`: write "
                             "`moe_runtime: {backend: autoep}`"]),
    ({"aux_loss_coef": 0.01, "z_loss_coef": 0.0, "ep_size": 2},
     ["`moe.aux_loss_coef` moved to `train.aux_loss_coef`: write `train: {aux_loss_coef: 0.01}`",
      "`moe.z_loss_coef` moved to `train.z_loss_coef`: write `train: {z_loss_coef: 0.0}`",
      "`moe.ep_size` moved to `moe_runtime.ep_size`: write `moe_runtime: {ep_size: 2}`"]),
    ({"use_tutel": True, "drop_tokens": False, "capacity_factor": 1.25, "eval_capacity_factor": 2.0,
      "min_capacity": 0, "num_experts": 8},
     [f"`moe.{k}` moved to `moe_runtime.{k}`" for k in ("use_tutel", "drop_tokens", "capacity_factor",
                                                       "eval_capacity_factor", "min_capacity")]),
])
def test_old_moe_layout_is_refused_naming_each_moved_key(tmp_path, moe, new):
    path = write(tmp_path, {"moe": moe})
    with pytest.raises(ConfigError) as info:
        load_config(path)
    msg = str(info.value)
    assert msg.startswith(f"{path}: recipe uses the old `moe:` layout")
    for line in new:
        assert line in msg


def test_old_moe_key_given_with_set_is_refused_naming_the_override(tmp_path):
    path = write(tmp_path, {"moe": {"top_k": 2}})
    with pytest.raises(ConfigError) as info:
        load_config(path, ["moe.ep_size=2"])
    assert str(info.value) == ("--set 'moe.ep_size=2': `moe.ep_size` moved to `moe_runtime.ep_size`; write "
                               "--set moe_runtime.ep_size=2")  # the override, not the recipe file, is named
    assert load_config(path, ["moe_runtime.ep_size=2", "moe_runtime.backend=autoep"]).moe_runtime.ep_size == 2


@pytest.mark.parametrize("raw,match", [
    ({"moe_runtime": {"backend": "deepspeed"}, "deepspeed": {"zero_stage": 3}},
     r"`moe_runtime\.backend` \('deepspeed'\) does not support ZeRO stage 3.*use moe_runtime\.backend 'autoep'"),
    ({"moe_runtime": {"backend": "deepspeed"}, "deepspeed": {"config": {"zero_optimization": {"stage": 3}}}},
     r"`moe_runtime\.backend` \('deepspeed'\) does not support ZeRO stage 3"),  # the effective stage
    ({"moe": {"score_func": "sigmoid"}, "moe_runtime": {"backend": "deepspeed"}},
     r"`moe\.score_func` \('sigmoid'\) is not supported by moe_runtime\.backend 'deepspeed'"),
    ({"moe": {"aux_loss_free_bias": True}, "moe_runtime": {"backend": "autoep"}},
     r"`moe\.aux_loss_free_bias` \(True\) is not supported by moe_runtime\.backend 'autoep'"),
    ({"moe_runtime": {"backend": "autoep", "use_tutel": True}},
     r"`moe_runtime\.use_tutel` \(True\) only applies to moe_runtime\.backend 'deepspeed'"),
    ({"moe": {"num_experts": 6}, "moe_runtime": {"backend": "autoep", "ep_size": 4}},
     r"`moe\.num_experts` \(6\) must be divisible by `moe_runtime\.ep_size` \(4\)"),
    ({"moe_runtime": {"ep_size": 2}}, r"`moe_runtime\.ep_size` \(2\) needs an expert-parallel backend"),
])
def test_backend_rules_are_checked_when_the_recipe_is_loaded(raw, match):
    with pytest.raises(ConfigError, match=match):
        config_from_dict(raw)


def test_budget_refuses_a_recipe_that_can_never_train(tmp_path, capsys):
    from smelt_ds.cli import main

    raw = yaml.safe_load((Path(__file__).resolve().parents[2] / "recipes/tiny/smelt.yaml").read_text())
    raw["moe_runtime"] = {"backend": "deepspeed"}
    raw["deepspeed"] = {"zero_stage": 3}
    path = write(tmp_path, raw)
    assert main(["budget", str(path)]) == 2
    err = capsys.readouterr().err
    assert "`moe_runtime.backend` ('deepspeed') does not support ZeRO stage 3" in err and "autoep" in err


@pytest.mark.parametrize("backend", ["reference", "autoep"])
@pytest.mark.parametrize("field,value", [("capacity_factor", 1.25), ("eval_capacity_factor", 2.0), ("min_capacity", 0)])
def test_a_capacity_is_refused_where_the_backend_routes_every_token(backend, field, value):
    rt = {"backend": backend, field: value, **({"ep_size": 2} if backend == "autoep" else {})}
    assert (f"`moe_runtime.{field}` ({value!r}) only applies to moe_runtime.backend 'deepspeed'"
            in bad({"moe_runtime": rt}))
    assert getattr(config_from_dict({"moe_runtime": {"backend": "deepspeed", field: value}}).moe_runtime,
                   field) == value
