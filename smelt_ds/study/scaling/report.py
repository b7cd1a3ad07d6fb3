"""The scaling report of :func:`~smelt_ds.study.scaling.analysis.analyse`'s result: ``report.md``
(tables with confidence intervals), ``scaling.json`` and PNG figures (:func:`write_report`)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np

from smelt_ds.study.scaling.law import PARAM_NAMES

__all__ = ["measured_savings", "report_markdown", "plot_report", "write_report"]


def _number_text(x: float | None, fmt: str = ".3g") -> str:
    """``x`` formatted with ``fmt``, or ``n/a`` for None or a non-finite value."""
    return "n/a" if x is None or (isinstance(x, float) and not math.isfinite(x)) else format(x, fmt)


def _percent_text(x: float | None) -> str:
    """A fraction as a signed percentage (``+12.3%``); ``< -1000%`` below -10; ``n/a`` when undefined."""
    if x is None or not math.isfinite(x):
        return "n/a"
    return "< -1000%" if x < -10 else f"{100 * x:+.1f}%"


def measured_savings(res: dict[str, Any], arch: str) -> tuple[float, float] | None:
    """(min, max) training-FLOPs saving of ``arch`` vs the Baseline over the compute range the
    runs measured (no extrapolation), from :func:`analyse`'s result; None if undefined."""
    a = res["architectures"].get(arch, {})
    if "savings" not in a:
        return None
    lo, hi = res["C_measured"]
    vals = [v for c, v in zip(res["C_grid"], a["savings"]["saving"], strict=True)
            if lo <= c <= hi * 1.0001 and v is not None and math.isfinite(v)]
    return (min(vals), max(vals)) if vals else None


def _ci_text(ci, i, pct=False) -> str:
    """`` [low, high]`` of the interval ``ci`` (``[lows, highs]``) at index ``i`` (as percentages with
    ``pct``); empty without ``ci``."""
    if ci is None:
        return ""
    lo, hi = ci[0][i], ci[1][i]
    if lo is None or hi is None or not (math.isfinite(lo) and math.isfinite(hi)):
        return " (CI n/a)"
    return f" [{_percent_text(lo)}, {_percent_text(hi)}]" if pct else f" [{_number_text(lo)}, {_number_text(hi)}]"


def _markdown_header(res: dict[str, Any]) -> list[str]:
    """Title, the law and method, and the units."""
    m, u = res["method"], res["units"]
    return ["# Scaling laws per architecture", "",
            f"Law: `{res['law']}`, fitted separately per architecture (Hoffmann et al. 2022, Approach 3, "
            f"Appendix D.2: Huber loss, delta = {m['huber_delta']:g}, on log loss; L-BFGS from the "
            f"best {m['n_starts']} points of their initialisation grid). 95% confidence intervals: "
            f"percentile bootstrap over runs ({m['n_bootstrap']} resamples, seed "
            f"{m['seed']}).", "",
            f"- loss: {u['loss']}", f"- N: {u['N']}", f"- D: {u['D']}",
            f"- C: {u['C']}; per architecture f(N) = f0 + fh sqrt(N) + f1 N, fitted to the runs' "
            "budgets (non-negative least squares on relative error; fh: head and attention-score FLOPs, which "
            "grow with the width)", ""]


def _markdown_runs(res: dict[str, Any]) -> list[str]:
    """## Runs: one row per run, then the runs left out."""
    lines = ["## Runs", "", "| architecture | size | budget | N | D (tokens) | C (FLOPs) | loss |",
             "|---|---|---|---:|---:|---:|---:|"]
    for r in sorted(res["runs"], key=lambda r: (r["architecture"], r["N"], r["D"])):
        lines.append(f"| {r['architecture']} | {r['size'] or ''} | {r['budget'] or ''} | {r['N']:.4g} | "
                     f"{r['D']:.4g} | {r['C']:.4g} | {r['loss']:.4f} |")
    if res["excluded"]:
        lines += ["", "Excluded:", ""] + [f"- `{e['what']}`: {e['reason']}" for e in res["excluded"]]
    return lines


def _fit_notes(res: dict[str, Any]) -> list[str]:
    """Warnings on the fits: few runs, estimates on a bound, a poor f(N), failed resamples."""
    notes = []
    for arch, a in res["architectures"].items():
        if a["n_runs"] < 10:
            notes.append(f"{arch}: {a['n_runs']} runs for 5 parameters: treat the fit as illustrative")
        if a["at_bound"]:
            notes.append(f"{arch}: estimate on the optimiser's bound for {', '.join(a['at_bound'])}")
        if a["flops_per_token"]["max_rel_residual"] > 0.02:
            notes.append(f"{arch}: f(N) misses a run's FLOPs/token by "
                         f"{a['flops_per_token']['max_rel_residual']:.1%}")
        if a["bootstrap_failed"]:
            notes.append(f"{arch}: {a['bootstrap_failed']} bootstrap resamples had < 2 distinct N or D")
    return notes


