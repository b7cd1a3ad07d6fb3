"""``smelt-ds preflight`` and ``render-job`` on ``deepspeed.config`` mistakes: an unknown key is
refused naming the closest key DeepSpeed takes, ``5e8`` is read as 500000000 (the memory estimate
and the job are those of the integer), and the ``ds config`` check parses the whole DeepSpeed config
with DeepSpeed's own classes at the job's world size. Loading: ``tests/config/test_deepspeed_validation.py``."""

from __future__ import annotations

import pytest

from smelt_ds.cli import main as cli_main
from smelt_ds.errors import ConfigError
from smelt_ds.launch.jobs import JobOptions, plan_job
from smelt_ds.launch.preflight import run_checks
from smelt_ds.parallel.ds_config import build_ds_config
from tests.config.test_deepspeed_validation import (
    ONE_RANK,
    TINY,
    ZERO,
    deepspeed_console,
    set_args,
    validate_deepspeed_config,
    zero_model_message,
)


@pytest.mark.parametrize("command", [["preflight"], ["render-job", "--scheduler", "slurm", "--dry-run"]])
def test_preflight_and_render_job_refuse_the_typo(command, capsys):
    rc = cli_main([command[0], TINY, *command[1:], *ONE_RANK, *set_args(f"{ZERO}.overlap_com=true")])
    out = capsys.readouterr()
    text = out.out + out.err
    assert rc == 2, text
    assert f"`{ZERO}.overlap_com` (True)" in text and f"did you mean `{ZERO}.overlap_comm`?" in text, text
    assert zero_model_message(overlap_com=True) in text


@pytest.mark.parametrize("key", ["allgather_bucket_size", "reduce_bucket_size"])
def test_preflight_and_render_job_read_5e8_as_500000000(key, tmp_path, capsys):
    """The memory estimate (which reads the ZeRO-2 buckets) and the rendered job are those of the
    integer written out; the estimate changes with the bucket, so it did read this one."""
    def total(value: str) -> int:
        plan = plan_job(TINY, JobOptions(scheduler="slurm", nodes=1, gpus_per_node=1,
                                         overrides=["deepspeed.zero_stage=2", f"{ZERO}.{key}={value}"]))
        assert plan.memory.configured is not None
        return plan.memory.configured.total
    assert total("5e8") == total("500000000")
    if key == "reduce_bucket_size":
        assert total("5e8") != total("1000")
    sets = set_args("deepspeed.zero_stage=2", f"{ZERO}.{key}=5e8")
    assert cli_main(["preflight", TINY, *ONE_RANK, *sets]) == 0, capsys.readouterr()
    assert "ds config     OK" in capsys.readouterr().out
    job = tmp_path / "job.sbatch"
    assert cli_main(["render-job", TINY, "--scheduler", "slurm", *ONE_RANK, "--log-dir", str(tmp_path / "logs"),
                     "-o", str(job), *sets]) == 0, capsys.readouterr()
    assert f"{ZERO}.{key}=5e8" in job.read_text()  # every rank loads the recipe as this one did


def test_the_ds_config_check_parses_the_whole_config_at_the_jobs_world_size():
    """On 4 ranks ``train_batch_size`` is micro-batch x accumulation x 4, which DeepSpeed's own
    assert accepts only at that world size; a config object that skipped the load-time check is
    refused by the named check, with DeepSpeed's message."""
    plan = plan_job(TINY, JobOptions(scheduler="slurm", nodes=1, gpus_per_node=4))
    rows = {r.name: r for r in run_checks(plan, data=False)}
    assert rows["ds config"].status == "ok" and "on 4 ranks" in rows["ds config"].detail
    ds = build_ds_config(plan.config, 4)
    assert ds["train_batch_size"] == 4 * ds["train_micro_batch_size_per_gpu"] * ds["gradient_accumulation_steps"]
    with pytest.raises(ConfigError, match="Check batch related parameters"):  # DeepSpeed's own world of 1
        validate_deepspeed_config({}, ds, world_size=1)
    cfg = plan.config
    bad = cfg.model_copy(update={"deepspeed": cfg.deepspeed.model_copy(
        update={"config": {"zero_optimization": {"overlap_com": True}}})})
    plan.config = bad
    rows = {r.name: r for r in run_checks(plan, data=False)}
    assert rows["ds config"].status == "fail", rows["ds config"]
    assert f"`{ZERO}.overlap_com` (True)" in rows["ds config"].detail
    assert zero_model_message(overlap_com=True) in rows["ds config"].detail


