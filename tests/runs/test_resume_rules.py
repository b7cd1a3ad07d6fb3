"""What a resume may change, checked before the engine is built (no training: a run directory's
``config.yaml`` and checkpoint markers are enough, as :func:`smelt_ds.train.guards.check_run_dir`
and :func:`smelt_ds.runs.reshard.plan_resume` read nothing else).

- A checkpoint whose reference shards pruning removed says so in its marker, and a resume at
  another layout onto it is refused naming the checkpoint, what it lacks and the fix.
- The peak LR and the step guard are run settings a resume may change (the exit-3 advice).
- ``moe_runtime`` keys that change which tokens reach their experts are refused; those that only
  place or speed up the same function are not.
- The micro-batch may change when the global batch is kept; another global batch is refused.

The trainings that show these resumes running (the LR a resumed run uses, the samples and
trajectory after a micro-batch change) are in tests/train/test_faults.py and tests/runs/test_reshard.py.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from smelt_ds.config.loading import config_from_dict, dump_config
from smelt_ds.errors import ConfigError
from smelt_ds.mappings import deep_merge
from smelt_ds.runs import checkpoint as ckpt
from smelt_ds.runs.cli import checkpoint_info
from smelt_ds.runs.reshard import plan_resume
from smelt_ds.train.guards import check_run_dir
from tests import two_ranks
from tests.runs.checkpoint_files import layout_files, writer


def _cfg(run: Path, **sections):
    """The shared tiny recipe (tests/two_ranks.py) with ``sections`` merged in."""
    return config_from_dict(deep_merge(two_ranks.recipe_raw(run, run.parent / "cache"), sections))


def _checkpoint(run: Path, step: int, cfg, world: int, reference: bool = True, **meta) -> Path:
    """A complete checkpoint of ``cfg`` on ``world`` ranks as :func:`smelt_ds.runs.checkpoint.save`
    marks one: DeepSpeed's files of the layout, a client state and (``reference``) a reference
    shard per rank (:mod:`tests.runs.checkpoint_files`), each listed with its digest and writer,
    and the marker's layout (:func:`smelt_ds.runs.checkpoint.run_layout`)."""
    d = ckpt.checkpoint_dir(run) / f"step{step:08d}"
    layout = ckpt.run_layout(cfg, world)
    files = {}
    for name in layout_files(world, layout["zero_stage"], layout["moe_backend"], layout["ep_size"], reference):
        r = writer(name)
        (d / name).parent.mkdir(parents=True, exist_ok=True)
        files[name] = {**ckpt.write_hashed({"step": step, "rank": r, "w": torch.ones(3)}, d / name), "rank": r}
    marker = {"step": step, "tokens_seen": step * 128, **layout, "reference_weights": reference,
              "layout_free": reference, "files": files, **meta}
    ckpt._write_marker(d, marker)
    return d


def _run(tmp_path: Path, world: int = 2, steps=(4,), **sections) -> tuple[Path, object]:
    """A run directory of the tiny recipe (with ``sections``) that saved ``steps`` on ``world`` ranks."""
    run = tmp_path / "run"
    cfg = _cfg(run, **sections)
    run.mkdir(parents=True)
    dump_config(cfg, run / "config.yaml")
    for s in steps:
        _checkpoint(run, s, cfg, world)
    return run, cfg


# ---------------------------------------------------------------------------------------------
# 1. a checkpoint whose reference shards pruning removed
# ---------------------------------------------------------------------------------------------


