"""A ``torch.profiler`` trace of a window of training steps on chosen ranks (the recipe's
``profile`` section, :class:`smelt_ds.config.profile.ProfileConfig`).

Each rank of ``profile.ranks`` starts a profiler before optimizer step ``start_step -
warmup_steps``, records steps ``start_step .. end_step`` and writes one trace with
``torch.profiler.tensorboard_trace_handler`` to
``RUN/profile/steps<start>-<end>/rank<R>.<timestamp>.pt.trace.json``: a Chrome trace (Perfetto,
chrome://tracing) in the layout TensorBoard's PyTorch profiler plugin reads
(``tensorboard --logdir RUN/profile``). Each profiled step is the range ``optimizer step S``
(one loop iteration: the step, its logging, validation and checkpoint); inside it the model's
named ranges (:mod:`smelt_ds.model.ranges`): ``layer L visit V`` per visit of every forward and
``moe route`` / ``moe dispatch`` / ``moe experts`` / ``moe combine`` per reference MoE layer
(the DeepSpeed-MoE and AutoEP layers run their stages inside DeepSpeed's own forward: no ranges
there). The ranges are on only while the profiler runs, on the profiled ranks.

``profile.memory_snapshot`` (CUDA): the allocator's history is recorded during the window
(``torch.cuda.memory._record_memory_history``) and dumped at each window step that raises the
peak allocated memory, so ``rank<R>.memory_snapshot.pickle`` ends as the snapshot of the window's
step of peak memory (https://pytorch.org/memory_viz). On CPU it is skipped with one message.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch

from smelt_ds.config.profile import ProfileConfig
from smelt_ds.errors import fail
from smelt_ds.files import write_atomic
from smelt_ds.model.ranges import set_ranges

__all__ = ["PROFILE_DIR", "check_profile", "StepProfiler", "window_dir"]

#: the profiler's outputs, inside the run directory
PROFILE_DIR = "profile"


def check_profile(p: ProfileConfig, max_steps: int, world_size: int | None) -> None:
    """What ``profile`` needs of the rest of the run, checked before training: the recorded
    window inside ``train.max_steps`` and every profiled rank below ``world_size`` (None: not
    known yet). Raises ConfigError naming the field, its value and the fix."""
    if not p.enabled:
        return
    if p.end_step > max_steps:
        fail("profile.start_step", p.start_step, f"with `profile.active_steps` ({p.active_steps}) records steps "
             f"{p.start_step}-{p.end_step}, past `train.max_steps` ({max_steps})",
             "lower profile.start_step or profile.active_steps, or raise train.max_steps")
    bad = [r for r in p.ranks if world_size is not None and r >= world_size]
    if bad and world_size is not None:
        fail("profile.ranks", p.ranks, f"names ranks {bad} but the run has {world_size} (ranks 0-{world_size - 1})",
             "profile ranks below the number of ranks, e.g. [0]")


def window_dir(run_dir: Path, p: ProfileConfig) -> Path:
    """``RUN/profile/steps<start>-<end>``: where the window's traces and snapshots go."""
    return run_dir / PROFILE_DIR / f"steps{p.start_step}-{p.end_step}"


