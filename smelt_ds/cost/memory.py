"""The memory table before launch: every ZeRO stage / offload option x activation-checkpointing
policy per GPU, with a fits / does-not-fit verdict against the device memory.

The terms (model states, activations, temporary buffers, KV cache) and their sources are in
:mod:`smelt_ds.cost.memory_terms`; the ``zero_optimization`` section each option would run with
comes from :func:`smelt_ds.cost.zero_config.zero_section`. Units: bytes unless a name says
otherwise.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Iterable

from smelt_ds.config.ds_template import resolve_precision
from smelt_ds.config.run import RunConfig, config_from_dict, config_to_dict
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
from smelt_ds.cost.zero_config import zero_section
from smelt_ds.errors import ConfigError

__all__ = ["GiB", "parse_bytes", "format_bytes", "ParamCounts", "param_counts", "ModelStates", "model_states",
           "ZERO_OPTIONS", "POLICIES", "visit_activation_terms", "outside_activation_terms", "ActivationEstimate",
           "activation_bytes", "temporary_bytes", "MemoryRow", "MemoryReport", "estimate", "format_table"]

#: ZeRO stage / offload options of the table: (label, stage, offload_optimizer, offload_param).
ZERO_OPTIONS = [("zero0", 0, False, False), ("zero1", 1, False, False), ("zero2", 2, False, False),
                ("zero2+opt_off", 2, True, False), ("zero3", 3, False, False),
                ("zero3+opt_off", 3, True, False), ("zero3+param_off", 3, True, True)]

SOURCES = {
    "model_states": "DeepSpeed estimate_zero2_model_states_mem_needs / estimate_zero3_model_states_mem_needs "
                    "(bf16: 2 B params + 18 B/param sharded); ZeRO-0/1 and fp32 by the same decomposition; "
                    "experts sharded over moe_runtime.ep_size, dense params over all ranks",
    "activations": "per-visit saved-tensor formula of smelt_ds.cost.memory.visit_activation_terms, after Korthikanti "
                   "et al. 2022 (arXiv 2205.05198) adapted to RMSNorm in fp32, GQA repeated K/V, SDPA "
                   "flash kernels, SwiGLU experts on T*K routed copies; checkpointed visits keep their input",
    "kv_cache": "visits * 2 * num_kv_heads * head_dim * bytes per token (smelt_ds.cost.budget)",
}


@dataclass
class MemoryRow:
    """One ZeRO option x checkpointing policy. Bytes per GPU unless named ``*_per_node``;
    ``headroom`` is ``(device - total) / device`` (negative when it does not fit)."""

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


def _check_cluster(cfg: RunConfig, nodes: int, gpus_per_node: int) -> None:
    for name, v in (("--nodes", nodes), ("--gpus-per-node", gpus_per_node)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ConfigError(f"`{name}` ({v!r}) must be a positive integer: e.g. {name} 1")
    world = nodes * gpus_per_node
    ep = cfg.moe_runtime.ep_size
    if world % ep:
        raise ConfigError(f"`--nodes` x `--gpus-per-node` ({nodes} x {gpus_per_node} = {world} GPUs) must be "
                          f"divisible by `moe_runtime.ep_size` ({ep}): expert parallelism shards the experts over groups "
                          f"of {ep} GPUs; use a multiple of {ep} GPUs or lower moe_runtime.ep_size")


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
    _check_cluster(cfg, nodes, gpus_per_node)
    dev_mem = parse_bytes(device_memory_bytes)

    prec = resolve_precision(cfg, precision, target="gpu")  # a GPU target: `auto` is bf16
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
            zero = zero_section(with_policy(cfg, p), nodes * gpus_per_node, dev_mem, stage, off_opt, off_param)
            tmp = sum(temporary_bytes(cfg, counts, stage, B, S, a, ds_zero=zero).values())
            total = ms.gpu + acts[p].peak + tmp
            rows.append(MemoryRow(label, stage, off_opt, off_param, p, ms.params, ms.grads, ms.optimizer,
                                  ms.zero3_gathered, ms.gpu, ms.cpu_per_node, acts[p].stored, acts[p].peak, tmp,
                                  total, total <= dev_mem, (dev_mem - total) / dev_mem))
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
# table
# ---------------------------------------------------------------------------------------------


def _unit(report: MemoryReport) -> tuple[str, int]:
    """GiB for real runs, MiB when every total is below 10 GiB (small recipes)."""
    return ("GiB", GiB) if max((r.total for r in report.rows), default=0) >= 10 * GiB else ("MiB", 2 ** 20)


def format_table(report: MemoryReport) -> str:
    """The report as a markdown table (GiB or MiB per GPU) with the verdicts and notes."""
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
                     num(x.total), num(x.cpu_per_node), "fits" if x.fits else "DOES NOT FIT", f"{x.headroom:+.1%}"])
    widths = [max(len(row[i]) for row in [head] + rows) for i in range(len(head))]
    line = lambda row: "| " + " | ".join(c.ljust(w) for c, w in zip(row, widths)) + " |"  # noqa: E731
    out = [f"{r.recipe}: {r.nodes} node(s) x {r.gpus_per_node} GPU(s) of {format_bytes(r.device_memory)}, "
           f"{r.precision}, micro-batch {r.micro_batch} x seq_len {r.seq_len} tokens, moe_runtime.ep_size {r.ep_size}; "
           f"{r.params.total:,} parameters ({r.params.expert:,} in experts; embedding and head included)",
           "", line(head), "|" + "|".join("-" * (w + 2) for w in widths) + "|"] + [line(row) for row in rows]
    out.append("")
    out.append(f"{unit} per GPU (host/node: {unit} of CPU memory per node). activations = saved for backward per "
               "micro-batch at the end of the forward pass; act. peak adds one recomputed visit; total = states + "
               "act. peak + temporary (logits, ZeRO buckets, ZeRO-3 gathered window); headroom = free share of "
               "device memory. * = the recipe's own setting.")
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
