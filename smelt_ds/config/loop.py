"""The ``loop`` section of a recipe: which unique layers are looped (SMELT's and the ablations':
docs/recipes.md), and the loop of a test-time loop count (:func:`loop_with_repeats`).

The visit plan a loop section means is :mod:`smelt_ds.config.schedule`'s; its rules (ranges
inside the depth, no overlap, a preset that is not empty) are checked when the plan is built,
which ``RunConfig`` does when a recipe is loaded.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from smelt_ds.config.schedule import build_schedule
from smelt_ds.config.schema import StrictModel
from smelt_ds.errors import ConfigError

__all__ = ["LoopPosition", "LoopRange", "LoopConfig", "loop_with_repeats"]


LoopPosition = Literal["none", "uniform", "bottom", "middle", "top", "asymmetric", "custom"]


class LoopRange(StrictModel):
    """A contiguous range of unique layers ``[start, end)`` run ``repeats`` times."""

    start: int = Field(description="first unique layer of the range (layer index from 0, included)")
    end: int = Field(description="the unique layer after the range (layer index, excluded): the range is [start, end)")
    repeats: int = Field(description="visits per forward pass of each layer of the range (2: looped twice)")


class LoopConfig(StrictModel):
    """Which unique layers are looped; SMELT loops the middle half twice (docs/recipes.md).

    ``position`` picks a preset range for depth L and ``fraction`` f (floor(f*L) layers):
    ``none`` (Baseline), ``uniform`` [0, L), ``bottom`` [0, w), ``middle`` [(L-w)//2, +w),
    ``top`` [L-w, L), ``asymmetric`` (the middle range split at its centre, lower part run
    ``repeats + 1`` times, upper part ``repeats`` times). ``custom`` takes ``ranges``; explicit
    ``ranges`` are also accepted with ``asymmetric``.
    """

    position: LoopPosition = Field(
        "middle", description="which unique layers loop: none (the Baseline), a preset range of floor(fraction * L) "
                              "layers (uniform: all L, bottom, middle, top, asymmetric), or custom (loop.ranges)")
    fraction: float = Field(0.5, gt=0, le=1, description="share of unique layers in a preset range")
    repeats: int = Field(2, description="visits per looped layer for presets")
    ranges: list[LoopRange] | None = Field(None, description="explicit loop ranges (custom / asymmetric)")
    order: Literal["block", "layer"] = Field(
        "block", description="block: a range's layers in turn, then all of them again; layer: each looped layer "
                             "`repeats` times in a row")
    input_injection: Literal["none", "add"] = Field(
        "none", description="add: re-add the looped block's input before each repeat (block order)")
    shared_lr_scale: float = Field(1.0, gt=0, description="LR multiplier for looped (shared) parameters")


def loop_with_repeats(loop: LoopConfig, num_layers: int, repeats: int | None = None,
                   exit_after: int | None = None) -> LoopConfig:
    """The ``loop`` section of a test-time loop count: the trained loop ranges with other repeats.

    ``repeats`` R sets every loop range's repeat count to R (R = 1: the looped layers run once,
    as in an unlooped model of the same unique layers; R = 3: a third visit). ``exit_after`` P is an
    early exit at a loop boundary: every range stops after at most P passes (P = 1: after the
    first pass of the looped block, then the layers above it). Both may be given (``exit_after``
    then caps ``repeats``); neither returns ``loop`` unchanged. The result is ``position: custom``
    with explicit ``ranges`` (same ``order`` and ``input_injection``), so
    ``build_schedule``, ``SmeltLM.set_loop`` and ``cost.budget.compute_budget`` (via
    ``cfg.model_copy(update={"loop": ...})``) all follow the plan actually run. Weights do not depend on
    the loop: unique layers are the same for every repeat count.

    Test-time loop counts follow the looped-LM literature (Ouro's ``total_ut_steps``, Huginn's
    ``num_steps``; early exit at loop boundaries, arXiv 2605.09165).

    Raises ConfigError for R or P < 1, or for a loop section without loop ranges (a Baseline:
    there is nothing to repeat; pass no loop option for it).
    """
    for flag, v in (("--loop-repeats", repeats), ("--exit-after", exit_after)):
        if v is not None and v < 1:
            raise ConfigError(f"`{flag}` ({v}) must be >= 1: 1 runs the looped layers once, "
                              "2 twice (the SMELT default)")
    if repeats is None and exit_after is None:
        return loop
    spans = build_schedule(loop, num_layers).spans
    if not spans:
        raise ConfigError(f"`loop.position` ({loop.position!r}) has no loop range: a test-time loop count "
                          "(`--loop-repeats` / `--exit-after`) applies to looped runs only; evaluate this "
                          "run without it")
    ranges = []
    for s in spans:
        r = s.repeats if repeats is None else repeats
        if exit_after is not None:
            r = min(r, exit_after)
        ranges.append(LoopRange(start=s.start, end=s.end, repeats=r))
    return loop.model_copy(update={"position": "custom", "ranges": ranges})
