"""Skip one optimizer update through DeepSpeed's own overflow path, on every optimizer it builds.

DeepSpeed skips an update when its optimizer reports an overflow (the fp16 loss-scaling path): the
optimizer clears the gradients without touching the weights or the Adam moments, and
``DeepSpeedEngine._take_model_step`` then counts ``engine.skipped_steps`` and leaves the LR
scheduler where it was. :func:`skipping_update` makes the optimizer report an overflow for one
``engine.step()`` whatever the precision, so a step smelt-ds decides to skip (a non-finite loss or
gradient norm on any rank, a loss spike: :mod:`smelt_ds.train.step_guard`) is skipped the way
DeepSpeed skips its own, with its buffers released as after a real overflow:

=========================================  ===========  ======================================================
optimizer (DeepSpeed 0.19.8)               built for    how the overflow is forced
=========================================  ===========  ======================================================
``DeepSpeedZeroOptimizer``                 ZeRO-1/2     ``check_grad_overflow`` on, ``has_overflow`` -> True
``DeepSpeedZeroOptimizer_Stage3``          ZeRO-3       ``_overflow_check_and_loss_scale_update`` -> overflow
``FP16_UnfusedOptimizer``                  ZeRO-0 bf16  ``overflow_checker.check`` -> True
a torch optimizer (``torch.optim.AdamW``)  ZeRO-0 fp32  ``step`` clears the gradients and sets ``overflow``
=========================================  ===========  ======================================================

Every rank must skip together (the overflow paths of ZeRO-1/2/3 skip the collectives of the
normal path on every rank alike); the caller decides with one all-reduce.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

__all__ = ["skipping_update"]

_MISSING = object()


def _patch(obj: Any, name: str, value: Any, undo: list) -> None:
    """Set instance attribute ``obj.name`` and remember how to put it back."""
    old = obj.__dict__.get(name, _MISSING)
    setattr(obj, name, value)
    undo.append((obj, name, old))


@contextlib.contextmanager
def skipping_update(engine) -> Iterator[None]:
    """Within the block, the accumulation boundary's ``engine.step()`` skips the update: weights,
    optimizer state and LR schedule unchanged, gradients cleared, ``engine.skipped_steps`` + 1.

    Raises TypeError for an optimizer none of the paths above covers (naming its class)."""
    opt = engine.optimizer
    undo: list = []
    name = type(opt).__name__
    try:
        if name == "DeepSpeedZeroOptimizer":
            _patch(opt, "check_grad_overflow", True, undo)
            _patch(opt, "has_overflow", lambda *a, **k: True, undo)
        elif name == "DeepSpeedZeroOptimizer_Stage3":
            def forced(update_scale: bool = True) -> bool:
                opt.overflow = True
                return opt._loss_scale_update_and_overflow_cleanup() if update_scale else True

            _patch(opt, "_overflow_check_and_loss_scale_update", forced, undo)
        elif name == "FP16_UnfusedOptimizer":
            _patch(opt.overflow_checker, "check", lambda *a, **k: True, undo)
        elif hasattr(opt, "param_groups") and hasattr(opt, "zero_grad") and not hasattr(opt, "overflow"):
            def skip(*a: Any, **k: Any) -> None:
                opt.zero_grad(set_to_none=True)

            _patch(opt, "step", skip, undo)
            _patch(opt, "overflow", True, undo)
        else:
            raise TypeError(f"cannot skip an update of optimizer {type(opt).__module__}.{name}: smelt-ds knows how to "
                            "skip DeepSpeed's ZeRO-1/2/3 and ZeRO-0 bf16 optimizers and a torch optimizer")
        yield
    finally:
        for obj, attr, old in reversed(undo):
            if old is _MISSING:
                with contextlib.suppress(AttributeError):
                    delattr(obj, attr)
            else:
                setattr(obj, attr, old)
