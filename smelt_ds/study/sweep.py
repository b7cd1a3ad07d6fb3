"""Scaling-law sweeps: a grid of sizes x token (or FLOPs) budgets x architectures, run locally one
after another or rendered as Slurm job arrays / Kubernetes jobs.

A sweep file (``recipes/sweeps/*.yaml``; keys equal the fields of :class:`SweepConfig`)::

    name: micro
    output_dir: runs/sweeps/{name}        # run directories: <output_dir>/<architecture>/<size>-<budget>
    base: ../tiny/baseline.yaml           # Baseline recipe (loop.position: none), relative to this file
    overrides: {train: {eval_every: 100000}}   # deep-merged into every size's Baseline
    sizes:                                # each: a Baseline, from `base` + overrides or its own `recipe`
      - {name: h64, overrides: {model: {hidden_size: 64}, moe: {expert_ffn_size: 48}}}
    budgets:                              # each: training tokens, training FLOPs (IsoFLOP grids) or
      - {name: d1, tokens: 131072}        # tokens per non-embedding parameter of the Baseline
      - {name: c1, flops: 1.0e+13}
      - {name: t20, tokens_per_param: 20}
    architectures:                        # position none = the Baseline itself; the others are
      - {name: baseline, position: none}  # generated from each size's Baseline by the matcher
      - {name: smelt, position: middle, repeats: 2}

Every looped recipe is :func:`smelt_ds.cost.budget.match_baseline` of its size's Baseline (same
per-token FLOPs, non-embedding parameters and KV cache; ``match_tolerance`` bounds the
deviation). Steps per run: ``round(tokens / global batch tokens)`` where a FLOPs budget becomes
tokens through the *Baseline's* training FLOPs per token (a tokens-per-parameter budget through
its non-embedding parameters), so that all architectures of one size and budget train on the same
tokens; each run's own compute (its budget's FLOPs/token x tokens)
is what the fit uses.

``smelt-ds sweep`` (``--dry-run`` too) estimates each run's training time from tokens/s:
measured where the sweep's output holds it (a run's ``summary.json``, else its ``metrics.jsonl``;
a run without either takes those of a run of the same architecture and size, which is the same
recipe with another step count), else analytic (:func:`estimate_runs`).

Local runs skip finished runs (``summary.json`` with the planned steps) and resume interrupted
ones from their newest ``COMPLETE`` checkpoint (``--resume auto``). Cluster rendering reuses
:mod:`smelt_ds.launch`: one job script per run, and per node layout one Slurm array whose task
id picks the run; for Kubernetes one PyTorchJob manifest per unfinished run.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import fnmatch
import json
import os
import re
import shlex
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from pydantic import Field, model_validator

from smelt_ds.config.loading import (
    apply_overrides,
    config_diff,
    config_from_dict,
    config_to_dict,
    read_yaml_mapping,
    validate_model,
)
from smelt_ds.config.loop import LoopPosition, LoopRange
from smelt_ds.config.run import RunConfig
from smelt_ds.config.schema import StrictModel
from smelt_ds.config.train import resolve_batch
from smelt_ds.cost.budget import compute_budget, match_baseline
from smelt_ds.data.cache import is_complete
from smelt_ds.data.loader import TrainLoader
from smelt_ds.data.prepare import PreparedData, prepare_from_config, prepared_path
from smelt_ds.errors import ConfigError
from smelt_ds.launch.jobs import LAUNCHERS_DIR, JobOptions, JobPlan, fill_template, k8s_pod_command, plan_job, render
from smelt_ds.launch.placement import load_raw
from smelt_ds.mappings import deep_merge
from smelt_ds.runs import checkpoint as ckpt
from smelt_ds.study.recipes import REPO_ROOT
from smelt_ds.train.guards import common_keys
from smelt_ds.train.loop import launcher_command, train
from smelt_ds.train.metrics import PEAK_TFLOPS, device_peak_tflops

__all__ = ["SweepConfig", "SweepSize", "SweepBudget", "SweepArchitecture", "SweepLaunch", "load_sweep",
           "PlannedRun", "SweepPlan", "plan_sweep", "materialize", "run_status", "select_runs", "run_local",
           "render_slurm", "render_k8s", "plan_table", "RunEstimate", "measured_tokens_per_s", "estimate_runs",
           "estimate_summary", "format_duration", "ASSUMED_MFU", "CPU_FLOPS_PER_CORE"]

NAME_PATTERN = r"^[a-z0-9][a-z0-9_.-]*$"
LABEL_FILE = "sweep_run.json"


# ---------------------------------------------------------------------------------------------
# schema
# ---------------------------------------------------------------------------------------------


class SweepSize(StrictModel):
    """One model size: its Baseline is ``recipe`` (or the sweep's ``base``) with ``overrides``."""

    name: str = Field(..., pattern=NAME_PATTERN, description="label of the size in run names and reports")
    recipe: str | None = Field(None, description="Baseline recipe of this size, relative to the sweep file; "
                                                 "default: the sweep's `base`")
    overrides: dict[str, Any] = Field(default_factory=dict, description="recipe sections deep-merged into it")
    tokens_per_s: float | None = Field(
        None, gt=0, description="training tokens/s of this size measured where the sweep is meant to run (all "
                                "ranks); the time estimate uses it for the size's runs until their run "
                                "directories hold a measurement")


class SweepBudget(StrictModel):
    """One training budget per run: exactly one of ``tokens`` (training tokens), ``flops``
    (training FLOPs) or ``tokens_per_param`` (training tokens per non-embedding parameter of the
    size's Baseline)."""

    name: str = Field(..., pattern=NAME_PATTERN)
    tokens: int | None = Field(None, gt=0, description="training tokens per run")
    flops: float | None = Field(None, gt=0, description="training FLOPs per run (tokens = flops / the Baseline's "
                                                        "training FLOPs per token): IsoFLOP grids")
    tokens_per_param: float | None = Field(None, gt=0, description="training tokens per non-embedding parameter "
                                                                   "of the Baseline (Chinchilla: about 20)")
    seeds: list[int] | None = Field(None, min_length=1, description="train.seed of each replicate at this budget "
                                                                    "(every size and architecture); default: the "
                                                                    "sweep's `seeds`")

    @model_validator(mode="after")
    def _one(self) -> SweepBudget:
        given = {k: v for k, v in (("tokens", self.tokens), ("flops", self.flops),
                                   ("tokens_per_param", self.tokens_per_param)) if v is not None}
        if len(given) != 1:
            raise ConfigError(f"budget {self.name!r}: set exactly one of `tokens` (training tokens), `flops` "
                              f"(training FLOPs) or `tokens_per_param`, got {given or 'none'}")
        return self

    def tokens_for(self, baseline_budget) -> float:
        """Training tokens of this budget for a size whose Baseline has ``baseline_budget``."""
        if self.tokens is not None:
            return float(self.tokens)
        if self.flops is not None:
            return self.flops / baseline_budget.train_flops_per_token
        return self.tokens_per_param * baseline_budget.non_embedding_params


class SweepArchitecture(StrictModel):
    """One architecture: ``position: none`` is the Baseline; any other loop position (with
    ``repeats``, ``fraction``, explicit ``ranges``) is matched to each size's Baseline."""

    name: str = Field(..., pattern=NAME_PATTERN)
    position: LoopPosition = Field("none", description="loop position (smelt-ds match --position)")
    repeats: int = Field(2, gt=1, description="visits per looped layer")
    fraction: float = Field(0.5, gt=0, le=1, description="share of unique layers looped")
    ranges: list[LoopRange] | None = Field(None, description="explicit loop ranges (custom / asymmetric)")
    ep_size: int | None = Field(
        None, gt=0, description="expert counts must divide by this (default moe_runtime.ep_size)")


class SweepLaunch(StrictModel):
    """Cluster rendering (``smelt-ds sweep --render``): options of :class:`smelt_ds.launch.jobs.JobOptions`."""

    layout: str | None = Field(None, description="cluster layout of the recipes (default: each recipe's default)")
    time: str = Field("2-00:00:00", description="Slurm time limit per job (D-HH:MM:SS); runs requeue and resume")
    partition: str | None = None
    account: str | None = None
    sbatch: list[str] = Field(default_factory=list, description="more #SBATCH options, e.g. --qos=high")
    max_parallel: int | None = Field(None, gt=0, description="Slurm array: at most this many runs at once")
    env: list[str] = Field(default_factory=list, description="NAME=VALUE exported in every job")
    image: str = Field("smelt-ds:latest", description="Kubernetes: container image")
    namespace: str = "default"
    runs_pvc: str = Field("smelt-runs", description="Kubernetes: PVC mounted at <workdir>/runs (holds output_dir)")
    data_pvc: str = Field("smelt-corpora", description="Kubernetes: PVC mounted at <workdir>/corpora")


class SweepConfig(StrictModel):
    """A scaling-law sweep (see the module docstring)."""

    name: str = Field(..., pattern=NAME_PATTERN)
    output_dir: str = Field("runs/sweeps/{name}", description="run directories and generated recipes")
    base: str | None = Field(None, description="Baseline recipe shared by sizes without their own `recipe`")
    overrides: dict[str, Any] = Field(default_factory=dict, description="deep-merged into every size's Baseline")
    sizes: list[SweepSize] = Field(..., min_length=1)
    budgets: list[SweepBudget] = Field(..., min_length=1)
    architectures: list[SweepArchitecture] = Field(..., min_length=1)
    match_tolerance: float | None = Field(0.01, gt=0, description="largest relative deviation of any budget of a "
                                                                  "matched recipe from its Baseline")
    warmup_fraction: float | None = Field(None, ge=0, lt=1, description="warmup steps as a share of each run's "
                                                                        "steps; default: the recipe's")
    seeds: list[int] | None = Field(None, min_length=1, description="train.seed of each replicate run (weight init "
                                                                    "and router jitter; the data order and split keep "
                                                                    "data.seed); run names end in -s<seed>; default: "
                                                                    "one run with the recipe's seed, no suffix")
    max_epochs: float | None = Field(None, gt=0, description="passes over the training split a run may read, at most "
                                                             "(1: no training token is read twice); checked against "
                                                             "the prepared data before training; null: no check")
    launch: SweepLaunch = Field(default_factory=SweepLaunch)

    @model_validator(mode="after")
    def _unique(self) -> SweepConfig:
        for key in ("sizes", "budgets", "architectures"):
            names = [x.name for x in getattr(self, key)]
            dup = sorted({n for n in names if names.count(n) > 1})
            if dup:
                raise ConfigError(f"`{key}` has duplicate names {dup}: give every entry its own name")
        for where, seeds in [("seeds", self.seeds)] + [(f"budgets[{i}].seeds", b.seeds)
                                                        for i, b in enumerate(self.budgets)]:
            if seeds is not None and len(set(seeds)) != len(seeds):
                raise ConfigError(f"`{where}` ({seeds}) repeats a seed: give every replicate its own seed")
        return self

    def seeds_of(self, budget: SweepBudget) -> list[int | None]:
        """The train.seed of each replicate at ``budget`` (None: the recipe's, one run without a suffix)."""
        given = budget.seeds or self.seeds
        return [None] if not given else list(given)


def load_sweep(path: str | Path) -> SweepConfig:
    """Load and validate a sweep file. Raises ConfigError naming the file and the bad field."""
    path = Path(path)
    raw = read_yaml_mapping(path, "sweep file", "recipes/sweeps/micro.yaml")
    return validate_model(SweepConfig, raw, f"sweep file {path}")


# ---------------------------------------------------------------------------------------------
# the plan
# ---------------------------------------------------------------------------------------------


@dataclass
class PlannedRun:
    """One run of the grid. ``steps`` optimizer steps of ``tokens_per_step`` tokens; budgets from
    :func:`smelt_ds.cost.budget.compute_budget` (FLOPs per token, non-embedding parameters)."""

    index: int
    name: str
    architecture: str
    position: str
    size: str
    budget: str
    run_dir: Path
    recipe_path: Path
    raw: dict[str, Any]
    config: RunConfig
    steps: int
    tokens_per_step: int
    train_flops_per_token: float
    non_embedding_params: int
    deviations: dict[str, float] | None = None
    seed: int | None = None

    @property
    def tokens(self) -> int:
        return self.steps * self.tokens_per_step

    @property
    def train_flops(self) -> float:
        return self.train_flops_per_token * self.tokens

    def label(self, sweep: str) -> dict[str, Any]:
        return {"sweep": sweep, "run": self.name, "architecture": self.architecture, "position": self.position,
                "size": self.size, "budget": self.budget, "seed": self.seed, "steps": self.steps, "tokens": self.tokens,
                "non_embedding_params": self.non_embedding_params,
                "train_flops_per_token": self.train_flops_per_token, "train_flops": self.train_flops,
                "deviations_vs_baseline": self.deviations}


@dataclass
class SweepPlan:
    sweep: SweepConfig
    source: Path
    output_dir: Path
    runs: list[PlannedRun]
    notes: list[str] = field(default_factory=list)
    #: every run of the sweep when ``runs`` is a selection (:func:`select_runs`), else None
    all_runs: list[PlannedRun] | None = None


def _size_baseline(sweep: SweepConfig, source: Path, i: int, overrides: list[str]) -> dict[str, Any]:

    size = sweep.sizes[i]
    rel = size.recipe or sweep.base
    if rel is None:
        raise ConfigError(f"sweep file {source}: `sizes[{i}].recipe` ({size.name}) is unset and there is no `base`: "
                          "set the sweep's `base` or this size's `recipe` (a Baseline recipe)")
    path = (source.parent / rel) if not Path(rel).is_absolute() else Path(rel)
    if not path.is_file():
        where = f"sizes[{i}].recipe" if size.recipe else "base"
        raise ConfigError(f"sweep file {source}: `{where}` ({rel!r}) does not exist (looked for {path}); paths are "
                          "relative to the sweep file")
    merged = deep_merge(deep_merge(load_raw(path), sweep.overrides or {}), size.overrides or {})
    raw = apply_overrides(merged, overrides)
    cfg = config_from_dict(raw, source=f"{source} size {size.name!r}")
    if cfg.loop.position != "none":
        raise ConfigError(f"sweep file {source}: size {size.name!r} has `loop.position` ({cfg.loop.position!r}): a "
                          "size must be a Baseline (loop.position: none); looped architectures are derived from it")
    return raw


def _architecture_raw(sweep: SweepConfig, source: Path, size: str, raw: dict[str, Any],
                      arch: SweepArchitecture) -> tuple[dict[str, Any], dict[str, float] | None, list[str]]:

    if arch.position == "none":
        return raw, None, []
    ranges = [r.model_dump() for r in arch.ranges] if arch.ranges else None
    try:
        m = match_baseline(raw, arch.position, repeats=arch.repeats, ep_size=arch.ep_size, fraction=arch.fraction,
                           ranges=ranges, tolerance=sweep.match_tolerance)
    except ConfigError as e:
        raise ConfigError(f"sweep file {source}: matching architecture {arch.name!r} to size {size!r}: {e} "
                          "(or raise `match_tolerance`)") from None
    return m.raw, m.deviations, m.notes


def _steps(cfg: RunConfig, tokens: float, scale: float) -> tuple[int, int]:
    _, per_step = resolve_batch(cfg.train, 1)
    return max(1, round(tokens * scale / per_step)), per_step


def plan_sweep(sweep: SweepConfig, source: str | Path, output_dir: str | None = None,
               overrides: list[str] | None = None, steps_scale: float = 1.0) -> SweepPlan:
    """Expand a sweep into runs (sizes x budgets x seeds x architectures, in that nesting: budget, size,
    seed, architecture, so that a partial sweep covers every architecture and a pair of the same seed
    trains one after the other). ``overrides`` are ``--set``
    strings applied to every size's Baseline before matching; ``steps_scale`` multiplies every run's
    steps and warmup (quick checks; use another ``output_dir``).

    Raises ConfigError for a missing or looped size recipe, an unmatched architecture, a warmup
    longer than a run, or an invalid generated recipe (naming the run).
    """

    source = Path(source)
    if not steps_scale > 0:
        raise ConfigError(f"--steps-scale ({steps_scale!r}) must be > 0, e.g. 0.1")
    out = Path((output_dir or sweep.output_dir).format(name=sweep.name))
    sizes = {}
    for i, size in enumerate(sweep.sizes):
        base_raw = _size_baseline(sweep, source, i, overrides or [])
        base_budget = compute_budget(config_from_dict(base_raw))
        sizes[size.name] = (base_raw, base_budget, {a.name: _architecture_raw(sweep, source, size.name, base_raw, a)
                                                    for a in sweep.architectures})
    runs: list[PlannedRun] = []
    notes: list[str] = []
    for budget in sweep.budgets:
        for size in sweep.sizes:
            base_raw, base_budget, archs = sizes[size.name]
            tokens = budget.tokens_for(base_budget)
            for seed in sweep.seeds_of(budget):
                for arch in sweep.architectures:
                    arch_raw, devs, match_notes = archs[arch.name]
                    notes += [f"{arch.name} @ {size.name}: {n}" for n in match_notes if n not in notes]
                    runs.append(_plan_run(sweep, source, out, len(runs), arch, size.name, budget.name, arch_raw,
                                          devs, tokens, steps_scale, seed))
    return SweepPlan(sweep, source, out, runs, sorted(set(notes)))


def _plan_run(sweep: SweepConfig, source: Path, out: Path, index: int, arch: SweepArchitecture, size: str,
              budget: str, arch_raw: dict[str, Any], devs, tokens: float, scale: float,
              seed: int | None = None) -> PlannedRun:

    suffix = "" if seed is None else f"-s{seed}"
    name = f"{arch.name}-{size}-{budget}{suffix}"
    raw = copy.deepcopy(arch_raw)
    raw["name"] = f"{sweep.name}-{name}"
    run_dir = out / arch.name / f"{size}-{budget}{suffix}"
    t = raw.setdefault("train", {})
    if seed is not None:
        t["seed"] = seed
    trial = config_from_dict(raw, source=f"{source} run {name}")
    steps, per_step = _steps(trial, tokens, scale)
    t["max_steps"] = steps
    t["run_dir"] = str(run_dir)
    if sweep.warmup_fraction is not None:
        t["warmup_steps"] = int(round(sweep.warmup_fraction * steps))
    elif scale != 1.0:
        t["warmup_steps"] = min(steps, int(round(trial.train.warmup_steps * scale)))
    if t.get("warmup_steps", trial.train.warmup_steps) > steps:
        raise ConfigError(f"sweep file {source}: run {name} has {steps} steps but `train.warmup_steps` "
                          f"({t.get('warmup_steps', trial.train.warmup_steps)}) is longer: set the sweep's "
                          "`warmup_fraction` (e.g. 0.05) or a larger budget")
    cfg = config_from_dict(raw, source=f"{source} run {name}")
    b = compute_budget(cfg)
    return PlannedRun(index, name, arch.name, cfg.loop.position, size, budget, run_dir,
                      out / "recipes" / f"{name}.yaml", raw, cfg, steps, per_step, b.train_flops_per_token,
                      b.non_embedding_params, devs, seed)


def plan_table(plan: SweepPlan, estimates: list[RunEstimate] | None = None, mfu: float | None = None) -> str:
    """A markdown table of the planned runs and their status (FLOPs are training FLOPs); with
    ``estimates`` (:func:`estimate_runs`) also each run's estimated training time, its tokens/s and
    where they come from, and the totals (:func:`estimate_summary`)."""
    head = "| # | run | N (non-embedding) | train FLOPs/token | steps | tokens | train FLOPs | status |"
    rule = "|---:|---|---:|---:|---:|---:|---:|---|"
    if estimates is not None:
        head += " est. time | tokens/s | from |"
        rule += "---:|---:|---|"
    lines = [f"sweep {plan.sweep.name}: {len(plan.runs)} runs in {plan.output_dir}", head, rule]
    for k, r in enumerate(plan.runs):
        row = (f"| {r.index} | {r.name} | {r.non_embedding_params:,} | {r.train_flops_per_token:.4g} "
               f"| {r.steps:,} "
               f"| {r.tokens:,} | {r.train_flops:.3g} | {run_status(r)} |")
        if estimates is not None:
            e = estimates[k]
            row += (f" {format_duration(e.seconds)} | {e.tokens_per_s:,.0f} | {e.source} |" if e.tokens_per_s
                    else f" n/a | n/a | {e.source} |")
        lines.append(row)
    by_size: dict[str, int] = {}
    for r in plan.runs:
        by_size[r.size] = by_size.get(r.size, 0) + r.steps
    lines.append("steps per size (all architectures and budgets): "
                 + ", ".join(f"{k} {v:,}" for k, v in by_size.items()))
    if estimates is not None:
        lines += estimate_summary(plan, estimates, ASSUMED_MFU if mfu is None else mfu)
    lines += [f"note: {n}" for n in plan.notes]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# one pass over the data (max_epochs)
# ---------------------------------------------------------------------------------------------


def check_data_passes(plan: SweepPlan, prepare: bool = False) -> list[str]:
    """Check that no run reads more than ``max_epochs`` passes over the training split of its data.

    A run reads ``steps x tokens per step`` tokens; one pass holds ``windows per epoch x seq_len``
    labelled tokens, computed as the training loader does (:class:`smelt_ds.data.loader.TrainLoader`:
    windows of ``seq_len + 1`` tokens per shard, ``round(weight x windows)`` per source) from the
    prepared data (``meta.json``). Data that is not prepared yet is prepared first when ``prepare``
    (the first run would do it anyway), else left unchecked with a note. Returns the notes.

    Raises ConfigError naming the run that reads the most passes, how many, and the fixes.
    """
    if plan.sweep.max_epochs is None:
        return []
    limit = plan.sweep.max_epochs
    groups: dict[Path, list[PlannedRun]] = {}
    notes: list[str] = []
    unlocated: dict[str, list[str]] = {}
    for r in plan.runs:
        try:
            groups.setdefault(prepared_path(r.config.data), []).append(r)
        except ConfigError as e:  # e.g. a path source that lives on the cluster only
            unlocated.setdefault(str(e), []).append(r.name)
    notes += [f"max_epochs ({limit:g}) not checked for {len(names)} run(s) ({names[0]}, ...): their data cannot "
              f"be located here ({e}); run this dry run where the data is prepared to check it"
              for e, names in unlocated.items()]
    over: list[tuple[float, PlannedRun, int, Path]] = []
    checked: list[tuple[float, PlannedRun, int, Path]] = []
    for path, runs in groups.items():
        if prepare and not is_complete(path):
            prepare_from_config(runs[0].config.data)
        if not is_complete(path):
            first = runs[0]
            notes.append(f"max_epochs ({limit:g}) not checked for {len(runs)} run(s): their data is not prepared yet "
                         f"({path}); the sweep prepares it and checks before its first run, or now: smelt-ds data "
                         f"prepare --recipe {first.recipe_path} (after materializing: smelt-ds sweep {plan.source})")
            continue
        prepared = PreparedData.load(path, verify="size")
        per_pass: dict[int, int] = {}
        for r in runs:
            S = r.config.train.seq_len
            if S not in per_pass:
                per_pass[S] = TrainLoader(prepared, S, 1, dp_rank=0, dp_world_size=1).windows_per_epoch * S
            passes = r.tokens / per_pass[S]
            checked.append((passes, r, per_pass[S], path))
            if passes > limit:
                over.append((passes, r, per_pass[S], path))
    if over:
        passes, r, one, path = max(over, key=lambda x: x[0])
        others = f" (and {len(over) - 1} other run(s))" if len(over) > 1 else ""
        raise ConfigError(f"run {r.name} reads {r.tokens:,} training tokens, {passes:.3g} passes over the training "
                          f"split of its data ({one:,} tokens in windows of train.seq_len + 1 = "
                          f"{r.config.train.seq_len + 1}; {path}){others}, more than the sweep's max_epochs "
                          f"({limit:g}): lower budget {r.budget!r} or drop size {r.size!r}, or give the runs more "
                          "training text (more or larger sources, data.ladder_max_bytes unset, a lower "
                          "data.validation_share)")
    if checked:
        passes, r, one, path = max(checked, key=lambda x: x[0])
        notes.append(f"max_epochs ({limit:g}) holds for {len(checked)} run(s): the most any reads is {passes:.3g} "
                     f"passes over its training split, {r.name} ({r.tokens:,} of {one:,} tokens; {path})")
    return notes


# ---------------------------------------------------------------------------------------------
# time estimates
# ---------------------------------------------------------------------------------------------

#: model FLOPs utilisation assumed for an analytic estimate on GPUs (a share of the dense bf16
#: peak of :data:`smelt_ds.train.metrics.PEAK_TFLOPS`): an assumption, not a measurement;
#: Megatron-LM reports up to 52% of peak for large dense models (Narayanan et al. 2021), MoE
#: training usually runs lower
ASSUMED_MFU = 0.3
#: sustained training FLOP/s per CPU core assumed for an analytic estimate on CPU (fp32): the
#: micro sweep (recipes/sweeps/micro.yaml, 1.7e14 training FLOPs) trained at about 60 GFLOP/s on
#: 2 cores of the development machine (31-73 GFLOP/s from the smallest to the largest width)
CPU_FLOPS_PER_CORE = 30e9


@dataclass
class RunEstimate:
    """Estimated training time of one planned run.

    ``seconds``: wall-clock seconds of all its training steps at ``tokens_per_s`` (tokens/s of the
    whole run, all ranks); ``remaining_s``: of the steps not done yet (0 for a finished run, the
    steps after the newest complete checkpoint for a partial one). ``source`` says where
    ``tokens_per_s`` comes from (``measured: <file> of <run>`` or ``analytic: <assumption>``);
    ``gpus``: the GPUs the run occupies (None on CPU), for GPU-hours. The time values are None
    when no estimate exists (an analytic estimate for a GPU whose peak is unknown). Start-up,
    data preparation and validation are not counted beyond what a measured tokens/s holds."""

    tokens_per_s: float | None
    seconds: float | None
    remaining_s: float | None
    source: str
    gpus: int | None = None


def measured_tokens_per_s(run_dir: Path) -> tuple[float, Path] | None:
    """Training tokens/s measured in ``run_dir``: ``summary.json``'s ``tokens_per_s`` (the mean of
    the logged windows, all ranks), else the mean ``tokens_per_s`` of the rows of ``metrics.jsonl``
    (the same definition, for a run that has not finished). Returns (tokens/s, the file read), or
    None when neither holds a positive value. Unreadable files and lines count as absent."""

    summary = run_dir / "summary.json"
    if summary.is_file():
        try:
            tps = json.loads(summary.read_text()).get("tokens_per_s")
        except (json.JSONDecodeError, OSError, AttributeError):
            tps = None
        if isinstance(tps, (int, float)) and tps > 0:
            return float(tps), summary
    metrics = run_dir / "metrics.jsonl"
    if metrics.is_file():
        values = []
        for line in metrics.read_text(errors="replace").splitlines():
            try:
                v = json.loads(line).get("tokens_per_s")
            except (json.JSONDecodeError, AttributeError):
                continue
            if isinstance(v, (int, float)) and v > 0:
                values.append(float(v))
        if values:
            return sum(values) / len(values), metrics
    return None


def _cpu_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def _analytic(plan: SweepPlan, r: PlannedRun, nproc: int, cpu_cores: int | None,
              local_peak_tflops: float | None, mfu: float) -> tuple[float | None, int | None, str]:
    """Sustained training FLOP/s assumed for run ``r`` (None: unknown GPU), its GPUs (None on
    CPU) and the assumption, in words."""

    layouts = r.config.cluster.layouts
    if layouts:  # a cluster recipe: the layout it is rendered for
        name = plan.sweep.launch.layout or r.config.cluster.default or next(iter(layouts))
        lay = layouts.get(name) or next(iter(layouts.values()))
        gpus = lay.nodes * lay.gpus_per_node
        peak = next((v for k, v in PEAK_TFLOPS.items() if k.lower() in lay.gpu.lower()), None)
        if peak is None:
            return None, gpus, (f"analytic: no peak TFLOP/s known for GPU {lay.gpu!r} of layout {name!r} "
                                f"(known: {', '.join(PEAK_TFLOPS)})")
        return (gpus * peak * 1e12 * mfu, gpus,
                f"analytic: layout {name}, {gpus} x {lay.gpu} at {peak:g} TFLOP/s x MFU {mfu:g}")
    if local_peak_tflops:  # a local run on this machine's GPUs
        return (nproc * local_peak_tflops * 1e12 * mfu, nproc,
                f"analytic: {nproc} local GPU(s) at {local_peak_tflops:g} TFLOP/s x MFU {mfu:g}")
    cores = cpu_cores or _cpu_cores()
    return cores * CPU_FLOPS_PER_CORE, None, f"analytic: {cores} CPU core(s) x {CPU_FLOPS_PER_CORE / 1e9:g} GFLOP/s"


def _done_steps(r: PlannedRun, status: str) -> int:
    if status == "done":
        return r.steps
    newest = ckpt.latest_complete(r.run_dir) if status == "partial" else None
    try:
        return min(r.steps, int(newest.name.removeprefix("step"))) if newest is not None else 0
    except ValueError:
        return 0


def estimate_runs(plan: SweepPlan, nproc: int = 1, cpu_cores: int | None = None,
                  local_peak_tflops: float | None = None, mfu: float = ASSUMED_MFU) -> list[RunEstimate]:
    """Estimate every planned run's training time (seconds) from its tokens and a throughput
    (tokens/s), in plan order.

    Throughput, the first found:

    1. measured in the run's own directory (:func:`measured_tokens_per_s`);
    2. measured in the directory of another run of the plan with the same architecture and size
       (the same recipe with another step count; summary.json before metrics.jsonl, in plan order);
    3. the size's ``tokens_per_s`` in the sweep file (measured where the sweep was sized);
    4. analytic: sustained FLOP/s / the run's training FLOPs per token
       (:func:`smelt_ds.cost.budget.compute_budget`: 3x forward, every visit). Sustained FLOP/s:
       for a recipe with cluster layouts, the GPUs of its layout (the sweep's ``launch.layout``,
       else the recipe's default) x their dense bf16 peak
       (:data:`smelt_ds.train.metrics.PEAK_TFLOPS`) x ``mfu`` (default :data:`ASSUMED_MFU`; ``smelt-ds
       sweep --mfu``); else, on this machine,
       ``nproc`` GPUs x ``local_peak_tflops`` (TFLOP/s; None: the CUDA device's,
       :func:`smelt_ds.train.metrics.device_peak_tflops`; 0: no GPU) x ``mfu``, or without a
       known GPU ``cpu_cores`` (default: the cores this process may use) x
       :data:`CPU_FLOPS_PER_CORE`, whatever ``nproc`` (ranks share the cores).

    A measured tokens/s is the one of the world size that run had; ``nproc`` does not rescale it.
    """

    if local_peak_tflops is None:
        local_peak_tflops = device_peak_tflops()
    measured = {r.name: measured_tokens_per_s(r.run_dir) for r in plan.runs}
    by_kind: dict[tuple[str, str], list[PlannedRun]] = {}
    for r in plan.runs:
        by_kind.setdefault((r.architecture, r.size), []).append(r)
    out = []
    for r in plan.runs:
        flops, gpus, source = _analytic(plan, r, nproc, cpu_cores, local_peak_tflops, mfu)
        found = measured[r.name]
        if found is not None:
            tps, path = found
            source = f"measured: {path.name} of this run"
        else:
            siblings = [(m, s) for s in by_kind[(r.architecture, r.size)] if (m := measured[s.name]) is not None]
            siblings.sort(key=lambda x: x[0][1].name != "summary.json")  # stable: plan order within each kind
            given = next(z.tokens_per_s for z in plan.sweep.sizes if z.name == r.size)
            if siblings:
                (tps, path), other = siblings[0]
                source = f"measured: {path.name} of {other.name}"
            elif given is not None:
                tps, source = given, f"measured: sizes[{r.size}].tokens_per_s of the sweep file"
            elif flops is None:
                out.append(RunEstimate(None, None, None, source, gpus))
                continue
            else:
                tps = flops / r.train_flops_per_token
        left = (r.steps - _done_steps(r, run_status(r))) * r.tokens_per_step / tps
        out.append(RunEstimate(tps, r.tokens / tps, left, source, gpus))
    return out


def format_duration(seconds: float | None) -> str:
    """``seconds`` in s, min, h or days, 3 significant digits ("n/a" for None)."""
    if seconds is None:
        return "n/a"
    for unit, div in (("days", 86400.0), ("h", 3600.0), ("min", 60.0)):
        if seconds >= 2 * div:
            return f"{seconds / div:.3g} {unit}"
    return f"{seconds:.3g} s"


def estimate_summary(plan: SweepPlan, estimates: list[RunEstimate], mfu: float = ASSUMED_MFU) -> list[str]:
    """The lines under the plan table: estimated training time of all runs and of the unfinished
    ones (one after another), GPU-hours where the runs use GPUs, how many estimates are measured,
    and the analytic assumptions when any estimate uses them."""

    known = [e for e in estimates if e.seconds is not None]
    total = sum(e.seconds or 0.0 for e in known)
    left = sum(e.remaining_s or 0.0 for e in known)
    todo = sum(1 for r in plan.runs if run_status(r) != "done")
    n_meas = sum(e.source.startswith("measured") for e in known)
    line = (f"estimated training time: {format_duration(total)} for all {len(known)} runs one after another, "
            f"{format_duration(left)} for the {todo} not finished")
    if any(e.gpus for e in known):
        line += f" ({sum((e.seconds or 0.0) * (e.gpus or 0) for e in known) / 3600:,.0f} GPU-hours in all)"
    line += f"; tokens/s measured for {n_meas} runs, analytic for {len(known) - n_meas}"
    if len(known) < len(estimates):
        line += f", unknown for {len(estimates) - len(known)}"
    lines = [line]
    if any(e.source.startswith("analytic") for e in estimates):
        lines.append("analytic tokens/s = sustained FLOP/s / training FLOPs per token (3x forward, every visit), "
                     f"assuming MFU {mfu:g} of the dense bf16 peak on GPUs (--mfu) and "
                     f"{CPU_FLOPS_PER_CORE / 1e9:g} GFLOP/s per CPU core (fp32); measured tokens/s come from the "
                     "sweep's run directories (summary.json, metrics.jsonl); start-up, data preparation and "
                     "validation are not counted")
    return lines


# ---------------------------------------------------------------------------------------------
# files and status
# ---------------------------------------------------------------------------------------------


def materialize(plan: SweepPlan) -> None:
    """Write every run's recipe (``<output_dir>/recipes/<run>.yaml``), its label
    (``<run_dir>/sweep_run.json``: architecture, size, budget, planned steps and tokens) and
    ``<output_dir>/sweep_plan.json`` (every run of the sweep, also for a selection). Raises
    ConfigError when a run directory holds another run."""
    plan.output_dir.mkdir(parents=True, exist_ok=True)
    (plan.output_dir / "recipes").mkdir(exist_ok=True)
    for r in plan.runs:
        _check_conflict(r)
        header = (f"# Generated by `smelt-ds sweep {plan.source}`: architecture {r.architecture}, size {r.size}, "
                  f"budget {r.budget}\n")
        if r.deviations:
            header += "# deviations vs Baseline: " + ", ".join(f"{k} {v:+.3%}" for k, v in r.deviations.items()) + "\n"
        r.recipe_path.write_text(header + yaml.safe_dump(r.raw, sort_keys=False))
        r.run_dir.mkdir(parents=True, exist_ok=True)
        (r.run_dir / LABEL_FILE).write_text(json.dumps(r.label(plan.sweep.name), indent=2))
    (plan.output_dir / "sweep_plan.json").write_text(json.dumps(
        {"sweep": plan.sweep.model_dump(mode="json"), "source": str(plan.source),
         "runs": [{**r.label(plan.sweep.name), "run_dir": str(r.run_dir), "recipe": str(r.recipe_path)}
                  for r in plan.all_runs or plan.runs], "notes": plan.notes}, indent=1))


# fields that do not change what a run computes: the cluster layouts, this invocation's stop step
# and compilation (train.compile: the same computation, compiled or not)
_NOT_COMPARED = (("cluster",), ("train", "exit_after_steps"), ("train", "compile"), ("train", "compile_backend"),
                 ("train", "deterministic"))


def _comparable(d: dict[str, Any]) -> dict[str, Any]:
    d = copy.deepcopy(d)
    for path in _NOT_COMPARED:
        node = d
        for key in path[:-1]:
            node = node.get(key) or {}
        node.pop(path[-1], None)
    return d


def _check_conflict(r: PlannedRun) -> None:
    existing = r.run_dir / "config.yaml"
    if not existing.is_file():
        return
    there = _comparable(yaml.safe_load(existing.read_text()) or {})
    planned = _comparable(config_to_dict(r.config))
    # fields added to the schema since the run directory was written are not compared
    diffs = config_diff(common_keys(planned, there), common_keys(there, planned))
    if diffs:
        raise ConfigError(f"run directory {r.run_dir} holds a run of another recipe ({'; '.join(diffs[:4])}): "
                          "delete it, or give this sweep another output_dir (--output-dir)")


def run_status(r: PlannedRun) -> str:
    """``done`` (summary.json of the planned steps), ``partial`` (a complete checkpoint) or ``new``."""

    s = r.run_dir / "summary.json"
    if s.is_file():
        try:
            if json.loads(s.read_text()).get("steps") == r.steps:
                return "done"
        except json.JSONDecodeError:
            pass
    return "partial" if ckpt.latest_complete(r.run_dir) is not None else "new"


# ---------------------------------------------------------------------------------------------
# local execution
# ---------------------------------------------------------------------------------------------


@dataclass
class RunOutcome:
    run: PlannedRun
    status: str  # done | skipped | failed | interrupted
    seconds: float = 0.0
    message: str = ""


def _train_subprocess(r: PlannedRun, resume: str, nproc: int) -> tuple[int, bool]:

    if nproc > 1:
        cmd = launcher_command(argparse.Namespace(nproc=nproc, recipe=str(r.recipe_path), resume=resume, set=[],
                                                  run_dir=None))
    else:
        cmd = [sys.executable, "-m", "smelt_ds.train", str(r.recipe_path), "--resume", resume]
    with (r.run_dir / "train.log").open("a") as log:
        log.write(f"\n$ {shlex.join(cmd)}\n")
        log.flush()
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        try:
            return proc.wait(), False
        except KeyboardInterrupt:  # the child got SIGINT too: it saves a checkpoint and exits
            return proc.wait(), True


def _train_inprocess(r: PlannedRun, resume: str) -> tuple[int, bool]:

    res = train(r.config, resume=resume, run_dir=str(r.run_dir))
    return 0, res.stopped_early


def select_runs(plan: SweepPlan, only: list[str] | None) -> SweepPlan:
    """The plan with only the runs whose name matches one of the shell patterns ``only`` (all runs
    for None or []), in plan order. Raises ConfigError naming a pattern that matches no run."""
    if not only:
        return plan
    names = [r.name for r in plan.runs]
    for pattern in only:
        if not any(fnmatch.fnmatchcase(n, pattern) for n in names):
            raise ConfigError(f"--only {pattern!r} matches no run of sweep {plan.sweep.name}: the runs are "
                              f"named <architecture>-<size>-<budget>[-s<seed>], e.g. {names[0]!r} "
                              "(`--dry-run` lists them)")
    return dataclasses.replace(plan, runs=[r for r in plan.runs if any(fnmatch.fnmatchcase(r.name, p) for p in only)],
                               all_runs=plan.all_runs or plan.runs)


def run_local(plan: SweepPlan, limit: int | None = None, executor: str = "subprocess", nproc: int = 1,
              log: Callable[[str], None] = print, only: list[str] | None = None) -> list[RunOutcome]:
    """Train the plan's runs one after another: finished runs are skipped, interrupted ones resume
    from their newest complete checkpoint. ``limit``: train at most this many runs now. ``only``:
    shell patterns of run names (e.g. ``*-h80-c3.2e13``); the runs matching none are left for later
    (not trained, not listed as outcomes); ConfigError when a pattern matches no run.
    ``executor``: ``subprocess`` (``python -m smelt_ds.train`` per run, output to
    ``<run_dir>/train.log``; ``deepspeed`` launcher with ``nproc`` > 1) or ``inprocess``
    (:func:`smelt_ds.train.loop.train` in this process). Stops at the first interrupted run (Ctrl-C /
    SIGTERM: the run saved a checkpoint; rerun to continue). Returns one outcome per run."""

    if executor not in ("subprocess", "inprocess"):
        raise ConfigError(f"--executor {executor!r} is unknown: use 'subprocess' or 'inprocess'")
    runs = select_runs(plan, only).runs
    materialize(plan)
    check_data_passes(plan, prepare=True)
    outcomes: list[RunOutcome] = []
    todo = []
    for r in runs:
        (outcomes.append(RunOutcome(r, "skipped", message="finished earlier")) if run_status(r) == "done"
         else todo.append(r))
    if outcomes:
        log(f"sweep {plan.sweep.name}: {len(outcomes)} of {len(runs)} runs finished earlier")
    if limit is not None:
        todo = todo[:max(0, limit)]
    t_all = time.perf_counter()
    for k, r in enumerate(todo, 1):
        # auto also for a run without a checkpoint: materialize wrote its config.yaml, and a run that crashed
        # before its first save left files that a new run (--resume none) is refused over
        resume = "auto"
        resuming = ckpt.latest_complete(r.run_dir) is not None
        log(f"[{k}/{len(todo)}] {r.name}: {r.steps} steps x {r.tokens_per_step} tokens"
            + (" (resuming)" if resuming else "") + f" -> {r.run_dir}")
        t0 = time.perf_counter()
        try:
            rc, interrupted = (_train_inprocess(r, resume) if executor == "inprocess"
                               else _train_subprocess(r, resume, nproc))
        except ConfigError as e:
            rc, interrupted = 2, False
            outcomes.append(RunOutcome(r, "failed", time.perf_counter() - t0, str(e)))
            log(f"    failed: {e}")
            continue
        dt = time.perf_counter() - t0
        if run_status(r) == "done":
            loss = json.loads((r.run_dir / "summary.json").read_text())["validation_loss"].get("all")
            outcomes.append(RunOutcome(r, "done", dt))
            log(f"    done in {dt:.0f} s, validation loss {loss:.4f} nats/token")
        elif interrupted or rc in (0, 143):  # 143: the run got SIGTERM and saved a checkpoint
            outcomes.append(RunOutcome(r, "interrupted", dt, "stopped before the end; rerun to resume"))
            log(f"    interrupted after {dt:.0f} s: rerun the same command to resume")
            break
        else:
            outcomes.append(RunOutcome(r, "failed", dt, f"exit code {rc}; see {r.run_dir / 'train.log'}"))
            log(f"    failed (exit code {rc}) after {dt:.0f} s: see {r.run_dir / 'train.log'}")
    log(f"sweep {plan.sweep.name}: {sum(o.status == 'done' for o in outcomes)} trained, "
        f"{sum(o.status == 'skipped' for o in outcomes)} skipped, {sum(o.status == 'failed' for o in outcomes)} "
        f"failed in {time.perf_counter() - t_all:.0f} s")
    return outcomes


# ---------------------------------------------------------------------------------------------
# cluster rendering (reuses smelt_ds.launch)
# ---------------------------------------------------------------------------------------------


def _job_name(sweep: str, r: PlannedRun) -> str:
    name = re.sub(r"[^a-z0-9-]", "-", f"{sweep}-{r.index:03d}-{r.name}".lower())
    return re.sub(r"-+", "-", name)[:52].strip("-")


def _path_in_job(path: Path, workdir: str) -> str:
    """``path`` as the job sees it: relative to its working directory or the repository root
    (which the Kubernetes image holds at its workdir), else absolute (as smelt_ds.launch does)."""

    p = path.resolve()
    for base in (Path(workdir), REPO_ROOT):
        try:
            return str(p.relative_to(base.resolve()))
        except ValueError:
            continue
    return str(p)


def _job_options(plan: SweepPlan, r: PlannedRun, scheduler: str, log_dir: str | None = None):

    L = plan.sweep.launch
    return JobOptions(scheduler=scheduler, layout=L.layout, time=L.time, partition=L.partition, account=L.account,
                      sbatch=list(L.sbatch), env=list(L.env), image=L.image, namespace=L.namespace,
                      runs_pvc=L.runs_pvc, data_pvc=L.data_pvc, job_name=_job_name(plan.sweep.name, r),
                      log_dir=log_dir)


#: the job-array script of ``--render slurm``, filled by :func:`smelt_ds.launch.jobs.fill_template`
ARRAY_TEMPLATE = LAUNCHERS_DIR / "slurm" / "sweep_array.sbatch"


def render_slurm(plan: SweepPlan) -> list[Path]:
    """Write ``<output_dir>/launch/slurm/runs/<NNN>-<run>.sbatch`` (one job script per run, from
    :func:`smelt_ds.launch.jobs.render`) and one array script per node layout,
    ``<output_dir>/launch/slurm/array-<nodes>x<gpus>.sbatch`` (``launchers/slurm/sweep_array.sbatch``
    filled). Returns the array scripts."""

    materialize(plan)
    root = plan.output_dir / "launch" / "slurm"
    (root / "runs").mkdir(parents=True, exist_ok=True)
    (root / "logs").mkdir(exist_ok=True)
    log_dir = str((root / "logs").resolve())
    groups: dict[tuple[int, int], list[tuple[PlannedRun, Path, JobPlan]]] = {}
    for r in plan.runs:
        job = plan_job(r.recipe_path, _job_options(plan, r, "slurm", log_dir))
        script = root / "runs" / f"{r.index:03d}-{r.name}.sbatch"
        script.write_text(render(job))
        groups.setdefault((job.nodes, job.gpus_per_node), []).append((r, script, job))
    L = plan.sweep.launch
    out = []
    for (nodes, gpus), items in groups.items():
        workdir, lead = items[0][2].workdir, items[0][2].options.signal_lead_s
        entries = [os.path.relpath(s.resolve(), workdir) + "|" + os.path.relpath(r.run_dir.resolve(), workdir)
                   for r, s, _ in items]
        rel = [f"  {shlex.quote(e)}" for e in entries]
        extra = [f"#SBATCH --partition={L.partition}"] if L.partition else []
        extra += [f"#SBATCH --account={L.account}"] if L.account else []
        extra += [f"#SBATCH {o}" for o in L.sbatch]
        path = root / f"array-{nodes}x{gpus}.sbatch"
        values = {"SWEEP": plan.sweep.name, "SOURCE": str(plan.source), "NODES": str(nodes), "GPUS_PER_NODE": str(gpus),
                  "ARRAY_SCRIPT": str(path), "JOB_NAME": f"sweep-{plan.sweep.name}", "LAST_TASK": str(len(items) - 1),
                  "ARRAY_LIMIT": f"%{L.max_parallel}" if L.max_parallel else "", "TIME": L.time,
                  "SIGNAL_LEAD_S": str(lead), "LOG_DIR": log_dir, "EXTRA_SBATCH": "\n".join(extra),
                  "WORKDIR": shlex.quote(workdir), "RUNS": "\n".join(rel)}
        path.write_text(fill_template(ARRAY_TEMPLATE.read_text(), values, os.path.relpath(ARRAY_TEMPLATE, REPO_ROOT),
                                      by="smelt-ds sweep --render slurm"))
        out.append(path)
    return out


def render_k8s(plan: SweepPlan) -> list[Path]:
    """Write one Kubeflow PyTorchJob manifest per unfinished run (:func:`smelt_ds.launch.jobs.render`)
    to ``<output_dir>/launch/k8s/<NNN>-<run>.yaml``; each exits at once if its run has finished.
    The output_dir must lie on the runs volume (under ``runs/``). Returns the manifests."""

    materialize(plan)
    root = plan.output_dir / "launch" / "k8s"
    root.mkdir(parents=True, exist_ok=True)
    out = []
    for r in plan.runs:
        if run_status(r) == "done":
            continue
        job = plan_job(r.recipe_path, _job_options(plan, r, "k8s"))
        text = render(job)
        run_dir = _path_in_job(r.run_dir, job.workdir)
        cmd = k8s_pod_command(job)
        guarded = f"test -f {shlex.quote(run_dir + '/summary.json')} && exit 0; {cmd}"
        if json.dumps(cmd) not in text:  # the template changed: never write a job that retrains a finished run
            raise RuntimeError(f"render_k8s: the pod command of {r.name} is not in the rendered manifest")
        text = text.replace(json.dumps(cmd), json.dumps(guarded))
        path = root / f"{r.index:03d}-{r.name}.yaml"
        path.write_text(text)
        out.append(path)
    return out


# ---------------------------------------------------------------------------------------------
# the command: smelt-ds sweep SWEEP [--dry-run | --render slurm]
# ---------------------------------------------------------------------------------------------


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``smelt-ds sweep``."""
    s = sub.add_parser("sweep", help="run (locally, one after another) or render (Slurm / Kubernetes) a scaling sweep",
                       description="Expand a sweep file (sizes x token budgets x architectures; looped recipes "
                                   "matched to each size's Baseline) and train its runs one after another, skipping "
                                   "finished runs and resuming interrupted ones; or render cluster jobs.")
    s.add_argument("sweep", help="sweep YAML, e.g. recipes/sweeps/micro.yaml")
    s.add_argument("--dry-run", action="store_true",
                   help="print the planned runs with each run's estimated training time (from tokens/s measured in "
                        "the sweep's run directories, else analytic) and write nothing")
    s.add_argument("--render", choices=["slurm", "k8s", "all"], default=None,
                   help="write cluster job files under <output_dir>/launch/ instead of training (default: none, "
                        "train here)")
    s.add_argument("--limit", type=int, default=None,
                   help="train at most this many unfinished runs now (default: all)")
    s.add_argument("--only", action="append", default=None, metavar="PATTERN",
                   help="only the runs whose name matches this shell pattern (repeatable), e.g. --only 'smelt-h80-*': "
                        "trained, listed by --dry-run, rendered by --render; the others stay for a later call "
                        "(default: every run)")
    s.add_argument("--steps-scale", type=float, default=1.0,
                   help="multiply every run's steps and warmup (quick checks; writes to <output_dir>-x<F> "
                        "unless --output-dir is given; default 1)")
    s.add_argument("--output-dir", default=None, help="override the sweep's output_dir (default: the sweep file's)")
    s.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a recipe field of every size's Baseline, e.g. --set data.builtin_max_bytes=150000")
    s.add_argument("--executor", choices=["subprocess", "inprocess"], default="subprocess",
                   help="subprocess: one `python -m smelt_ds.train` per run (log in <run_dir>/train.log); "
                        "inprocess: train in this process (default subprocess)")
    s.add_argument("--nproc", type=int, default=1,
                   help="local ranks per run (deepspeed launcher when > 1; default 1)")
    s.add_argument("--mfu", type=_mfu, default=ASSUMED_MFU,
                   help="model FLOPs utilisation assumed for analytic GPU estimates: a share of the GPUs' dense bf16 "
                        f"peak, in (0, 1] (default {ASSUMED_MFU:g}); measured tokens/s are used where they exist")
    s.set_defaults(func=run_sweep)


def _mfu(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number: give a share of the peak, e.g. 0.4") from None
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"{value:g} is not in (0, 1]: give a share of the peak, e.g. 0.4 for 40%")
    return value


def _plan(args: argparse.Namespace):

    sweep = load_sweep(args.sweep)
    out = args.output_dir
    if out is None and args.steps_scale != 1.0:
        out = sweep.output_dir.format(name=sweep.name).rstrip("/") + f"-x{args.steps_scale:g}"
    return plan_sweep(sweep, args.sweep, output_dir=out, overrides=args.set, steps_scale=args.steps_scale)


def run_sweep(args: argparse.Namespace) -> int:

    if args.limit is not None and args.limit < 0:
        raise ConfigError(f"--limit ({args.limit}) must be >= 0")
    plan = _plan(args)
    shown = select_runs(plan, args.only)  # --only: the table, the estimate and the rendered jobs of those runs
    print(plan_table(shown, estimate_runs(shown, nproc=args.nproc, mfu=args.mfu), args.mfu))
    if args.dry_run or args.render:
        for note in check_data_passes(shown):
            print(f"note: {note}")
    if args.dry_run:
        return 0
    if args.render:
        written = []
        if args.render in ("slurm", "all"):
            written += render_slurm(shown)
        if args.render in ("k8s", "all"):
            written += render_k8s(shown)
        for p in written:
            print(f"wrote {p}")
        if args.render in ("slurm", "all"):
            print("submit: " + "; ".join(f"sbatch {p}" for p in written if p.suffix == ".sbatch"))
        if args.render in ("k8s", "all"):
            print(f"submit: kubectl apply -f {plan.output_dir / 'launch' / 'k8s'}  "
                  "(output_dir must be on the runs volume)")
        return 0
    outcomes = run_local(plan, limit=args.limit, executor=args.executor, nproc=args.nproc, only=args.only)
    print(f"fit: smelt-ds scaling fit {plan.output_dir}")
    if any(o.status == "interrupted" for o in outcomes):
        return 130
    return 1 if any(o.status == "failed" for o in outcomes) else 0