def _markdown_fits(res: dict[str, Any]) -> list[str]:
    """## Fits: the law's parameters with CIs and f(N) per architecture, then the notes."""
    lines = ["", "## Fits", "", "| architecture | runs | E | A | alpha | B | beta | RMSE log L | f0 | fh | f1 |",
             "|---|---:|---|---|---|---|---|---:|---:|---:|---:|"]
    for arch, a in res["architectures"].items():
        ci = a["params_ci95"]
        cells = [_number_text(a["params"][n], ".4g")
                 + (f" [{_number_text(ci[n][0])}, {_number_text(ci[n][1])}]" if ci else "")
                 for n in PARAM_NAMES]
        fp = a["flops_per_token"]
        lines.append(f"| {arch} | {a['n_runs']} | " + " | ".join(cells) + f" | {a['rmse_log_loss']:.4f} | "
                     f"{fp['f0']:.4g} | {fp['fh']:.4g} | {fp['f1']:.4g} |")
    notes = _fit_notes(res)
    if notes:
        lines += [""] + [f"- note: {n}" for n in notes]
    return lines


def _markdown_identification(res: dict[str, Any]) -> list[str]:
    """## Identification: the three checks of :func:`~smelt_ds.study.scaling.identify.identification`
    per architecture, N_opt per IsoFLOP budget by Approach 3 (the law) and Approach 2 (the parabola),
    and what each unidentified fit lacks."""
    archs = {a: v["identification"] for a, v in res["architectures"].items() if v.get("identification")}
    if not archs:
        return []
    one = next(iter(archs.values()))
    lines = ["", "## Identification", "",
             f"A law counts as identified when `E` is off the optimiser's bound, each exponent's 95% bootstrap "
             f"interval lies within +-{one['rel']:.0%} of its estimate, and the frontier's `N_opt` lies inside the "
             f"sizes run at that budget for {one['min_budgets']} or more of the sweep's IsoFLOP budgets "
             "(`smelt_ds/study/scaling/identify.py`).", "",
             "| architecture | identified | E off bound (share of resamples on a bound) "
             "| alpha: 95% interval vs estimate | beta: 95% interval vs estimate "
             "| budgets with N_opt inside their sizes |",
             "|---|---|---|---|---|---|"]
    for arch, ident in archs.items():
        share = "" if ident["E_bound_share"] is None else f" ({ident['E_bound_share']:.0%})"
        cells = []
        for name in ("alpha", "beta"):
            e = ident["exponents"][name]
            if e["on_bound"]:
                cells.append(f"{e['estimate']:.3g}: on the optimiser's bound")
            elif e["ci95_rel"] is None:
                cells.append(f"{e['estimate']:.3g}: n/a (no bootstrap)")
            else:
                cells.append(f"{e['estimate']:.3g}: {e['ci95_rel'][0]:+.0%} / {e['ci95_rel'][1]:+.0%}"
                             + ("" if e["within"] else " (too wide)"))
        lines.append(f"| {arch} | {'yes' if ident['identified'] else '**no**'} | "
                     f"{'yes' if ident['E_off_bound'] else 'no'}{share} | {cells[0]} | {cells[1]} | "
                     f"{ident['budgets_inside']} of {len(ident['budgets'])} |")
    rows = [(arch, b) for arch, ident in archs.items() for b in ident["budgets"]]
    if rows:
        lines += ["", "N_opt (non-embedding parameters) at each IsoFLOP budget: Approach 3 (the fitted law's "
                  "frontier) vs Approach 2 (the parabola in log N through the budget's runs; n/a: no interior "
                  "minimum).", "", "| architecture | C (FLOPs) | N_opt, law | N_opt, IsoFLOP parabola | sizes run "
                  "| law's N_opt inside them |", "|---|---:|---:|---:|---|---|"]
        for arch, b in rows:
            lo, hi = b["N_range"]
            lines.append(f"| {arch} | {b['C']:.3g} | {_number_text(b['N_opt'])} | {_number_text(b['N_opt_isoflop'])} "
                         f"| {lo:.3g}-{hi:.3g} | {'yes' if b['inside'] else 'no'} |")
    short = [(arch, ident["shortfalls"]) for arch, ident in archs.items() if ident["shortfalls"]]
    if short:
        lines += [""] + [f"- {arch}, not identified: " + "; ".join(s) for arch, s in short]
    return lines


