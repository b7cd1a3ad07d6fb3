"""``smelt-ds plot RUN [RUN ...]``: training curves of run directories as one PNG and the numbers as CSV.

    smelt-ds plot runs/tiny-baseline runs/tiny-smelt -o curves.png     # + curves.csv beside it

Read from each run directory (a run still training can be plotted; nothing is written to it
unless the default output is used): ``metrics.jsonl`` (:mod:`smelt_ds.train.metrics`) and
``config.yaml``, whose recipe gives the training FLOPs per token
(:func:`smelt_ds.cost.budget.compute_budget` at ``train.seq_len``: 3 x forward, attention over
``seq_len`` keys); a run without a loadable ``config.yaml`` falls back to ``summary.json``'s budget.

Panels: training loss (nats/token: ``loss``, the training objective's mean over each logging
interval) and validation loss per domain (one colour per run, one line style and marker per
domain) vs tokens and vs training FLOPs (training FLOPs per token x tokens, the "6N" axis: the fair
one when runs spend different FLOPs per token; a FLOP-matched SMELT and Baseline differ on it by
their FLOPs deviation, under 1%); learning rate; gradient norm (before clipping); expert load
(max over mean tokens per expert) per (layer, visit), one panel per run.

Validation rows carry no ``tokens``: a validation at step ``s`` is placed at the tokens of the
training rows around it (linear between logged steps, which is exact for the constant tokens per
optimizer step), or at ``s x train_batch_size x seq_len`` from ``ds_config.json`` when the run has
logged no training row yet.

The CSV is long form, one plotted number a row: ``run, step, tokens, train_flops, metric, value``
(``metric`` is the ``metrics.jsonl`` key, e.g. ``loss``, ``val/code``, ``router/L1V0/load_max_over_mean``).
"""

from __future__ import annotations

import argparse
import bisect
import csv
import io
import json
import math
import os
import re
import sys
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from smelt_ds.arguments import CommaList
from smelt_ds.config.loading import load_config
from smelt_ds.config.run import RunConfig
from smelt_ds.cost.budget import compute_budget
from smelt_ds.errors import ConfigError
from smelt_ds.eval.plots import DPI, safe_name
from smelt_ds.files import write_atomic, write_text_atomic

__all__ = ["RunCurves", "IncompleteLineWarning", "read_metrics", "load_curves", "load_runs", "parse_labels",
           "curve_rows", "write_csv", "figure_size", "plot_curves", "output_paths", "run_plot", "add_parser",
           "CSV_COLUMNS", "X_AXES"]

CSV_COLUMNS = ("run", "step", "tokens", "train_flops", "metric", "value")
X_AXES = ("tokens", "flops", "both")
_LOAD = re.compile(r"^router/L(\d+)V(\d+)/load_max_over_mean$")
_STYLES = ("-", "--", ":", "-.")
_MARKERS = ("o", "s", "^", "D", "v", "P", "X")
_PANEL_W, _PANEL_H = 6.0, 3.2  # inches per panel; two panels a row


class IncompleteLineWarning(UserWarning):
    """The last line of a ``metrics.jsonl`` is incomplete (a run still writing it) and was skipped."""


@dataclass
class RunCurves:
    """The plotted series of one run.

    Attributes:
        label: legend and CSV name of the run.
        path: the run directory.
        train_flops_per_token: training FLOPs per token (3 x forward, :mod:`smelt_ds.cost.budget`).
        series: ``metrics.jsonl`` key -> ``[(step, tokens, value)]`` sorted by step (steps are
            optimizer steps, tokens the training tokens seen at that step).
    """

    label: str
    path: Path
    train_flops_per_token: float
    series: dict[str, list[tuple[int, int, float]]] = field(default_factory=dict)

    def flops(self, tokens: int) -> float:
        """Training FLOPs spent after ``tokens`` training tokens."""
        return self.train_flops_per_token * tokens


# ---------------------------------------------------------------------------------------------
# reading
# ---------------------------------------------------------------------------------------------


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """The rows of a ``metrics.jsonl`` file (blank lines skipped).

    An unparsable last line without its newline (a run still writing it) is skipped with an
    :class:`IncompleteLineWarning`. Raises ConfigError naming the file and the line number for a
    damaged line (not JSON, not an object, no integer ``step``), and for a file without rows.
    """
    path = Path(path)
    text = path.read_text(encoding="utf-8", errors="replace")
    lines = text.split("\n")  # the last element is "" when the file ends with a newline
    rows = []
    for i, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            if i == len(lines):
                warnings.warn(f"{path}: line {i} is incomplete (the run is still writing it?): skipped",
                              IncompleteLineWarning, stacklevel=2)
                continue
            raise ConfigError(f"{path}: line {i} is damaged ({e.msg}): {line[:80]!r}; delete or repair that line "
                              "(each line is one JSON object written by the training)") from None
        if not isinstance(row, dict) or not isinstance(row.get("step"), int) or isinstance(row.get("step"), bool):
            raise ConfigError(f"{path}: line {i} is not a metrics row (a JSON object with an integer 'step'): "
                              f"{line[:80]!r}; delete or repair that line")
        rows.append(row)
    if not rows:
        raise ConfigError(f"{path} holds no metrics rows yet: the run logs its first row after train.log_every "
                          "steps; plot it once a row is there")
    return rows


