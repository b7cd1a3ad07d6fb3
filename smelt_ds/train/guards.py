"""Run-directory guards: one run per directory, a resume that matches what its checkpoints hold.

Checked before anything is written: a new run in a directory with checkpoints, a resume of another
run or scale, or a resume that changes a recipe field the checkpoint depends on is refused with a
ConfigError naming the field, both values and the way forward.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from smelt_ds.config.loading import config_diff, config_to_dict
from smelt_ds.config.moe import RUNTIME_FUNCTION_KEYS, MoERuntimeConfig, routing_changes, token_routing
from smelt_ds.config.run import RunConfig
from smelt_ds.errors import ConfigError
from smelt_ds.parallel.distributed import on_rank0
from smelt_ds.parallel.moe_backends import TUTEL_INSTALL_HINT, tutel_available
from smelt_ds.runs import checkpoint as ckpt
from smelt_ds.runs.provenance import RUN_TOKENIZER, tokenizer_file_hash
from smelt_ds.runs.reshard import plan_resume
from smelt_ds.runs.run_lock import RunLock

__all__ = ["check_run_dir", "check_optional_packages", "earlier_run_files", "common_keys", "RUN_FILES",
           "RESUME_MAY_CHANGE", "lock_run_dir", "remove_refused_new_run"]

#: what a run writes into its run directory besides checkpoints/, its lock and its tokenizer
#: (loop._fit before the first checkpoint: zero3_tuning.json (ZeRO-3), config.yaml, ds_config.json,
#: tb/, metrics.jsonl, trackers/ (tracking) and profile/ (profiling); summary.* at the end). A new
#: run refuses a directory holding any of them;
#: ``--resume auto`` without a checkpoint removes them. The lock (run_lock.LOCK_NAME) and the
#: tokenizer (provenance.RUN_TOKENIZER) may be left by a run refused before it trained.
RUN_FILES = ("config.yaml", "ds_config.json", "metrics.jsonl", "tb", "summary.json", "summary.txt",
             "zero3_tuning.json", "trackers", "profile")


# recipe fields a checkpoint depends on: a resume with other values cannot load it, or would
# silently change what the run computes (token ids, routing)
_RESUME_FIXED = {"model": None, "loop": None,
                 "moe": ("num_experts", "top_k", "expert_ffn_size", "shared_expert_ffn_size", "score_func",
                         "aux_loss_free_bias")}


def check_run_dir(out_dir: Path, cfg: RunConfig, resume: str, world_size: int | None = None,
                  take_over: bool = True) -> None:
    """Refuse to mix runs in one run directory, before anything is written to it.

    Raises ConfigError when the recipe needs an optional package that is missing
    (:func:`check_optional_packages`); when a new run (``resume == "none"``) would start in a
    directory that already holds checkpoints (they would be taken for this run's by export, eval and
    ``--resume auto``) or another run's files without a checkpoint (:func:`earlier_run_files`: its
    config.yaml would be replaced and its logs mixed with this run's); when ``--resume`` names a
    directory that does not exist, a checkpoint of another run directory, or one older than the
    run's newest (a rewind would mix the newer checkpoints into this run); or when a resumed run's
    recipe differs from the run directory's ``config.yaml`` in a field the checkpoint depends on
    (``_RESUME_FIXED``: model, loop, MoE layout, tokenizer), in a field outside
    :data:`RESUME_MAY_CHANGE`, or in what the MoE layers compute (:func:`_check_token_routing`:
    token dropping and capacity); or, when ``world_size`` is given,
    when the checkpoint cannot continue at this layout and micro-batch size
    (:func:`smelt_ds.runs.reshard.plan_resume`: another layout without the layout-free state, or
    with its shards removed by pruning; another global batch; a global batch the ranks and
    micro-batches cannot form).

    ``--resume auto`` in a directory without a complete checkpoint starts from step 0 in place:
    with ``take_over`` (the training itself, which holds the run lock), global rank 0 first removes
    what an earlier run left there (:data:`RUN_FILES`, its tokenizer and incomplete checkpoints), so
    nothing of it is mixed into this run; ``take_over=False`` only checks (e.g. before the launcher
    starts the ranks).
    """

    check_optional_packages(cfg)
    damaged = sorted(p.name for p in ckpt.checkpoint_dir(out_dir).glob("damaged-step*"))
    if resume == "none":
        latest = ckpt.latest_complete(out_dir)
        if latest is not None or damaged:
            held = f"newest {latest.name}" if latest is not None else f"only damaged ones: {', '.join(damaged[:3])}"
            raise ConfigError(f"run directory {out_dir} already holds checkpoints of an earlier run ({held}): "
                              "continue it with --resume auto, or start this run in a new --run-dir (or delete "
                              "the old one)")
        found = earlier_run_files(out_dir)
        if found:
            raise ConfigError(f"run directory {out_dir} holds files of an earlier run that saved no checkpoint "
                              f"({', '.join(found)}): a new run here would overwrite them and mix the two runs' "
                              "logs. Start this run in a new --run-dir, delete the directory, or rerun with "
                              "--resume auto to start from step 0 in place (the earlier run's files are removed "
                              "first)")
        return
    if resume == "auto" and ckpt.latest_complete(out_dir) is None:
        if damaged:
            raise ConfigError(f"--resume auto: run directory {out_dir} holds no checkpoint that verifies, only "
                              f"damaged ones ({', '.join(damaged[:3])}): nothing to continue from; start a new run "
                              "in a new --run-dir (the damaged checkpoints are kept for inspection)")
        if take_over and _global_rank() == 0:
            _take_over(out_dir)
        return
    if resume != "auto":
        path = Path(resume)
        if not path.is_dir():
            raise ConfigError(f"--resume {resume!r} does not exist: pass a checkpoint directory "
                              f"({out_dir}/checkpoints/stepNNNNNNNN) or --resume auto")
        owner = path.resolve().parent.parent
        if owner != out_dir.resolve():
            raise ConfigError(f"--resume {resume}: the checkpoint belongs to run directory {owner}, not to "
                              f"{out_dir}: resume it there (--run-dir {owner}), or start a new run from its "
                              "weights with `smelt-ds export` and train.init_from")
        latest = ckpt.latest_complete(out_dir)
        if latest is not None and latest.name > path.name:
            raise ConfigError(f"--resume {resume} is older than the run's newest checkpoint {latest.name}: to "
                              "rewind, first move the newer checkpoints out of checkpoints/ (otherwise they are "
                              "pruned by train.keep_last or mixed into this run), or resume with --resume auto")
    saved = out_dir / "config.yaml"
    if saved.is_file() and not (resume == "auto" and ckpt.latest_complete(out_dir) is None):
        _check_recipe_against_run(out_dir, saved, cfg, resume)
    if world_size is not None:  # another layout: refused unless the checkpoint converts (smelt_ds.runs.reshard)
        plan_resume(cfg, out_dir, resume, world_size)


def _check_recipe_against_run(out_dir: Path, saved: Path, cfg: RunConfig, resume: str) -> None:
    """The resumed recipe against the run's ``config.yaml`` (:func:`check_run_dir`)."""
    import yaml

    old, new = yaml.safe_load(saved.read_text()) or {}, config_to_dict(cfg)
    _same_tokenizer_same_path(old, new)
    diffs = []
    for section, keys in _RESUME_FIXED.items():
        a, b = new.get(section) or {}, old.get(section) or {}
        if keys is not None:
            a, b = {k: a.get(k) for k in keys}, {k: b.get(k) for k in keys}
        diffs += config_diff(a, b, section, labels=("in this recipe", "in the run"))
    if diffs:
        raise ConfigError(f"--resume {resume}: run directory {out_dir} was trained with another model "
                          f"({'; '.join(diffs[:4])}): resume with the run's own recipe ({saved}), or start "
                          "this recipe in a new --run-dir")
    _check_token_routing(old, out_dir, resume, cfg)
    _check_resume_overrides(old, new, out_dir, resume, batch_recorded=_records_batch(out_dir, resume))