class StepProfiler:
    """The profiler of one rank; a no-op on ranks not profiled. Call :meth:`before_step` before
    each optimizer step, :meth:`after_step` at the end of its loop iteration and :meth:`close`
    after the loop."""

    def __init__(self, p: ProfileConfig, run_dir: Path, rank: int, start_step: int):
        """``start_step``: the step training continues from (0 for a new run)."""
        self.cfg, self.rank, self.dir = p, rank, window_dir(run_dir, p)
        self.first = p.start_step - p.warmup_steps  # the first step run under the profiler
        self.on = p.enabled and rank in p.ranks
        self.prof: Any = None
        self.step_range: Any = None
        self.snapshot = self.on and p.memory_snapshot and torch.cuda.is_available()
        self.peak, self.peak_step = -1, 0  # bytes, and the step that reached it (0: none yet)
        if self.on and start_step >= self.first:
            self.on = False
            self._say(f"profile: the window (steps {p.start_step}-{p.end_step}, warm-up from step {self.first}) does "
                      f"not lie after the resumed step {start_step}: nothing is profiled in this invocation (set "
                      f"profile.start_step above {start_step + p.warmup_steps} to profile it)")
        if self.on and p.memory_snapshot and not self.snapshot:
            self._say("profile.memory_snapshot: skipped: CUDA memory snapshots need a CUDA device (this run is on "
                      "CPU); the trace is written as usual")

    def _say(self, text: str) -> None:
        print(f"rank {self.rank}: {text}", file=sys.stderr, flush=True)

    def before_step(self, step: int) -> None:
        """``step``: the optimizer step about to run (from 1)."""
        if self.on and self.prof is None and step == self.first:
            self._start()
        if self.snapshot and self.prof is not None and step == self.cfg.start_step:
            torch.cuda.reset_peak_memory_stats()  # the peak of the recorded steps, not of the warm-up
        if self.prof is not None:
            from torch.profiler import record_function

            self.step_range = record_function(f"optimizer step {step}")
            self.step_range.__enter__()

    def after_step(self, step: int) -> None:
        """``step``: the optimizer step just finished (its logging, validation and checkpoint included)."""
        if self.prof is None:
            return
        if self.step_range is not None:
            self.step_range.__exit__(None, None, None)
            self.step_range = None
        if self.snapshot and step >= self.cfg.start_step:
            self._snapshot_if_peak(step)
        self.prof.step()
        if step >= self.cfg.end_step:
            self._stop()
            self._say(f"profile: trace of steps {self.cfg.start_step}-{self.cfg.end_step} in {self.dir} (open it in "
                      f"https://ui.perfetto.dev or chrome://tracing, or: tensorboard --logdir {self.dir.parent})")

    def close(self) -> None:
        """Stop a profiler still running (training stopped inside the window: the recorded steps
        are written)."""
        if self.step_range is not None:
            self.step_range.__exit__(None, None, None)
            self.step_range = None
        if self.prof is not None:
            self._stop()

    def _start(self) -> None:
        from torch.profiler import ProfilerActivity, profile, schedule, tensorboard_trace_handler

        p = self.cfg
        self.dir.mkdir(parents=True, exist_ok=True)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        self.prof = profile(activities=activities,
                            schedule=schedule(wait=0, warmup=p.warmup_steps, active=p.active_steps, repeat=1),
                            on_trace_ready=tensorboard_trace_handler(str(self.dir), worker_name=f"rank{self.rank}"),
                            record_shapes=p.record_shapes, with_stack=p.with_stack)
        self.prof.start()
        set_ranges(True)
        if self.snapshot:
            torch.cuda.memory._record_memory_history(max_entries=p.memory_snapshot_max_entries)

    def _stop(self) -> None:
        set_ranges(False)
        self.prof.stop()
        self.prof = None
        if self.snapshot:
            torch.cuda.memory._record_memory_history(enabled=None)
            if self.peak_step:
                self._say(f"profile: memory snapshot of step {self.peak_step} (peak allocated {self.peak} bytes) in "
                          f"{self._snapshot_path()} (open it in https://pytorch.org/memory_viz)")

    def _snapshot_path(self) -> Path:
        return self.dir / f"rank{self.rank}.memory_snapshot.pickle"

    def _snapshot_if_peak(self, step: int) -> None:
        """Dump the allocator history when this step raised the peak allocated memory (bytes)."""
        peak = int(torch.cuda.max_memory_allocated())
        if peak > self.peak:
            self.peak, self.peak_step = peak, step
            write_atomic(self._snapshot_path(), lambda tmp: torch.cuda.memory._dump_snapshot(str(tmp)))