def _run_config(run_dir: Path) -> tuple[RunConfig | None, ConfigError | None]:
    """The run's resolved recipe (``config.yaml``), or None and why not."""
    if not (run_dir / "config.yaml").is_file():
        return None, None
    try:
        return load_config(run_dir / "config.yaml"), None
    except ConfigError as e:
        return None, e


def _train_flops_per_token(run_dir: Path, cfg: RunConfig | None, error: ConfigError | None) -> float:
    """Training FLOPs per token of the run's recipe, else of ``summary.json``'s budget."""
    if cfg is not None:
        return compute_budget(cfg, cfg.train.seq_len).train_flops_per_token
    try:
        return float(json.loads((run_dir / "summary.json").read_text())["budget"]["train_flops_per_token"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    if error is not None:
        raise ConfigError(f"run {str(run_dir)!r}: its config.yaml cannot be loaded, and no summary.json budget "
                          f"gives the training FLOPs per token instead: {error}")
    raise ConfigError(f"run {str(run_dir)!r} has no config.yaml (nor a summary.json with a budget): the training "
                      "FLOPs per token come from the run's recipe; pass a run directory written by `smelt-ds train`")


def _tokens_per_step(run_dir: Path, cfg: RunConfig | None) -> int | None:
    """Tokens per optimizer step from ``ds_config.json`` (``train_batch_size`` samples x ``train.seq_len``)."""
    if cfg is None:
        return None
    try:
        return int(json.loads((run_dir / "ds_config.json").read_text())["train_batch_size"]) * cfg.train.seq_len
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _tokens_of_steps(rows: list[dict[str, Any]], run_dir: Path, cfg: RunConfig | None, path: Path):
    """A function step -> training tokens: linear between the logged ``(step, tokens)`` points
    (and ``(0, 0)``), the last points' tokens per step beyond them."""
    known = {0: 0}
    for r in rows:
        if _is_number(r.get("tokens")):
            known[r["step"]] = int(r["tokens"])
    steps = sorted(known)
    if len(steps) == 1:
        per_step = _tokens_per_step(run_dir, cfg)
        if per_step is None:
            raise ConfigError(f"{path} logs no training row with 'tokens' yet and {run_dir / 'ds_config.json'} does "
                              "not give the tokens per step: plot the run after its first training row "
                              "(train.log_every steps)")
        return lambda s: s * per_step

    def tokens(s: int) -> int:
        if s in known:
            return known[s]
        j = bisect.bisect_left(steps, s)
        lo, hi = (steps[j - 1], steps[j]) if j < len(steps) else (steps[-2], steps[-1])
        rate = (known[hi] - known[lo]) / (hi - lo)
        return round(known[lo] + (s - lo) * rate)

    return tokens


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _plotted(key: str) -> bool:
    return key in ("loss", "lr", "grad_norm") or key.startswith("val/") or bool(_LOAD.match(key))


def load_curves(run_dir: str | Path, label: str | None = None) -> RunCurves:
    """The plotted series of the run directory ``run_dir``; ``label`` defaults to the recipe name
    (``config.yaml``'s ``name``), else the directory name.

    Raises ConfigError for a path that is not a run directory (no ``metrics.jsonl``), a
    ``metrics.jsonl`` without rows or with a damaged line, and a run whose training FLOPs per
    token cannot be computed (see :func:`read_metrics`, the module docstring)."""
    run_dir = Path(run_dir)
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        what = "does not exist" if not run_dir.exists() else ("is a file" if not run_dir.is_dir()
                                                               else "has no metrics.jsonl")
        raise ConfigError(f"run {str(run_dir)!r} {what}: pass run directories written by `smelt-ds train` "
                          "(they hold metrics.jsonl from the first logged step on)")
    rows = read_metrics(path)
    cfg, cfg_error = _run_config(run_dir)
    flops_per_token = _train_flops_per_token(run_dir, cfg, cfg_error)
    tokens = _tokens_of_steps(rows, run_dir, cfg, path)
    by_key: dict[str, dict[int, float]] = {}
    for r in rows:
        for k, v in r.items():
            if _plotted(k) and _is_number(v):
                by_key.setdefault(k, {})[r["step"]] = float(v)  # a step logged twice: the later row wins
    series = {k: [(s, tokens(s), v) for s, v in sorted(d.items())] for k, d in by_key.items()}
    return RunCurves(label or (cfg.name if cfg is not None else run_dir.name), run_dir, flops_per_token, series)


def _unique(labels: list[str], runs: list[Path]) -> list[str]:
    if len(set(labels)) == len(labels):
        return labels
    return [f"{lab} ({p.name})" if labels.count(lab) > 1 else lab for lab, p in zip(labels, runs, strict=True)]


def parse_labels(labels: str | None, n_runs: int) -> list[str] | None:
    """``--labels A,B`` as a list of ``n_runs`` names (None when not given). Raises ConfigError
    for another count or an empty name."""
    if labels is None:
        return None
    out = [s.strip() for s in labels.split(",")]
    if len(out) != n_runs or not all(out):
        raise ConfigError(f"--labels {labels!r} gives {len(out)} name(s) for {n_runs} run(s): pass one non-empty "
                          "name per RUN, comma-separated, in the order of the runs")
    return out


def load_runs(runs: list[str | Path], labels: list[str] | None = None) -> list[RunCurves]:
    """:func:`load_curves` of each run, with ``labels`` (one per run) or the recipe names made unique."""
    given: list[str | None] = list(labels) if labels is not None else [None] * len(runs)
    curves = [load_curves(r, lab) for r, lab in zip(runs, given, strict=True)]
    names = _unique([c.label for c in curves], [c.path for c in curves])
    for c, n in zip(curves, names, strict=True):
        c.label = n
    return curves


# ---------------------------------------------------------------------------------------------
# writing
# ---------------------------------------------------------------------------------------------


def curve_rows(runs: list[RunCurves]) -> list[tuple[str, int, int, float, str, float]]:
    """Every plotted number in long form: ``(run, step, tokens, train FLOPs, metric, value)``, by
    run, then metric, then step."""
    return [(r.label, s, t, r.flops(t), k, v) for r in runs for k in sorted(r.series) for s, t, v in r.series[k]]


def write_csv(runs: list[RunCurves], path: str | Path) -> Path:
    """Write :func:`curve_rows` with the header :data:`CSV_COLUMNS` to ``path`` atomically."""
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(CSV_COLUMNS)
    w.writerows((run, s, t, repr(f), k, repr(v)) for run, s, t, f, k, v in curve_rows(runs))
    return write_text_atomic(path, buf.getvalue())


def _plt():
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def _domains(runs: list[RunCurves]) -> list[str]:
    """Validation domains in first-seen order, ``all`` last."""
    ds = list(dict.fromkeys(k.removeprefix("val/") for r in runs for k in r.series if k.startswith("val/")))
    return sorted(ds, key=lambda d: d == "all")


def _x_values(r: RunCurves, pts, axis: str) -> list[float]:
    return [float(t) if axis == "tokens" else r.flops(t) for _, t, _ in pts]


def _xlabel(axis: str) -> str:
    return "training tokens" if axis == "tokens" else "training FLOPs (FLOPs/token x tokens)"


def _loss_panels(axes, runs: list[RunCurves], colors, axis: str) -> None:
    ax_t, ax_v = axes
    for r, c in zip(runs, colors, strict=True):
        pts = r.series.get("loss", [])
        ax_t.plot(_x_values(r, pts, axis), [v for *_, v in pts], color=c, lw=1.2, label=r.label, **_markers_if_few(pts))
    ax_t.set_title(f"train loss (mean over each logging interval) vs {axis}", fontsize=9)
    ax_t.set_ylabel("loss (nats/token)")
    for j, d in enumerate(_domains(runs)):
        for r, c in zip(runs, colors, strict=True):
            pts = r.series.get(f"val/{d}", [])
            if pts:
                ax_v.plot(_x_values(r, pts, axis), [v for *_, v in pts], color=c, ls=_STYLES[j % len(_STYLES)],
                          marker=_MARKERS[j % len(_MARKERS)], ms=4, lw=1.2, label=f"{r.label} {d}")
    ax_v.set_title(f"validation loss per domain vs {axis} ('all': domains weighted equally)", fontsize=9)
    ax_v.set_ylabel("loss (nats/token)")
    for ax in axes:
        ax.set_xlabel(_xlabel(axis))
        _legend(ax)


def _markers_if_few(pts) -> dict[str, Any]:
    """Markers for a series of one to three points (a run that has just started), which a line alone hides."""
    return {"marker": "o", "ms": 4} if len(pts) <= 3 else {}


def _legend(ax) -> None:
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7, ncol=2 if len(ax.get_legend_handles_labels()[0]) > 4 else 1)
    else:
        ax.text(0.5, 0.5, "nothing logged yet", ha="center", va="center", transform=ax.transAxes, fontsize=8)
    ax.grid(alpha=0.3)


def _scalar_panel(ax, runs: list[RunCurves], colors, key: str, title: str, axis: str, widen: bool = False,
                  log: bool = False) -> None:
    """One line per run. ``widen``: earlier runs drawn wider, so equal curves (runs sharing one LR
    schedule) stay visible; ``log``: log y-axis (gradient norms: a spike does not flatten the rest)."""
    for i, (r, c) in enumerate(zip(runs, colors, strict=True)):
        pts = r.series.get(key, [])
        lw = 1.2 + 2.4 * (len(runs) - 1 - i) / max(1, len(runs) - 1) if widen else 1.2
        ax.plot(_x_values(r, pts, axis), [v for *_, v in pts], color=c, lw=lw, label=r.label, **_markers_if_few(pts))
    if log and all(v > 0 for r in runs for *_, v in r.series.get(key, [])) and any(r.series.get(key) for r in runs):
        ax.set_yscale("log")
        title = title.replace(" vs ", " (log scale) vs ", 1)
    ax.set_title(title, fontsize=9)
    ax.set_xlabel(_xlabel(axis))
    _legend(ax)


def _load_panel(ax, r: RunCurves, axis: str) -> None:
    """One run's expert load per (layer, visit): colour per layer, line style per visit."""
    keys = sorted((int(m[1]), int(m[2]), k) for k in r.series if (m := _LOAD.match(k)))
    layers = sorted({layer for layer, _, _ in keys})
    cmap = _plt().get_cmap("viridis")
    for layer, visit, k in keys:
        pts = r.series[k]
        c = cmap(layers.index(layer) / max(1, len(layers) - 1) * 0.9)
        ax.plot(_x_values(r, pts, axis), [v for *_, v in pts], color=c, ls=_STYLES[visit % len(_STYLES)], lw=1.1,
                label=f"L{layer}V{visit}")
    ax.set_title(f"{r.label}: expert load (max / mean tokens per expert) per (layer, visit)", fontsize=9)
    ax.set_xlabel(_xlabel(axis))
    _legend(ax)


def figure_size(n_runs: int, x: str = "both") -> tuple[int, int]:
    """``(width, height)`` in pixels of :func:`plot_curves`'s PNG for ``n_runs`` runs."""
    rows = (2 if x == "both" else 1) + 1 + math.ceil(n_runs / 2)
    return round(2 * _PANEL_W * DPI), round(rows * _PANEL_H * DPI)


def plot_curves(runs: list[RunCurves], path: str | Path, x: str = "both") -> tuple[int, int]:
    """Draw the curves of ``runs`` (colours in run order) into the PNG ``path`` (written atomically)
    and return its ``(width, height)`` in pixels (:func:`figure_size`).

    ``x``: ``tokens``, ``flops`` or ``both`` (loss panels against each; LR, gradient norm and expert
    load against tokens unless ``x`` is ``flops``). Raises ConfigError for another ``x``."""
    if x not in X_AXES:
        raise ConfigError(f"--x {x!r} is unknown: use one of {', '.join(X_AXES)}")
    plt = _plt()
    w, h = figure_size(len(runs), x)
    loss_axes = ["tokens", "flops"] if x == "both" else [x]
    n_rows = len(loss_axes) + 1 + math.ceil(len(runs) / 2)
    fig, axes = plt.subplots(n_rows, 2, figsize=(w / DPI, h / DPI), layout="constrained", squeeze=False)
    colors = [plt.get_cmap("tab10")(i % 10) for i in range(len(runs))]
    for row, axis in enumerate(loss_axes):
        _loss_panels(axes[row], runs, colors, axis)
    other = "flops" if x == "flops" else "tokens"
    row = len(loss_axes)
    _scalar_panel(axes[row][0], runs, colors, "lr", f"learning rate vs {other}", other, widen=True)
    _scalar_panel(axes[row][1], runs, colors, "grad_norm", f"gradient norm before clipping vs {other}",
                  other, log=True)
    for i, r in enumerate(runs):
        _load_panel(axes[row + 1 + i // 2][i % 2], r, other)
    if len(runs) % 2:
        axes[-1][1].axis("off")
    fig.suptitle(" vs ".join(r.label for r in runs), fontsize=11)
    try:
        write_atomic(path, lambda tmp: fig.savefig(tmp, dpi=DPI, format="png"))
    finally:
        plt.close(fig)
    return w, h


# ---------------------------------------------------------------------------------------------
# the command
# ---------------------------------------------------------------------------------------------


def output_paths(runs: list[str | Path], labels: list[str], output: str | None, csv_path: str | None
                 ) -> tuple[Path, Path]:
    """``(PNG, CSV)`` paths: ``-o`` ending in ``.png`` is the PNG, any other ``-o`` a directory;
    without ``-o``, the first run's directory. The default file name is ``curves.png`` for one
    run and ``curves_vs_<label 2>[_<label 3>...].png`` for several; the CSV defaults to the PNG's
    name with ``.csv``. Missing parent directories are created.

    Raises ConfigError when an output path cannot be written (naming it and the fix)."""
    name = "curves" if len(labels) == 1 else "curves_vs_" + "_".join(safe_name(lab) for lab in labels[1:])
    if output is not None and output.lower().endswith(".png"):
        png = Path(output)
    else:
        png = Path(output if output is not None else runs[0]) / f"{name}.png"
    out_csv = Path(csv_path) if csv_path is not None else png.with_suffix(".csv")
    for p, flag in ((png, "-o"), (out_csv, "--csv")):
        _check_writable(p, flag)
    return png, out_csv


def _check_writable(path: Path, flag: str) -> None:
    fix = f"choose another {flag} path"
    if path.is_dir():
        raise ConfigError(f"{flag} {str(path)!r} is a directory, not a file: {fix}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"{flag} {str(path)!r} cannot be written: its directory cannot be created "
                          f"({e.strerror}): {fix}") from None
    if not os.access(path.parent, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise ConfigError(f"{flag} {str(path)!r} cannot be written (no write permission): {fix}")


def run_plot(args: argparse.Namespace) -> int:
    """``smelt-ds plot``: load the runs, write the PNG and the CSV, print their paths. Returns 0;
    raises ConfigError for bad runs, labels or outputs. An incomplete last line of a run's
    ``metrics.jsonl`` is skipped with a warning on stderr."""
    labels = parse_labels(args.labels, len(args.runs))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", IncompleteLineWarning)
        runs = load_runs(args.runs, labels)
    for warning in caught:
        print(f"smelt-ds plot: warning: {warning.message}", file=sys.stderr)
    png, out_csv = output_paths(args.runs, [r.label for r in runs], args.output, args.csv)
    try:
        w, h = plot_curves(runs, png, args.x)
        write_csv(runs, out_csv)
    except OSError as e:
        raise ConfigError(f"cannot write {e.filename or png}: {e.strerror}: choose another -o/--csv path") from None
    n = sum(len(r.series.get("loss", [])) for r in runs)
    print(f"wrote {png} ({w}x{h} px) and {out_csv} ({n} training-loss points, {len(runs)} run(s))")
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "plot", help="training curves of runs side by side (PNG + CSV)",
        description="Plot run directories side by side (a run still training too): training loss and validation "
                    "loss per domain vs training tokens and vs training FLOPs, learning rate, gradient norm, and "
                    "expert load (max/mean) per (layer, visit). Training FLOPs = the recipe's training FLOPs per "
                    "token (3 x forward, as `smelt-ds budget` counts them) x tokens: the fair x-axis to compare "
                    "SMELT with its Baseline, which are FLOP-matched (their curves on it differ from the token "
                    "axis only by the <1% FLOPs deviation), and the one to use for runs that are not matched. "
                    "Writes one PNG and every plotted number as CSV (run, step, tokens, train_flops, metric, value).",
        epilog="example: smelt-ds plot runs/tiny-baseline runs/tiny-smelt -o plots/tiny.png  "
               "(also writes plots/tiny.csv)")
    p.add_argument("runs", nargs="+", metavar="RUN", help="run directories (holding metrics.jsonl and config.yaml)")
    p.add_argument("-o", "--output", default=None,
                   help="PNG file (ending in .png) or directory; default: the first RUN's directory, file "
                        "curves.png (one run) or curves_vs_<label 2>....png")
    p.add_argument("--csv", default=None, help="CSV file (default: the PNG's path with .csv)")
    p.add_argument("--labels", default=None, action=CommaList,
                   help="comma-separated legend names, one per RUN (default: the recipe names)")
    p.add_argument("--x", choices=X_AXES, default="both",
                   help="x-axis of the loss panels: tokens, training FLOPs, or both (default: both)")
    p.set_defaults(func=run_plot)
