"""The memory table before launch: every ZeRO stage / offload option x activation-checkpointing
policy per GPU, with a fits / does-not-fit verdict against the device memory.

The terms (model states, activations, temporary buffers, KV cache) and their sources are in
:mod:`smelt_ds.cost.memory_terms`; the ``zero_optimization`` section each option would run with
comes from :func:`smelt_ds.parallel.zero_section.zero_section`. Units: bytes unless a name says
otherwise.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

from smelt_ds.config.loading import config_from_dict, config_to_dict
from smelt_ds.config.run import RunConfig
from smelt_ds.cost.budget import kv_cache_bytes_per_token
from smelt_ds.cost.memory_terms import (
    POLICIES,
    ActivationEstimate,
    GiB,
    ModelStates,
    ParamCounts,
    activation_bytes,
    format_bytes,
    model_states,
    outside_activation_terms,
    param_counts,
    parse_bytes,
    temporary_bytes,
    visit_activation_terms,
    with_policy,
)
from smelt_ds.cost.precision import resolve_precision
from smelt_ds.errors import ConfigError
from smelt_ds.parallel.zero_section import zero_section

__all__ = ["GiB", "parse_bytes", "format_bytes", "ParamCounts", "param_counts", "ModelStates", "model_states",
           "ZERO_OPTIONS", "POLICIES", "visit_activation_terms", "outside_activation_terms", "ActivationEstimate",
           "activation_bytes", "temporary_bytes", "MemoryRow", "MemoryReport", "check_cluster", "estimate",
           "TERM_HINTS", "Term", "Fix", "Verdict", "row_fits", "setting_overrides", "row_terms", "verdict",
           "format_verdict", "format_headroom", "format_table"]

#: ZeRO stage / offload options of the table: (label, stage, offload_optimizer, offload_param).
ZERO_OPTIONS = [("zero0", 0, False, False), ("zero1", 1, False, False), ("zero2", 2, False, False),
                ("zero2+opt_off", 2, True, False), ("zero3", 3, False, False),
                ("zero3+opt_off", 3, True, False), ("zero3+param_off", 3, True, True)]

SOURCES = {
    "model_states": "DeepSpeed estimate_zero2_model_states_mem_needs / estimate_zero3_model_states_mem_needs "
                    "(bf16: 2 B params + 18 B/param sharded); ZeRO-0/1 and fp32 by the same decomposition; "
                    "experts sharded over moe_runtime.ep_size, dense params over all ranks",
    "activations": "per-visit saved-tensor formula of smelt_ds.cost.memory_terms.visit_activation_terms, after "
                   "Korthikanti et al. 2022 (arXiv 2205.05198) adapted to RMSNorm in fp32, GQA repeated K/V, SDPA "
                   "flash kernels, SwiGLU experts on T*K routed copies; checkpointed visits keep their input",
    "kv_cache": "visits * 2 * num_kv_heads * head_dim * bytes per token (smelt_ds.cost.budget)",
}


@dataclass
class MemoryRow:
    """One ZeRO option x checkpointing policy. Bytes per GPU unless named ``*_per_node``;
    ``fits`` is ``total <= device memory``; ``headroom`` is ``(device - total) / device``
    (negative when it does not fit); ``visits`` the visits of the plan, ``checkpointed_visits``
    how many of them the policy recomputes, ``largest_visit`` the most bytes one
    non-checkpointed visit saves (the activations are mostly ``visits - checkpointed_visits``
    such visits, :func:`activation_bytes`)."""

    option: str
    zero_stage: int
    offload_optimizer: bool
    offload_param: bool
    policy: str
    params: int
    grads: int
    optimizer: int
    zero3_gathered: int
    model_states: int
    cpu_per_node: int
    activations: int
    activations_peak: int
    temporary: int
    total: int
    fits: bool
    headroom: float
    visits: int = 0
    checkpointed_visits: int = 0
    largest_visit: int = 0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class MemoryReport:
    """Estimated memory of a recipe on ``nodes x gpus_per_node`` GPUs of ``device_memory`` bytes.

    ``rows``: every ZeRO option x checkpointing policy; ``configured``: the row of the recipe's
    own ``deepspeed`` and ``train.activation_checkpointing`` settings (None when that combination
    is not in the table); ``kv_cache_bytes``: inference KV cache of one sequence of
    ``context_len`` tokens in ``kv_dtype``.
    """

    recipe: str
    nodes: int
    gpus_per_node: int
    device_memory: int
    precision: str
    seq_len: int
    micro_batch: int
    ep_size: int
    params: ParamCounts
    rows: list[MemoryRow]
    configured: MemoryRow | None
    context_len: int
    kv_dtype: str
    kv_cache_bytes: int
    activation_terms: dict[str, int] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    sources: dict[str, str] = field(default_factory=lambda: dict(SOURCES))
    measured: list[dict[str, Any]] = field(default_factory=list)

    def fits(self, headroom: float = 0.1) -> bool:
        """Whether the recipe's configured row fits with at least ``headroom`` (fraction of device
        memory) to spare."""
        return self.configured is not None and self.configured.headroom >= headroom

    def row(self, option: str, policy: str) -> MemoryRow:
        """The row of ``option`` (e.g. ``zero3``) and ``policy``; KeyError if absent."""
        for r in self.rows:
            if r.option == option and r.policy == policy:
                return r
        raise KeyError((option, policy))

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _with_batch(cfg: RunConfig, seq_len: int | None, micro_batch: int | None) -> RunConfig:
    if seq_len is None and micro_batch is None:
        return cfg
    raw = config_to_dict(cfg)
    if seq_len is not None:
        raw["train"]["seq_len"] = seq_len
    if micro_batch is not None:
        raw["train"]["micro_batch_size"] = micro_batch
    raw["train"]["global_batch_tokens"] = None
    return config_from_dict(raw, source=f"recipe {cfg.name!r} with --seq-len/--micro-batch")


def check_cluster(cfg: RunConfig, nodes: int, gpus_per_node: int) -> None:
    """Raise ConfigError unless ``nodes`` and ``gpus_per_node`` are positive integers and their
    product (the world size) is a multiple of ``moe_runtime.ep_size`` (``1`` for the reference
    backend, which the config enforces). The message names ``--nodes`` / ``--gpus-per-node`` and a
    world size that works."""
    for name, v in (("--nodes", nodes), ("--gpus-per-node", gpus_per_node)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ConfigError(f"`{name}` ({v!r}) must be a positive integer, e.g. {name} 1")
    world = nodes * gpus_per_node
    ep = cfg.moe_runtime.ep_size
    if world % ep:
        fix = next(g for g in range(gpus_per_node + 1, gpus_per_node + ep + 1) if nodes * g % ep == 0)
        raise ConfigError(f"`moe_runtime.ep_size` ({ep}) does not divide the world size ({nodes} node(s) x "
                          f"{gpus_per_node} GPU(s) = {world}): expert parallelism splits the experts over groups of "
                          f"{ep} GPUs; set --nodes / --gpus-per-node to a multiple of {ep} GPUs (e.g. --nodes "
                          f"{nodes} --gpus-per-node {fix}), or lower moe_runtime.ep_size")


def estimate(cfg: RunConfig, nodes: int = 1, gpus_per_node: int = 1, device_memory_bytes: int | str = 80 * GiB,
             seq_len: int | None = None, micro_batch: int | None = None, precision: str | None = None,
             context_len: int | None = None, kv_dtype: str = "bf16", device: str = "cuda",
             options: Iterable[str] | None = None, policies: Iterable[str] | None = None) -> MemoryReport:
    """Memory per GPU of ``cfg`` for every ZeRO option (:data:`ZERO_OPTIONS`) and checkpointing
    policy (:data:`POLICIES`) on ``nodes x gpus_per_node`` GPUs of ``device_memory_bytes`` each.

    Args:
        cfg: the recipe.
        nodes, gpus_per_node: the cluster (N = nodes * gpus_per_node ranks).
        device_memory_bytes: bytes per GPU (int or a string such as ``"80GiB"``).
        seq_len, micro_batch: override ``train.seq_len`` (tokens) / ``train.micro_batch_size``
            (samples per GPU).
        precision: ``bf16`` | ``fp32``; default the recipe's (``auto`` -> bf16, a GPU target).
        context_len: KV-cache context (tokens), default ``model.max_seq_len``.
        kv_dtype: KV-cache element type.
        device: ``cuda`` (estimates for GPUs) or ``cpu`` (to compare with a CPU measurement:
            CPU dropout saves the scaled noise, CPU SDPA with dropout uses the math kernel).
        options, policies: restrict the table (labels of :data:`ZERO_OPTIONS`, :data:`POLICIES`).

    Returns:
        a :class:`MemoryReport`; ``report.fits(0.1)`` checks the recipe's own setting.

    Raises:
        ConfigError: bad cluster sizes (N not divisible by ``moe_runtime.ep_size``), memory size, batch
            or precision.
    """
    cfg = _with_batch(cfg, seq_len, micro_batch)
    check_cluster(cfg, nodes, gpus_per_node)
    dev_mem = parse_bytes(device_memory_bytes)

    prec = resolve_precision(cfg, precision)  # a GPU target: `auto` is bf16
    a = 2 if prec == "bf16" else 4
    B, S = cfg.train.micro_batch_size, cfg.train.seq_len
    counts = param_counts(cfg)
    option_set = set(options) if options is not None else {o[0] for o in ZERO_OPTIONS}
    policy_list = list(policies) if policies is not None else list(POLICIES)
    bad = sorted(option_set - {o[0] for o in ZERO_OPTIONS}) + [p for p in policy_list if p not in POLICIES]
    if bad:
        raise ConfigError(f"unknown memory table entries {bad}: options are {[o[0] for o in ZERO_OPTIONS]}, "
                          f"policies {list(POLICIES)}")
    notes = []
    acts = {p: activation_bytes(cfg, p, B, S, a, device) for p in policy_list}
    rows = []
    for label, stage, off_opt, off_param in ZERO_OPTIONS:
        if label not in option_set:
            continue
        if stage == 3 and cfg.moe_runtime.backend == "deepspeed":
            notes.append(f"{label}: skipped, moe_runtime.backend 'deepspeed' does not support ZeRO-3 (use 'autoep')")
            continue
        ms = model_states(counts, nodes, gpus_per_node, stage, off_opt, off_param, prec, cfg.moe_runtime.ep_size)
        for p in policy_list:
            # the ZeRO-3 loop tuning depends on the policy (recomputes lengthen backward reuse gaps)
            zero = zero_section(with_policy(cfg, p), nodes * gpus_per_node, dev_mem, prec, stage, off_opt, off_param)
            tmp = sum(temporary_bytes(cfg, counts, stage, B, S, a, ds_zero=zero).values())
            total = ms.gpu + acts[p].peak + tmp
            rows.append(MemoryRow(label, stage, off_opt, off_param, p, ms.params, ms.grads, ms.optimizer,
                                  ms.zero3_gathered, ms.gpu, ms.cpu_per_node, acts[p].stored, acts[p].peak, tmp,
                                  total, total <= dev_mem, (dev_mem - total) / dev_mem, len(acts[p].per_visit),
                                  acts[p].checkpointed, max(acts[p].per_visit, default=0)))
    ds = cfg.deepspeed
    # ZeRO-3 parameter offload uses the zero3_offload_param template, which offloads the optimizer too
    off_opt = ds.offload_optimizer != "none" or ds.offload_param != "none"
    own = next((o[0] for o in ZERO_OPTIONS if o[1] == ds.zero_stage and o[2] == off_opt
                and o[3] == (ds.offload_param != "none")), None)
    policy = cfg.train.activation_checkpointing.policy
    configured = next((r for r in rows if r.option == own and r.policy == policy), None)
    if configured is None:
        notes.append(f"the recipe's own setting (ZeRO-{ds.zero_stage}, offload_optimizer {ds.offload_optimizer}, "
                     f"policy {policy}) is not among the rows shown: fits() is False")
    ctx = context_len or cfg.model.max_seq_len
    terms: dict[str, int] = {}
    for v in cfg.schedule.plan:
        for k, val in visit_activation_terms(cfg, v.layer, B, S, a, device).items():
            terms[k] = terms.get(k, 0) + val
    for k, val in outside_activation_terms(cfg, B, S, a).items():
        terms[f"outside/{k}"] = val
    return MemoryReport(cfg.name, nodes, gpus_per_node, dev_mem, prec, S, B, cfg.moe_runtime.ep_size, counts, rows,
                        configured, ctx, kv_dtype, kv_cache_bytes_per_token(cfg, kv_dtype) * ctx, terms, notes)


# ---------------------------------------------------------------------------------------------
# the verdict on the recipe's own setting
# ---------------------------------------------------------------------------------------------

#: what lowers each term of a row (the verdict's advice; the fixes it names are estimated rows)
TERM_HINTS = {
    "parameters": "ZeRO-3 shards them over all GPUs; zero3+param_off keeps them on the host",
    "gradients": "ZeRO-2/3 shard them over the data-parallel GPUs (more GPUs, less on each)",
    "optimizer states": "ZeRO-1/2/3 shard them over the data-parallel GPUs (more GPUs, less on each); "
                        "offload_optimizer keeps them on the host",
    "activations": "activation checkpointing of the looped visits (policy looped) or of every visit (full) "
                   "keeps only each checkpointed visit's input; or a smaller train.micro_batch_size",
    "ZeRO-3 gathered layer": "the largest module gathered with its gradient: a larger moe_runtime.ep_size "
                             "splits the experts",
    "buffers": "logits, ZeRO buckets and the ZeRO-3 gathered window: a smaller train.micro_batch_size or "
               "reduce_bucket_size",
}
#: fixes are ranked by what they cost at run time: GPU-only sharding before offload, then recompute
_OPTION_COST = ("zero0", "zero1", "zero2", "zero3", "zero2+opt_off", "zero3+opt_off", "zero3+param_off")
_POLICY_COST = ("none", "looped", "every_n", "full")


@dataclass
class Term:
    """One contributor to a row's total: ``bytes`` per GPU, ``share`` of the total, ``hint``
    (:data:`TERM_HINTS`: what lowers it), ``detail`` (for activations: visits and bytes per visit)."""

    name: str
    bytes: int
    share: float
    hint: str
    detail: str = ""


@dataclass
class Fix:
    """A setting that fits with the verdict's headroom: ZeRO option ``option`` and checkpointing
    ``policy`` on ``nodes x gpus_per_node`` GPUs needing ``total`` bytes per GPU. ``overrides``
    (``--set KEY=VALUE`` strings) and ``flags`` (command-line flags such as ``--nodes 3``) turn the
    recipe's own setting into it."""

    option: str
    policy: str
    nodes: int
    gpus_per_node: int
    total: int
    headroom: float
    overrides: list[str]
    flags: list[str] = field(default_factory=list)
    host_per_node: int = 0  # bytes of CPU memory per node the setting needs (DeepSpeed's estimate)

    def describe(self) -> str:
        what = " ".join([*(f"--set {o}" for o in self.overrides), *self.flags])
        where = f"{self.nodes} node(s) x {self.gpus_per_node} GPU(s)" if self.flags else \
            f"{self.option} + checkpointing {self.policy}"
        host = f" and {format_bytes(self.host_per_node)} of host memory per node" if "_off" in self.option else ""
        return f"{where} at {format_bytes(self.total)} per GPU{host} ({what})"