def _table_rows(C: list[float]) -> list[int]:
    """Indices of the (at most 7, evenly spread) compute levels shown in the tables."""
    return sorted(set(np.linspace(0, len(C) - 1, min(len(C), 7)).round().astype(int).tolist()))


def _markdown_frontier(res: dict[str, Any]) -> list[str]:
    """## Compute-optimal frontier: L*, N_opt, D_opt per architecture at a few compute levels."""
    C = res["C_grid"]
    lines = ["", "## Compute-optimal frontier", "",
             "L*(C) = min over N of L(N, C / f(N)); N_opt, D_opt its minimiser "
             f"(training FLOPs measured in the runs: {res['C_measured'][0]:.3g} to {res['C_measured'][1]:.3g}; "
             "beyond is extrapolation).", "",
             "| C (FLOPs) | " + " | ".join(f"{a}: L* [CI] | N_opt | D_opt" for a in res["architectures"]) + " |",
             "|---:|" + "---|---:|---:|" * len(res["architectures"])]
    for i in _table_rows(C):
        row = [f"{C[i]:.3g}"]
        for a in res["architectures"].values():
            f = a["frontier"]
            row += [_number_text(f["loss"][i], ".4f") + _ci_text(a["frontier_ci95"], i), _number_text(f["N_opt"][i]),
                    _number_text(f["D_opt"][i])]
        lines.append("| " + " | ".join(row) + " |")
    return lines


def _markdown_savings(res: dict[str, Any]) -> list[str]:
    """## Training FLOPs saved vs the Baseline: per architecture, saving and loss delta on the
    frontier, and the envelope cross-check. Empty without a Baseline and another architecture."""
    base = res["baseline"]
    if base is None or len(res["architectures"]) < 2:
        return []
    C = res["C_grid"]
    lines = ["", f"## Training FLOPs saved vs {base}", "",
             f"saving(C) = 1 - C_X / C, where C_X is the compute at which architecture X's frontier reaches "
             f"{base}'s frontier loss L*_{base}(C) (positive: X needs less compute). Loss delta: "
             f"L*_X(C) - L*_{base}(C) at equal compute (nats/token).", ""]
    for arch, a in res["architectures"].items():
        if "savings" not in a:
            continue
        s = a["savings"]
        m = measured_savings(res, arch)
        rng = f"{_percent_text(m[0])} to {_percent_text(m[1])}" if m else "n/a"
        lines += [f"**{arch}**: saving over the measured compute range: {rng}.", "",
                  "| C (FLOPs) | saving [95% CI] | loss delta [95% CI] |", "|---:|---|---|"]
        for i in _table_rows(C):
            lines.append(f"| {C[i]:.3g} | {_percent_text(s['saving'][i])}{_ci_text(a['savings_ci95'], i, True)} | "
                         f"{_number_text(s['loss_delta'][i], '+.4f')}{_ci_text(a['loss_delta_ci95'], i)} |")
        if a["envelope_savings"]:
            es = ", ".join(f"{_percent_text(e['saving'])} at {e['C']:.3g}" for e in a["envelope_savings"])
            lines += ["", f"Envelope cross-check (runs only, no fit): {es}."]
        lines.append("")
    return lines


def _markdown_paired(res: dict[str, Any]) -> list[str]:
    """## Paired runs: the fit-free comparison of matched runs. Empty without pairs."""
    paired = [(arch, a["paired"]) for arch, a in res["architectures"].items() if a.get("paired")]
    if not paired:
        return []
    lines = [f"## Paired runs: each architecture vs {res['baseline']} at the same size and budget (no fit)", "",
             "delta = loss - loss of the matched Baseline run (nats/token; negative: better). In a "
             "budget-matched sweep the two runs of a pair have the same N, D and training FLOPs, so this "
             "compares the architectures at equal compute without a law. 95% CI and p: paired t-test "
             "(scipy.stats.ttest_rel) over design points (size and budget; the pairs of other seeds at a "
             "point are averaged first). seed SD: pooled standard deviation of a pair's delta between seeds, "
             "the run-to-run noise of one pair (n/a without replicates: seed noise is then inside the spread).",
             "",
             "| architecture | points (run pairs) | mean delta [95% CI] | p | better in | seed SD "
             "| mean delta by budget |",
             "|---|---:|---|---:|---:|---:|---|"]
    for arch, pr in paired:
        ci = f" [{pr['ci95'][0]:+.4f}, {pr['ci95'][1]:+.4f}]" if pr["ci95"] else ""
        pv = f"{pr['p_value']:.3g}" if pr["p_value"] is not None else "n/a"
        sd = (f"{pr['seed_sd']:.4f} ({pr['replicated_points']} points)" if pr.get("seed_sd") is not None
              else "n/a")
        bb = ", ".join(f"{k} {v:+.4f}" for k, v in pr["by_budget"].items())
        lines.append(f"| {arch} | {pr['n_pairs']} ({pr.get('n_runs_pairs', pr['n_pairs'])}) | "
                     f"{pr['mean_delta']:+.4f}{ci} | {pv} | {pr['wins']}/{pr['n_pairs']} | {sd} | {bb} |")
    lines.append("")
    return lines


