"""The shipped recipes: where they are, their memory verdicts on their cluster layouts, and the
ablations derived from each Baseline.

``recipes/<size>/<variant>.yaml`` for sizes ``tiny`` (CPU), ``s``, ``m``, ``l``, ``xl`` and
variants ``baseline`` (unlooped), ``smelt`` (middle half x2) and the ablations ``uniform``,
``bottom``, ``top``, ``asymmetric``. Every looped recipe is the output of
:func:`smelt_ds.cost.budget.match_baseline` (``smelt-ds match``) on its size's Baseline and matches it
within 1% on per-token FLOPs, non-embedding parameters and KV cache.

A recipe is resolved for a cluster layout (the recipe's ``cluster`` section; the CPU stand-in for
recipes without one) and its memory estimated there by :mod:`smelt_ds.launch.placement`, as
``smelt-ds render-job`` and ``smelt-ds memory`` do.

``smelt-ds recipes table`` writes ``docs/recipes.md`` (:func:`recipes_table`); ``smelt-ds recipes
derive BASELINE`` writes the five looped recipes next to a Baseline (:func:`derive_variants`).
Units: parameters are counts, FLOPs per token, bytes per token (KV cache) or per GPU (memory),
1 GiB = 2**30 bytes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from smelt_ds import resources
from smelt_ds.config.loading import config_from_dict
from smelt_ds.config.run import RunConfig
from smelt_ds.config.train import resolve_batch
from smelt_ds.cost.budget import Budget, compute_budget, deviations, match_baseline
from smelt_ds.errors import ConfigError
from smelt_ds.launch.placement import MIN_HEADROOM, load_raw, memory_report, resolve, zero_option
from smelt_ds.mappings import deep_merge
from smelt_ds.model.looping import LoopSchedule

__all__ = ["REPO_ROOT", "RECIPES_DIR", "DOCS_TABLE", "SIZES", "VARIANTS", "POSITIONS", "RecipeEntry", "shipped_recipes",
           "derive_variants", "write_variants", "recipe_rows", "recipes_table"]

#: the folder holding recipes/, launchers/ and ds_configs/: the checkout, or the installed package's
#: copy (smelt_ds.resources); paths are shown and passed to jobs relative to it
REPO_ROOT = resources.DATA_ROOT
RECIPES_DIR = resources.RECIPES_DIR
DOCS_TABLE = resources.DOCS_TABLE
SIZES = ("tiny", "s", "m", "l", "xl")
VARIANTS = ("baseline", "smelt", "uniform", "bottom", "top", "asymmetric")
#: loop position (``smelt-ds match --position``) of each looped variant
POSITIONS = {"smelt": "middle", "uniform": "uniform", "bottom": "bottom", "top": "top", "asymmetric": "asymmetric"}


# ---------------------------------------------------------------------------------------------
# discovery and loading
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RecipeEntry:
    """One shipped recipe file: ``size`` (directory) and ``variant`` (file stem)."""

    size: str
    variant: str
    path: Path

    @property
    def baseline_path(self) -> Path:
        return self.path.with_name("baseline.yaml")


def shipped_recipes(root: Path = RECIPES_DIR) -> list[RecipeEntry]:
    """Every ``recipes/<size>/<variant>.yaml`` of the sizes in :data:`SIZES` (other directories,
    e.g. sweep specifications, are not recipes), sizes in :data:`SIZES` order, then variants in
    :data:`VARIANTS` order (other names last, alphabetically)."""
    def key(p: Path):
        var = p.stem
        return (SIZES.index(p.parent.name), VARIANTS.index(var) if var in VARIANTS else len(VARIANTS), var)

    paths = [p for size in SIZES for p in (root / size).glob("*.yaml")]
    return [RecipeEntry(p.parent.name, p.stem, p) for p in sorted(paths, key=key)]


# ---------------------------------------------------------------------------------------------
# deriving the looped variants from a Baseline
# ---------------------------------------------------------------------------------------------


def _loop_block(loop: dict[str, Any]) -> str:
    return "loop:\n" + "".join("  " + line + "\n" for line in yaml.safe_dump(loop, sort_keys=False).splitlines())


def derive_variants(baseline_path: str | Path, tolerance: float = 0.01) -> dict[str, str]:
    """The YAML text of each looped variant (:data:`POSITIONS`) of a Baseline recipe file.

    Each is :func:`smelt_ds.cost.budget.match_baseline` of the Baseline (``smelt-ds match --position P
    --ep-size <moe_runtime.ep_size> --tolerance 0.01``), written as ``base: baseline.yaml`` plus what
    the match changes: ``name``, ``model.num_layers``, ``moe.num_experts`` and the ``loop`` section
    (every other field, and the comments citing its sources, stay in the Baseline's file). Raises
    ConfigError when a variant deviates beyond ``tolerance``, when the Baseline's ``loop`` section
    holds more than ``position: none`` (it would reach every variant through ``base:``), or when
    the written text, its base merged (:func:`smelt_ds.config.loading.read_recipe`), is not the
    matcher's recipe.
    """
    path = Path(baseline_path)
    raw = load_raw(path)
    base = config_from_dict(raw, source=str(path))
    size = path.parent.name
    if raw.get("loop") != {"position": "none"}:
        raise ConfigError(f"{path}: the Baseline's loop section must be exactly `loop: {{position: none}}` "
                          f"(got {raw.get('loop')!r}): its other keys would reach every variant through `base:`")
    ep = base.moe_runtime.ep_size
    out = {}
    for variant, position in POSITIONS.items():
        name = f"{size}-{variant}"
        res = match_baseline(raw, position, ep_size=ep, tolerance=tolerance, name=name)
        cfg, d = res.config, res.deviations
        cmd = (f"smelt-ds match {_repo_relative(path)} --position {position} --ep-size {ep} --tolerance {tolerance:g} "
               f"--name {name}")
        head = [f"# {size.upper()} {variant} ({_describe(cfg)}): written by "
                f"`smelt-ds recipes derive {_repo_relative(path)}`,",
                f"# i.e. `{cmd}`.",
                f"# {cfg.model.num_layers} unique layers, {res.matched.visits} visits per forward pass, "
                f"{cfg.moe.num_experts} experts per layer. Deviations from the Baseline:",
                f"# FLOPs/token {d['flops']:+.3%}, non-embedding params {d['params']:+.3%}, "
                f"KV cache {d['kv_cache']:+.3%}.", "#",
                f"# Sources: those of {path.name}, which this recipe extends (`base:`); every field not set",
                "# here is the Baseline's. `smelt-ds config show` prints the whole recipe."]
        body = [f"base: {path.name}", f"name: {name}", "model:",
                f"  num_layers: {cfg.model.num_layers}".ljust(27) + f"# unique layers; {res.matched.visits} visits = "
                "the Baseline's depth", "moe:",
                f"  num_experts: {cfg.moe.num_experts}".ljust(27) + "# matched: total non-embedding parameters equal "
                "the Baseline's"]
        full = "\n".join(head + body) + "\n" + _loop_block(res.raw["loop"])
        if _plain(deep_merge(raw, _without_base(yaml.safe_load(full)))) != _plain(res.raw):
            raise ConfigError(f"{path}: the '{variant}' text with its base merged is not the matched recipe")
        out[variant] = full
    return out


def _without_base(raw: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in raw.items() if k != "base"}


def _plain(d: Any) -> Any:
    return json.loads(json.dumps(d))


def _repo_relative(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(REPO_ROOT))
    except ValueError:
        return str(path)


def _describe(cfg: RunConfig) -> str:
    loop = cfg.loop
    if loop.position == "none":
        return "Baseline, no loop"
    if loop.ranges:
        return "loops " + ", ".join(f"[{r.start},{r.end}) x{r.repeats}" for r in loop.ranges)

    spans = LoopSchedule.from_config(loop, cfg.model.num_layers).spans
    return f"{loop.position}: " + ", ".join(f"layers [{s.start},{s.end}) x{s.repeats}" for s in spans)


# ---------------------------------------------------------------------------------------------
# the table
# ---------------------------------------------------------------------------------------------


def _in_gib(n: float) -> str:
    return f"{n / 2 ** 30:.1f}"


def _si_prefixed(n: float) -> str:
    for unit, div in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= div:
            return f"{n / div:.3g}{unit}"
    return f"{n:.0f}"


def recipe_rows(entries: list[RecipeEntry] | None = None) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """``(budget_rows, layout_rows)`` of every shipped recipe.

    A budget row: size, variant, loop, unique layers, visits, experts, top-k, non-embedding and
    active parameters, train FLOPs/token, KV bytes/token, and the deviations from the size's
    Baseline. A layout row (one per recipe and layout): layout, GPU, nodes, GPUs per node, ZeRO
    option, ``ep_size``, policy, micro-batch, accumulation, memory per GPU (bytes), headroom and
    whether it fits with :data:`MIN_HEADROOM`.
    """
    entries = entries if entries is not None else shipped_recipes()
    base_budgets: dict[Path, Budget] = {}
    budget_rows, layout_rows = [], []
    for e in entries:
        cfg = config_from_dict(load_raw(e.path), source=str(e.path))
        b = compute_budget(cfg)
        if e.baseline_path not in base_budgets:
            base = config_from_dict(load_raw(e.baseline_path), source=str(e.baseline_path))
            base_budgets[e.baseline_path] = compute_budget(base)
        d = deviations(b, base_budgets[e.baseline_path])
        budget_rows.append({"size": e.size, "variant": e.variant, "path": _repo_relative(e.path),
                            "loop": _describe(cfg),
                            "unique_layers": b.unique_layers, "visits": b.visits, "experts": b.num_experts,
                            "top_k": cfg.moe.top_k, "non_embedding_params": b.non_embedding_params,
                            "active_non_embedding_params": b.active_non_embedding_params,
                            "train_flops_per_token": b.train_flops_per_token,
                            "kv_cache_bytes_per_token": b.kv_cache_bytes_per_token, "deviation": d})
        names = list(cfg.cluster.layouts) or ["cpu"]
        for name in names:
            r = resolve(e.path, name)
            c, lay = r.config, r.layout
            rep = memory_report(c, lay)
            row = rep.configured
            accum, _ = resolve_batch(c.train, lay.nodes * lay.gpus_per_node)
            layout_rows.append({"size": e.size, "variant": e.variant, "layout": name, "gpu": lay.gpu,
                                "device_memory_gib": lay.device_memory_gib, "nodes": lay.nodes,
                                "gpus_per_node": lay.gpus_per_node, "zero": zero_option(c),
                                "backend": c.moe_runtime.backend, "ep_size": c.moe_runtime.ep_size,
                                "policy": c.train.activation_checkpointing.policy,
                                "precision": rep.precision, "micro_batch": c.train.micro_batch_size,
                                "accumulation": accum, "memory_bytes": row.total, "headroom": row.headroom,
                                "fits": rep.fits(MIN_HEADROOM)})
    return budget_rows, layout_rows


def _markdown_table(head: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"] + \
        ["| " + " | ".join(r) + " |" for r in rows]


def _training_rows(entries: list[RecipeEntry]) -> list[list[str]]:
    rows = []
    for e in entries:
        if e.variant != "baseline":
            continue
        c = config_from_dict(load_raw(e.path), source=str(e.path))
        t = c.train
        tokens = t.max_steps * (t.global_batch_tokens or t.micro_batch_size * t.seq_len)
        rows.append([e.size, str(t.seq_len), f"{t.global_batch_tokens:,}" if t.global_batch_tokens else
                     f"{t.micro_batch_size * t.seq_len:,} per rank", f"{t.lr:g}", str(t.warmup_steps),
                     f"{t.schedule} to {t.min_lr_ratio:g}", f"{t.max_steps:,}", _si_prefixed(tokens),
                     f"{c.moe_runtime.backend}, ep {c.moe_runtime.ep_size}", f"ZeRO-{c.deepspeed.zero_stage}"])
    return rows


def recipes_table(entries: list[RecipeEntry] | None = None) -> str:
    """The markdown of ``docs/recipes.md``: training setup per size, the three budgets of every
    recipe with deviations from its Baseline, and every recipe x layout with its memory per GPU
    and verdict (``smelt_ds.parallel.memory.estimate``). Deterministic: it depends only on the recipes and
    the estimators."""
    entries = entries if entries is not None else shipped_recipes()
    budgets, layouts = recipe_rows(entries)
    out = ["# Shipped recipes", "",
           "<!-- Written by `smelt-ds recipes table` from recipes/*/*.yaml; do not edit by hand. "
           "tests/study/test_recipes.py fails when it is out of date. -->", "",
           "Every size has a Baseline (`baseline.yaml`, no loop), SMELT (`smelt.yaml`, the middle half of the "
           "unique layers run twice) and the loop-position ablations `uniform`, `bottom`, `top` and `asymmetric`, "
           "each derived from the Baseline by `smelt-ds match` (`smelt-ds recipes derive`) and matched on "
           "per-token FLOPs, non-embedding parameters and KV cache within 1%. Sources of every shape and "
           "training choice are cited in the Baseline files. `tiny` runs on a CPU.", "",
           "## Training setup (same for all variants of a size)", ""]
    out += _markdown_table(["size", "seq_len (tokens)", "global batch (tokens)", "peak LR", "warmup (steps)",
                            "schedule", "steps", "tokens", "MoE backend", "ZeRO"], _training_rows(entries))
    out += ["", "## Budgets", "",
            "Non-embedding parameters count all experts and exclude the token embedding and the output head; "
            "active = top-k experts only. FLOPs per token of training (3 x forward) at the recipe's `seq_len`; "
            "KV cache in bf16 bytes per token (every visit keeps its own K and V). Deviations are relative to the "
            "size's Baseline.", ""]
    out += _markdown_table(
        ["recipe", "loop", "unique layers", "visits", "experts/layer", "top-k", "non-emb params", "active non-emb",
         "train FLOPs/token", "KV bytes/token", "dFLOPs", "dparams", "dKV"],
        [[f"`{r['path']}`", r["loop"], str(r["unique_layers"]), str(r["visits"]), str(r["experts"]),
          str(r["top_k"]), _si_prefixed(r["non_embedding_params"]), _si_prefixed(r["active_non_embedding_params"]),
          _si_prefixed(r["train_flops_per_token"]), f"{r['kv_cache_bytes_per_token']:,}",
          f"{r['deviation']['flops']:+.2%}", f"{r['deviation']['params']:+.2%}",
          f"{r['deviation']['kv_cache']:+.2%}"] for r in budgets])
    out += ["", "## Layouts and memory per GPU", "",
            f"Estimated by `smelt-ds memory` (`smelt_ds.parallel.memory.estimate`) for the recipe's own ZeRO option "
            f"and activation-checkpointing policy with the layout's overrides applied; a layout fits when at least "
            f"{MIN_HEADROOM:.0%} of the device memory stays free. GiB = 2^30 bytes. `smelt-ds render-job RECIPE "
            f"--layout NAME` renders the job; accumulation = global batch / (micro-batch x seq_len x GPUs). "
            f"Under ZeRO-3 "
            f"the memory includes the looped block kept gathered between visits by the loop-aware reuse distance "
            f"(`deepspeed.zero3_loop_tuning: auto`) at the layout's world size and device memory.", ""]
    out += _markdown_table(["recipe", "layout", "GPU", "nodes x GPUs", "ZeRO", "MoE (ep)", "checkpointing", "precision",
                            "micro-batch x accumulation", "memory/GPU (GiB)", "device (GiB)", "headroom", "verdict"],
               [[f"{r['size']}/{r['variant']}", r["layout"], r["gpu"], f"{r['nodes']} x {r['gpus_per_node']}",
                 r["zero"], f"{r['backend']} ({r['ep_size']})", r["policy"], r["precision"],
                 f"{r['micro_batch']} x {r['accumulation']}", _in_gib(r["memory_bytes"]), f"{r['device_memory_gib']:g}",
                 f"{r['headroom']:.0%}", "fits" if r["fits"] else "DOES NOT FIT"] for r in layouts])
    return "\n".join(out) + "\n"


def write_variants(baseline_path: str | Path, check: bool = False) -> list[Path]:
    """Write (or with ``check`` compare) the derived variants next to the Baseline. Returns the
    paths written, or with ``check`` the paths whose file differs from the derivation."""
    path = Path(baseline_path)
    stale = []
    for variant, text in derive_variants(path).items():
        target = path.with_name(f"{variant}.yaml")
        if check:
            if not target.is_file() or target.read_text() != text:
                stale.append(target)
        else:
            target.write_text(text)
            stale.append(target)
    return stale