@dataclass
class Verdict:
    """Whether the recipe's own ZeRO option and checkpointing policy (the report's ``configured``
    row) fits with ``min_headroom`` (a fraction) of the device memory to spare.

    ``limit`` = ``device_memory * (1 - min_headroom)`` bytes; ``over_by`` = ``total - limit``
    (0 when it fits); ``terms``: the row's contributors, largest first; ``over``: the fewest
    largest terms whose bytes together reach ``over_by`` (empty when it fits); ``fixes``: settings
    that fit, closest to the recipe's first (other rows on the same GPUs, then more nodes);
    ``nodes_searched``: whether larger node counts were tried for the recipe's own setting.
    """

    fits: bool
    option: str
    policy: str
    total: int
    device_memory: int
    min_headroom: float
    headroom: float
    limit: int
    over_by: int
    terms: list[Term]
    over: list[str]
    fixes: list[Fix]
    nodes_searched: bool = False

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def row_fits(row: MemoryRow, min_headroom: float) -> bool:
    """Whether ``row`` leaves at least ``min_headroom`` (fraction) of the device memory free."""
    return row.headroom >= min_headroom


def setting_overrides(cfg: RunConfig, option: str, policy: str) -> list[str]:
    """The ``--set KEY=VALUE`` strings that give ``cfg`` ZeRO option ``option`` (a label of
    :data:`ZERO_OPTIONS`) and checkpointing ``policy``: only the keys that change."""
    _, stage, off_opt, off_param = next(o for o in ZERO_OPTIONS if o[0] == option)
    ds = cfg.deepspeed
    want = {"deepspeed.zero_stage": (ds.zero_stage, stage),
            "deepspeed.offload_optimizer": (ds.offload_optimizer, "cpu" if off_opt else "none"),
            "deepspeed.offload_param": (ds.offload_param, "cpu" if off_param else "none"),
            "train.activation_checkpointing.policy": (cfg.train.activation_checkpointing.policy, policy)}
    return [f"{k}={new}" for k, (old, new) in want.items() if old != new]


