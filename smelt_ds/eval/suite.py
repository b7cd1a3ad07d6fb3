"""``smelt-ds eval`` and ``smelt-ds analyze`` as library calls: evaluate or analyse several runs
on the same settings and collect one JSON-able result (the first run is the reference, normally
the Baseline).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch

from smelt_ds.errors import ConfigError
from smelt_ds.eval.analysis import analyze_model
from smelt_ds.eval.data import EvalData, open_eval_data
from smelt_ds.eval.icl import DEFAULT_SHOTS, TASK_NAMES, build_tasks, evaluate_task
from smelt_ds.eval.loss import evaluate_domain, position_buckets
from smelt_ds.runs import checkpoint as ckpt
from smelt_ds.runs.load import LoadedRun, describe_model
from smelt_ds.runs.validation_loss import ALL_DEFINITION, combine_domains

__all__ = ["EvalSettings", "AnalysisSettings", "evaluate_runs", "analyze_runs", "resolve_seq_len", "training_ranks",
           "training_windows"]


@dataclass
class EvalSettings:
    """What ``smelt-ds eval`` measures. Lengths in tokens, ``batches`` in micro-batches per domain
    (per rank when ``ranks`` > 1: windows split over ranks as training's validation splits them).

    ``training_windows``: take ``seq_len``, ``micro_batch_size``, ``batches`` and ``ranks`` from
    the first run (:func:`training_windows`), so the losses equal its in-loop validation."""

    seq_len: int | None = None  # default: the first run's train.seq_len
    micro_batch_size: int = 8
    batches: int | None = 32  # None: every window
    ranks: int = 1
    buckets: list[int] | None = None  # bucket ends; default powers of two from 8
    shots: tuple[int, ...] = DEFAULT_SHOTS
    episodes: int = 64
    tasks: tuple[str, ...] = TASK_NAMES
    seed: int = 0
    training_windows: bool = False


@dataclass
class AnalysisSettings:
    """What ``smelt-ds analyze`` reads: ``batches`` micro-batches per domain (``domains``: all
    validation domains when None) of ``seq_len`` tokens."""

    seq_len: int | None = None
    micro_batch_size: int = 4
    batches: int = 4
    domains: list[str] | None = None
    top_m: int = 3


def resolve_seq_len(runs: list[LoadedRun], seq_len: int | None) -> int:
    """``seq_len`` or the first run's ``train.seq_len``; must fit every run's ``model.max_seq_len``."""
    s = seq_len if seq_len is not None else runs[0].cfg.train.seq_len
    for r in runs:
        if s > r.cfg.model.max_seq_len:
            raise ConfigError(f"`--seq-len` ({s}) exceeds `model.max_seq_len` ({r.cfg.model.max_seq_len}) of run "
                              f"{r.name!r}: pass --seq-len <= {r.cfg.model.max_seq_len}")
        if s <= 1:
            raise ConfigError(f"`--seq-len` ({s}) must be > 1 token")
    return s


def training_ranks(run: LoadedRun) -> int:
    """Ranks (data-parallel x expert-parallel) that trained ``run``, from the ``COMPLETE`` marker of
    the checkpoint its export came from (the export's ``SOURCE``). Training's validation splits
    each domain's windows over that many ranks. Raises ConfigError when the checkpoint is unknown
    or gone (an export copied without its run)."""
    source = run.export_dir / "SOURCE"
    marker = Path(source.read_text().strip()) / ckpt.MARKER if source.is_file() else None
    if marker is None or not marker.is_file():
        where = f"{source} names {marker.parent}, which holds no {ckpt.MARKER}" if marker else f"{source} is missing"
        raise ConfigError(f"`--training-windows` needs the number of ranks that trained {run.name!r}, read from its "
                          f"checkpoint's {ckpt.MARKER} marker, but {where}: pass the run directory or checkpoint "
                          "instead of the export, or give --batches/--micro-batch/--seq-len yourself (training's "
                          "windows: the first eval.eval_batches x train.micro_batch_size x ranks of each domain)")
    return int(json.loads(marker.read_text()).get("world_size", 1))


def training_windows(run: LoadedRun) -> dict[str, int]:
    """The windows ``run``'s in-loop validation reads (:func:`smelt_ds.train.validation.evaluate`):
    ``{"seq_len": train.seq_len (tokens), "micro_batch_size": train.micro_batch_size (windows),
    "batches": eval.eval_batches (micro-batches per rank and domain), "ranks": ranks}``, i.e. per
    domain the first ``batches x micro_batch_size x ranks`` windows in shard order (fewer when the
    domain holds fewer). Raises ConfigError as :func:`training_ranks`."""
    t = run.cfg.train
    return {"seq_len": t.seq_len, "micro_batch_size": t.micro_batch_size, "batches": run.cfg.eval.eval_batches,
            "ranks": training_ranks(run)}


def _windows_notes(runs: list[LoadedRun], settings: EvalSettings, seq_len: int, windows: dict[str, int]) -> list[str]:
    """What the losses were computed on, ``all``'s definition, and how both relate to training's
    in-loop validation."""
    first = runs[0]
    per = ", ".join(f"{d} {w:,} windows = {w * seq_len:,} tokens" for d, w in windows.items())
    cap = ("every window" if settings.batches is None else
           f"at most {settings.batches} micro-batches of {settings.micro_batch_size} windows"
           + (f" on each of {settings.ranks} ranks" if settings.ranks > 1 else ""))
    notes = [f"loss of a domain: mean next-token cross-entropy (nats/token) over the label tokens of its first windows "
             f"of {seq_len} tokens in shard order ({cap}; {first.name}: {per}); `all`: {ALL_DEFINITION}, as "
             "training's val/all"]
    if not settings.training_windows:
        notes.append("training's in-loop validation (metrics.jsonl val/*, summary.txt) reads only the first "
                     "eval.eval_batches x train.micro_batch_size x ranks windows of each domain: --training-windows "
                     "evaluates exactly those")
        return notes
    notes.append(f"--training-windows: the windows of {first.name}'s in-loop validation (train.seq_len {seq_len}, "
                 f"eval.eval_batches {settings.batches} x train.micro_batch_size {settings.micro_batch_size} x "
                 f"{settings.ranks} rank(s)), so the losses equal its metrics.jsonl val/* at this checkpoint's "
                 "step, up "
                 "to float rounding (a run validated in bf16 or with a token-dropping MoE backend differs by that: "
                 "this evaluation runs the reference backend in fp32)")
    for r in runs[1:]:
        t = r.cfg.train
        if (t.seq_len, t.micro_batch_size, r.cfg.eval.eval_batches) != (seq_len, settings.micro_batch_size,
                                                                        settings.batches):
            notes.append(f"{r.name} validated on other windows in training (train.seq_len {t.seq_len}, "
                         f"train.micro_batch_size {t.micro_batch_size}, eval.eval_batches {r.cfg.eval.eval_batches}): "
                         "its numbers here are not its metrics.jsonl's")
    return notes


def _data_for(runs: list[LoadedRun]) -> dict[str, EvalData]:
    cache: dict[str, EvalData] = {}
    out = {}
    for r in runs:
        # runs trained on the same data section share one prepared directory
        key = r.cfg.data.model_dump_json() + r.eval_split
        if key not in cache:
            cache[key] = open_eval_data(r.cfg, r.eval_split)
        out[r.name] = cache[key]
    return out


def _same_data_note(data: dict[str, EvalData]) -> str | None:
    keys = {d.key for d in data.values()}
    if len(keys) > 1:
        return ("runs use different prepared data (keys " + ", ".join(sorted(k[:12] for k in keys)) +
                "): losses are not comparable across runs; bits per byte are tokenizer-independent")
    return None


@torch.no_grad()
def evaluate_runs(runs: list[LoadedRun], settings: EvalSettings, log=print) -> dict:
    """Per-domain loss and bits per byte, loss by position bucket, in-context curves.

    Returns ``{"kind": "eval", "runs": [...], "settings": {...}, "domains": {run: {domain: {...}}},
    "icl": {run: {task: {k: {...} | None}}}, "tasks": {task: {...}}, "notes": [...]}``; domain
    ``all`` weighs the domains equally (:data:`smelt_ds.runs.validation_loss.ALL_DEFINITION`); the notes
    state the windows evaluated. With ``settings.training_windows`` the windows are the first
    run's in-loop validation windows (:func:`training_windows`). Raises ConfigError for a
    ``seq_len`` beyond a run's context or an unknown training rank count.
    """
    if settings.training_windows:
        w = training_windows(runs[0])
        settings = replace(settings, seq_len=w["seq_len"], micro_batch_size=w["micro_batch_size"],
                           batches=w["batches"], ranks=w["ranks"])
    seq_len = resolve_seq_len(runs, settings.seq_len)
    buckets = position_buckets(seq_len, settings.buckets)
    max_len = min(r.cfg.model.max_seq_len for r in runs)
    data = _data_for(runs)
    result: dict[str, Any] = {"kind": "eval", "runs": [describe_model(r) for r in runs],
              "settings": {**asdict(settings), "seq_len": seq_len, "icl_max_len": max_len,
                           "buckets": [list(b) for b in buckets]},
              "domains": {}, "icl": {}, "tasks": {}, "notes": []}
    note = _same_data_note(data)
    if note:
        result["notes"].append(note)
    for r in runs:
        d = data[r.name]
        r.model.eval()
        per = {}
        for dom in d.domains:
            batches = d.batches(dom, seq_len, settings.micro_batch_size, settings.batches, settings.ranks)
            per[dom] = evaluate_domain(r.model, batches, d.byte_lengths)
            log(f"[{r.name}] {dom}: loss {per[dom].loss:.4f} nats/token, {per[dom].bits_per_byte:.4f} bits/byte "
                f"({per[dom].windows:,} windows, {per[dom].tokens:,} tokens)")
        per["all"] = combine_domains(list(per.values()))
        log(f"[{r.name}] all: loss {per['all'].loss:.4f} nats/token ({ALL_DEFINITION})")
        if r is runs[0]:
            result["notes"] += _windows_notes(runs, settings, seq_len, {k: v.windows for k, v in per.items()
                                                                        if k != "all"})
        result["domains"][r.name] = {k: v.as_dict(buckets) for k, v in per.items()}
        tasks = build_tasks(d, settings.tasks, settings.seed)
        result["icl"][r.name] = {}
        for t in tasks:
            result["tasks"].setdefault(t.name, {"kind": t.kind, "description": t.description})
            curve = evaluate_task(r.model, t, settings.shots, settings.episodes, max_len, d.prepared.pad_id)
            result["icl"][r.name][t.name] = {str(k): v for k, v in curve.items()}
            log(f"[{r.name}] icl {t.name}: " + ", ".join(
                f"k={k} {v['loss']:.3f}" if v else f"k={k} n/a" for k, v in curve.items()))
    return result


def _analysis_batches(d: EvalData, settings: AnalysisSettings, seq_len: int) -> list[dict]:
    domains = settings.domains or d.domains
    bad = [x for x in domains if x not in d.domains]
    if bad:
        raise ConfigError(f"`--domains` ({','.join(domains)}) names domain(s) {bad} without validation data: "
                          f"choose from {','.join(d.domains)}")
    out = []
    for dom in domains:
        out += d.batches(dom, seq_len, settings.micro_batch_size, settings.batches)
    return out


@torch.no_grad()
def analyze_runs(runs: list[LoadedRun], settings: AnalysisSettings, log=print) -> dict:
    """Attention sink, routing and logit lens of every run (see :mod:`smelt_ds.eval.analysis`).

    Returns ``{"kind": "analysis", "runs": [...], "settings": {...}, "analysis": {run: {...}}, "notes": [...]}``.
    """
    seq_len = resolve_seq_len(runs, settings.seq_len)
    data = _data_for(runs)
    result: dict[str, Any] = {"kind": "analysis", "runs": [describe_model(r) for r in runs],
              "settings": {**asdict(settings), "seq_len": seq_len}, "analysis": {}, "notes": []}
    note = _same_data_note(data)
    if note:
        result["notes"].append(note)
    for r in runs:
        batches = _analysis_batches(data[r.name], settings, seq_len)
        a = analyze_model(r.model, batches, settings.top_m)
        result["analysis"][r.name] = a
        sink = [v["mean"]["first_mass"] for v in a["attention"].values()]
        log(f"[{r.name}] first-token mass per visit: " + " ".join(f"{x:.3f}" for x in sink)
            + f"; lens loss final {a['logit_lens']['final_loss']:.4f}")
    return result