def test_a_top_level_key_deepspeed_never_reads_is_a_warning_naming_the_closest_key(capsys):
    """DeepSpeed's parser ignores a top-level key it does not know (its top level is no model), and
    ``deepspeed.initialize`` reads ``data_parallel_size`` itself: no misspelling of a key the parser
    reads (``tensor_parallel``, ratio 20/33 < MISSPELT), so the ds config check warns and passes."""
    from deepspeed.runtime.config import DeepSpeedConfig
    ignored = DeepSpeedConfig({"train_micro_batch_size_per_gpu": 1, "data_parallel_size": 2})
    assert not hasattr(ignored, "data_parallel_size")  # its parser does not keep it
    rc = cli_main(["preflight", TINY, "--nodes", "1", "--gpus-per-node", "2",
                   *set_args("deepspeed.config.data_parallel_size=2")])
    out = capsys.readouterr().out
    assert rc == 0, out
    row = next(line for line in out.splitlines() if line.startswith("  ds config"))
    assert "WARN" in row and "`deepspeed.config.data_parallel_size`: did you mean " \
        "`deepspeed.config.tensor_parallel`?" in row, row


REFUSED = {  # --set -> what the refusal names
    # one edit from zero_optimization (ratio 32/33): DeepSpeed would drop its settings
    "deepspeed.config.zero_optimiztion.stage=1": ["`deepspeed.config.zero_optimiztion` ({'stage': 1})",
                                                  "did you mean `deepspeed.config.zero_optimization`?"],
    # before: DeepSpeed's ~40-line deprecation notice (twice), then an AttributeError in the ZeRO-3 tuning
    "deepspeed.config.zero_optimization=true": ["`deepspeed.config.zero_optimization` (True, a bool) must be a mapping",
                                                "`stage` with `deepspeed.zero_stage`"],
}


@pytest.mark.parametrize("command", [["preflight"], ["render-job", "--scheduler", "slurm", "--dry-run"]])
@pytest.mark.parametrize("setting", sorted(REFUSED))
def test_a_misspelt_top_level_key_or_a_section_that_is_no_mapping_fails_preflight_and_render_job(
        command, setting, capsys):
    """Refused by the config check, naming the key and the fix, and DeepSpeed prints nothing."""
    with deepspeed_console() as console:
        rc = cli_main([command[0], TINY, "--nodes", "4", "--gpus-per-node", "1", *command[1:], *set_args(setting)])
    out = capsys.readouterr()
    text = out.out + out.err
    assert rc == 2, text
    assert all(part in text for part in REFUSED[setting]), text
    assert console.getvalue() == "" and "Traceback" not in text, (console.getvalue(), text)


def test_the_ds_config_check_fails_a_misspelt_key_of_a_config_that_skipped_the_load_check():
    plan = plan_job(TINY, JobOptions(scheduler="slurm", nodes=1, gpus_per_node=2))
    cfg = plan.config
    plan.config = cfg.model_copy(update={"deepspeed": cfg.deepspeed.model_copy(
        update={"config": {"steps_per_prnt": 10}})})
    rows = {r.name: r for r in run_checks(plan, data=False)}
    assert rows["ds config"].status == "fail", rows["ds config"]
    assert "did you mean `deepspeed.config.steps_per_print`?" in rows["ds config"].detail