def row_terms(row: MemoryRow) -> list[Term]:
    """The contributors to ``row.total`` (they add up to it), largest first."""
    stored = row.visits - row.checkpointed_visits
    detail = (f"{stored} of {row.visits} visits keep their activations, up to {format_bytes(row.largest_visit)} "
              f"per visit" + (f"; {row.checkpointed_visits} checkpointed" if row.checkpointed_visits else ""))
    parts = [("parameters", row.params, ""), ("gradients", row.grads, ""), ("optimizer states", row.optimizer, ""),
             ("ZeRO-3 gathered layer", row.zero3_gathered, ""), ("activations", row.activations_peak, detail),
             ("buffers", row.temporary, "")]
    # the parts of DeepSpeed's model-state estimate may differ from its total by rounding: buffers absorb it
    rounding = row.model_states - row.params - row.grads - row.optimizer - row.zero3_gathered
    sized = [(n, b + (rounding if n == "buffers" else 0), d) for n, b, d in parts]
    terms = [Term(n, b, b / max(row.total, 1), TERM_HINTS[n], d) for n, b, d in sized if b or n == "activations"]
    return sorted(terms, key=lambda t: -t.bytes)


def _row_fixes(cfg: RunConfig, report: MemoryReport, own: MemoryRow, min_headroom: float, most: int) -> list[Fix]:
    """Up to ``most`` rows that fit: the cheapest change of the policy alone, of the ZeRO option
    alone, of both, then the next cheapest (:data:`_OPTION_COST`, :data:`_POLICY_COST`)."""
    def key(r: MemoryRow) -> tuple:
        changed = (r.option != own.option) + (r.policy != own.policy)
        return changed, _OPTION_COST.index(r.option), _POLICY_COST.index(r.policy), r.total

    ok = sorted((r for r in report.rows if row_fits(r, min_headroom) and r is not own), key=key)
    kinds = [lambda r: r.option == own.option, lambda r: r.policy == own.policy,
             lambda r: r.option != own.option and r.policy != own.policy]
    picked: list[MemoryRow] = []
    for kind in kinds:
        first = next((r for r in ok if kind(r) and r not in picked), None)
        if first is not None:
            picked.append(first)
    picked += [r for r in ok if r not in picked]
    return [Fix(r.option, r.policy, report.nodes, report.gpus_per_node, r.total, r.headroom,
                setting_overrides(cfg, r.option, r.policy), host_per_node=r.cpu_per_node)
            for r in sorted(picked[:most], key=key)]


