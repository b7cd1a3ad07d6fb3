"""Where a recipe runs: its cluster layout and world size, resolved one way for ``smelt-ds
render-job``, ``smelt-ds memory``, the recipe table and sweeps, and its memory verdict there.

:func:`resolve` loads a recipe for a layout (``--layout``, else ``cluster.default``, else the first
layout; the layout's ``overrides`` before the user's ``--set``); :func:`place` also takes the node
and GPU counts from ``--nodes`` / ``--gpus-per-node`` or the layout, and checks that the run can
use that many GPUs (:func:`check_world`). :func:`memory_report` estimates the recipe's own ZeRO
option and checkpointing policy there (it fits when it leaves :data:`MIN_HEADROOM` of the device
memory free); :func:`nodes_to_fit` finds the fewest nodes on which it fits.

A **layout** (:class:`smelt_ds.config.cluster.ClusterLayout`, the recipe's ``cluster`` section) says
on how many nodes x GPUs of which memory the recipe runs; its ``overrides`` (``--set`` strings,
e.g. a bigger micro-batch on 141 GB H200s) are applied before the user's own ``--set``. Recipes
without ``cluster.layouts`` (the CPU recipes) resolve to :data:`CPU_LAYOUT` (``cpu``: 1 node x 1
process). Units: counts of nodes, GPUs (ranks) and tokens; memory in bytes (1 GiB = 2**30 bytes).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from smelt_ds.config.cluster import ClusterLayout
from smelt_ds.config.loading import apply_overrides, config_from_dict, read_recipe
from smelt_ds.config.run import RunConfig
from smelt_ds.config.train import resolve_batch
from smelt_ds.cost.precision import resolve_precision
from smelt_ds.errors import ConfigError
from smelt_ds.parallel.memory import ZERO_OPTIONS, Fix, GiB, MemoryReport, check_cluster, estimate, row_fits
from smelt_ds.parallel.zero_section import zero3_plan

__all__ = ["MIN_HEADROOM", "CPU_LAYOUT", "load_raw", "Resolved", "resolve", "zero_option", "zero3_decision",
           "memory_report", "Placement", "place", "check_world", "nodes_to_fit"]

#: share of device memory a layout must leave free (``smelt-ds memory`` headroom, render-job's check)
MIN_HEADROOM = 0.10
#: the layout of recipes without a ``cluster`` section: one CPU process with a nominal 8 GiB
CPU_LAYOUT = ClusterLayout(gpu="cpu", device_memory_gib=8.0, nodes=1, gpus_per_node=1)


def load_raw(path: str | Path) -> dict[str, Any]:
    """The YAML mapping of a recipe file, its ``base:`` chain merged
    (:func:`smelt_ds.config.loading.read_recipe`). Raises ConfigError for a missing file or bad YAML."""
    return read_recipe(path, "recipe file", "recipes/xl/smelt.yaml")[0]


@dataclass
class Resolved:
    """A recipe resolved for one layout: ``config`` has the layout's overrides and then the user's
    ``--set`` applied; ``overrides`` is that list (what a launched job must pass on)."""

    path: Path
    config: RunConfig
    layout_name: str
    layout: ClusterLayout
    overrides: list[str]


def resolve(path: str | Path, layout: str | None = None, overrides: list[str] | None = None) -> Resolved:
    """Load ``path`` for the named layout (default: ``cluster.default``, else the first layout, else
    :data:`CPU_LAYOUT` named ``cpu``). Precedence: ``overrides`` (``--set``) > the layout's
    ``overrides`` > YAML > defaults.

    Raises ConfigError for an unknown layout name (listing the recipe's layouts) or an invalid
    recipe after the overrides.
    """
    path = Path(path)
    raw, lines = read_recipe(path, "recipe file", "recipes/xl/smelt.yaml")
    user = list(overrides or [])
    # a bad value is blamed on its --set item, or on the recipe file's line (as `smelt-ds config show` does)
    first = config_from_dict(apply_overrides(raw, user), source=str(path), overrides=user, key_lines=lines)
    layouts = first.cluster.layouts
    if not layouts:
        if layout not in (None, "cpu"):
            raise ConfigError(f"--layout {layout!r}: {path} has no `cluster.layouts` (a CPU recipe); "
                              "omit --layout or use 'cpu'")
        name, lay = "cpu", CPU_LAYOUT
    else:
        name = layout or first.cluster.default or next(iter(layouts))
        if name not in layouts:
            raise ConfigError(f"--layout {name!r}: `cluster.layouts` of {path} has {sorted(layouts)}; "
                              "choose one of them")
        lay = layouts[name]
    merged = list(lay.overrides) + user
    cfg = config_from_dict(apply_overrides(raw, merged), source=f"{path} (layout {name})", overrides=merged,
                           key_lines=lines)
    return Resolved(path, cfg, name, lay, merged)


def zero_option(cfg: RunConfig) -> str:
    """The :data:`smelt_ds.parallel.memory.ZERO_OPTIONS` label of the recipe's ZeRO stage and offloads
    (e.g. ``zero3+opt_off``). Raises ConfigError when the memory table has no such option."""

    ds = cfg.deepspeed
    want = (ds.zero_stage, ds.offload_optimizer != "none", ds.offload_param != "none")
    for label, *rest in ZERO_OPTIONS:
        if tuple(rest) == want:
            return label
    raise ConfigError(f"`deepspeed.zero_stage` ({ds.zero_stage}) with offload_optimizer "
                      f"{ds.offload_optimizer!r} / offload_param {ds.offload_param!r} has no memory estimate: "
                      f"use one of {[o[0] for o in ZERO_OPTIONS]}")


def zero3_decision(cfg: RunConfig, layout: ClusterLayout, world_size: int):
    """The loop-aware ZeRO-3 decision (:func:`smelt_ds.parallel.zero_section.zero3_plan`) DeepSpeed's config
    will get on ``world_size`` GPUs of the layout's memory in the precision the job will train in
    (fp32 for a CPU layout, the recipe's on a GPU: ``auto`` is bf16), or None below ZeRO-3."""

    if cfg.deepspeed.zero_stage != 3:
        return None
    precision = "fp32" if layout.gpu == "cpu" else resolve_precision(cfg)
    return zero3_plan(cfg, world_size, int(layout.device_memory_gib * GiB), precision)


def memory_report(cfg: RunConfig, layout: ClusterLayout, nodes: int | None = None,
                  gpus_per_node: int | None = None):
    """``smelt_ds.parallel.memory.estimate`` of the recipe's own ZeRO option and checkpointing policy on
    ``nodes x gpus_per_node`` GPUs (default: the layout's) of the layout's device memory. A CPU
    layout is estimated in fp32 for CPU processes. Under ZeRO-3 the loop-aware reuse distance the
    job will run with at that world size (:func:`smelt_ds.parallel.zero_section.zero_section`) is what
    the estimate's gathered window sees. ``report.fits(MIN_HEADROOM)`` is the verdict."""

    nodes, gpus = nodes or layout.nodes, gpus_per_node or layout.gpus_per_node
    cpu = layout.gpu == "cpu"
    return estimate(cfg, nodes, gpus, int(layout.device_memory_gib * GiB), precision="fp32" if cpu else None,
                    device="cpu" if cpu else "cuda", options=[zero_option(cfg)],
                    policies=[cfg.train.activation_checkpointing.policy])


@dataclass
class Placement:
    """A recipe resolved for ``nodes x gpus_per_node`` GPUs of a layout. ``from_layout``: the
    recipe has ``cluster.layouts`` (else the layout is the CPU stand-in); ``accumulation`` and
    ``global_batch_tokens`` (tokens per optimizer step) at that world size."""

    resolved: Resolved
    nodes: int
    gpus_per_node: int
    from_layout: bool
    accumulation: int
    global_batch_tokens: int

    @property
    def config(self) -> RunConfig:
        return self.resolved.config

    @property
    def layout_name(self) -> str:
        return self.resolved.layout_name

    @property
    def layout(self) -> ClusterLayout:
        return self.resolved.layout

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node


def check_world(cfg: RunConfig, layout_name: str, layout: ClusterLayout, nodes: int, gpus: int,
                from_layout: bool) -> tuple[int, int]:
    """Raise ConfigError when the run cannot use ``nodes x gpus`` GPUs: non-positive counts, more
    GPUs per node than a node of the layout has, a world size ``moe_runtime.ep_size`` does not
    divide (:func:`smelt_ds.parallel.memory.check_cluster`), more ranks than the global batch has
    micro-batches. Returns ``(accumulation, global_batch_tokens)``."""
    _check_ep(cfg, layout_name, layout, nodes, gpus, from_layout)
    check_cluster(cfg, nodes, gpus)
    world = nodes * gpus
    if from_layout and gpus > layout.gpus_per_node:
        raise ConfigError(f"`--gpus-per-node` ({gpus}) is more GPUs than a node of layout '{layout_name}' has "
                          f"({layout.gpus_per_node} x {layout.gpu}): use at most {layout.gpus_per_node}, or "
                          "choose another --layout")
    t = cfg.train
    if t.global_batch_tokens is not None:
        micro_tokens = t.micro_batch_size * t.seq_len
        micro_batches = t.global_batch_tokens // micro_tokens
        if world > micro_batches:
            raise ConfigError(f"{nodes} x {gpus} = {world} GPUs is more than the layout needs: the global batch of "
                              f"`train.global_batch_tokens` ({t.global_batch_tokens:,}) tokens is {micro_batches} "
                              f"micro-batches of {t.micro_batch_size} x {t.seq_len} tokens, one per data-parallel "
                              f"rank at most; use at most {micro_batches} GPUs, or raise train.global_batch_tokens "
                              "/ lower train.micro_batch_size")
    return resolve_batch(cfg.train, world)


def _check_ep(cfg: RunConfig, layout_name: str, layout: ClusterLayout, nodes: int, gpus: int,
              from_layout: bool) -> None:
    """Raise ConfigError when ``moe_runtime.ep_size`` does not divide ``nodes x gpus``, suggesting
    only fixes :func:`check_world` accepts: the nearest world size (nodes x GPUs per node, at most the
    layout's GPUs per node) that ``ep_size`` divides and the global batch splits over, and the
    ``ep_size`` values (dividing the world size and ``moe.num_experts``) the recipe loads with.
    Non-positive counts are left to :func:`smelt_ds.parallel.memory.check_cluster`."""
    ep = cfg.moe_runtime.ep_size
    counts_ok = all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in (nodes, gpus))
    if not counts_ok or (nodes * gpus) % ep == 0:
        return
    world = nodes * gpus

    def accepted(c: RunConfig, n: int, g: int) -> bool:
        try:
            check_world(c, layout_name, layout, n, g, from_layout)
        except ConfigError:
            return False
        return True

    max_gpus = layout.gpus_per_node if from_layout else max(gpus, ep)
    worlds = sorted(((n, g) for g in range(1, max_gpus + 1) for n in range(1, nodes * ep + 1) if n * g % ep == 0),
                    key=lambda ng: (abs(ng[0] * ng[1] - world), ng[0] * ng[1] < world, ng[1] != gpus, ng[0]))
    layout_fix = next((f"--nodes {n} --gpus-per-node {g}" for n, g in worlds if accepted(cfg, n, g)), None)
    eps = []
    for e in (d for d in range(ep - 1, 0, -1) if world % d == 0 and cfg.moe.num_experts % d == 0):
        raw = cfg.model_dump(mode="json")
        raw["moe_runtime"]["ep_size"] = e
        try:
            other = config_from_dict(raw, source="ep_size candidate")
        except ConfigError:
            continue
        if accepted(other, nodes, gpus):
            eps.append(e)
    fixes = ([f"set --nodes / --gpus-per-node to a multiple of {ep} GPUs the global batch splits over: "
              f"{layout_fix}"] if layout_fix else []) + \
        ([f"set moe_runtime.ep_size to {' or '.join(map(str, eps[:3]))} (it divides the world size {world} and "
          f"moe.num_experts {cfg.moe.num_experts})"] if eps else [])
    fix = "; or ".join(fixes) if fixes else ("no layout of this recipe fits: lower moe_runtime.ep_size and "
                                             "moe.num_experts together")
    raise ConfigError(f"`moe_runtime.ep_size` ({ep}) does not divide the world size ({nodes} node(s) x {gpus} GPU(s) "
                      f"= {world}): expert parallelism splits the experts over groups of {ep} GPUs: {fix}")


def place(recipe: str | Path, layout: str | None = None, overrides: list[str] | None = None,
          nodes: int | None = None, gpus_per_node: int | None = None, default_nodes: int | None = None,
          before_check: Callable[[int, int], None] | None = None) -> Placement:
    """Resolve ``recipe`` for a layout and a world size, as ``render-job`` and ``memory`` do.

    Args:
        recipe: the recipe file.
        layout: ``--layout`` (default ``cluster.default``, else the first layout, else ``cpu``).
        overrides: ``--set KEY=VALUE`` strings (after the layout's own overrides).
        nodes, gpus_per_node: ``--nodes`` / ``--gpus-per-node`` (default: the layout's).
        default_nodes: the node count when ``nodes`` is None and the recipe has no layouts (e.g.
            the hosts of a hostfile).
        before_check: called with ``(nodes, gpus_per_node)`` before :func:`check_world` (render-job
            checks its hostfile there, so that a host short of slots is the error it reports).

    Raises:
        ConfigError: an unknown layout, an invalid recipe, or a world size the run cannot use
            (:func:`check_world`).
    """
    res = resolve(recipe, layout, overrides)
    from_layout = bool(res.config.cluster.layouts)
    if nodes is None:
        nodes = default_nodes if default_nodes and not from_layout else res.layout.nodes
    gpus = gpus_per_node if gpus_per_node is not None else res.layout.gpus_per_node
    if before_check is not None:
        _check_ep(res.config, res.layout_name, res.layout, nodes, gpus, from_layout)  # its fixes are accepted
        check_cluster(res.config, nodes, gpus)  # positive counts first
        before_check(nodes, gpus)
    accum, gbt = check_world(res.config, res.layout_name, res.layout, nodes, gpus, from_layout)
    return Placement(res, nodes, gpus, from_layout, accum, gbt)


def nodes_to_fit(pl: Placement, cfg: RunConfig, report: MemoryReport, min_headroom: float, max_nodes: int = 1024,
                 **estimate_kwargs) -> Fix | None:
    """The fewest nodes (more than ``pl.nodes``, ``pl.gpus_per_node`` GPUs each, a world size
    :func:`check_world` accepts, at most ``max_nodes``) on which the recipe's own row of
    ``report`` (``report.configured``, estimated for ``cfg``: the placement's config, with any
    ``--seq-len`` / ``--micro-batch`` applied) leaves ``min_headroom`` of the device memory free,
    re-estimated at each node count; None when there is none.

    ``estimate_kwargs``: the other :func:`smelt_ds.parallel.memory.estimate` arguments ``report`` was
    made with (precision, device). Model states per GPU shrink with the data-parallel size,
    activations per GPU do not: when the most nodes do not fit, no other count is tried;
    otherwise the counts are tried in order up to the first that fits.
    """
    own = report.configured
    if own is None:
        return None

    def fitting_row(n: int):
        rep = estimate(cfg, n, pl.gpus_per_node, report.device_memory, options=[own.option], policies=[own.policy],
                       **estimate_kwargs)
        return rep.configured if rep.configured is not None and row_fits(rep.configured, min_headroom) else None

    def usable(n: int) -> bool:
        try:
            check_world(cfg, pl.layout_name, pl.layout, n, pl.gpus_per_node, pl.from_layout)
        except ConfigError:  # ep_size or the global batch does not divide, or too many ranks
            return False
        return True

    t = cfg.train
    if t.global_batch_tokens is not None:  # at most one micro-batch per rank
        max_nodes = min(max_nodes, t.global_batch_tokens // (t.micro_batch_size * t.seq_len) // pl.gpus_per_node)
    counts = [n for n in range(pl.nodes + 1, max_nodes + 1) if usable(n)]
    if not counts or fitting_row(counts[-1]) is None:
        return None
    for n in counts:
        row = fitting_row(n)
        if row is not None:
            return Fix(own.option, own.policy, n, pl.gpus_per_node, row.total, row.headroom, [], ["--nodes", str(n)],
                       host_per_node=row.cpu_per_node)
    return None
