"""Test-time loop count: the same weights run with other repeats of their loop ranges.

``smelt-ds eval RUN [RUN...] --loop-repeats 1,2,3 [--exit-after P]`` scores every run once per
repeat count R: validation loss per domain (nats/token; ``all`` the mean of the domains' values,
each domain weighted equally), the visit plan actually run, the KV-cache slots of that plan (one per
visit) and its budgets (forward FLOPs per token, KV-cache bytes per token;
:func:`smelt_ds.cost.budget.compute_budget`). The plan comes from
:func:`smelt_ds.config.loop.loop_with_repeats` and is applied with ``SmeltLM.set_loop``; the trained
plan is restored afterwards. A Baseline (no loop range) is scored once, on its own plan, and its
rows say ``no loop``.

Looped-LM practice: Ouro's ``total_ut_steps`` and Huginn's ``num_steps`` set the recurrence depth
at inference; arXiv 2605.09165 exits early at loop boundaries (here: ``exit_after``).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from smelt_ds.config.loop import LoopConfig, loop_with_repeats
from smelt_ds.cost.budget import compute_budget
from smelt_ds.errors import ConfigError
from smelt_ds.eval.data import open_eval_data
from smelt_ds.eval.loss import evaluate_domain
from smelt_ds.model.attention import KVCache
from smelt_ds.parallel.device import device_of, to_device
from smelt_ds.runs.load import LoadedRun
from smelt_ds.runs.validation_loss import combine_domains

__all__ = ["parse_repeats", "has_loop", "loop_plan", "loss_by_repeats", "loop_repeats_markdown"]


def parse_repeats(text: str | None) -> list[int] | None:
    """``"1,2,3"`` -> ``[1, 2, 3]`` (order kept, duplicates refused). Raises ConfigError."""
    if text is None:
        return None
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ConfigError(f"`--loop-repeats` ({text!r}) must be comma-separated integers >= 1, e.g. 1,2,3") from None
    if not values or min(values) < 1:
        raise ConfigError(f"`--loop-repeats` ({text!r}) must list repeat counts >= 1, e.g. 1,2,3")
    if len(set(values)) != len(values):
        raise ConfigError(f"`--loop-repeats` ({text!r}) names a repeat count twice: list each once")
    return values


def has_loop(run: LoadedRun) -> bool:
    """Whether the run's plan has a loop range (a test-time loop count applies)."""
    return bool(run.cfg.schedule.spans)


@torch.no_grad()
def _kv_slots(model) -> int:
    """KV-cache slots a forward of one token creates: one per visit of the current plan."""
    cache = KVCache()
    (token,) = to_device(device_of(model), torch.zeros(1, 1, dtype=torch.long))
    model(token, kv_cache=cache)
    return len(cache.slots)


class loop_plan:  # noqa: N801 - used as a context manager: `with loop_plan(run, repeats=1): ...`
    """Context manager: ``run.model`` runs ``loop_with_repeats(run.cfg.loop, L, repeats, exit_after)``
    inside the block and its trained plan afterwards (also on error). ``.loop`` is the applied
    loop section. Raises ConfigError for a run without loop ranges."""

    def __init__(self, run: LoadedRun, repeats: int | None = None, exit_after: int | None = None):
        self.run = run
        self.loop = loop_with_repeats(run.cfg.loop, run.cfg.model.num_layers, repeats, exit_after)
        self._old: LoopConfig | None = None

    def __enter__(self) -> loop_plan:
        self._old = self.run.model.set_loop(self.loop)
        return self

    def __exit__(self, *exc) -> None:
        assert self._old is not None
        self.run.model.set_loop(self._old)


def _settings_for(runs: list[LoadedRun], repeats: list[int] | None, exit_after: int | None
                  ) -> Iterator[tuple[LoadedRun, int | None, str]]:
    for r in runs:
        if not has_loop(r):
            yield r, None, "no loop"
            continue
        for R in (repeats or [None]):  # type: ignore[list-item]
            label = (("trained" if R is None else f"R={R}")
                     + ("" if exit_after is None else f", exit after {exit_after}"))
            yield r, R, label