def verdict(cfg: RunConfig, report: MemoryReport, min_headroom: float, more_nodes: Fix | None = None,
            nodes_searched: bool = False, most: int = 3) -> Verdict:
    """The verdict on ``report.configured`` (the report of ``cfg`` with every option and policy):
    fits when it leaves ``min_headroom`` of the device memory free; otherwise the terms over and
    up to ``most`` rows of the report that fit, plus ``more_nodes`` (the recipe's own setting on
    more nodes, found by the caller; ``nodes_searched``: the caller looked and found none when
    ``more_nodes`` is None) when given.

    Raises:
        ConfigError: the recipe's ZeRO option / policy is not among the report's rows.
    """
    own = report.configured
    if own is None:
        ds = cfg.deepspeed
        raise ConfigError(f"`deepspeed.zero_stage` ({ds.zero_stage}) with offload_optimizer {ds.offload_optimizer!r} "
                          f"/ offload_param {ds.offload_param!r} and checkpointing policy "
                          f"{cfg.train.activation_checkpointing.policy!r} has no memory estimate: use one of "
                          f"{[o[0] for o in ZERO_OPTIONS]}")
    limit = int(report.device_memory * (1 - min_headroom))
    fits = row_fits(own, min_headroom)
    over_by = max(0, own.total - limit)
    terms = row_terms(own)
    over: list[str] = []
    for t in terms:
        if sum(x.bytes for x in terms if x.name in over) >= over_by:
            break
        over.append(t.name)
    fixes = [] if fits else _row_fixes(cfg, report, own, min_headroom, most) + ([more_nodes] if more_nodes else [])
    return Verdict(fits, own.option, own.policy, own.total, report.device_memory, min_headroom, own.headroom, limit,
                   over_by, terms, over, fixes, nodes_searched or more_nodes is not None)


