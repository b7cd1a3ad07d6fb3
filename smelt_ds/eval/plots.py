"""PNG plots of eval and analysis results (matplotlib, Agg backend; no display needed).

Every figure has a fixed size (inches x :data:`DPI`, give or take the last pixel, which matplotlib
versions round differently); :func:`plot_eval` and :func:`plot_analysis` return
``{file name: [width, height]}`` (pixels, read from the PNG written), which ``figures.json`` records.
Colours follow the run order (the first run, the Baseline, is blue).
"""

from __future__ import annotations

import math
import re
from pathlib import Path

from smelt_ds.files import write_atomic

__all__ = ["DPI", "plot_eval", "plot_analysis", "safe_name"]

DPI = 100


def _plt():
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def _colors(n: int) -> list:
    plt = _plt()
    cmap = plt.get_cmap("tab10")
    return [cmap(i % 10) for i in range(n)]


def _save(fig, path: Path) -> list[int]:
    """Write ``fig`` as a PNG at ``DPI``; returns its size [width, height] in pixels, read from the file
    (matplotlib < 3.11.1 truncates ``inches * DPI``, later versions round it)."""
    from PIL import Image

    try:
        write_atomic(path, lambda tmp: fig.savefig(tmp, dpi=DPI, format="png"))
    finally:
        _plt().close(fig)
    with Image.open(path) as png:
        return list(png.size)


def safe_name(name: str) -> str:
    """A run name usable in a file name (characters other than letters, digits, ``_.-`` become ``_``)."""
    return re.sub(r"[^A-Za-z0-9_.-]", "_", name)


def _none_as_nan(x):
    return float("nan") if x is None else x


# ---------------------------------------------------------------------------------------------
# eval
# ---------------------------------------------------------------------------------------------


def _domains_figure(result: dict, path: Path) -> list[int]:
    plt = _plt()
    names = [r["name"] for r in result["runs"]]
    domains = list(dict.fromkeys(d for n in names for d in result["domains"][n]))
    fig, axes = plt.subplots(1, 2, figsize=(7.5, 3.0), layout="constrained")
    width = 0.8 / len(names)
    for ax, (key, label) in zip(axes, (("loss", "loss (nats/token)"), ("bits_per_byte", "bits per byte")), strict=True):
        for i, (n, c) in enumerate(zip(names, _colors(len(names)), strict=True)):
            vals = [_none_as_nan(result["domains"][n].get(d, {}).get(key)) for d in domains]
            ax.bar([j + (i - (len(names) - 1) / 2) * width for j in range(len(domains))], vals, width, color=c,
                   label=n)
        ax.set_xticks(range(len(domains)), domains)
        ax.set_ylabel(label)
        finite = [v for n in names for d in domains
                  if (v := result["domains"][n].get(d, {}).get(key)) is not None and math.isfinite(v)]
        if finite:
            lo, hi = min(finite), max(finite)
            ax.set_ylim(max(0.0, lo - 0.15 * (hi - lo + 1e-9) - 0.05 * hi), hi + 0.1 * (hi - lo + 1e-9) + 0.02 * hi)
    axes[0].legend(fontsize=7)
    fig.suptitle("validation per domain", fontsize=10)
    return _save(fig, path)


def _positions_figure(result: dict, path: Path) -> list[int]:
    plt = _plt()
    names = [r["name"] for r in result["runs"]]
    domains = list(dict.fromkeys(d for n in names for d in result["domains"][n]))
    domains = ["all"] + [d for d in domains if d != "all"]
    buckets = result["settings"]["buckets"]
    labels = [f"{s}-{e}" for s, e in buckets]
    fig, axes = plt.subplots(2, len(domains), figsize=(3.0 * len(domains), 4.6), layout="constrained",
                             squeeze=False, sharex=True)
    for j, d in enumerate(domains):
        ref = [_none_as_nan(p["loss"]) for p in result["domains"][names[0]].get(d, {}).get("positions", [])]
        for n, c in zip(names, _colors(len(names)), strict=True):
            vals = [_none_as_nan(p["loss"]) for p in result["domains"][n].get(d, {}).get("positions", [])]
            if not vals:
                continue
            axes[0, j].plot(range(len(vals)), vals, "o-", color=c, label=n, ms=3)
            axes[1, j].plot(range(len(vals)), [v - r for v, r in zip(vals, ref, strict=True)], "o-", color=c, ms=3)
        axes[0, j].set_title(d, fontsize=9)
        axes[1, j].axhline(0.0, color="grey", lw=0.5)
        axes[1, j].set_xticks(range(len(labels)), labels, rotation=45, fontsize=7)
        axes[1, j].set_xlabel("token position")
    axes[0, 0].set_ylabel("loss (nats/token)")
    axes[1, 0].set_ylabel(f"Δ vs {names[0]}")
    axes[0, 0].legend(fontsize=7)
    return _save(fig, path)