def _markdown_envelope(res: dict[str, Any]) -> list[str]:
    """## Envelope and IsoFLOP profiles: the model-free cross-checks per architecture."""
    lines = ["## Envelope and IsoFLOP profiles", ""]
    for arch, a in res["architectures"].items():
        env = ", ".join(f"{e['loss']:.3f} at {e['C']:.3g} (N {e['N']:.3g})" for e in a["envelope"])
        lines.append(f"- {arch} lower envelope (loss at C): {env}")
        for g in a["isoflop"]:
            lines.append(f"  - IsoFLOP at {g['C']:.3g} FLOPs over {len(g['N'])} sizes: N_opt "
                         f"{_number_text(g['N_opt'])}" + ("" if g["N_opt"] else " (no interior minimum)"))
        if not a["isoflop"]:
            lines.append("  - no IsoFLOP profile: no compute level with >= 3 sizes (use `flops:` budgets in the sweep)")
    return lines


def _markdown_figures(figures: dict[str, str]) -> list[str]:
    """## Figures: links to the PNGs of :func:`plot_report`. Empty without figures."""
    if not figures:
        return []
    return ["", "## Figures", ""] + [f"![{k}]({v})" for k, v in figures.items()]


def report_markdown(res: dict[str, Any], figures: dict[str, str]) -> str:
    """The markdown report of :func:`analyse`'s result, one section after another."""
    sections = [_markdown_header(res), _markdown_runs(res), _markdown_fits(res),
                _markdown_identification(res), _markdown_frontier(res),
                _markdown_savings(res),
                _markdown_paired(res), _markdown_envelope(res), _markdown_figures(figures)]
    return "\n".join(line for lines in sections for line in lines) + "\n"


def _save_figure(fig, ax, out_dir: Path, name: str, xlabel: str, ylabel: str, title: str) -> str:
    """Log-x axes labels, title and legend, then write ``out_dir/name`` and close the figure."""
    import matplotlib.pyplot as plt

    ax.set_xscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out_dir / name)
    plt.close(fig)
    return name


def _plot_loss_vs_flops(res: dict[str, Any], out_dir: Path, name: str, colors: list[str]) -> str | None:
    """Runs and fitted frontiers L*(C) with their 95% bands, over the measured compute."""
    import matplotlib.pyplot as plt

    C = np.array(res["C_grid"])
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=100)
    for k, (arch, a) in enumerate(res["architectures"].items()):
        col = colors[k % len(colors)]
        pts = [r for r in res["runs"] if r["architecture"] == arch]
        ax.scatter([r["C"] for r in pts], [r["loss"] for r in pts], color=col, s=22, label=f"{arch} runs")
        ax.plot(C, np.array(a["frontier"]["loss"], dtype=float), color=col, label=f"{arch} frontier L*(C)")
        if a["frontier_ci95"]:
            band = [np.array(b, dtype=float) for b in a["frontier_ci95"]]
            ax.fill_between(C, band[0], band[1],
                            color=col, alpha=0.15, lw=0)
    ax.axvspan(*res["C_measured"], color="0.9", zorder=0, label="measured compute")
    return _save_figure(fig, ax, out_dir, name,
                 "training FLOPs C",
                 "validation loss (nats/token)",
                 "Loss vs training compute, with compute-optimal frontiers (95% bootstrap bands)")