def format_verdict(v: Verdict) -> str:
    """The verdict as text: FITS with its headroom, or DOES NOT FIT with the terms over, the
    other terms and the fixes."""
    own = f"the recipe's own setting, {v.option} + checkpointing {v.policy}"
    need = f"at least {v.min_headroom:.0%} free, as render-job requires"
    if v.fits:
        return (f"verdict: FITS: {own}, needs {format_bytes(v.total)} of {format_bytes(v.device_memory)} per GPU, "
                f"{format_headroom(v.headroom)} headroom ({need})")
    out = [f"verdict: DOES NOT FIT: {own}, needs {format_bytes(v.total)} of {format_bytes(v.device_memory)} per GPU, "
           f"{format_bytes(v.over_by)} over the {format_bytes(v.limit)} that leave {need}"]
    for t in v.terms:
        tag = "over" if t.name in v.over else "also"
        detail = f"; {t.detail}" if t.detail else ""
        hint = f": {t.hint}" if t.name in v.over else ""
        out.append(f"  {tag}: {t.name} {format_bytes(t.bytes)} ({t.share:.0%} of the total{detail}){hint}")
    if v.fixes:
        out.append("  fits instead: " + "; or ".join(f.describe() for f in v.fixes))
    if v.nodes_searched and not any(f.flags for f in v.fixes):
        out.append("  more nodes do not bring the recipe's own setting under (activations per GPU do not shrink "
                   "with more GPUs; the global batch caps the node count)")
    if not v.fixes:
        out.append("  nothing in the table fits on these GPUs: lower train.micro_batch_size or train.seq_len, or use "
                   "GPUs with more memory")
    return "\n".join(out)