# what a resume may change: how long, how often to log/evaluate/save (and which checkpoints keep
# the reference weights), where data are cached, evaluation settings and compilation (the same
# computation, compiled or not); the run settings a user changes to get past a bad stretch, as in
# Megatron-LM (its --override-opt_param-scheduler): the peak LR and the step guard (the exit-3
# advice, train.step_guard); everything else would change the optimisation it continues (the
# schedule's shape, the batch, the data) while the checkpoint restores the old state, so
# config.yaml would lie. The LR does not: the resumed engine takes its base LR from the recipe
# (smelt_ds.train.loop.resync_lr), and metrics.jsonl logs the LR of every step.
RESUME_MAY_CHANGE = ("name", "train.max_steps", "train.log_every", "train.eval_every", "train.save_every",
                     "train.keep_last", "train.reference_weights", "train.exit_after_steps", "train.lr",
                     "train.step_guard", "train.run_dir", "train.init_from", "eval",
                     "cluster", "data.num_proc", "data.cache_dir", "data.output_dir", "data.offline", "data.verify",
                     "data.shared_filesystem", "data.prepare_timeout_s", "deepspeed.comms_logger", "train.compile",
                     "train.compile_backend", "train.deterministic", "tracking", "profile",
                     # the layout: a resume at another one converts the checkpoint (smelt_ds.runs.reshard) and
                     # re-derives the accumulation for the run's global batch; the MoE runtime's placement
                     # keys (smelt_ds.config.moe.RUNTIME_PLACEMENT_KEYS; its function keys: _check_token_routing)
                     "deepspeed.zero_stage", "deepspeed.config.zero_optimization", "moe_runtime.backend",
                     "moe_runtime.ep_size", "moe_runtime.use_tutel", "train.gradient_accumulation_steps")
