"""Loop schedules and the looping block manager (DESIGN §1 and §3).

A :class:`LoopSchedule` turns the ``loop`` config and the number of unique layers L into the
**visit plan**: the ordered list of :class:`Visit` ``(layer, visit)`` pairs one forward pass runs.
Effective depth = ``len(visit_plan)``.

``order: block`` (the looped-transformer convention) runs a loop range ``[a, b)`` as
``a..b-1, a..b-1``; ``order: layer`` runs each looped layer ``repeats`` times in a row. For L=8,
middle, repeats 2::

    block: 0 1 | 2 3 4 5 | 2 3 4 5 | 6 7
    layer: 0 1 2 2 3 3 4 4 5 5 6 7

The :class:`LoopingBlockManager` owns the plan at run time: layers do not know they are looped;
the manager passes each visit its index (KV-cache slot, statistics, input injection) and decides
per visit whether to checkpoint activations.
"""

from __future__ import annotations

import math
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator, NamedTuple, Sequence

import torch
from torch import nn

from smelt_ds.errors import ConfigError

__all__ = ["Visit", "LoopSpan", "LoopSchedule", "LoopingBlockManager", "preset_ranges", "checkpoint_phase"]


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

    @classmethod
    def from_config(cls, loop_cfg, num_layers: int) -> "LoopSchedule":
        """Build from a :class:`smelt_ds.config.LoopConfig`. Raises ConfigError."""
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
        return self.visits_of(layer) > 1

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


CheckpointFn = Callable[..., Any]

_PHASE = threading.local()


def checkpoint_phase() -> str | None:
    """Where the running layer code is inside an activation checkpoint of the manager:
    ``None`` (not checkpointed), ``"forward"`` (the first, real forward of a checkpointed visit;
    under a reentrant checkpoint it runs without grad) or ``"recompute"`` (the replay in
    backward). Side effects that must happen once per forward (e.g. the router's
    tokens-per-expert counts for the aux-loss-free bias) check for ``"recompute"``."""
    return getattr(_PHASE, "value", None)


@contextmanager
def _phase(value: str):
    previous = checkpoint_phase()
    _PHASE.value = value
    try:
        yield
    finally:
        _PHASE.value = previous


class _VisitCapture:
    """Stands in for the recorder inside a checkpointed visit: keeps what the layer records
    (``record(visit, route, losses)``, the :class:`smelt_ds.model.lm.VisitRecorder` protocol) so
    the manager can return the losses as outputs of the checkpointed function."""

    def __init__(self) -> None:
        self.route = None
        self.losses: dict[str, torch.Tensor] = {}

    def record(self, visit: Visit, route, losses: dict[str, torch.Tensor]) -> None:
        self.route = route
        self.losses = dict(losses)


def _noop_probs_hook(visit: Visit, probs: torch.Tensor) -> None:
    return None