def format_headroom(h: float) -> str:
    """A headroom fraction as a percentage; a total above 10x the device as ``needs 12.3x``
    (a percentage of thousands says nothing)."""
    return f"{h:+.1%}" if h >= -9 else f"needs {1 - h:.3g}x"


# ---------------------------------------------------------------------------------------------
# table
# ---------------------------------------------------------------------------------------------


def _unit(report: MemoryReport) -> tuple[str, int]:
    """GiB for real runs, MiB when every total is below 10 GiB (small recipes)."""
    return ("GiB", GiB) if max((r.total for r in report.rows), default=0) >= 10 * GiB else ("MiB", 2 ** 20)


def _row_verdict(row: MemoryRow, min_headroom: float | None) -> str:
    if not row.fits:
        return "DOES NOT FIT"
    return "fits" if min_headroom is None or row_fits(row, min_headroom) else f"tight (<{min_headroom:.0%} free)"


def format_table(report: MemoryReport, min_headroom: float | None = None) -> str:
    """The report as a markdown table (GiB or MiB per GPU) with the verdicts and notes. A row
    fits when its total is at most the device memory; with ``min_headroom`` (a fraction) a row
    that fits with less free is marked ``tight``."""
    r = report
    unit, div = _unit(r)
    num = lambda n: f"{n / div:.2f}"  # noqa: E731
    head = ["option", "policy", "params", "grads", "optim", "z3 layer", "states", "activations", "act. peak",
            "temporary", "total", "host/node", "verdict", "headroom"]
    rows = []
    for x in r.rows:
        mark = " *" if x is r.configured else ""
        rows.append([x.option + mark, x.policy, num(x.params), num(x.grads), num(x.optimizer), num(x.zero3_gathered),
                     num(x.model_states), num(x.activations), num(x.activations_peak), num(x.temporary),
                     num(x.total), num(x.cpu_per_node), _row_verdict(x, min_headroom), format_headroom(x.headroom)])
    widths = [max(len(row[i]) for row in [head] + rows) for i in range(len(head))]
    line = lambda row: "| " + " | ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) + " |"  # noqa: E731
    out = [f"{r.recipe}: {r.nodes} node(s) x {r.gpus_per_node} GPU(s) of {format_bytes(r.device_memory)}, "
           f"{r.precision}, micro-batch {r.micro_batch} x seq_len {r.seq_len} tokens, moe_runtime.ep_size {r.ep_size}; "
           f"{r.params.total:,} parameters ({r.params.expert:,} in experts; embedding and head included)",
           "", line(head), "|" + "|".join("-" * (w + 2) for w in widths) + "|"] + [line(row) for row in rows]
    out.append("")
    out.append(f"{unit} per GPU (host/node: {unit} of CPU memory per node). activations = saved for backward per "
               "micro-batch at the end of the forward pass; act. peak adds one recomputed visit; total = states + "
               "act. peak + temporary (logits, ZeRO buckets, ZeRO-3 gathered window); headroom = free share of "
               "device memory" + (f" (tight: under the {min_headroom:.0%} render-job requires)" if min_headroom
                                  is not None else "") + ". * = the recipe's own setting.")
    out.append(f"inference KV cache: {format_bytes(r.kv_cache_bytes)} per sequence of {r.context_len} tokens "
               f"({r.kv_dtype}, every visit keeps its own K and V)")
    for m in r.measured:
        if m.get("saved_activations") is not None:
            out.append(f"measured ({m['device']}, policy {m['policy']}): saved activations "
                       f"{format_bytes(m['saved_activations'])} vs predicted {format_bytes(m['predicted_activations'])}"
                       f"; params+grads+optimizer {format_bytes(m['params'] + m['grads'] + m['optimizer'])} vs "
                       f"predicted {format_bytes(m['predicted_model_states'])} (fp32, ZeRO-0, 1 process)")
        else:
            out.append(f"measured ({m['device']}, policy {m['policy']}): allocator peak "
                       f"{format_bytes(m['peak_allocated'])} vs predicted total "
                       f"{format_bytes(m['predicted_total'] or 0)} (1 GPU)")
    out += [f"note: {n}" for n in r.notes]
    out += [f"source ({k}): {v}" for k, v in r.sources.items()]
    return "\n".join(out)
