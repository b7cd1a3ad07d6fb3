"""The one definition of the per-domain validation loss, shared by training's in-loop validation
(:func:`smelt_ds.train.validation.evaluate`: ``val/<domain>`` and ``val/all`` in ``metrics.jsonl``)
and ``smelt-ds eval`` (:mod:`smelt_ds.eval.loss`, :mod:`smelt_ds.eval.suite`): both sum a domain's
cross-entropy and label tokens into a :class:`DomainLoss` and take ``all`` from
:func:`combine_domains`, so on the same windows the two give the same numbers.

Definitions (within a domain every number is a token- or byte-weighted mean over its evaluated
label tokens; the domain ``all`` weighs the domains equally):

- **loss** (nats/token): mean next-token cross-entropy ``-ln p(x_{t+1} | x_{<=t})`` over the label
  tokens of the validation windows (end-of-text labels included): ``nats / tokens``. Windows hold
  ``seq_len + 1`` tokens cut from the domain's concatenated token stream (documents separated by
  end-of-text, not padded), taken in shard order.
- **all**: the mean of the domains' values, every domain weighted equally whatever its number of
  windows (a macro average: how many windows a cap such as ``--batches`` or ``eval.eval_batches``
  leaves each domain does not change the weights); domains without a label token are left out.
  Its ``tokens``, ``bytes`` and ``windows`` are sums over the domains.
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

__all__ = ["ALL_DEFINITION", "DomainLoss", "AllDomains", "combine_domains", "validation_losses"]

#: How the domain ``all`` is computed, as the outputs state it (eval.json, eval.md, training's summary).
ALL_DEFINITION = "the mean of the domains' values, each domain weighted equally"


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
        return [n / t if t else float("nan") for n, t in zip(self.pos_nats, self.pos_tokens, strict=True)]

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
    """Plain mean; NaN for no values (a NaN value, e.g. a diverged model's loss, stays NaN)."""
    return sum(xs) / len(xs) if xs else float("nan")


def _mean_where_counted(xs: list[float]) -> float:
    """Mean of the values that are not NaN (NaN: no token at that place)."""
    return _mean([x for x in xs if not math.isnan(x)])


@dataclass
class AllDomains(DomainLoss):
    """The domain ``all``: counts (``nats``, ``tokens``, ``bytes``, ``windows``, per position) are
    sums over ``parts``; every loss is the mean of the parts' values, each domain weighted equally
    (see :data:`ALL_DEFINITION`). Domains without a label token (or byte) are left out of the mean
    of ``loss`` (``bits_per_byte``), and domains without a token at a position or bucket out of
    its mean."""

    parts: list[DomainLoss] = field(default_factory=list)

    @property
    def loss(self) -> float:
        """Mean over the domains with a label token of their loss (nats/token); NaN when none."""
        return _mean([p.loss for p in self.parts if p.tokens])

    @property
    def bits_per_byte(self) -> float:
        """Mean over the domains with a label byte of their bits per byte; NaN when none."""
        return _mean([p.bits_per_byte for p in self.parts if p.bytes])

    def position_loss(self) -> list[float]:
        """Per position ``1..S``: mean over the domains of their loss there (nats/token)."""
        per = [p.position_loss() for p in self.parts]
        return [_mean_where_counted([x[i] for x in per if i < len(x)]) for i in range(len(self.pos_nats))]

    def bucket_loss(self, buckets: list[tuple[int, int]]) -> list[dict]:
        """Per bucket: mean over the domains of their bucket loss; ``tokens`` summed."""
        per = [p.bucket_loss(buckets) for p in self.parts]
        return [{"start": s, "end": e, "loss": _mean_where_counted([x[i]["loss"] for x in per]),
                 "tokens": sum(x[i]["tokens"] for x in per)} for i, (s, e) in enumerate(buckets)]

    def as_dict(self, buckets: list[tuple[int, int]]) -> dict:
        return {**super().as_dict(buckets), "definition": ALL_DEFINITION}


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
        for i, (n, t) in enumerate(zip(p.pos_nats, p.pos_tokens, strict=True)):
            out.pos_nats[i] += n
            out.pos_tokens[i] += t
    return out


def validation_losses(parts: dict[str, DomainLoss]) -> dict[str, float]:
    """``{domain: loss, ..., "all": loss}`` (nats/token) of the domains with at least one label
    token, ``all`` from :func:`combine_domains` of those domains; empty when no domain has one.
    Training's ``val/<domain>`` and ``val/all``."""
    out = {d: p.loss for d, p in parts.items() if p.tokens}
    if out:
        out["all"] = combine_domains(list(parts.values())).loss
    return out
