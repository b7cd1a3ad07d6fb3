"""DeepSpeed's own config classes validate ``deepspeed.config`` when the recipe is loaded (so
``smelt-ds train`` refuses before a process starts); a number written ``5e8`` (a string to YAML
1.1) is read as the number DeepSpeed's field takes, or refused naming the fix; the shipped
templates and recipes build configs DeepSpeed accepts. The reference for each refusal is
DeepSpeed's own model, called here directly. ``smelt-ds preflight`` / ``render-job``:
``tests/launch/test_preflight_deepspeed.py``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from smelt_ds.cli import main as cli_main
from smelt_ds.config.loading import load_config
from smelt_ds.errors import ConfigError
from smelt_ds.launch.jobs import JobOptions, plan_job
from smelt_ds.parallel.ds_config import build_ds_config

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "recipes" / "tiny" / "smelt.yaml")
ZERO = "deepspeed.config.zero_optimization"
ONE_RANK = ["--nodes", "1", "--gpus-per-node", "1"]


def zero_model_message(**keys) -> str:
    """DeepSpeed's own message for ``keys`` in its ZeRO section (the model ``deepspeed.initialize`` runs)."""
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    from pydantic import ValidationError

    with pytest.raises(ValidationError) as info:
        DeepSpeedZeroConfig(**keys)
    return info.value.errors()[0]["msg"]


def validate_deepspeed_config(*args, **kwargs):
    """:func:`smelt_ds.config.deepspeed_validation.validate_deepspeed_config`, imported per test so
    that the other tests of this file run on a checkout without it."""
    from smelt_ds.config.deepspeed_validation import validate_deepspeed_config as validate

    return validate(*args, **kwargs)


def set_args(*items: str) -> list[str]:
    return [x for item in items for x in ("--set", item)]


# ---------------------------------------------------------------------------------------------
# at load: an unknown key, a number written 5e8
# ---------------------------------------------------------------------------------------------

def test_a_typo_of_a_zero_key_is_refused_at_load_with_deepspeeds_message_and_the_closest_key():
    deepspeeds = zero_model_message(overlap_com=True)  # "Extra inputs are not permitted"
    with pytest.raises(ConfigError) as info:
        load_config(TINY, [f"{ZERO}.overlap_com=true"])
    msg = str(info.value)
    assert msg.startswith(f"--set {ZERO}.overlap_com=true: `{ZERO}.overlap_com` (True)"), msg
    assert deepspeeds in msg and "DeepSpeedZeroConfig" in msg, msg
    assert f"did you mean `{ZERO}.overlap_comm`?" in msg, msg


def test_a_typo_inside_a_nested_model_names_the_nested_key():
    """``offload_optimizer`` is DeepSpeed's own nested model: its keys are suggested, not the ZeRO section's."""
    with pytest.raises(ConfigError) as info:
        load_config(TINY, ["deepspeed.zero_stage=2", "deepspeed.offload_optimizer=cpu",
                           f"{ZERO}.offload_optimizer.pin_memroy=true"])
    msg = str(info.value)
    assert f"`{ZERO}.offload_optimizer.pin_memroy` (True)" in msg
    assert f"did you mean `{ZERO}.offload_optimizer.pin_memory`?" in msg, msg


@pytest.mark.parametrize("key", ["allgather_bucket_size", "reduce_bucket_size"])
def test_a_number_written_5e8_is_read_as_the_integer_deepspeed_takes(key):
    """YAML 1.1 reads 5e8 as the string '5e8', which DeepSpeed's integer field refuses; the
    recipe holds 500000000, which DeepSpeed parses to the same value as the integer written out."""
    assert "unable to parse string as an integer" in zero_model_message(**{key: "5e8"})
    cfg = load_config(TINY, ["deepspeed.zero_stage=2", f"{ZERO}.{key}=5e8"])
    value = cfg.deepspeed.config["zero_optimization"][key]
    assert value == 500_000_000 and type(value) is int
    ds = build_ds_config(cfg, 1)
    assert ds["zero_optimization"][key] == 500_000_000
    from deepspeed.runtime.config import DeepSpeedConfig
    assert getattr(DeepSpeedConfig(ds).zero_config, key) == 500_000_000


@pytest.mark.parametrize("written,fix", [("25e-2", "write a whole number"),  # YAML 1.1: the string '25e-2'
                                         ("5e8x", "write 500000000 or 5.0e+8")])
def test_a_number_deepspeeds_field_cannot_take_is_refused_naming_the_fix(written, fix):
    with pytest.raises(ConfigError) as info:
        load_config(TINY, [f"{ZERO}.reduce_bucket_size={written}"])  # not a whole number of elements
    msg = str(info.value)
    assert f"`{ZERO}.reduce_bucket_size` ({written!r})" in msg, msg
    assert zero_model_message(reduce_bucket_size=written) in msg  # "unable to parse string as an integer"
    assert fix in msg, msg


def test_a_string_field_keeps_the_text_that_looks_like_a_number():
    """DeepSpeed's tensorboard ``job_name`` is a string: '1e5' stays the text written."""
    out = validate_deepspeed_config({"tensorboard": {"enabled": True, "job_name": "1e5"}, "steps_per_print": "1e6"})
    assert out == {"tensorboard": {"enabled": True, "job_name": "1e5"}, "steps_per_print": 1_000_000}


def test_a_valid_passthrough_still_loads_unchanged():
    sets = ["deepspeed.zero_stage=2", f"{ZERO}.overlap_comm=true", f"{ZERO}.reduce_bucket_size=5.0e+8",
            "deepspeed.config.steps_per_print=10"]
    cfg = load_config(TINY, sets)
    assert cfg.deepspeed.config == {"zero_optimization": {"overlap_comm": True, "reduce_bucket_size": 5.0e8},
                                    "steps_per_print": 10}


def test_train_refuses_before_any_process_starts(tmp_path, capsys, monkeypatch):
    started = []
    monkeypatch.setattr("smelt_ds.train.cli.run_launcher", lambda cmd, **kw: started.append(cmd) or 0)
    monkeypatch.setattr("smelt_ds.train.cli.run_and_report", lambda args, name: started.append(name) or 0)
    rc = cli_main(["train", TINY, "--nproc", "2", "--run-dir", str(tmp_path / "run"),
                   *set_args(f"{ZERO}.overlap_com=true")])
    err = capsys.readouterr().err
    assert rc == 2 and f"`{ZERO}.overlap_com` (True)" in err and "overlap_comm" in err, err
    assert started == [] and not (tmp_path / "run").exists()


# ---------------------------------------------------------------------------------------------
# what ships validates
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("template", sorted(p.stem for p in (ROOT / "ds_configs").glob("*.json")))
def test_every_shipped_template_is_accepted_by_deepspeed(template):
    config = json.loads((ROOT / "ds_configs" / f"{template}.json").read_text())
    base = {**config, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 3, "train_batch_size": 48}
    assert validate_deepspeed_config({}, base, world_size=8) == {}


RECIPES = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "recipes").glob("*/*.yaml") if p.parent.name != "sweeps")


@pytest.mark.parametrize("recipe", RECIPES)
def test_every_shipped_recipe_builds_a_config_deepspeed_accepts_at_its_layout(recipe):
    plan = plan_job(ROOT / recipe, JobOptions(scheduler="slurm"))
    world = plan.nodes * plan.gpus_per_node
    validate_deepspeed_config({}, build_ds_config(plan.config, world), world_size=world)
