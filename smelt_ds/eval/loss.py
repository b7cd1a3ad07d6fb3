"""Validation loss per domain, bits per byte, and loss by token position.

Definitions (within a domain every number is a token- or byte-weighted mean over its evaluated
label tokens; the domain ``all`` weighs the domains equally):

- **loss** (nats/token): mean next-token cross-entropy ``-ln p(x_{t+1} | x_{<=t})`` over the label
  tokens of the validation windows (end-of-text labels included), as in training's validation
  (:func:`smelt_ds.train.validation.evaluate`). Windows hold ``seq_len + 1`` tokens cut from the
  domain's concatenated token stream (documents separated by end-of-text, not padded), taken in
  shard order.
- **all**: the mean of the domains' values, every domain weighted equally whatever its number of
  windows (a macro average: how many windows a cap such as ``--batches`` or ``eval.eval_batches``
  leaves each domain does not change the weights). Training's ``val/all`` is defined the same way,
  so on the same windows the two agree. Its ``tokens``, ``bytes`` and ``windows`` are sums over
  the domains.
- **bits per byte**: ``loss_nats * tokens / (bytes * ln 2)``, with ``bytes`` the UTF-8 bytes of
  the label tokens' text (special tokens count 0 bytes; see
  :func:`smelt_ds.eval.data.token_byte_lengths`). Tokenizer-independent, so runs with different
  vocabularies compare (Gao et al. 2020, The Pile, §5).
- **position** ``p`` (1-based): the label at input position ``p - 1``, predicted from ``p``
  tokens of context inside the window (windows are cut from the concatenated token stream).
  Buckets are inclusive ranges ``[start, end]`` of positions.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from smelt_ds.errors import ConfigError

__all__ = ["ALL_DEFINITION", "token_losses", "position_buckets", "parse_buckets", "DomainLoss", "AllDomains",
           "evaluate_domain", "combine_domains"]

#: How the domain ``all`` is computed, as the outputs state it (eval.json, eval.md, training's summary).
ALL_DEFINITION = "the mean of the domains' values, each domain weighted equally"


@torch.no_grad()
def token_losses(model, input_ids: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token cross-entropy (nats) and mask, both ``(B, S)``; ignored labels (-100) give 0."""
    logits = model(input_ids).logits.float()
    B, S, V = logits.shape
    nll = F.cross_entropy(logits.reshape(-1, V), labels.reshape(-1), ignore_index=-100, reduction="none")
    return nll.view(B, S).double(), labels != -100


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


@dataclass
class DomainLoss:
    """Sums over the evaluated label tokens of one domain.

    ``nats`` total cross-entropy (nats), ``tokens`` label tokens, ``bytes`` UTF-8 bytes of them,
    ``windows`` validation windows (rows) evaluated, ``pos_nats`` / ``pos_tokens`` ``(S,)`` the
    same per position (index ``p - 1``).
    """

    nats: float = 0.0
    tokens: int = 0
    bytes: int = 0
    windows: int = 0
    pos_nats: list[float] = field(default_factory=list)
    pos_tokens: list[int] = field(default_factory=list)

    @property
    def loss(self) -> float:
        """Mean cross-entropy, nats/token."""
        return self.nats / self.tokens if self.tokens else float("nan")

    @property
    def bits_per_byte(self) -> float:
        """``nats / (bytes * ln 2)``, bits/byte."""
        return self.nats / (self.bytes * math.log(2)) if self.bytes else float("nan")

    def position_loss(self) -> list[float]:
        """Mean loss at each position ``1..S`` (nats/token; NaN where no token)."""
        return [n / t if t else float("nan") for n, t in zip(self.pos_nats, self.pos_tokens)]

    def bucket_loss(self, buckets: list[tuple[int, int]]) -> list[dict]:
        """``[{"start", "end", "loss" (nats/token), "tokens"}]`` per inclusive position bucket."""
        out = []
        for start, end in buckets:
            n = sum(self.pos_nats[start - 1:end])
            t = sum(self.pos_tokens[start - 1:end])
            out.append({"start": start, "end": end, "loss": n / t if t else float("nan"), "tokens": t})
        return out

    def as_dict(self, buckets: list[tuple[int, int]]) -> dict:
        """JSON-able: ``loss`` (nats/token), ``bits_per_byte``, ``tokens``, ``bytes``, ``windows``,
        ``positions`` (per bucket) and ``per_position`` (nats/token)."""
        return {"loss": self.loss, "bits_per_byte": self.bits_per_byte, "tokens": self.tokens,
                "bytes": self.bytes, "windows": self.windows, "positions": self.bucket_loss(buckets),
                "per_position": self.position_loss()}


def _mean(xs: list[float]) -> float:
    xs = [x for x in xs if not math.isnan(x)]
    return sum(xs) / len(xs) if xs else float("nan")


@dataclass
class AllDomains(DomainLoss):
    """The domain ``all``: counts (``nats``, ``tokens``, ``bytes``, ``windows``, per position) are
    sums over ``parts``; every loss is the mean of the parts' values, each domain weighted equally
    (see :data:`ALL_DEFINITION`). Domains without a token at a place are left out of its mean."""

    parts: list[DomainLoss] = field(default_factory=list)

    @property
    def loss(self) -> float:
        """Mean over the domains of their loss (nats/token)."""
        return _mean([p.loss for p in self.parts])

    @property
    def bits_per_byte(self) -> float:
        """Mean over the domains of their bits per byte."""
        return _mean([p.bits_per_byte for p in self.parts])

    def position_loss(self) -> list[float]:
        """Per position ``1..S``: mean over the domains of their loss there (nats/token)."""
        per = [p.position_loss() for p in self.parts]
        return [_mean([x[i] for x in per if i < len(x)]) for i in range(len(self.pos_nats))]

    def bucket_loss(self, buckets: list[tuple[int, int]]) -> list[dict]:
        """Per bucket: mean over the domains of their bucket loss; ``tokens`` summed."""
        per = [p.bucket_loss(buckets) for p in self.parts]
        return [{"start": s, "end": e, "loss": _mean([x[i]["loss"] for x in per]),
                 "tokens": sum(x[i]["tokens"] for x in per)} for i, (s, e) in enumerate(buckets)]

    def as_dict(self, buckets: list[tuple[int, int]]) -> dict:
        return {**super().as_dict(buckets), "definition": ALL_DEFINITION}


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
        for p, (n, t) in enumerate(zip(nll.sum(0).tolist(), mask.sum(0).tolist())):
            out.pos_nats[p] += n
            out.pos_tokens[p] += int(t)
    return out


def combine_domains(parts: list[DomainLoss]) -> AllDomains:
    """The domain ``all`` of several domains' results: summed counts, losses averaged over the
    domains with equal weights (:class:`AllDomains`)."""
    out = AllDomains(parts=list(parts))
    S = max((len(p.pos_nats) for p in parts), default=0)
    out.pos_nats, out.pos_tokens = [0.0] * S, [0] * S
    for p in parts:
        out.nats += p.nats
        out.tokens += p.tokens
        out.bytes += p.bytes
        out.windows += p.windows
        for i, (n, t) in enumerate(zip(p.pos_nats, p.pos_tokens)):
            out.pos_nats[i] += n
            out.pos_tokens[i] += t
    return out