def test_pruning_rewrites_the_marker_to_say_the_layout_free_state_is_gone(tmp_path):
    """``train.reference_weights: newest`` prunes the shards of the older checkpoint once a newer
    one is complete (:func:`_prune`, as every save runs it): that checkpoint's marker stops
    claiming the layout-free state, ``checkpoint info`` says what it lacks and why, and the newest
    one still resumes at any layout."""
    run, _ = _run(tmp_path, steps=(2, 4))
    root = ckpt.checkpoint_dir(run)
    ckpt._prune(root, keep_last=2, drop_reference=True)
    old, new = ckpt.read_marker(root / "step00000002"), ckpt.read_marker(root / "step00000004")
    assert (old["layout_free"], old["reference_weights"], old["reference_removed_by"]) == (False, False, "step00000004")
    assert not any(n.startswith("reference/") for n in old["files"]) and not (root / "step00000002/reference").exists()
    assert ckpt.verify(root / "step00000002") == []  # every listed file is there: not damaged
    assert (new["layout_free"], new["reference_weights"]) == (True, True)
    assert ckpt.holds(old) == {"reference_weights": False, "layout_free": False, "removed_by": "step00000004"}
    text, status = checkpoint_info(root / "step00000002")
    assert status == 0 and "resumes at any layout" not in text, text
    assert ("layout-free   no: its reference shards were removed by pruning once step00000004 was complete "
            "(train.reference_weights newest or minimal); resumes at its own layout only") in text
    assert "reference     no (" in text
    text, _ = checkpoint_info(root / "step00000004")
    assert "layout-free   yes: resumes at any layout below" in text and "reference     yes (" in text


def test_a_layout_change_onto_a_pruned_checkpoint_is_refused_by_the_resume_check(tmp_path):
    """The run rewound to its pruned step 2 (the newer checkpoint moved away, as the refusal of an
    older --resume says to do) and resumed on 1 rank: refused by the run-directory check, before
    any engine, naming the checkpoint, what it no longer holds, why, and the fix. At its own
    layout it resumes (DeepSpeed's files are all there)."""
    run, cfg = _run(tmp_path, steps=(2, 4))
    root = ckpt.checkpoint_dir(run)
    ckpt._prune(root, keep_last=2, drop_reference=True)
    (root / "step00000004").rename(tmp_path / "moved-step00000004")
    with pytest.raises(ConfigError, match=re.escape(f"checkpoint {root / 'step00000002'} was written with another "
                                                    "layout (ranks 2 in the checkpoint vs 1 now)") +
                       r" and no longer holds its layout-free training state: its reference shards .* were removed "
                       r"by pruning once the newer step00000004 was complete .*resume the run's newest checkpoint "
                       r"at this layout \(--resume auto\), or this one at its own layout \(2 rank\(s\), ZeRO-1, "
                       r"reference, EP 1\)"):
        check_run_dir(run, cfg, "auto", 1)
    check_run_dir(run, cfg, "auto", 2)


def test_a_marker_that_an_older_version_pruned_is_read_as_what_it_holds(tmp_path):
    """Markers pruned before the marker said so kept ``"layout_free": true`` next to
    ``reference_removed_by``: read as holding no layout-free state, and the next pruning rewrites them."""
    run, cfg = _run(tmp_path, steps=())
    ck = _checkpoint(run, 2, cfg, 2, reference=False, layout_free=True, reference_removed_by="step00000004")
    meta = ckpt.read_marker(ck)
    del meta["reference_weights"]
    ckpt._write_marker(ck, meta)
    assert ckpt.holds(ckpt.read_marker(ck))["layout_free"] is False
    with pytest.raises(ConfigError, match="no longer holds its layout-free training state"):
        plan_resume(cfg, run, str(ck), 1)
    _checkpoint(run, 4, cfg, 2)
    ckpt._prune(ckpt.checkpoint_dir(run), keep_last=2, drop_reference=True)
    assert json.loads((ck / ckpt.MARKER).read_text())["layout_free"] is False


# ---------------------------------------------------------------------------------------------
# 2. the peak LR and the step guard: run settings (the exit-3 advice)
# ---------------------------------------------------------------------------------------------


