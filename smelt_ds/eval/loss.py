"""Validation loss of a model per domain, by token position and in bits per byte: the per-token
cross-entropy of a plain forward pass summed into the shared definition
(:mod:`smelt_ds.runs.validation_loss`: :class:`~smelt_ds.runs.validation_loss.DomainLoss`, ``all``
from :func:`~smelt_ds.runs.validation_loss.combine_domains`, the same as training's validation).
Position buckets are inclusive ranges ``[start, end]`` of 1-based positions.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from smelt_ds.errors import ConfigError
from smelt_ds.parallel.device import device_of, to_device
from smelt_ds.runs.validation_loss import DomainLoss

__all__ = ["token_losses", "position_buckets", "parse_buckets", "evaluate_domain"]


@torch.no_grad()
def token_losses(model, input_ids: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token cross-entropy (nats) and mask, both ``(B, S)`` on the CPU; ignored labels (-100)
    give 0. ``input_ids`` and ``labels`` (CPU) go to the model's device
    (:func:`~smelt_ds.parallel.device.to_device`); the logits are read in fp32 there, whatever the
    model's dtype (:mod:`smelt_ds.eval.device`). The mask is the CPU labels'."""
    ids_dev, labels_dev = to_device(device_of(model), input_ids, labels)
    logits = model(ids_dev).logits.float()
    B, S, V = logits.shape
    nll = F.cross_entropy(logits.reshape(-1, V), labels_dev.reshape(-1), ignore_index=-100, reduction="none")
    return nll.view(B, S).double().cpu(), labels != -100


def position_buckets(seq_len: int, edges: list[int] | None = None) -> list[tuple[int, int]]:
    """Inclusive 1-based position ranges covering ``1..seq_len``.

    ``edges`` are bucket ends (tokens); default: powers of two from 8 (1-8, 9-16, 17-32, ...),
    the last bucket ending at ``seq_len``. Edges at or beyond ``seq_len`` are dropped.
    """
    if edges is None:
        edges, e = [], 8
        while e < seq_len:
            edges.append(e)
            e *= 2
    ends = sorted({e for e in edges if 0 < e < seq_len}) + [seq_len]
    out, start = [], 1
    for end in ends:
        out.append((start, end))
        start = end + 1
    return out


def parse_buckets(text: str | None) -> list[int] | None:
    """``"64,256,1024"`` -> ``[64, 256, 1024]`` (bucket ends, tokens). Raises ConfigError."""
    if text is None:
        return None
    try:
        edges = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ConfigError(f"`--buckets` ({text!r}) must be comma-separated positive integers (bucket ends in "
                          "tokens), e.g. 64,256,1024") from None
    if not edges or min(edges) <= 0:
        raise ConfigError(f"`--buckets` ({text!r}) must list positive bucket ends (tokens), e.g. 64,256,1024")
    return edges


def evaluate_domain(model, batches: list[dict], byte_lengths) -> DomainLoss:
    """Sum losses, tokens, bytes and windows over ``batches`` (``input_ids``/``labels`` ``(B, S)``).

    ``byte_lengths`` ``(V,)``: UTF-8 bytes per token id. Raises ConfigError when a batch is
    longer than the first.
    """
    out = DomainLoss()
    for b in batches:
        nll, mask = token_losses(model, b["input_ids"], b["labels"])
        S = nll.shape[1]
        if not out.pos_nats:
            out.pos_nats, out.pos_tokens = [0.0] * S, [0] * S
        if S > len(out.pos_nats):
            raise ConfigError(f"validation batches of different lengths ({S} > {len(out.pos_nats)} tokens)")
        out.nats += float(nll.sum())
        out.tokens += int(mask.sum())
        out.windows += int(nll.shape[0])
        labels = b["labels"][mask].numpy()
        out.bytes += int(byte_lengths[labels].sum())
        for p, (n, t) in enumerate(zip(nll.sum(0).tolist(), mask.sum(0).tolist(), strict=True)):
            out.pos_nats[p] += n
            out.pos_tokens[p] += int(t)
    return out