@torch.no_grad()
def loss_by_repeats(runs: list[LoadedRun], repeats: list[int] | None, exit_after: int | None = None,
                    seq_len: int | None = None, micro_batch_size: int = 8, batches: int | None = 32,
                    log=print) -> dict[str, Any]:
    """Validation loss of every run at every repeat count (see the module docstring).

    ``batches`` micro-batches of ``micro_batch_size`` windows of ``seq_len`` tokens (default: the
    first run's ``train.seq_len``) per domain, the same windows for every run and repeat count.
    Returns ``{"kind": "loop_repeats", "rows": [{"run", "repeats" (int | None), "exit_after",
    "label", "visit_plan" (layer indices), "visits", "kv_cache_slots", "flops_per_token",
    "kv_cache_bytes_per_token", "loss": {domain: nats/token}, "tokens": {domain: tokens}}]}``
    (``all`` = the mean of the domains' values, each domain weighted equally). Raises ConfigError
    when no repeat option is given or when no run has a loop range.
    """
    if repeats is None and exit_after is None:
        raise ConfigError("give `--loop-repeats R[,R...]` and/or `--exit-after P` for a test-time loop table")
    if not any(has_loop(r) for r in runs):
        raise ConfigError("no run has a loop range: `--loop-repeats` / `--exit-after` apply to looped runs "
                          f"(runs: {', '.join(r.name for r in runs)})")
    S = seq_len if seq_len is not None else runs[0].cfg.train.seq_len
    data_cache: dict[str, Any] = {}
    rows = []
    for r, R, label in _settings_for(runs, repeats, exit_after):
        key = r.cfg.data.model_dump_json() + r.eval_split
        if key not in data_cache:
            data_cache[key] = open_eval_data(r.cfg, r.eval_split)
        d = data_cache[key]
        r.model.eval()
        looped = has_loop(r)
        ctx = loop_plan(r, R, exit_after) if looped else None
        loop = ctx.loop if ctx is not None else r.cfg.loop
        if ctx is not None:
            ctx.__enter__()
        try:
            per = {dom: evaluate_domain(r.model, d.batches(dom, S, micro_batch_size, batches), d.byte_lengths)
                   for dom in d.domains}
            slots = _kv_slots(r.model)
            plan = r.model.schedule.layers()
        finally:
            if ctx is not None:
                ctx.__exit__(None, None, None)
        per["all"] = combine_domains(list(per.values()))
        budget = compute_budget(r.cfg.model_copy(update={"loop": loop}), seq_len=S)
        row: dict[str, Any] = {"run": r.name, "repeats": R, "exit_after": exit_after if looped else None,
               "label": label,
               "visit_plan": plan, "visits": len(plan), "kv_cache_slots": slots,
               "flops_per_token": budget.forward_flops_per_token,
               "kv_cache_bytes_per_token": budget.kv_cache_bytes_per_token,
               "loss": {k: v.loss for k, v in per.items()}, "tokens": {k: v.tokens for k, v in per.items()}}
        rows.append(row)
        log(f"[{r.name}] {label}: {len(plan)} visits, loss " +
            ", ".join(f"{k} {v:.4f}" for k, v in row["loss"].items()) + " nats/token")
    return {"kind": "loop_repeats", "seq_len": S, "micro_batch_size": micro_batch_size, "batches": batches,
            "rows": rows}


def loop_repeats_markdown(result: dict[str, Any]) -> str:
    """One table: run, plan label, visits, KV-cache slots, forward FLOPs/token, loss per domain."""
    domains = list(result["rows"][0]["loss"]) if result["rows"] else []
    head = ["run", "loop", "visits", "KV slots", "fwd FLOPs/token"] + [f"loss {d} (nats/token)" for d in domains]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in result["rows"]:
        cells = [row["run"], row["label"], str(row["visits"]), str(row["kv_cache_slots"]),
                 f"{row['flops_per_token']:,.0f}"] + [f"{row['loss'][d]:.4f}" for d in domains]
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    tokens = result["rows"][0]["tokens"] if result["rows"] else {}
    lines.append(f"Loss: token-weighted mean over up to {result['batches']} micro-batches of "
                 f"{result['micro_batch_size']} validation windows of {result['seq_len']} tokens per domain ("
                 + ", ".join(f"{d} {n:,} tokens" for d, n in tokens.items() if d != "all")
                 + "; `all`: the mean of the domains' values, each domain weighted equally), the same windows in "
                 "every row. The trained plan is the "
                 "row whose visits equal training's; a Baseline has no loop to repeat. Other repeat counts change "
                 "the FLOPs per token (column): compare them with the Baseline knowing the budgets no longer match.")
    return "\n".join(lines)
