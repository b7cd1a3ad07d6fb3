"""The ``profile`` section of a recipe: a ``torch.profiler`` trace of a window of optimizer steps
on chosen ranks (Megatron-LM's ``--profile --profile-step-start/--profile-step-end
--profile-ranks``, torchtitan's ``[profiling]``), run by :mod:`smelt_ds.train.profiler`.

The window is steps ``start_step .. start_step + active_steps - 1`` (optimizer steps, counted from
1 as in ``metrics.jsonl``), preceded by ``warmup_steps`` steps the profiler runs but discards.
Checks that need the rest of the recipe or the launch (the window inside ``train.max_steps``, the
ranks below the world size) run before training starts
(:func:`smelt_ds.train.profiler.check_profile`).
"""

from __future__ import annotations

from pydantic import Field, model_validator

from smelt_ds.config.schema import StrictModel
from smelt_ds.errors import fail

__all__ = ["ProfileConfig"]


class ProfileConfig(StrictModel):
    """A profiled window of training steps: a Chrome / TensorBoard trace per chosen rank under
    ``RUN/profile/steps<A>-<B>/``, with named ranges per visit (``layer L visit V``) and per MoE
    stage (``moe route``, ``moe dispatch``, ``moe experts``, ``moe combine``); on CUDA optionally
    a memory snapshot at the window's step of peak memory."""

    enabled: bool = Field(False, description="take a trace of the window on the chosen ranks")
    start_step: int = Field(10, ge=1, description="first recorded optimizer step (steps count from 1)")
    active_steps: int = Field(2, ge=1, description="recorded optimizer steps from start_step on (steps)")
    warmup_steps: int = Field(1, ge=0, description="optimizer steps just before start_step that the profiler runs "
                                                   "but does not record (its own start-up kept out of the trace)")
    ranks: list[int] = Field(default_factory=lambda: [0], description="global ranks that write a trace")
    record_shapes: bool = Field(False, description="record the input shapes of each op (larger traces)")
    with_stack: bool = Field(False, description="record the Python stack of each op (larger, slower traces)")
    memory_snapshot: bool = Field(
        False, description="CUDA only: record allocator history during the window and dump a snapshot at its step of "
                           "peak allocated memory (open it at https://pytorch.org/memory_viz); skipped with a message "
                           "on CPU")
    memory_snapshot_max_entries: int = Field(100_000, gt=0, description="allocator events the snapshot keeps (events)")

    @model_validator(mode="after")
    def _check(self) -> ProfileConfig:
        if self.warmup_steps >= self.start_step:
            fail("profile.warmup_steps", self.warmup_steps, f"must be < `profile.start_step` ({self.start_step}): "
                 "the warm-up steps come before the first recorded step",
                 f"lower profile.warmup_steps to at most {self.start_step - 1}, or raise profile.start_step")
        if not self.ranks:
            fail("profile.ranks", self.ranks, "is empty", "list the global ranks to profile, e.g. [0]")
        bad = [r for r in self.ranks if r < 0]
        if bad:
            fail("profile.ranks", self.ranks, f"holds negative ranks {bad}", "use global ranks 0, 1, ...")
        twice = sorted({r for r in self.ranks if self.ranks.count(r) > 1})
        if twice:
            fail("profile.ranks", self.ranks, f"names {twice} more than once", "list each rank once")
        return self

    @property
    def end_step(self) -> int:
        """The last recorded optimizer step."""
        return self.start_step + self.active_steps - 1
