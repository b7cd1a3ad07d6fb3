"""DeepSpeed's own config classes validate ``deepspeed.config`` when the recipe is loaded (so
``smelt-ds train`` refuses before a process starts); a number written ``5e8`` (a string to YAML
1.1) is read as the number DeepSpeed's field takes, or refused naming the fix; the shipped
templates and recipes build configs DeepSpeed accepts. The reference for each refusal is
DeepSpeed's own model, called here directly. ``smelt-ds preflight`` / ``render-job``:
``tests/launch/test_preflight_deepspeed.py``."""

from __future__ import annotations

import contextlib
import io
import json
import logging
from collections.abc import Iterator
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


@contextlib.contextmanager
def deepspeed_console() -> Iterator[io.StringIO]:
    """What DeepSpeed's logger writes to its console handlers inside the block (a handler of our
    own beside them: pytest's capture cannot see DeepSpeed's, which holds the stdout of import)."""
    ds_log, text = logging.getLogger("DeepSpeed"), io.StringIO()
    handler = logging.StreamHandler(text)
    ds_log.addHandler(handler)
    try:
        yield text
    finally:
        ds_log.removeHandler(handler)


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


def test_text_that_is_no_number_is_told_the_field_takes_a_whole_number_without_the_5e8_hint():
    with pytest.raises(ConfigError) as info:
        load_config(TINY, [f"{ZERO}.reduce_bucket_size=abc"])
    msg = str(info.value)
    assert f"`{ZERO}.reduce_bucket_size` ('abc')" in msg, msg
    assert zero_model_message(reduce_bucket_size="abc") in msg  # "unable to parse string as an integer"
    assert "write a whole number (this field of DeepSpeed's is an integer)" in msg, msg
    assert "5e8" not in msg and "5.0e+8" not in msg, msg


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
# at load: a section that is not a mapping, a misspelt top-level key
# ---------------------------------------------------------------------------------------------

def test_zero_optimization_true_is_refused_at_load_naming_the_mapping_and_the_zero_stage_field():
    """DeepSpeed itself reads ``zero_optimization: true`` as its deprecated ZeRO format (ZeRO-1,
    with a ~40-line notice on stdout); smelt-ds sets the stage from ``deepspeed.zero_stage``."""
    from deepspeed.runtime.config import DeepSpeedConfig
    with deepspeed_console() as reference:
        old_format = DeepSpeedConfig({"train_micro_batch_size_per_gpu": 1, "zero_optimization": True})
    assert old_format.zero_optimization_stage == 1 and "deprecated" in reference.getvalue()
    with deepspeed_console() as console, pytest.raises(ConfigError) as info:
        load_config(TINY, [f"{ZERO}=true"])
    msg = str(info.value)
    assert f"`{ZERO}` (True, a bool) must be a mapping of DeepSpeed's keys" in msg, msg
    assert "`stage` with `deepspeed.zero_stage`" in msg, msg
    assert console.getvalue() == ""  # DeepSpeed's notice is not printed


@pytest.mark.parametrize("key,text,value", [("flops_profiler", "1", 1), ("activation_checkpointing", "true", True),
                                            ("tensorboard", "true", True), ("aio", "on", True)])  # YAML 1.1: on
def test_every_deepspeed_section_given_a_value_that_is_not_a_mapping_is_refused(key, text, value):
    """DeepSpeed's own parser refuses each with a message that names no key (``'bool' object has no
    attribute 'get'``, ``argument after ** must be a mapping``), or a model's; smelt-ds names the key,
    the value and that it must be a mapping."""
    from deepspeed.runtime.config import DeepSpeedConfig
    with pytest.raises((AttributeError, TypeError, ValueError)):  # the reference: DeepSpeed refuses it too
        DeepSpeedConfig({"train_micro_batch_size_per_gpu": 1, key: value})
    with pytest.raises(ConfigError) as info:
        load_config(TINY, [f"deepspeed.config.{key}={text}"])
    msg = str(info.value)
    assert f"`deepspeed.config.{key}` ({value!r}, a {type(value).__name__}) must be a mapping" in msg, msg


def test_a_deprecation_deepspeed_logs_is_one_line_not_its_console_output(caplog):
    """DeepSpeed accepts its old ZeRO key name and logs a deprecation to stdout; validation keeps
    the notice off the console and logs it as one line."""
    old = "stage3_gather_fp16_weights_on_model_save"
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    with deepspeed_console() as reference:
        DeepSpeedZeroConfig(**{old: True})
    assert f"{old} is deprecated" in reference.getvalue()  # DeepSpeed's own print
    with deepspeed_console() as console, caplog.at_level("WARNING", logger="smelt_ds.config.deepspeed_validation"):
        assert validate_deepspeed_config({"zero_optimization": {old: True}}) == {"zero_optimization": {old: True}}
    assert console.getvalue() == ""
    lines = [r.getMessage() for r in caplog.records if old in r.getMessage()]
    assert len(lines) <= 1 and all("deprecated" in line and "\n" not in line for line in lines), lines


def test_a_misspelt_top_level_key_is_refused_at_load_naming_the_key_deepspeed_reads():
    """DeepSpeed ignores ``zero_optimiztion`` (no model at its top level): its stage would be
    dropped. One edit away from ``zero_optimization``: difflib ratio 2*16/(16+17) = 32/33 >= 0.8."""
    import difflib

    from deepspeed.runtime.config import DeepSpeedConfig

    ignored = DeepSpeedConfig({"train_micro_batch_size_per_gpu": 1, "zero_optimiztion": {"stage": 2}})
    assert ignored.zero_optimization_stage == 0  # what DeepSpeed does with it
    with pytest.raises(ConfigError) as info:
        load_config(TINY, ["deepspeed.config.zero_optimiztion.overlap_comm=true"])
    msg = str(info.value)
    assert "`deepspeed.config.zero_optimiztion` ({'overlap_comm': True})" in msg, msg
    assert "did you mean `deepspeed.config.zero_optimization`?" in msg, msg
    from smelt_ds.config.deepspeed_validation import MISSPELT
    assert difflib.SequenceMatcher(None, "zero_optimiztion", "zero_optimization").ratio() == 32 / 33 >= MISSPELT


def test_a_key_deepspeed_reads_outside_its_parser_still_loads():
    """``data_parallel_size`` (read by ``deepspeed.initialize``, not its parser) is no misspelling
    of the closest key the parser reads: ``tensor_parallel``, ratio 2*10/(18+15) = 20/33 < 0.8."""
    import difflib

    from smelt_ds.config.deepspeed_validation import MISSPELT, unread_keys
    assert difflib.SequenceMatcher(None, "data_parallel_size", "tensor_parallel").ratio() == 20 / 33 < MISSPELT
    cfg = load_config(TINY, ["deepspeed.config.data_parallel_size=2"])
    assert cfg.deepspeed.config == {"data_parallel_size": 2}
    assert "data_parallel_size" in unread_keys({"train_micro_batch_size_per_gpu": 1, "data_parallel_size": 2})


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
