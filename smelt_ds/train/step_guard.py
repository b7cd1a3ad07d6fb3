"""Non-finite and spiking steps (``train.step_guard``): skip the update on every rank together.

After the accumulation boundary's backward, before ``engine.step()``, the ranks sum the step's
control vector (one all-reduce, :mod:`smelt_ds.train.loop`), which holds the sum of their finite
micro-batch losses, the count of non-finite ones and the count of micro-batches. A step is
skipped when

* any rank's loss is non-finite (NaN or +-inf), or the global gradient norm before clipping is
  (:func:`smelt_ds.parallel.grad_norm.clip_before_step`, the same value on every rank); or
* ``loss_spike_factor`` is set and the step's mean loss over the ranks exceeds that factor
  times the median of the last ``loss_spike_window`` kept steps' mean losses (once 10 are kept:
  the loss-spike rule of large runs, e.g. OLMo's and PaLM's "skip batches with a loss spike").

A skipped step goes through DeepSpeed's own overflow path (:func:`smelt_ds.parallel.skip.skipping_update`):
weights, Adam moments and the LR schedule stay as they were, the batch is consumed and the step
counts (the data order and the step numbers of a run stay those of the plan). After
``max_consecutive_skips`` skipped steps in a row, training saves the (unchanged, last good)
state and stops with exit status :data:`SKIP_EXIT`, advising a resume with a lower peak LR or a
higher limit (:func:`resume_advice`): both are run settings a resume may change
(:data:`smelt_ds.train.guards.RESUME_MAY_CHANGE`), as Megatron-LM lets a resumed run override its
LR schedule.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass
from typing import Any

from smelt_ds.config.train import StepGuard, TrainConfig

__all__ = ["SKIP_EXIT", "Verdict", "StepGuardState", "resume_advice"]

#: exit status of a run stopped after ``train.step_guard.max_consecutive_skips`` skipped steps
SKIP_EXIT = 3
#: kept steps of loss history before the spike rule applies
MIN_HISTORY = 10


def resume_advice(t: TrainConfig) -> str:
    """What the stop after ``train.step_guard.max_consecutive_skips`` skipped steps tells the user
    to do: the two resumes that get past a bad stretch, each a command line's ``--resume`` and
    ``--set`` arguments (half the peak LR ``train.lr``; twice the limit), which a resume accepts
    and applies (the LR from the first resumed step, on the same schedule)."""
    lr, limit = t.lr / 2, 2 * t.step_guard.max_consecutive_skips
    return ("it holds the last good weights (skipped steps change none): look at the skipped samples in "
            f"metrics.jsonl, then resume with a lower peak LR, --resume auto --set train.lr={lr:g} (half the run's "
            f"{t.lr:g}), or a higher limit, --resume auto --set train.step_guard.max_consecutive_skips={limit}")


@dataclass
class Verdict:
    """The ranks' shared view of one step: its mean loss over every rank's micro-batches, whether
    any loss or the gradient norm was non-finite, and the reason to skip (None: keep)."""

    mean_loss: float
    nonfinite: bool
    skip: str | None


class StepGuardState:
    """The guard's state over a run: the recent kept losses (for the spike rule) and the current
    run of consecutive skips. :meth:`state_dict` / :meth:`load_state_dict` carry it through a
    checkpoint, so a resumed run skips the same steps as an uninterrupted one."""

    def __init__(self, cfg: StepGuard) -> None:
        self.cfg = cfg
        self.history: deque[float] = deque(maxlen=cfg.loss_spike_window)
        self.consecutive = 0
        self.skipped = 0

    def decide(self, total: float, bad: float, n: float, grad_norm: float | None) -> Verdict:
        """The verdict for a step from the sums over every rank (the step's control all-reduce,
        :mod:`smelt_ds.train.loop`): ``total`` the finite micro-batch losses' sum, ``bad`` the
        count of non-finite ones, ``n`` the count of micro-batches, and the global gradient norm
        (None: not known here, e.g. optimizer offload). Every rank gets the same sums, so every
        rank decides the same."""
        nonfinite_any = bad > 0 or (grad_norm is not None and not math.isfinite(grad_norm))
        mean = total / max(n - bad, 1.0) if bad < n else math.nan
        skip = None
        if nonfinite_any:
            skip = "non-finite loss" if bad > 0 else "non-finite gradient norm"
        elif self.cfg.loss_spike_factor is not None and len(self.history) >= MIN_HISTORY:
            median = statistics.median(self.history)
            if mean > self.cfg.loss_spike_factor * median:
                skip = (f"loss spike ({mean:.4f} > {self.cfg.loss_spike_factor:g} x the median {median:.4f} of the "
                        f"last {len(self.history)} steps)")
        if skip is None:
            self.history.append(mean)
            self.consecutive = 0
        else:
            self.consecutive += 1
            self.skipped += 1
        return Verdict(mean, nonfinite_any, skip)

    def exhausted(self) -> bool:
        """Whether the run of skips reached ``max_consecutive_skips``."""
        return self.consecutive >= self.cfg.max_consecutive_skips

    def state_dict(self) -> dict[str, Any]:
        return {"history": list(self.history), "consecutive": self.consecutive, "skipped": self.skipped}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.history.extend(state.get("history", []))
        self.consecutive = int(state.get("consecutive", 0))
        self.skipped = int(state.get("skipped", 0))

