"""The looping block manager (DESIGN §3); the visit plan it runs is :mod:`smelt_ds.config.schedule`'s
:class:`LoopSchedule` (re-exported here with :class:`Visit`, :class:`LoopSpan`, :func:`preset_ranges`).

The :class:`LoopingBlockManager` owns the plan at run time: layers do not know they are looped;
the manager passes each visit its index (KV-cache slot, statistics, input injection) and decides
per visit whether to checkpoint activations.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch
from torch import nn

from smelt_ds.config.schedule import LoopSchedule, LoopSpan, Visit, preset_ranges

__all__ = ["Visit", "LoopSpan", "LoopSchedule", "LoopingBlockManager", "preset_ranges", "checkpoint_phase"]


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