def _icl_figure(result: dict, path: Path) -> list[int]:
    plt = _plt()
    names = [r["name"] for r in result["runs"]]
    tasks = list(result["tasks"])
    fig, axes = plt.subplots(2, max(1, len(tasks)), figsize=(2.4 * max(1, len(tasks)), 4.4), layout="constrained",
                             squeeze=False)
    for j, t in enumerate(tasks):
        for n, c in zip(names, _colors(len(names)), strict=True):
            curve = result["icl"][n].get(t, {})
            ks = list(curve)
            losses = [_none_as_nan((curve[k] or {}).get("loss")) for k in ks]
            accuracies = [_none_as_nan((curve[k] or {}).get("accuracy")) for k in ks]
            axes[0, j].plot(range(len(ks)), losses, "o-", color=c, ms=3, label=n)
            axes[1, j].plot(range(len(ks)), accuracies, "o-", color=c, ms=3)
            for ax in axes[:, j]:
                ax.set_xticks(range(len(ks)), ks, fontsize=7)
        axes[0, j].set_title(t, fontsize=9)
        axes[1, j].set_xlabel("in-context examples k")
        axes[1, j].set_ylim(-0.02, 1.02)
    axes[0, 0].set_ylabel("answer loss (nats/token)")
    axes[1, 0].set_ylabel("exact-match accuracy")
    axes[0, 0].legend(fontsize=7)
    return _save(fig, path)


