"""Collecting runs for the scaling fits: one :class:`RunPoint` (final validation loss, non-embedding
parameters N, training tokens D, training FLOPs per token) per finished run directory, and the runs
left out with the reason (:class:`Exclusion`)."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from smelt_ds.errors import ConfigError

__all__ = ["RunPoint", "Exclusion", "architecture_label", "collect_runs", "average_replicates", "summarize_exclusions"]


@dataclass
class RunPoint:
    """One finished run. ``loss`` nats/token; ``N`` non-embedding parameters; ``D`` training
    tokens; ``flops_per_token`` training FLOPs per token (3 x forward, loops counted);
    ``C = flops_per_token * D`` training FLOPs. ``seed``: the sweep's replicate seed (None: one run
    per point); ``replicates``: runs averaged into this point (:func:`average_replicates`)."""

    run_dir: str
    architecture: str
    loss: float
    N: float
    D: float
    flops_per_token: float
    position: str = "none"
    size: str | None = None
    budget: str | None = None
    seed: int | None = None
    replicates: int = 1

    @property
    def C(self) -> float:
        return self.flops_per_token * self.D

    def point_key(self) -> tuple:
        """The design point: (architecture, size, budget) from the sweep labels, else (architecture, N, D)."""
        if self.size is not None and self.budget is not None:
            return (self.architecture, "label", self.size, self.budget)
        return (self.architecture, "N, D", self.N, self.D)


@dataclass
class Exclusion:
    """A run (or architecture) left out of the analysis and why."""

    what: str
    reason: str


def architecture_label(loop: dict[str, Any]) -> str:
    """Architecture of a recipe's ``loop`` section: ``baseline`` for ``position: none``, else
    ``<position>x<repeats>`` (``custom``/explicit ranges: ``custom[start:end:repeats,...]``)."""
    pos = loop.get("position", "middle")
    if pos == "none":
        return "baseline"
    if loop.get("ranges"):
        rs = ",".join(f"{r['start']}:{r['end']}:{r['repeats']}" for r in loop["ranges"])
        return f"{pos}[{rs}]"
    return f"{pos}x{loop.get('repeats', 2)}"


def _is_run_dir(p: Path) -> bool:
    return any((p / n).is_file() for n in ("summary.json", "sweep_run.json", "config.yaml"))


def _find_run_dirs(path: Path) -> list[Path]:
    if _is_run_dir(path):
        return [path]
    found = sorted({m.parent for n in ("summary.json", "sweep_run.json") for m in path.rglob(n)
                    if "checkpoints" not in m.parts and "exports" not in m.parts})
    return [p for p in found if not any(q != p and q in p.parents for q in found)]


class _Unreadable(Exception):
    """A run's file that cannot be read (the message names it and what is wrong)."""


def _read_file(path: Path, parse) -> dict[str, Any]:
    """``parse(text)`` of ``path``, which must give a mapping; raises :class:`_Unreadable`."""
    try:
        data = parse(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError, yaml.YAMLError) as e:  # JSONDecodeError is a ValueError
        raise _Unreadable(f"{path} is not readable ({type(e).__name__}: {str(e).splitlines()[0][:160]})") from None
    if data is None and path.suffix == ".yaml":
        return {}
    if not isinstance(data, dict):
        raise _Unreadable(f"{path} is not readable (holds a {type(data).__name__}, not a mapping)")
    return data


def _read_point(run_dir: Path, loss_key: str, skip_unreadable: bool = False) -> RunPoint | Exclusion:
    """The run's point, or why it is left out. Raises ConfigError naming the file when its
    summary.json, sweep_run.json or config.yaml cannot be read, unless ``skip_unreadable``."""
    try:
        return _read_files(run_dir, loss_key)
    except _Unreadable as e:
        if skip_unreadable:
            return Exclusion(str(run_dir), f"unreadable: {e} (--skip-unreadable)")
        raise ConfigError(f"{e}: the run's results cannot be read, and fitting without them would change the fit "
                          "without a word; restore the file (or rerun the run), remove the run directory, or "
                          "pass --skip-unreadable to fit without it (it is then listed as excluded)") from None


