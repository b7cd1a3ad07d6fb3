"""The moe and moe_runtime sections (smelt_ds/config/moe.py): the architecture only in moe, the old
layout refused naming each moved key, the backend rules checked when a recipe is loaded."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from smelt_ds.config.loading import config_from_dict, load_config
from smelt_ds.config.run import RunConfig
from smelt_ds.errors import ConfigError
from tests.config.recipe_helpers import bad, write

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
     r"`deepspeed\.config\.zero_optimization\.stage` \(3\) is set by the recipe field deepspeed\.zero_stage"),
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