def plot_eval(result: dict, out_dir: Path) -> dict[str, list[int]]:
    """``eval_domains.png`` (loss and bits per byte per domain), ``eval_positions.png`` (loss by
    position bucket and its difference to the first run), ``eval_icl.png`` (answer loss and
    accuracy vs k per task)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    return {"eval_domains.png": _domains_figure(result, out_dir / "eval_domains.png"),
            "eval_positions.png": _positions_figure(result, out_dir / "eval_positions.png"),
            "eval_icl.png": _icl_figure(result, out_dir / "eval_icl.png")}


# ---------------------------------------------------------------------------------------------
# analysis
# ---------------------------------------------------------------------------------------------


def _depth_series(attn: dict, stat: str) -> tuple[list[int], list[float], list[int]]:
    recs = sorted(attn.values(), key=lambda r: r["plan_index"])
    return ([r["plan_index"] + 1 for r in recs], [r["mean"][stat] for r in recs], [r["visit"] for r in recs])


def _attention_figure(result: dict, path: Path) -> list[int]:
    plt = _plt()
    names = [r["name"] for r in result["runs"]]
    fig, axes = plt.subplots(1, 3, figsize=(9.0, 3.0), layout="constrained")
    for n, c in zip(names, _colors(len(names)), strict=True):
        attn = result["analysis"][n]["attention"]
        for ax, stat in zip(axes, ("first_mass", "content_mass", "entropy"), strict=True):
            d, v, visit = _depth_series(attn, stat)
            ax.plot(d, v, "-", color=c, label=n, lw=1)
            first = [(x, y) for x, y, k in zip(d, v, visit, strict=True) if k == 0]
            later = [(x, y) for x, y, k in zip(d, v, visit, strict=True) if k > 0]
            ax.scatter([x for x, _ in first], [y for _, y in first], color=c, s=14)
            ax.scatter([x for x, _ in later], [y for _, y in later], facecolors="white", edgecolors=c, s=22, marker="s")
    for ax, t in zip(axes, ("first-token mass (sink)", "content mass", "entropy (nats)"), strict=True):
        ax.set_title(t, fontsize=9)
        ax.set_xlabel("depth (visit)")
    axes[0].legend(fontsize=7, title="■ = 2nd+ visit", title_fontsize=7)
    return _save(fig, path)


def _heads_figure(run: dict, name: str, path: Path) -> list[int]:
    plt = _plt()
    recs = sorted(run["attention"].values(), key=lambda r: r["plan_index"])
    labels = [f"L{r['layer']}V{r['visit']}" for r in recs]
    heads = len(recs[0]["first_mass"]) if recs else 1
    fig, axes = plt.subplots(1, 2, figsize=(2.0 + 1.0 * heads, 0.6 + 0.28 * max(4, len(recs))), layout="constrained")
    for ax, stat, title in ((axes[0], "first_mass", "first-token mass"), (axes[1], "entropy", "entropy (nats)")):
        data = [r[stat] for r in recs]
        im = ax.imshow(data, aspect="auto", cmap="viridis", vmin=0.0)
        ax.set_yticks(range(len(labels)), labels, fontsize=7)
        ax.set_xticks(range(heads), [f"h{h}" for h in range(heads)], fontsize=7)
        ax.set_title(f"{name}: {title}", fontsize=8)
        fig.colorbar(im, ax=ax, shrink=0.8)
    return _save(fig, path)


def _routing_figure(result: dict, path: Path) -> list[int]:
    plt = _plt()
    names = [r["name"] for r in result["runs"]]
    fig, axes = plt.subplots(1, 2, figsize=(8.0, 3.0), layout="constrained")
    width = 0.8 / len(names)
    for i, (n, c) in enumerate(zip(names, _colors(len(names)), strict=True)):
        visits = sorted(result["analysis"][n]["routing"]["visits"].values(), key=lambda r: r["plan_index"])
        axes[0].plot([v["plan_index"] + 1 for v in visits], [v["load_max_over_mean"] for v in visits], "o-", color=c,
                     ms=3, label=n)
        div = result["analysis"][n]["routing"]["divergence"]
        axes[1].bar([j + (i - (len(names) - 1) / 2) * width for j in range(len(div))],
                    [x["divergence"] for x in div], width, color=c, label=n)
        for j, x in enumerate(div):
            axes[1].text(j + (i - (len(names) - 1) / 2) * width, x["divergence"], f"L{x['layer']}", ha="center",
                         va="bottom", fontsize=7)
    axes[0].axhline(1.0, color="grey", lw=0.5)
    axes[0].set_title("expert load max/mean (1 = balanced)", fontsize=9)
    axes[0].set_xlabel("depth (visit)")
    axes[0].legend(fontsize=7)
    axes[1].set_title("routing divergence, visit 1 -> 2", fontsize=9)
    axes[1].set_ylabel("share of tokens with changed experts")
    axes[1].set_xticks([])
    axes[1].set_ylim(0, 1.05)
    return _save(fig, path)


def _load_figure(run: dict, name: str, path: Path) -> list[int]:
    plt = _plt()
    visits = sorted(run["routing"]["visits"].values(), key=lambda r: r["plan_index"])
    E = len(visits[0]["load"]) if visits else 1
    fig, ax = plt.subplots(figsize=(2.0 + 0.18 * E, 0.8 + 0.28 * max(4, len(visits))), layout="constrained")
    im = ax.imshow([v["load"] for v in visits] or [[0.0]], aspect="auto", cmap="magma")
    ax.set_yticks(range(len(visits)), [f"L{v['layer']}V{v['visit']}" for v in visits], fontsize=7)
    ax.set_xlabel("expert")
    ax.set_title(f"{name}: share of routed tokens per expert", fontsize=8)
    fig.colorbar(im, ax=ax, shrink=0.8)
    return _save(fig, path)


def _lens_figure(result: dict, path: Path) -> list[int]:
    plt = _plt()
    names = [r["name"] for r in result["runs"]]
    fig, axes = plt.subplots(1, 2, figsize=(8.0, 3.0), layout="constrained")
    for n, c in zip(names, _colors(len(names)), strict=True):
        lens = result["analysis"][n]["logit_lens"]
        d = [r["depth"] for r in lens["depths"]]
        axes[0].plot(d, [r["loss"] for r in lens["depths"]], "o-", color=c, ms=3, label=n)
        axes[1].plot(d, [r["agree_final"] for r in lens["depths"]], "o-", color=c, ms=3)
        for b in lens["boundaries"]:
            for ax in axes:
                ax.axvline(b["depth"], color=c, ls=":", lw=1)
    axes[0].set_title("logit-lens loss (nats/token)", fontsize=9)
    axes[1].set_title("top-1 agreement with the final output", fontsize=9)
    for ax in axes:
        ax.set_xlabel("depth (0 = embedding; dotted = loop boundary)")
    axes[0].legend(fontsize=7)
    return _save(fig, path)


def plot_analysis(result: dict, out_dir: Path) -> dict[str, list[int]]:
    """``attention_sink.png`` (head-mean sink, content mass, entropy by depth), per run
    ``attention_heads_<run>.png`` and ``routing_load_<run>.png`` heatmaps, ``routing.png`` (load
    balance and divergence) and ``logit_lens.png``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    out = {"attention_sink.png": _attention_figure(result, out_dir / "attention_sink.png"),
           "routing.png": _routing_figure(result, out_dir / "routing.png"),
           "logit_lens.png": _lens_figure(result, out_dir / "logit_lens.png")}
    for r in result["runs"]:
        n, f = r["name"], safe_name(r["name"])
        out[f"attention_heads_{f}.png"] = _heads_figure(result["analysis"][n], n, out_dir / f"attention_heads_{f}.png")
        if result["analysis"][n]["routing"]["visits"]:
            out[f"routing_load_{f}.png"] = _load_figure(result["analysis"][n], n, out_dir / f"routing_load_{f}.png")
    return out
