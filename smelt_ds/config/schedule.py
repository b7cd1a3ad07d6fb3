"""The visit plan of a loop config (the ``loop`` section of docs/configuration.md): pure Python, no torch.

A :class:`LoopSchedule` turns the ``loop`` config and the number of unique layers L into the
**visit plan**: the ordered list of :class:`Visit` ``(layer, visit)`` pairs one forward pass runs.
Effective depth = ``len(visit_plan)``. ``RunConfig.schedule`` is the one way to ask a recipe for it.

``order: block`` (the looped-transformer convention) runs a loop range ``[a, b)`` as
``a..b-1, a..b-1``; ``order: layer`` runs each looped layer ``repeats`` times in a row. For L=8,
middle, repeats 2::

    block: 0 1 | 2 3 4 5 | 2 3 4 5 | 6 7
    layer: 0 1 2 2 3 3 4 4 5 5 6 7
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from smelt_ds.errors import ConfigError

__all__ = ["Visit", "LoopSpan", "LoopSchedule", "preset_ranges", "build_schedule"]


class Visit(NamedTuple):
    """One execution of a unique layer: ``layer`` in [0, L), ``visit`` = how many times that
    layer already ran in this forward pass (0 for the first execution)."""

    layer: int
    visit: int


@dataclass(frozen=True)
class LoopSpan:
    """Unique layers ``[start, end)`` executed ``repeats`` times."""

    start: int
    end: int
    repeats: int

    @property
    def width(self) -> int:
        return self.end - self.start


def preset_ranges(position: str, num_layers: int, fraction: float = 0.5, repeats: int = 2) -> list[LoopSpan]:
    """Loop ranges of a preset position for depth ``num_layers`` (width w = floor(fraction * L)).

    Raises ConfigError when the preset yields an empty range for this depth.
    """
    L = num_layers
    if position == "none":
        return []
    if position == "uniform":
        return [LoopSpan(0, L, repeats)]
    w = math.floor(fraction * L)
    if w < 1:
        raise ConfigError(
            f"`loop.position` ('{position}') yields an empty loop range for `model.num_layers` ({L}) "
            f"with `loop.fraction` ({fraction}): floor({fraction} * {L}) = 0 layers; "
            "use more layers, a larger fraction, or position 'uniform'")
    if position == "bottom":
        return [LoopSpan(0, w, repeats)]
    if position == "top":
        return [LoopSpan(L - w, L, repeats)]
    start = (L - w) // 2
    if position == "middle":
        return [LoopSpan(start, start + w, repeats)]
    if position == "asymmetric":
        if w < 2:
            raise ConfigError(
                f"`loop.position` ('asymmetric') needs a middle range of at least 2 layers to split, "
                f"got {w} for `model.num_layers` ({L}); use more layers or explicit `loop.ranges`")
        mid = start + w // 2
        return [LoopSpan(start, mid, repeats + 1), LoopSpan(mid, start + w, repeats)]
    raise ConfigError(f"`loop.position` ({position!r}) is unknown: use none, uniform, bottom, middle, top, "
                      "asymmetric or custom")


def _check_spans(spans: Sequence[LoopSpan], num_layers: int) -> list[LoopSpan]:
    # sort, but name each range by its index in the recipe (`loop.ranges[i]`)
    indexed = sorted(enumerate(spans), key=lambda item: item[1].start)
    spans = [s for _, s in indexed]
    for i, (orig, s) in enumerate(indexed):
        path = f"loop.ranges[{orig}]"
        if s.repeats < 1:
            raise ConfigError(f"`{path}.repeats` ({s.repeats}) must be >= 1: use 1 for no loop, 2 to loop twice")
        if s.end <= s.start:
            raise ConfigError(f"`{path}` ([{s.start}, {s.end})) is empty: end must be > start")
        if s.start < 0 or s.end > num_layers:
            raise ConfigError(f"`{path}` ([{s.start}, {s.end})) is out of bounds for `model.num_layers` "
                              f"({num_layers}): keep 0 <= start < end <= {num_layers}")
        if i and s.start < spans[i - 1].end:
            p_orig, p = indexed[i - 1]
            raise ConfigError(f"`{path}` ([{s.start}, {s.end})) overlaps `loop.ranges[{p_orig}]` "
                              f"([{p.start}, {p.end})): loop ranges must not overlap; merge them or move one")
    return spans


class LoopSchedule:
    """The visit plan of one architecture.

    Args:
        num_layers: unique layers L.
        spans: non-overlapping loop ranges (validated; raises ConfigError naming the range).
        order: ``block`` or ``layer``.
    """

    def __init__(self, num_layers: int, spans: Sequence[LoopSpan] = (), order: str = "block"):
        if order not in ("block", "layer"):
            raise ConfigError(f"`loop.order` ({order!r}) is unknown: use 'block' or 'layer'")
        self.num_layers = num_layers
        self.spans = _check_spans(list(spans), num_layers)
        self.order = order
        self.plan: list[Visit] = self._build_plan()
        #: unique layers that run more than once per forward pass (computed once; see is_looped)
        self.looped_layers: frozenset[int] = frozenset(
            i for s in self.spans if s.repeats > 1 for i in range(s.start, s.end))

    @classmethod
    def from_config(cls, loop_cfg, num_layers: int) -> LoopSchedule:
        """Build from a :class:`smelt_ds.config.loop.LoopConfig`. Raises ConfigError."""
        if loop_cfg.position == "custom" or (loop_cfg.ranges is not None and loop_cfg.position == "asymmetric"):
            if not loop_cfg.ranges:
                raise ConfigError(f"`loop.ranges` ({loop_cfg.ranges!r}) must list at least one range for "
                                  f"`loop.position` ('{loop_cfg.position}'): add {{start, end, repeats}} items")
            spans = [LoopSpan(r.start, r.end, r.repeats) for r in loop_cfg.ranges]
        else:
            if loop_cfg.ranges is not None:
                raise ConfigError(f"`loop.ranges` is set but `loop.position` is '{loop_cfg.position}': set "
                                  "position to 'custom' (or 'asymmetric') to use explicit ranges")
            if loop_cfg.repeats < 1:
                raise ConfigError(f"`loop.repeats` ({loop_cfg.repeats}) must be >= 1: use 2 to loop twice")
            spans = preset_ranges(loop_cfg.position, num_layers, loop_cfg.fraction, loop_cfg.repeats)
        if loop_cfg.input_injection == "add" and loop_cfg.order == "layer":
            raise ConfigError("`loop.input_injection` ('add') needs `loop.order` 'block': injection re-adds "
                              "a looped block's input before each repeat of the whole block")
        return cls(num_layers, spans, loop_cfg.order)

    # -- plan -------------------------------------------------------------------------------
    def _build_plan(self) -> list[Visit]:
        counts = [0] * self.num_layers
        plan: list[Visit] = []

        def emit(layer: int) -> None:
            plan.append(Visit(layer, counts[layer]))
            counts[layer] += 1

        layer = 0
        for span in self.spans:
            while layer < span.start:
                emit(layer)
                layer += 1
            if self.order == "block":
                for _ in range(span.repeats):
                    for i in range(span.start, span.end):
                        emit(i)
            else:
                for i in range(span.start, span.end):
                    for _ in range(span.repeats):
                        emit(i)
            layer = span.end
        while layer < self.num_layers:
            emit(layer)
            layer += 1
        return plan

    @property
    def effective_depth(self) -> int:
        """Number of visits per forward pass."""
        return len(self.plan)

    def visits_of(self, layer: int) -> int:
        """How many times unique layer ``layer`` runs per forward pass."""
        for s in self.spans:
            if s.start <= layer < s.end:
                return s.repeats
        return 1

    def is_looped(self, layer: int) -> bool:
        """Whether unique layer ``layer`` runs more than once per forward pass."""
        return layer in self.looped_layers

    def span_of(self, layer: int) -> LoopSpan | None:
        for s in self.spans:
            if s.start <= layer < s.end:
                return s
        return None

    def layers(self) -> list[int]:
        """Plan as a plain list of layer indices."""
        return [v.layer for v in self.plan]

    def __repr__(self) -> str:
        return f"LoopSchedule(L={self.num_layers}, spans={self.spans}, order={self.order!r}, plan={self.layers()})"


def build_schedule(loop_cfg, num_layers: int) -> LoopSchedule:
    """The visit plan of a ``loop`` section (:class:`smelt_ds.config.loop.LoopConfig`) over
    ``num_layers`` unique layers: what ``RunConfig.schedule`` returns and what ``SmeltLM`` builds
    from its ``loop_cfg`` and ``model_cfg.num_layers``. Raises ConfigError."""
    return LoopSchedule.from_config(loop_cfg, num_layers)