class LoopingBlockManager(nn.Module):
    """Runs the visit plan over a list of unique layers.

    Each layer is called as ``layer(x, visit=Visit, **kwargs)`` and returns the new residual
    stream of shape ``(batch, seq, hidden)``. The manager adds per-repeat input injection and
    per-visit activation checkpointing (``checkpoint_policy(visit) -> bool`` plus a
    ``checkpoint_fn(fn, x)`` supplied from outside, so the model never imports DeepSpeed).

    A checkpointed visit runs as ``checkpoint_fn(run, x)`` where ``run`` returns the visit's
    output *and* its MoE losses (``aux``, ``z``) as outputs, so that the losses get their
    gradient under a reentrant checkpoint too (which runs the forward without grad); the manager
    records them into the ``recorder`` outside the checkpoint, once, from the first call. The
    recompute in backward records nothing, so router statistics and losses are never counted
    twice. Recompute reproduces the forward exactly when ``checkpoint_fn`` restores the RNG state
    (``torch.utils.checkpoint`` and ``deepspeed.checkpointing`` both do): same dropout masks, same
    router jitter, hence the same experts.

    ``checkpoint_frees_inputs`` must be set when ``checkpoint_fn`` empties its input tensor
    in place (DeepSpeed's ``partition_activations`` / ``cpu_checkpointing`` replace
    ``x.data``); the manager then keeps a copy of a looped block's input for input injection.
    """

    layers: nn.ModuleList  # set with object.__setattr__ (not a registered submodule)

    def __init__(self, layers: nn.ModuleList, schedule: LoopSchedule, input_injection: str = "none"):
        super().__init__()
        if len(layers) != schedule.num_layers:
            raise ValueError(f"{len(layers)} layers for a schedule of {schedule.num_layers}")
        # Not registered as a submodule: SmeltLM owns the layers. Registering them twice would put
        # every weight in the state dict twice (layers.* and blocks.layers.*), and on load the
        # second copy would overwrite expert-parallel ranks' own experts.
        object.__setattr__(self, "layers", layers)
        self.schedule = schedule
        self.input_injection = input_injection
        self.checkpoint_policy: Callable[[Visit], bool] | None = None
        self.checkpoint_fn: CheckpointFn | None = None
        self.checkpoint_frees_inputs = False

    def iter_visits(self) -> Iterator[Visit]:
        return iter(self.schedule.plan)

    def forward(self, x: torch.Tensor, visit_hook: Callable[[Visit, torch.Tensor], None] | None = None,
                **layer_kwargs) -> torch.Tensor:
        """Run every visit. ``x``: ``(batch, seq, hidden)``; returns the same shape.

        ``visit_hook(visit, x)`` (optional) sees the residual stream after each visit (logit lens).
        """
        block_input: dict[int, torch.Tensor] = {}
        for visit in self.schedule.plan:
            span = self.schedule.span_of(visit.layer)
            if span is not None and self.input_injection == "add" and visit.layer == span.start:
                if visit.visit == 0:
                    block_input[span.start] = x.clone() if self.checkpoint_frees_inputs else x
                else:
                    x = x + block_input[span.start]
            x = self._run_visit(visit, x, layer_kwargs)
            if visit_hook is not None:
                visit_hook(visit, x)
        return x

    def _run_visit(self, visit: Visit, x: torch.Tensor, layer_kwargs: dict) -> torch.Tensor:
        layer = self.layers[visit.layer]
        use_ckpt = (self.training and torch.is_grad_enabled() and self.checkpoint_fn is not None
                    and self.checkpoint_policy is not None and layer_kwargs.get("kv_cache") is None
                    and self.checkpoint_policy(visit))
        if not use_ckpt:
            return layer(x, visit=visit, **layer_kwargs)
        return self._run_checkpointed(layer, visit, x, layer_kwargs)

    def _run_checkpointed(self, layer: nn.Module, visit: Visit, x: torch.Tensor, layer_kwargs: dict) -> torch.Tensor:
        recorder = layer_kwargs.get("recorder")
        first: list[_VisitCapture] = []  # the capture of the real forward (recompute adds none)

        def run(h: torch.Tensor):
            recompute = bool(first)
            capture = _VisitCapture()
            kwargs = dict(layer_kwargs, recorder=capture) if recorder is not None else dict(layer_kwargs)
            if recompute and kwargs.get("probs_hook") is not None:
                kwargs["probs_hook"] = _noop_probs_hook  # same code path, no second report
            with _phase("recompute" if recompute else "forward"):
                y = layer(h, visit=visit, **kwargs)
            if not recompute:
                first.append(capture)
            names = sorted(first[0].losses)
            if not names:
                return y
            return (y, *(capture.losses[n] for n in names))

        assert self.checkpoint_fn is not None  # _run_visit checkpoints only with a checkpoint_fn
        outs = self.checkpoint_fn(run, x)
        outs = (outs,) if isinstance(outs, torch.Tensor) else tuple(outs)
        capture = first[0]
        if recorder is not None and (capture.route is not None or capture.losses):
            recorder.record(visit, capture.route, dict(zip(sorted(capture.losses), outs[1:])))
        return outs[0]