def _plot_savings(res: dict[str, Any], out_dir: Path, name: str, colors: list[str]) -> str | None:
    """Training FLOPs saved vs the Baseline per architecture with 95% bands (clipped to the
    axes); None without an architecture that has savings."""
    import matplotlib.pyplot as plt

    others = {a: v for a, v in res["architectures"].items() if "savings" in v}
    if not others:
        return None
    C = np.array(res["C_grid"])
    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    point = np.concatenate([100 * np.array(a["savings"]["saving"], dtype=float) for a in others.values()])
    point = point[np.isfinite(point)]
    lo_y = max(-100.0, min(-10.0, 1.5 * point.min() - 5 if point.size else -10.0))
    hi_y = min(100.0, max(10.0, 1.5 * point.max() + 5 if point.size else 10.0))
    for k, (arch, a) in enumerate(res["architectures"].items()):
        if arch not in others:
            continue
        col = colors[k % len(colors)]
        ax.plot(C, 100 * np.array(a["savings"]["saving"], dtype=float), color=col, label=arch)
        if a["savings_ci95"]:  # clipped to the axes: a bootstrap band can reach -1000s of %
            ax.fill_between(C, np.clip(100 * np.array(a["savings_ci95"][0], dtype=float), lo_y, hi_y),
                            np.clip(100 * np.array(a["savings_ci95"][1], dtype=float), lo_y, hi_y),
                            color=col, alpha=0.15, lw=0)
    ax.set_ylim(lo_y, hi_y)
    ax.axhline(0, color="k", lw=0.8)
    ax.axvspan(*res["C_measured"], color="0.9", zorder=0, label="measured compute")
    return _save_figure(fig, ax, out_dir, name,
                 f"{res['baseline']} training FLOPs C",
                 f"training FLOPs saved vs {res['baseline']} (%)",
                 "Compute saved at equal loss on the frontier (95% bootstrap bands, clipped to the axes)")


def _plot_paired(res: dict[str, Any], out_dir: Path, name: str, colors: list[str]) -> str | None:
    """The paired loss differences of :func:`paired_comparison`, with their mean and 95% CI;
    None without pairs."""
    import matplotlib.pyplot as plt

    paired = {a: v["paired"] for a, v in res["architectures"].items() if v.get("paired")}
    if not paired:
        return None
    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    for k, arch in enumerate(res["architectures"]):
        if arch not in paired:
            continue
        col, pr = colors[k % len(colors)], paired[arch]
        ax.scatter([q["C"] for q in pr["pairs"]], [q["delta"] for q in pr["pairs"]], color=col, s=22,
                   label=f"{arch} - {res['baseline']}, one point per size and budget (seeds averaged)")
        ax.axhline(pr["mean_delta"], color=col, lw=1.2, label=f"{arch} mean {pr['mean_delta']:+.4f}")
        if pr["ci95"]:
            ax.axhspan(*pr["ci95"], color=col, alpha=0.15, lw=0, label=f"{arch} 95% CI (paired t)")
    ax.axhline(0, color="k", lw=0.8)
    return _save_figure(fig, ax, out_dir, name,
                 "training FLOPs C of the pair",
                 "loss difference (nats/token)",
                 f"Matched runs: loss minus the {res['baseline']} run of the same N, D and FLOPs (no fit)")


def plot_report(res: dict[str, Any], out_dir: Path, prefix: str = "scaling_") -> dict[str, str]:
    """Write ``<prefix>loss_vs_flops.png`` (runs and fitted frontiers with 95% bands) and, with a
    Baseline and another architecture, ``<prefix>savings.png`` and ``<prefix>paired.png`` (the
    paired loss differences of :func:`paired_comparison`). Returns ``{title: file name}``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    figures = (("loss vs training FLOPs", "loss_vs_flops.png", _plot_loss_vs_flops),
               ("training FLOPs saved", "savings.png", _plot_savings),
               ("paired loss differences", "paired.png", _plot_paired))
    figs = {}
    for title, suffix, plot in figures:
        name = plot(res, out_dir, f"{prefix}{suffix}", colors)
        if name is not None:
            figs[title] = name
    return figs


def _jsonable(x):
    """``x`` with numpy scalars as Python numbers and non-finite floats as None (JSON null)."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, np.generic):
        return _jsonable(x.item())
    return x


def write_report(res: dict[str, Any], out_dir: str | Path) -> dict[str, Path]:
    """Write ``report.md``, ``scaling.json`` (NaN as null) and the PNG figures to ``out_dir``.
    Returns the written paths by kind."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    res = _jsonable(res)
    figs = plot_report(res, out)
    (out / "scaling.json").write_text(json.dumps(res, indent=1))
    (out / "report.md").write_text(report_markdown(res, figs))
    return {"report": out / "report.md", "json": out / "scaling.json", **{k: out / v for k, v in figs.items()}}
