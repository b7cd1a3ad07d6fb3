"""A sweep file's schema (:class:`SweepConfig`), its plan of runs (:func:`plan_sweep`) and the runs'
files and status on disk (:func:`materialize`, :func:`run_status`). What a sweep is: :mod:`smelt_ds.study.sweep`."""

from __future__ import annotations

import copy
import json
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
from smelt_ds.errors import ConfigError
from smelt_ds.launch.placement import load_raw
from smelt_ds.mappings import deep_merge
from smelt_ds.runs import checkpoint as ckpt
from smelt_ds.train.guards import common_keys

__all__ = ["SweepConfig", "SweepSize", "SweepBudget", "SweepArchitecture", "SweepLaunch", "load_sweep",
           "PlannedRun", "SweepPlan", "plan_sweep", "materialize", "run_status", "NAME_PATTERN", "LABEL_FILE"]

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