#: the batch fields a resume may change where the checkpoint records its global batch: plan_resume
#: keeps the run's global batch (refusing another) and re-derives the accumulation (Megatron-LM
#: lets the micro-batch change the same way)
RESUME_BATCH = ("train.micro_batch_size", "train.global_batch_tokens")


def _records_batch(out_dir: Path, resume: str) -> bool:
    """Whether the checkpoint ``resume`` names (``auto``: the newest complete one whose marker is
    sound, :func:`smelt_ds.runs.checkpoint.newest_sound`) records the run's global batch in its
    marker, which :func:`smelt_ds.runs.reshard.plan_resume` keeps."""
    path = ckpt.newest_sound(out_dir) if resume == "auto" else Path(resume)
    if path is None or not (path / ckpt.MARKER).is_file():
        return False
    try:
        return "global_batch_samples" in ckpt.read_marker(path)
    except ConfigError:
        return False


def _runtime(raw: dict) -> MoERuntimeConfig | None:
    """The ``moe_runtime`` section of a saved ``config.yaml`` (None when it has none, e.g. an older
    layout, or one this version cannot read: not compared)."""
    from pydantic import ValidationError

    section = raw.get("moe_runtime")
    if not isinstance(section, dict):
        return None
    try:
        return MoERuntimeConfig(**{k: v for k, v in section.items() if k in MoERuntimeConfig.model_fields})
    except ValidationError:
        return None


def _routing_words(rt: MoERuntimeConfig) -> str:
    if not token_routing(rt)["drop_tokens"]:
        return f"backend {rt.backend!r}: every token reaches its top-k experts"
    return (f"backend 'deepspeed', which drops the tokens over capacity (capacity_factor {rt.capacity_factor}, "
            f"eval_capacity_factor {rt.eval_capacity_factor}, min_capacity {rt.min_capacity})")


