"""Where a model's inputs go: the one place that moves batches onto the device of the model or
engine that consumes them.

Loaders build their tensors on the host (``torch.from_numpy``); a CUDA model indexed with CPU
token ids raises "Expected all tensors to be on the same device" at its first layer. Every path
that feeds a model (training, validation, the in-loop harness, ``eval``, ``analyze``,
``generate``, the export parity checks) calls :func:`to_device` with the model's
:func:`device_of`, as torchtitan's and Megatron-LM's training steps move each batch before the
forward. Host-side values (sample ids, label counts) stay on the host.

Pinned host memory (:func:`pin`) lets the copy run asynchronously (``non_blocking``) on a CUDA
device; on a CPU-only machine nothing is pinned and the move is a no-op.
"""

from __future__ import annotations

import torch

__all__ = ["device_of", "pin", "to_device"]


def device_of(model) -> torch.device:
    """The device a model or DeepSpeed engine computes on: ``engine.device`` for a DeepSpeed
    engine (the accelerator device DeepSpeed set for this rank), else the device of the module's
    first parameter or buffer (the CPU for a module with neither)."""
    dev = getattr(model, "device", None)
    if isinstance(dev, torch.device):
        return dev
    if isinstance(dev, str):
        return torch.device(dev)
    for t in model.parameters():
        return t.device
    for t in model.buffers():
        return t.device
    return torch.device("cpu")


def pin(t: torch.Tensor) -> torch.Tensor:
    """``t`` in pinned (page-locked) host memory when a CUDA device is present, so that
    :func:`to_device` copies it asynchronously; ``t`` itself otherwise (or when it is not a CPU
    tensor)."""
    if t.device.type == "cpu" and torch.cuda.is_available():
        return t.pin_memory()
    return t


def to_device(device: torch.device | str, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``tensors`` on ``device`` (the same objects when already there), copied with
    ``non_blocking=True``: from pinned memory the copy overlaps with the host's work, and the
    stream order makes the consumer's kernels wait for it. Shapes and dtypes are unchanged."""
    device = torch.device(device)
    return tuple(t if t.device == device else t.to(device, non_blocking=True) for t in tensors)
