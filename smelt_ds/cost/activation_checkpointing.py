"""Which visits recompute their activations in backward (``train.activation_checkpointing``).

One definition for the engine's checkpointing wiring
(:func:`smelt_ds.parallel.engine.configure_activation_checkpointing`), the activation memory
estimate (:mod:`smelt_ds.cost.memory_terms`) and the ZeRO-3 trace (:mod:`smelt_ds.cost.zero3_tuning`).
"""

from __future__ import annotations

from smelt_ds.config.run import RunConfig
from smelt_ds.config.schedule import LoopSchedule, Visit

__all__ = ["checkpointed_visits"]


def checkpointed_visits(cfg: RunConfig, schedule: LoopSchedule) -> set[Visit]:
    """Visits whose activations are recomputed in backward under
    ``train.activation_checkpointing.policy``: ``full`` every visit, ``looped`` the visits of
    looped layers, ``every_n`` every n-th visit of the plan (positions 0, n, 2n, ...), ``none``
    no visit."""
    ac = cfg.train.activation_checkpointing
    plan = schedule.plan
    if ac.policy == "none":
        return set()
    if ac.policy == "full":
        return set(plan)
    if ac.policy == "looped":
        return {v for v in plan if v.layer in schedule.looped_layers}
    return {v for i, v in enumerate(plan) if i % ac.every_n == 0}