def _check_token_routing(old: dict, out_dir: Path, resume: str, cfg: RunConfig) -> None:
    """Refuse a resume whose ``moe_runtime`` computes another function than the run's (``old``:
    its ``config.yaml``): another :data:`~smelt_ds.config.moe.RUNTIME_FUNCTION_KEYS` value where it
    decides which tokens reach their experts (:func:`~smelt_ds.config.moe.routing_changes`), such as
    a switch from a dropless backend to DeepSpeed-MoE, which drops tokens by default. Raises
    ConfigError naming each field, the run's and the recipe's values and the ``--set`` that keeps
    the run's function."""
    was, now = _runtime(old), cfg.moe_runtime
    if was is None:
        return
    changes = routing_changes(was, now)
    if not changes:
        return
    def yaml(v: object) -> str:
        return str(v).lower() if isinstance(v, bool) else repr(v)

    diffs = "; ".join(f"moe_runtime.{k}: {yaml(a)} in the run, {yaml(b)} in this recipe (in effect)"
                      for k, (a, b) in changes.items())
    if not token_routing(was)["drop_tokens"]:
        fix = ("--set moe_runtime.drop_tokens=false (DeepSpeed-MoE without dropping, the run's function)"
               if now.backend == "deepspeed" else "the run's settings")
    else:
        sets = [f"moe_runtime.{k}={str(v).lower() if isinstance(v, bool) else v}"
                for k, v in token_routing(was).items()]
        fix = " ".join(f"--set {x}" for x in (["moe_runtime.backend=deepspeed"] if now.backend != "deepspeed"
                                              else []) + sets)
    raise ConfigError(f"--resume {resume}: {diffs} (run directory {out_dir}): the run computes its MoE layers with "
                      f"{_routing_words(was)}; this recipe with {_routing_words(now)}. A resume may move the same "
                      "function to another backend, expert-parallel size or kernels (moe_runtime.backend, ep_size, "
                      f"use_tutel), not change which tokens reach their experts: resume with {fix}, or start a new "
                      "run from its weights (`smelt-ds export` then train.init_from)")


def _same_tokenizer_same_path(old: dict, new: dict) -> None:
    """The tokenizer is compared by content on resume (:func:`smelt_ds.runs.provenance.record_run_tokenizer`
    names both digests): a copy of the run's tokenizer under another path is the same tokenizer."""
    a = (old.get("data") or {}).get("tokenizer") or {}
    b = (new.get("data") or {}).get("tokenizer") or {}
    if a.get("path") and b.get("path") and a["path"] != b["path"]:
        if Path(a["path"]).is_file() and Path(b["path"]).is_file() and \
                tokenizer_file_hash(a["path"]) == tokenizer_file_hash(b["path"]):
            b["path"] = a["path"]  # b is new's own dict: compared as the run's path from here on


def _check_resume_overrides(old: dict, new: dict, out_dir: Path, resume: str, batch_recorded: bool = False) -> None:
    """Raise ConfigError naming every field outside :data:`RESUME_MAY_CHANGE` whose value differs
    from the run's ``config.yaml`` (fields the saved file lacks are not compared). Also allowed:
    the ``moe_runtime`` function keys (:func:`_check_token_routing` compares what they compute) and,
    with ``batch_recorded`` (the checkpoint's marker records the global batch), :data:`RESUME_BATCH`
    (:func:`smelt_ds.runs.reshard.plan_resume` checks them against it)."""
    more = tuple(f"moe_runtime.{k}" for k in RUNTIME_FUNCTION_KEYS) + (RESUME_BATCH if batch_recorded else ())

    def allowed(path: str) -> bool:
        return any(path == p or path.startswith(p + ".") for p in RESUME_MAY_CHANGE + more)

    diffs = [d for d in config_diff(common_keys(new, old), common_keys(old, new),
                                    labels=("in this recipe", "in the run"))
             if not allowed(d.split(":", 1)[0])]
    if diffs:
        raise ConfigError(f"--resume {resume}: {'; '.join(diffs[:4])} (run directory {out_dir}): a resume continues "
                          "the run's optimisation from its checkpoint and may change only "
                          f"{', '.join(RESUME_MAY_CHANGE[1:10])}, eval.*, data caching, the layout and the "
                          "micro-batch (docs/training.md, 'What a resume may change'): resume with the run's "
                          "values, or start a new run from its weights (`smelt-ds export` then train.init_from)")


def common_keys(a: Any, b: Any) -> Any:
    """``a`` restricted to the keys ``b`` also has (recursively, into lists of the same length, such
    as ``data.sources``): fields added since ``b`` was written."""
    if isinstance(a, dict) and isinstance(b, dict):
        return {k: common_keys(v, b[k]) for k, v in a.items() if k in b}
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return [common_keys(x, y) for x, y in zip(a, b, strict=True)]
    return a


