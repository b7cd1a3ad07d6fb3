"""The looping block manager: runs the visit plan over the unique layers (docs/architecture.md).

The plan itself is :mod:`smelt_ds.config.schedule`'s :class:`LoopSchedule` (re-exported here with
:class:`Visit`, :class:`LoopSpan`, :func:`preset_ranges`). Layers do not know they are looped:
:class:`LoopingBlockManager` calls each unique layer once per visit of the plan, hands it a
:class:`VisitContext` (which visit this is: KV-cache slot, statistics key; the per-forward
inputs; whether the call is an activation-checkpoint recompute), adds input injection at the
start of a loop range and decides per visit whether to checkpoint activations.

API::

    manager = LoopingBlockManager(layers, schedule, input_injection="none" | "add")
    y = manager(x, cos=cos, sin=sin, kv_cache=None, recorder=None, probs_hook=None,
                visit_hook=None)                  # x, y: (B, S, H)
    manager.configure_checkpointing(visits, fn, frees_inputs=False)
    manager.disable_checkpointing()
    manager.checkpointing                         # CheckpointConfig | None
    manager.wrap_checkpoint_fn(wrap)              # fn -> wrap(fn), e.g. to count saved tensors

A layer is called as ``layer(x, ctx)`` with ``x`` ``(B, S, H)`` and returns the new residual
stream ``(B, S, H)``. ``visits`` is a set of :class:`Visit` or a predicate ``visit -> bool``;
``fn(run, x)`` is a checkpoint function such as ``torch.utils.checkpoint`` (supplied from outside,
so the model never imports DeepSpeed); ``frees_inputs`` says that ``fn`` empties its input tensor
in place.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from typing import Any, Protocol

import torch
from torch import nn

from smelt_ds.config.schedule import LoopSchedule, LoopSpan, Visit, preset_ranges
from smelt_ds.model.ranges import named_range

__all__ = ["Visit", "LoopSpan", "LoopSchedule", "LoopingBlockManager", "VisitContext", "CheckpointConfig",
           "CheckpointFn", "ProbsHook", "VisitRecorderLike", "preset_ranges"]


CheckpointFn = Callable[..., Any]
"""``fn(run, x)``: runs ``run(x)`` under an activation checkpoint and returns its outputs."""

ProbsHook = Callable[[Visit, torch.Tensor], None]
"""``hook(visit, probs)`` (:data:`smelt_ds.model.attention.AttnProbsHook`)."""


class VisitRecorderLike(Protocol):
    """What the manager needs of a recorder (:class:`smelt_ds.model.lm.VisitRecorder`)."""

    def record(self, visit: Visit, route: Any, losses: dict[str, torch.Tensor]) -> None: ...


@dataclass(frozen=True, eq=False)  # eq=False: holds tensors
class VisitContext:
    """What one visit's layer call gets besides the residual stream.

    ``visit``: the :class:`Visit` being run. ``cos``, ``sin``: the rotary tables ``(S, D)`` of the
    positions of ``x``. ``kv_cache``: the per-visit :class:`smelt_ds.model.attention.KVCache`
    (inference) or None (typed ``Any``: attention.py imports this module). ``recorder``:
    where an MoE layer records ``(visit, route, losses)``, or None. ``probs_hook``: receives
    ``(visit, attention probs)``, or None. ``checkpointed``: the call runs inside the manager's
    checkpoint function. ``recompute``: the call is the replay of a checkpointed visit in backward
    (its outputs are the forward's; side effects that must happen once per forward must not).
    """

    visit: Visit
    cos: torch.Tensor
    sin: torch.Tensor
    kv_cache: Any = None
    recorder: VisitRecorderLike | None = None
    probs_hook: ProbsHook | None = None
    checkpointed: bool = False
    recompute: bool = False

    @property
    def counts_tokens(self) -> bool:
        """Whether this call adds to once-per-training-forward statistics (the reference router's
        tokens per expert): with grad enabled, or the first call of a checkpointed visit (a
        reentrant checkpoint runs it without grad); never a recompute. Read it inside the call."""
        return not self.recompute and (self.checkpointed or torch.is_grad_enabled())


@dataclass(frozen=True)
class CheckpointConfig:
    """The manager's activation-checkpointing setup (:meth:`LoopingBlockManager.configure_checkpointing`).

    ``visits``: the checkpointed visits (a frozenset) or a predicate; ``fn``: ``fn(run, x)``;
    ``frees_inputs``: ``fn`` empties its input tensor in place (DeepSpeed's
    ``partition_activations`` / ``cpu_checkpointing`` replace ``x.data``).
    """

    visits: frozenset[Visit] | Callable[[Visit], bool]
    fn: CheckpointFn
    frees_inputs: bool = False

    def selects(self, visit: Visit) -> bool:
        if isinstance(self.visits, frozenset):
            return visit in self.visits
        return bool(self.visits(visit))


class _VisitCapture:
    """Stands in for the recorder inside a checkpointed visit: keeps what the layer records
    (``record(visit, route, losses)``) so the manager can return the losses as outputs of the
    checkpointed function."""

    def __init__(self) -> None:
        self.route = None
        self.losses: dict[str, torch.Tensor] = {}

    def record(self, visit: Visit, route, losses: dict[str, torch.Tensor]) -> None:
        self.route = route
        self.losses = dict(losses)


def _noop_probs_hook(visit: Visit, probs: torch.Tensor) -> None:
    return None


class LoopingBlockManager(nn.Module):
    """Runs the visit plan over a list of unique layers (see the module docstring for the API).

    Input injection ``add``: the residual stream entering a loop range on its first visit is
    added again to the stream entering the range on every later visit.

    Activation checkpointing: in training with grad enabled and without a KV cache, a visit the
    :class:`CheckpointConfig` selects runs as ``fn(run, x)``, where ``run`` returns the visit's
    output *and* its MoE losses (``aux``, ``z``) as outputs, so that the losses get their
    gradient under a reentrant checkpoint too (which runs the forward without grad). The layer
    gets ``replace(ctx, checkpointed=True, recorder=<capture>)``; the manager records the
    captured route and losses into ``ctx.recorder`` outside the checkpoint, once, from the first
    call. The recompute in backward gets ``recompute=True`` and a no-op ``probs_hook`` and
    records nothing, so router statistics and losses are never counted twice. Recompute
    reproduces the forward exactly when ``fn`` restores the RNG state (``torch.utils.checkpoint``
    and ``deepspeed.checkpointing`` both do): same dropout masks, same router jitter, hence the
    same experts. With ``frees_inputs`` the manager keeps a copy of a looped block's input for
    input injection.
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
        self._checkpointing: CheckpointConfig | None = None

    # -- checkpointing ------------------------------------------------------------------------
    def configure_checkpointing(self, visits: Iterable[Visit] | Callable[[Visit], bool], fn: CheckpointFn,
                                frees_inputs: bool = False) -> None:
        """Checkpoint the ``visits`` (a collection of :class:`Visit`, or a predicate called once per
        visit of each training forward) with ``fn(run, x)``; ``frees_inputs``: ``fn`` empties its
        input in place. Replaces any earlier setup. Raises ValueError for a visit not in the plan
        and TypeError for a non-callable ``fn``."""
        if not callable(fn):
            raise TypeError(f"checkpoint fn must be callable, got {type(fn).__name__}")
        chosen: frozenset[Visit] | Callable[[Visit], bool]
        if callable(visits):
            chosen = visits
        else:
            chosen = frozenset(Visit(*v) for v in visits)
            unknown = sorted(chosen - set(self.schedule.plan))
            if unknown:
                raise ValueError(f"visits {unknown} are not in the visit plan {self.schedule.plan}")
        self._checkpointing = CheckpointConfig(chosen, fn, bool(frees_inputs))

    def disable_checkpointing(self) -> None:
        """Run every visit without activation checkpointing."""
        self._checkpointing = None

    @property
    def checkpointing(self) -> CheckpointConfig | None:
        """The current setup, or None when no visit is checkpointed."""
        return self._checkpointing

    def wrap_checkpoint_fn(self, wrap: Callable[[CheckpointFn], CheckpointFn]) -> bool:
        """Replace the checkpoint function ``fn`` by ``wrap(fn)`` (same visits, same
        ``frees_inputs``); returns False, and does nothing, when checkpointing is off."""
        if self._checkpointing is None:
            return False
        self._checkpointing = replace(self._checkpointing, fn=wrap(self._checkpointing.fn))
        return True

    # -- forward ------------------------------------------------------------------------------
    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: Any = None,
                recorder: VisitRecorderLike | None = None, probs_hook: ProbsHook | None = None,
                visit_hook: Callable[[Visit, torch.Tensor], None] | None = None) -> torch.Tensor:
        """Run every visit. ``x``: ``(B, S, H)``; returns the same shape.

        ``cos``, ``sin``, ``kv_cache``, ``recorder``, ``probs_hook`` go into every visit's
        :class:`VisitContext`. ``visit_hook(visit, x)`` (optional) sees the residual stream
        ``(B, S, H)`` after each visit (logit lens). While a profiler records, each visit is the
        named range ``layer L visit V`` (:mod:`smelt_ds.model.ranges`; an activation-checkpoint
        recompute in backward runs outside it).
        """
        frees_inputs = self._checkpointing is not None and self._checkpointing.frees_inputs
        block_input: dict[int, torch.Tensor] = {}
        for visit in self.schedule.plan:
            span = self.schedule.span_of(visit.layer)
            if span is not None and self.input_injection == "add" and visit.layer == span.start:
                if visit.visit == 0:
                    block_input[span.start] = x.clone() if frees_inputs else x
                else:
                    x = x + block_input[span.start]
            ctx = VisitContext(visit, cos, sin, kv_cache, recorder, probs_hook)
            with named_range("layer {} visit {}", visit.layer, visit.visit):  # a profiler range (off: a flag check)
                x = self._run_visit(ctx, x)
            if visit_hook is not None:
                visit_hook(visit, x)
        return x

    def _run_visit(self, ctx: VisitContext, x: torch.Tensor) -> torch.Tensor:
        layer = self.layers[ctx.visit.layer]
        ckpt = self._checkpointing
        if (ckpt is not None and self.training and torch.is_grad_enabled() and ctx.kv_cache is None
                and ckpt.selects(ctx.visit)):
            return self._run_checkpointed(layer, ctx, x, ckpt.fn)
        return layer(x, ctx)

    def _run_checkpointed(self, layer: nn.Module, ctx: VisitContext, x: torch.Tensor,
                          fn: CheckpointFn) -> torch.Tensor:
        first: list[_VisitCapture] = []  # the capture of the real forward (recompute adds none)

        def run(h: torch.Tensor):
            recompute = bool(first)
            capture = _VisitCapture()
            inner = replace(ctx, checkpointed=True, recompute=recompute,
                            recorder=capture if ctx.recorder is not None else None)
            if recompute and ctx.probs_hook is not None:
                inner = replace(inner, probs_hook=_noop_probs_hook)  # same code path, no second report
            y = layer(h, inner)
            if not recompute:
                first.append(capture)
            names = sorted(first[0].losses)
            if not names:
                return y
            return (y, *(capture.losses[n] for n in names))

        outs = fn(run, x)
        outs = (outs,) if isinstance(outs, torch.Tensor) else tuple(outs)
        capture = first[0]
        if ctx.recorder is not None and (capture.route is not None or capture.losses):
            ctx.recorder.record(ctx.visit, capture.route, dict(zip(sorted(capture.losses), outs[1:], strict=True)))
        return outs[0]
