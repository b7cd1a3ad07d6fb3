"""Grouped linear layer of sorted token copies by per-expert weights, traceable by torch.compile in fp32.

``torch._grouped_mm`` runs eagerly on CPU in fp32 and bf16, but its meta kernel (what
torch.compile traces with) accepts bf16 only, so a compiled fp32 model (every CPU run) cannot
trace it. :func:`grouped_linear` calls ``torch._grouped_mm`` directly where it can be traced
(eager, or bf16 inputs under compile, where inductor has its own grouped-GEMM lowering) and
otherwise goes through ``smelt_ds::grouped_linear``, a ``torch.library`` custom operator with a
fake (shape) kernel and an autograd formula, which torch.compile keeps as one opaque call (as
transformers' ``grouped_mm_fallback`` does). On CPU the operator runs one BLAS call per group;
elsewhere ``torch._grouped_mm``.

Shapes: ``x_NK`` (N, K) rows sorted by group; ``w_EMK`` (E, M, K), each expert's weight in
``nn.Linear`` layout (out, in); ``offs_E`` (E,) int32, the cumulative row counts (``offs_E[-1] ==
N``); result (N, M), row block e = ``x[offs[e-1]:offs[e]] @ w[e]^T``. Backward: ``dx_e = dy_e @
w_e`` and ``dw_e = dy_e^T @ x_e``, computed in the weight's own layout (no transposed copy of an
(E, M, K) gradient).

Which branch runs is decided by :func:`branch_device_type`, the tensor's device type unless
:data:`DEVICE_BRANCHES` maps it to another: tests map ``"cpu"`` to ``"cuda"`` and run the CUDA
branches (``torch._grouped_mm`` in every mode used here, which has CPU kernels too) on CPU
tensors, next to the CPU branches and a per-group reference. None of the CUDA branches reads a
tensor on the host: the groups are given by ``offs_E`` on the device. The CPU branches read
``offs_E`` once per call (:func:`_group_bounds`), to slice the groups for one BLAS call each.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

__all__ = ["DEVICE_BRANCHES", "branch_device_type", "device_branches", "grouped_linear"]

#: Device type -> the device type whose branches its tensors take, here and in
#: :mod:`smelt_ds.model.experts` (``{}``: every tensor takes its own device's). Only tests set it
#: (:func:`device_branches`), to run a device's branches on CPU tensors.
DEVICE_BRANCHES: dict[str, str] = {}


def branch_device_type(t: torch.Tensor) -> str:
    """The device type whose branches ``t`` takes: ``t.device.type`` unless :data:`DEVICE_BRANCHES`
    maps it to another."""
    return DEVICE_BRANCHES.get(t.device.type, t.device.type)


@contextlib.contextmanager
def device_branches(mapping: dict[str, str]) -> Iterator[None]:
    """Within the block, tensors of each device type in ``mapping`` take the mapped device type's
    branches (e.g. ``{"cpu": "cuda"}``: CPU tensors run the CUDA code paths); restored after it."""
    before = dict(DEVICE_BRANCHES)
    DEVICE_BRANCHES.update(mapping)
    try:
        yield
    finally:
        DEVICE_BRANCHES.clear()
        DEVICE_BRANCHES.update(before)


def _group_bounds(offs_E: torch.Tensor) -> list[tuple[int, int, int]]:
    """``[(e, start, end)]`` of the non-empty groups (one host read of ``offs_E``)."""
    out, start = [], 0
    for e, end in enumerate(offs_E.tolist()):
        if end > start:
            out.append((e, start, end))
        start = end
    return out


def _cpu_grouped_mm(a_NK: torch.Tensor, w_EKM: torch.Tensor, offs_E: torch.Tensor) -> torch.Tensor:
    """``a_e @ w_EKM[e]`` per group, one BLAS call each, written in place (a strided ``w_EKM``, e.g.
    a transposed view, needs no copy); rows of empty groups do not exist, so ``new_empty`` is safe."""
    out = a_NK.new_empty(a_NK.shape[0], w_EKM.shape[2])
    for e, start, end in _group_bounds(offs_E):
        torch.mm(a_NK[start:end], w_EKM[e], out=out[start:end])
    return out


@torch.library.custom_op("smelt_ds::grouped_linear", mutates_args=())
def _grouped_linear_op(x_NK: torch.Tensor, w_EMK: torch.Tensor, offs_E: torch.Tensor) -> torch.Tensor:
    if branch_device_type(x_NK) != "cpu":
        return torch._grouped_mm(x_NK, w_EMK.transpose(-2, -1), offs=offs_E)
    return _cpu_grouped_mm(x_NK, w_EMK.transpose(-2, -1), offs_E)


@_grouped_linear_op.register_fake
def _(x_NK: torch.Tensor, w_EMK: torch.Tensor, offs_E: torch.Tensor) -> torch.Tensor:
    return x_NK.new_empty(x_NK.shape[0], w_EMK.shape[1])


@torch.library.custom_op("smelt_ds::grouped_linear_input_grad", mutates_args=())
def _input_grad_op(dy_NM: torch.Tensor, w_EMK: torch.Tensor, offs_E: torch.Tensor) -> torch.Tensor:
    if branch_device_type(dy_NM) != "cpu":
        return torch._grouped_mm(dy_NM, w_EMK, offs=offs_E)
    return _cpu_grouped_mm(dy_NM, w_EMK, offs_E)


@_input_grad_op.register_fake
def _(dy_NM: torch.Tensor, w_EMK: torch.Tensor, offs_E: torch.Tensor) -> torch.Tensor:
    return dy_NM.new_empty(dy_NM.shape[0], w_EMK.shape[2])


@torch.library.custom_op("smelt_ds::grouped_linear_weight_grad", mutates_args=())
def _weight_grad_op(x_NK: torch.Tensor, dy_NM: torch.Tensor, offs_E: torch.Tensor) -> torch.Tensor:
    if branch_device_type(x_NK) != "cpu":  # (M, N) x (N, K) -> (E, M, K): groups along the reduction
        return torch._grouped_mm(dy_NM.t(), x_NK, offs=offs_E)
    dw = x_NK.new_zeros(offs_E.shape[0], dy_NM.shape[1], x_NK.shape[1])  # empty groups: zero gradient
    for e, start, end in _group_bounds(offs_E):
        torch.mm(dy_NM[start:end].t(), x_NK[start:end], out=dw[e])
    return dw


@_weight_grad_op.register_fake
def _(x_NK: torch.Tensor, dy_NM: torch.Tensor, offs_E: torch.Tensor) -> torch.Tensor:
    return x_NK.new_empty(offs_E.shape[0], dy_NM.shape[1], x_NK.shape[1])


def _setup_context(ctx, inputs, output) -> None:
    x_NK, w_EMK, offs_E = inputs
    ctx.save_for_backward(x_NK, w_EMK, offs_E)


def _backward(ctx, dy_NM: torch.Tensor):
    x_NK, w_EMK, offs_E = ctx.saved_tensors
    dy_NM = dy_NM.contiguous()
    dx = _input_grad_op(dy_NM, w_EMK, offs_E) if ctx.needs_input_grad[0] else None
    dw = _weight_grad_op(x_NK, dy_NM, offs_E) if ctx.needs_input_grad[1] else None
    return dx, dw, None


_grouped_linear_op.register_autograd(_backward, setup_context=_setup_context)


def grouped_linear(x_NK: torch.Tensor, w_EMK: torch.Tensor, offs_E: torch.Tensor) -> torch.Tensor:
    """``(N, K) x (E, M, K) -> (N, M)``: row block e times ``w_EMK[e]^T``, the groups given by the
    int32 cumulative row counts ``offs_E`` (see the module docstring); differentiable in ``x_NK``
    and ``w_EMK``. Raises what ``torch._grouped_mm`` raises where it runs (e.g. row strides that
    are not multiples of 16 bytes)."""
    if torch.compiler.is_compiling() and x_NK.dtype != torch.bfloat16:
        return _grouped_linear_op(x_NK, w_EMK, offs_E)
    return torch._grouped_mm(x_NK, w_EMK.transpose(-2, -1), offs=offs_E)
