"""``smelt-ds eval`` and ``smelt-ds analyze`` as library calls: evaluate or analyse several runs
on the same settings and collect one JSON-able result (the first run is the reference, normally
the Baseline).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch

from smelt_ds.errors import ConfigError
from smelt_ds.eval.analysis import analyze_model
from smelt_ds.eval.data import EvalData, open_eval_data
from smelt_ds.eval.icl import DEFAULT_SHOTS, TASK_NAMES, build_tasks, evaluate_task
from smelt_ds.eval.loss import combine_domains, evaluate_domain, position_buckets
from smelt_ds.eval.runs import LoadedRun, describe_model

__all__ = ["EvalSettings", "AnalysisSettings", "evaluate_runs", "analyze_runs", "resolve_seq_len"]


@dataclass
class EvalSettings:
    """What ``smelt-ds eval`` measures. Lengths in tokens, ``batches`` in micro-batches per domain."""

    seq_len: int | None = None  # default: the first run's train.seq_len
    micro_batch_size: int = 8
    batches: int | None = 32  # None: every window
    buckets: list[int] | None = None  # bucket ends; default powers of two from 8
    shots: tuple[int, ...] = DEFAULT_SHOTS
    episodes: int = 64
    tasks: tuple[str, ...] = TASK_NAMES
    seed: int = 0


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
    ``all`` is the token-weighted combination.
    """
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
            batches = d.batches(dom, seq_len, settings.micro_batch_size, settings.batches)
            per[dom] = evaluate_domain(r.model, batches, d.byte_lengths)
            log(f"[{r.name}] {dom}: loss {per[dom].loss:.4f} nats/token, {per[dom].bits_per_byte:.4f} bits/byte "
                f"({per[dom].tokens:,} tokens)")
        per["all"] = combine_domains(list(per.values()))
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
