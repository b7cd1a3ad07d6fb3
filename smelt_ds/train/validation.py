"""In-loop validation: the loss per validation domain of the engine being trained (rank-collective).

``train.eval_every`` steps and at the end of a run, :func:`smelt_ds.train.loop.train` calls
:func:`evaluate`; its numbers go to ``metrics.jsonl`` (``val/<domain>``, ``val/all``), TensorBoard
and ``summary.txt``.

Definition: the one of :mod:`smelt_ds.runs.validation_loss`, which ``smelt-ds eval`` uses too (a
domain's loss is the mean next-token cross-entropy, nats/token, over the label tokens of its
validation windows; ``all`` is :data:`~smelt_ds.runs.validation_loss.ALL_DEFINITION`). The windows
are a cheap subset: per domain
the first ``eval.eval_batches x train.micro_batch_size x ranks`` windows of ``train.seq_len + 1``
tokens in shard order (rank r reads windows r, r + ranks, ...; fewer when a domain holds fewer,
see :func:`validation_windows`). ``smelt-ds eval RUN --training-windows`` evaluates exactly
those windows from a checkpoint and gives the same numbers.
"""

from __future__ import annotations

import torch

from smelt_ds.config.run import RunConfig
from smelt_ds.parallel import control
from smelt_ds.parallel.device import device_of, to_device
from smelt_ds.runs.validation_loss import DomainLoss, validation_losses

__all__ = ["evaluate", "validation_windows", "describe_validation"]


@torch.no_grad()
def evaluate(engine, data, cfg: RunConfig) -> dict[str, float]:
    """Loss (nats/token) per validation domain and ``all`` over up to ``eval.eval_batches``
    micro-batches per rank and domain.

    Per domain, the cross-entropy (nats: ``lm_loss`` times the batch's label tokens) and the label
    tokens are summed over the batches on the engine's device (every batch moved there by
    :func:`~smelt_ds.parallel.device.to_device`), and all domains' sums all-reduced over the ranks
    at once (one control all-reduce) into a
    :class:`~smelt_ds.runs.validation_loss.DomainLoss`; the values are
    :func:`~smelt_ds.runs.validation_loss.validation_losses` of those sums, the definition
    ``smelt-ds eval`` uses (token-weighted within a domain, ``all`` weighing the domains equally,
    domains without a label token left out). ``engine`` is called as ``engine(input_ids,
    labels=labels)`` and must return ``lm_loss``, the mean over the batch's label tokens.
    """
    engine.eval()
    device = device_of(engine)
    sums: dict[str, torch.Tensor] = {}
    for domain, batches in data.validation(cfg.eval.eval_batches).items():
        s = torch.zeros(2, dtype=torch.float64, device=device)  # (nats, label tokens), on the device
        for batch in batches:
            n = int((batch.labels != -100).sum())  # the host's copy of the labels: no device sync
            input_ids, labels = to_device(device, batch.input_ids, batch.labels)
            o = engine(input_ids, labels=labels)
            s += torch.stack([o.lm_loss.detach().double() * n, torch.tensor(float(n), dtype=torch.float64,
                                                                             device=device)])
        sums[domain] = s
    engine.train()
    # every domain's sums in one all-reduce (the control group: smelt_ds.parallel.control)
    totals = control.all_reduce_sum(torch.cat(list(sums.values()))) if sums else []
    parts = {d: DomainLoss(nats=totals[2 * i], tokens=int(totals[2 * i + 1])) for i, d in enumerate(sums)}
    return validation_losses(parts)


def validation_windows(data) -> dict[str, int]:
    """Windows per domain that :func:`evaluate` reads on all ranks together (units: windows of
    ``train.seq_len`` label tokens): ``ranks x min(windows per rank, eval.eval_batches x
    train.micro_batch_size)``, from this rank's loaders (``data.val_loaders``, every rank reads as
    many). Empty when ``data`` has no validation loaders."""
    out = {}
    for domain, vl in getattr(data, "val_loaders", {}).items():
        per_rank = len(vl.sample_ids)
        if vl.max_batches is not None:
            per_rank = min(per_rank, vl.max_batches * vl.micro_batch_size)
        out[domain] = vl.dp_world_size * per_rank
    return out


def describe_validation(data, cfg: RunConfig) -> str | None:
    """One line saying what the validation losses were computed on, for ``summary.txt``, e.g.
    ``code 64, text 64 of 128 tokens (the first of each domain: eval.eval_batches
    8 x train.micro_batch_size 8 x 1 rank); reproduce: smelt-ds eval RUN --training-windows``.
    None when ``data`` has no validation loaders."""
    windows = validation_windows(data)
    if not windows:
        return None
    ranks = next(iter(data.val_loaders.values())).dp_world_size
    per = ", ".join(f"{d} {w:,}" for d, w in windows.items())
    return (f"{per} of {cfg.train.seq_len} tokens (the first of each domain's validation split: "
            f"eval.eval_batches {cfg.eval.eval_batches} x train.micro_batch_size {cfg.train.micro_batch_size} x "
            f"{ranks} rank{'s' if ranks != 1 else ''}); `smelt-ds eval RUN --training-windows` recomputes these "
            "losses from a checkpoint")