def check_optional_packages(cfg: RunConfig) -> None:
    """Raise ConfigError when the recipe needs an optional package that is not installed:
    ``moe_runtime.use_tutel`` with ``moe_runtime.backend: deepspeed`` needs ``tutel``
    (:func:`smelt_ds.parallel.moe_backends.tutel_available`). Checked before data, DeepSpeed and the
    run directory, so the refusal leaves nothing behind."""
    rt = cfg.moe_runtime
    if not (rt.backend == "deepspeed" and rt.use_tutel):
        return
    if not tutel_available():
        raise ConfigError(f"`moe_runtime.use_tutel` (True) needs the optional package `tutel`, which is not installed: "
                          f"install it ({TUTEL_INSTALL_HINT}), or set moe_runtime.use_tutel to false (e.g. --set "
                          "moe_runtime.use_tutel=false) to run DeepSpeed-MoE without tutel kernels")


def earlier_run_files(out_dir: Path) -> list[str]:
    """The files of :data:`RUN_FILES` an earlier run left in ``out_dir``, described
    (``metrics.jsonl`` with its rows and last step, ``tb/`` with its event files). Empty for a
    missing directory or one holding only checkpoints, the lock, the tokenizer and files smelt-ds
    does not write (e.g. a sweep's ``sweep_run.json`` and ``train.log``)."""
    found = []
    for name in RUN_FILES:
        path = out_dir / name
        if not path.exists():
            continue
        if name == "metrics.jsonl":
            found.append(f"metrics.jsonl ({_metrics_extent(path)})")
        elif name == "tb":
            found.append(f"tb/ ({sum(1 for _ in path.rglob('events.out.tfevents.*'))} event files)")
        else:
            found.append(name)
    return found


def _metrics_extent(path: Path) -> str:
    import json

    rows, last = 0, None
    for line in path.read_text(errors="replace").splitlines():
        if not line.strip():
            continue
        rows += 1
        try:
            last = json.loads(line).get("step", last)
        except (ValueError, AttributeError):
            pass
    return f"{rows} rows" + (f", last step {last}" if last is not None else "")


def _incomplete_checkpoints(out_dir: Path) -> list[Path]:
    root = ckpt.checkpoint_dir(out_dir)
    return sorted(p for p in root.glob("step*") if p.is_dir() and not (p / ckpt.MARKER).is_file())


def _take_over(out_dir: Path) -> None:
    """``--resume auto`` without a checkpoint: remove an earlier run's files (see :func:`check_run_dir`)."""
    import shutil

    partial = _incomplete_checkpoints(out_dir)
    found = earlier_run_files(out_dir) + [f"incomplete checkpoints/{p.name}" for p in partial]
    tokenizer = out_dir / RUN_TOKENIZER
    if not found and not tokenizer.exists():
        return
    for name in RUN_FILES:
        path = out_dir / name
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()
    tokenizer.unlink(missing_ok=True)  # the earlier run's: this run records its own
    for p in partial:  # no COMPLETE marker: not a checkpoint, and in the way of this run's step numbers
        shutil.rmtree(p)
    (ckpt.checkpoint_dir(out_dir) / "latest").unlink(missing_ok=True)
    if found:
        print(f"run directory {out_dir}: --resume auto found no checkpoint: starting from step 0 in place, removed "
              f"the earlier run's {', '.join(found)}", file=sys.stderr)


def _global_rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def lock_run_dir(out_dir: Path, rank: int):
    """Rank 0 takes the run directory's exclusive lock (:class:`smelt_ds.runs.run_lock.RunLock`);
    every rank raises the same ConfigError when another training holds it (collective).
    Returns ``(lock or None, created)``: whether this call created the directory."""


    created = not out_dir.exists()
    lock = on_rank0(rank, lambda: RunLock(out_dir).acquire())
    return lock, created


def remove_refused_new_run(out_dir: Path) -> None:
    """A new run refused before it saved anything (a ConfigError from the engine, a tracker that
    cannot start, ...) leaves no directory behind that it created: everything it wrote there
    (lock, config.yaml, ds_config.json, tokenizer.json, trackers/, tb/) goes, so the corrected
    command starts cleanly. A directory holding a checkpoint is never removed."""

    if out_dir.is_dir() and not (out_dir / "checkpoints").exists():
        import shutil

        shutil.rmtree(out_dir, ignore_errors=True)