def test_the_peak_lr_and_the_step_guard_may_change_on_resume_and_the_schedule_not(tmp_path):
    run, _ = _run(tmp_path)
    lower = _cfg(run, train={"lr": 1.5e-3, "step_guard": {"max_consecutive_skips": 10, "loss_spike_factor": 3.0}})
    check_run_dir(run, lower, "auto", 2)
    for field, value in (("warmup_steps", 5), ("min_lr_ratio", 0.5), ("weight_decay", 0.01)):
        with pytest.raises(ConfigError, match=rf"train.{field}: .*may change only train.max_steps, .*train.lr, "
                                              r"train.step_guard"):
            check_run_dir(run, _cfg(run, train={field: value}), "auto", 2)


# ---------------------------------------------------------------------------------------------
# 3. moe_runtime: which tokens reach their experts is the run's
# ---------------------------------------------------------------------------------------------


def test_every_moe_runtime_key_is_classified_as_function_or_placement():
    """A key added to ``moe_runtime`` must be placed in one of the two lists (the resume rule and
    docs/training.md name them)."""
    from smelt_ds.config.moe import RUNTIME_FUNCTION_KEYS, RUNTIME_PLACEMENT_KEYS, MoERuntimeConfig

    assert set(RUNTIME_FUNCTION_KEYS) | set(RUNTIME_PLACEMENT_KEYS) == set(MoERuntimeConfig.model_fields)
    assert not set(RUNTIME_FUNCTION_KEYS) & set(RUNTIME_PLACEMENT_KEYS)


def test_a_switch_to_deepspeed_moe_that_drops_tokens_is_refused_and_a_dropless_one_resumes(tmp_path):
    """The reference backend routes every token; DeepSpeed-MoE drops the tokens over capacity by
    default (``drop_tokens: true``): resuming the run on it would silently change the function."""
    run, _ = _run(tmp_path, deepspeed={"zero_stage": 1})
    dropping = _cfg(run, deepspeed={"zero_stage": 1}, moe_runtime={"backend": "deepspeed", "ep_size": 2})
    with pytest.raises(ConfigError, match=r"--resume auto: moe_runtime.drop_tokens: false in the run, true in this "
                                          r"recipe \(in effect\).*backend 'reference': every token reaches its top-k "
                                          r"experts; this recipe with backend 'deepspeed', which drops the tokens over "
                                          r"capacity \(capacity_factor 1.0, .*resume with --set "
                                          r"moe_runtime.drop_tokens=false"):
        check_run_dir(run, dropping, "auto", 2)
    dropless = _cfg(run, deepspeed={"zero_stage": 1},
                    moe_runtime={"backend": "deepspeed", "ep_size": 2, "drop_tokens": False, "capacity_factor": 2.0})
    check_run_dir(run, dropless, "auto", 2)  # the same function on another backend and EP size


@pytest.mark.parametrize("key,value", [("capacity_factor", 2.0), ("eval_capacity_factor", 0.5), ("min_capacity", 0),
                                       ("drop_tokens", False)])
def test_a_capacity_change_of_a_run_that_drops_tokens_is_refused_naming_the_runs_values(tmp_path, key, value):
    ds = {"deepspeed": {"zero_stage": 1}, "moe_runtime": {"backend": "deepspeed", "capacity_factor": 1.25}}
    run, _ = _run(tmp_path, **ds)
    with pytest.raises(ConfigError) as e:
        check_run_dir(run, _cfg(run, **deep_merge(ds, {"moe_runtime": {key: value}})), "auto", 2)
    run_value = {"capacity_factor": 1.25, "eval_capacity_factor": 1.0, "min_capacity": 4, "drop_tokens": True}[key]
    msg = str(e.value)
    def yaml(v):
        return str(v).lower() if isinstance(v, bool) else repr(v)

    assert f"moe_runtime.{key}: {yaml(run_value)} in the run, {yaml(value)} in this recipe (in effect)" in msg, msg
    assert ("resume with --set moe_runtime.drop_tokens=true --set moe_runtime.capacity_factor=1.25 --set "
            "moe_runtime.eval_capacity_factor=1.0 --set moe_runtime.min_capacity=4") in msg, msg
    check_run_dir(run, _cfg(run, **deep_merge(ds, {"moe_runtime": {"ep_size": 2}})), "auto", 2)  # placement only


