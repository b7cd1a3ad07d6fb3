"""A sweep's checks and estimates before it trains: one pass over the data (:func:`check_data_passes`),
each run's training time from measured or analytic tokens/s (:func:`estimate_runs`) and the plan's table
(:func:`plan_table`). What a sweep is: :mod:`smelt_ds.study.sweep`."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from smelt_ds.data.cache import is_complete
from smelt_ds.data.loader import TrainLoader
from smelt_ds.data.prepare import prepare_from_config, prepared_path
from smelt_ds.data.prepared import PreparedData
from smelt_ds.errors import ConfigError
from smelt_ds.runs import checkpoint as ckpt
from smelt_ds.study.sweep_plan import PlannedRun, SweepPlan, run_status
from smelt_ds.train.metrics import FORM_PEAK_TFLOPS, device_peak_tflops, layout_peak_tflops

__all__ = ["check_data_passes", "plan_table", "RunEstimate", "measured_tokens_per_s", "estimate_runs",
           "estimate_summary", "format_duration", "ASSUMED_MFU", "CPU_FLOPS_PER_CORE"]


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
#: peak of :func:`smelt_ds.train.metrics.layout_peak_tflops`): an assumption, not a measurement;
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
        peak = layout_peak_tflops(lay.gpu)
        if peak is None:
            known = ", ".join(f"{family} {form}" for family, form in FORM_PEAK_TFLOPS)
            return None, gpus, (f"analytic: no peak TFLOP/s known for GPU {lay.gpu!r} of layout {name!r} "
                                f"(known: {known}, named with the form factor, e.g. 'H100-SXM5-80GB', or a "
                                "torch.cuda.get_device_name() name)")
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
       (:func:`smelt_ds.train.metrics.layout_peak_tflops`) x ``mfu`` (default
       :data:`ASSUMED_MFU`; ``smelt-ds sweep --mfu``); else, on this machine,
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