def _read_files(run_dir: Path, loss_key: str) -> RunPoint | Exclusion:
    label = _read_file(run_dir / "sweep_run.json", json.loads) if (run_dir / "sweep_run.json").is_file() else {}
    if not (run_dir / "summary.json").is_file():
        return Exclusion(str(run_dir), "unfinished: no summary.json (missing or interrupted run; "
                                       "`smelt-ds sweep` resumes it)")
    s = _read_file(run_dir / "summary.json", json.loads)
    val = s.get("validation_loss") or {}
    if loss_key not in val:
        return Exclusion(str(run_dir), f"summary.json has no validation_loss[{loss_key!r}] "
                                       f"(domains: {sorted(val)})")
    loss = val[loss_key]
    if loss is None or not math.isfinite(loss) or loss <= 0:
        return Exclusion(str(run_dir), f"validation loss {loss!r} is not a finite positive number (diverged run?)")
    b = s.get("budget") or {}
    if not b.get("non_embedding_params") or not b.get("train_flops_per_token") or not s.get("tokens"):
        return Exclusion(str(run_dir), "summary.json lacks budget.non_embedding_params, "
                                       "budget.train_flops_per_token or tokens")
    loop: dict[str, Any] = {}
    if (run_dir / "config.yaml").is_file():
        loop = _read_file(run_dir / "config.yaml", yaml.safe_load).get("loop") or {}
    arch = label.get("architecture") or architecture_label(loop)
    return RunPoint(str(run_dir), arch, float(loss), float(b["non_embedding_params"]), float(s["tokens"]),
                    float(b["train_flops_per_token"]), position=label.get("position", loop.get("position", "none")),
                    size=label.get("size"), budget=label.get("budget"), seed=label.get("seed"))


def collect_runs(paths: Sequence[str | Path], loss_key: str = "all",
                 skip_unreadable: bool = False) -> tuple[list[RunPoint], list[Exclusion]]:
    """Read runs from run directories or directories holding run directories (a sweep's
    ``output_dir``). Returns the usable runs and the runs left out with reasons (unfinished,
    non-finite loss, missing fields; with ``skip_unreadable``, a run whose summary.json,
    sweep_run.json or config.yaml cannot be read).

    Raises ConfigError for a path that does not exist or holds no run directory, and for a run
    whose summary.json, sweep_run.json or config.yaml cannot be read (corrupt or truncated),
    naming the file, unless ``skip_unreadable``.
    """
    points: list[RunPoint] = []
    excluded: list[Exclusion] = []
    seen: set[Path] = set()
    for raw in paths:
        path = Path(raw)
        if not path.exists():
            raise ConfigError(f"run directory {str(path)!r} does not exist: pass run directories (with "
                              "summary.json) or a sweep's output_dir")
        dirs = _find_run_dirs(path)
        if not dirs:
            raise ConfigError(f"{str(path)!r} holds no run directory (no summary.json, sweep_run.json or "
                              "config.yaml below it): pass a run directory or a sweep's output_dir")
        for d in dirs:
            if d.resolve() in seen:
                continue
            seen.add(d.resolve())
            r = _read_point(d, loss_key, skip_unreadable)
            if isinstance(r, RunPoint):
                points.append(r)
            else:
                excluded.append(r)
    return points, excluded


def average_replicates(points: Sequence[RunPoint]) -> list[RunPoint]:
    """One point per design point (:meth:`RunPoint.point_key`: the same architecture, size and budget,
    i.e. replicates of another seed), in the order of their first run: its loss is the mean of the
    replicates' losses (nats/token) and ``replicates`` their number; N, D and FLOPs per token are the
    first run's (replicates differ only in train.seed). A point trained with two seeds thus weighs as
    much in the fits as a point trained once. Points without replicates are returned as they are."""
    groups: dict[tuple, list[RunPoint]] = {}
    for p in points:
        groups.setdefault(p.point_key(), []).append(p)
    out = []
    for g in groups.values():
        if len(g) == 1:
            out.append(g[0])
            continue
        first = g[0]
        out.append(RunPoint(";".join(p.run_dir for p in g), first.architecture, sum(p.loss for p in g) / len(g),
                            first.N, first.D, first.flops_per_token, position=first.position, size=first.size,
                            budget=first.budget, seed=None, replicates=len(g)))
    return out


def summarize_exclusions(excluded: list[Exclusion], examples: int = 2) -> list[str]:
    """One line per distinct reason: ``<count> x <reason> (e.g. <paths>)``."""
    by: dict[str, list[str]] = {}
    for e in excluded:
        by.setdefault(e.reason, []).append(e.what)
    return [f"{len(w)} x {r} (e.g. {', '.join(w[:examples])}{', ...' if len(w) > examples else ''})"
            if len(w) > 1 else f"{w[0]}: {r}" for r, w in by.items()]