# ---------------------------------------------------------------------------------------------
# 4. the micro-batch may change, the global batch not
# ---------------------------------------------------------------------------------------------


def test_a_micro_batch_change_keeping_the_global_batch_resumes_with_the_accumulation_adjusted(tmp_path):
    """Measured before: 4 -> 2 on 1 rank was refused. The run's global batch (4 samples) is kept:
    accumulation 1 -> 2; at the writing layout DeepSpeed's files load it (no conversion)."""
    run, _ = _run(tmp_path, world=1, train={"micro_batch_size": 4})
    smaller = _cfg(run, train={"micro_batch_size": 2})
    check_run_dir(run, smaller, "auto", 1)
    cfg, plan = plan_resume(smaller, run, "auto", 1)
    assert cfg.train.gradient_accumulation_steps == 2 and plan is not None and plan.changes == {}
    assert (plan.old_accum, plan.new_accum) == (1, 2)
    assert plan.record()["micro_batch_change"]["micro_batch_size"] == [4, 2]
    assert "micro-batch 4 -> 2 x accumulation 1 -> 2 (the run's global batch of 4 samples kept" in plan.console()
    cfg, plan = plan_resume(_cfg(run, train={"micro_batch_size": 1}), run, "auto", 2)  # and at another layout
    assert cfg.train.gradient_accumulation_steps == 2 and plan is not None and plan.changes == {"world_size": (1, 2)}
    same = _cfg(run, train={"micro_batch_size": 4, "global_batch_tokens": 4 * 32})
    check_run_dir(run, same, "auto", 1)  # the run's global batch, spelled in tokens


def test_another_global_batch_is_refused_and_so_is_a_micro_batch_that_cannot_form_it(tmp_path):
    run, _ = _run(tmp_path, world=1, train={"micro_batch_size": 4})
    with pytest.raises(ConfigError, match=r"train.global_batch_tokens 256 differs from the run's global batch of 128 "
                                          r"tokens \(4 samples of train.seq_len 32; .*--set "
                                          r"train.global_batch_tokens=128, or train with another global batch as a "
                                          r"new run"):
        check_run_dir(run, _cfg(run, train={"micro_batch_size": 2, "global_batch_tokens": 256}), "auto", 1)
    with pytest.raises(ConfigError, match=r"1 rank\(s\) cannot form the run's global batch of 4 samples from "
                                          r"micro-batches of 3 \(not a whole number of micro-batches of 3; .*on 1 "
                                          r"rank\(s\) with train.micro_batch_size 1, 2 or 4"):
        check_run_dir(run, _cfg(run, train={"micro_batch_size": 3}), "auto", 1)
    with pytest.raises(ConfigError, match=r"draws random numbers per micro-batch .*another layout or micro-batch size"
                                          r".*--set train.micro_batch_size=4"):
        plan_resume(_cfg(run, model={"dropout": 0.1}, train={"micro_batch_size": 2}), run, "auto", 1)


def test_a_checkpoint_that_does_not_record_its_batch_keeps_its_micro_batch(tmp_path):
    """A marker without the global batch (written before it was recorded): nothing to keep the
    global batch against, so the micro-batch stays the run's."""
    run, cfg = _run(tmp_path, steps=(), world=1, train={"micro_batch_size": 4})
    ck = _checkpoint(run, 2, cfg, 1)
    meta = ckpt.read_marker(ck)
    del meta["global_batch_samples"], meta["micro_batch_size"]
    ckpt._write_marker(ck, meta)
    with pytest.raises(ConfigError, match=r"train.micro_batch_size: 4 in the run, 2 in this recipe"):
        check_run_dir(run, _cfg(run, train={"micro_batch_size": 2}), "auto", 1)
