"""The ``deepspeed`` MoE backend's CUDA-only branch, run on CPU tensors (issue 45, item 5), and its
per-visit host reads.

:func:`~smelt_ds.parallel.moe_backends.deepspeed_moe._per_expert_mm` stacks the weights and runs one
``torch.bmm`` on any device but the CPU, and one ``torch.mm`` per expert on the CPU; the choice is
:func:`smelt_ds.model.grouped_gemm.branch_device_type`, so ``device_branches({"cpu": "cuda"})``
runs the ``stack`` + ``bmm`` branch here. Both branches are compared with a plain fp64
computation, and with each other, forward and backward (the fused SwiGLU node). The route a visit
records keeps DeepSpeed's capacity tensor unread (no host read per visit).

Tolerances: tests/numerics.py, ``assert_close_chain(got, want, n)``: two computations of a chain of
reductions of total length ``n`` in fp32 differ by at most ``2 n u`` (u = 2^-24) of the tensor's
largest value (Higham 2002, section 3.1; first order); against fp64 the reference's own error is
negligible.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("deepspeed")

from smelt_ds.model.grouped_gemm import device_branches  # noqa: E402
from smelt_ds.parallel import moe_backends  # noqa: E402
from smelt_ds.parallel.moe_backends import deepspeed_moe  # noqa: E402
from smelt_ds.parallel.moe_backends.deepspeed_moe import (  # noqa: E402
    CapacityRouterOutput,
    _LocalExpertsSwiGLU,
    _per_expert_mm,
)
from tests.numerics import assert_close_chain  # noqa: E402
from tests.parallel.moe_backends.backend_helpers import MICRO, SEQ, build, shard_batches, tiny_cfg  # noqa: E402

CUDA = {"cpu": "cuda"}


class _MatmulCalls(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts ``aten.bmm`` and ``aten.mm`` calls."""

    def __init__(self):
        super().__init__()
        self.bmm = self.mm = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten.bmm.default, torch.ops.aten.bmm.out):
            self.bmm += 1
        elif func in (torch.ops.aten.mm.default, torch.ops.aten.mm.out):
            self.mm += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("operand", ["list of transposed views", "3-D tensor"])
@pytest.mark.parametrize("branch", ["cuda", "cpu"])
def test_per_expert_mm_branches_equal_fp64(branch, operand):
    """``a[e] @ b[e]`` for E = 5 experts, N = 7 rows, K = 24, M = 12: the CUDA branch is one
    ``bmm`` (no ``mm``), the CPU branch one ``mm`` per expert (no ``bmm``); both equal the fp64
    ``einsum`` within one dot product over K = 24."""
    g = torch.Generator().manual_seed(0)
    a = torch.randn(5, 7, 24, generator=g)
    w = torch.randn(5, 12, 24, generator=g)  # nn.Linear layout (out, in): b[e] = w[e]^T
    b = [m.t() for m in w] if operand.startswith("list") else w.transpose(1, 2)
    with device_branches(CUDA if branch == "cuda" else {}), _MatmulCalls() as seen:
        out = _per_expert_mm(a, b)
    assert (seen.bmm, seen.mm) == ((1, 0) if branch == "cuda" else (0, 5))
    want = torch.einsum("enk,emk->enm", a.double(), w.double())
    assert out.shape == (5, 7, 12)
    assert_close_chain(out.double(), want, 24)


def _swiglu_case(E=4, N=9, H=16, F_=12, seed=1):
    """Capacity buffers ``x (E, N, H)`` (the last two rows zero: unfilled slots), the E experts'
    gate, up ``[F, H]`` and down ``[H, F]`` weights, N(0, 0.3), and an upstream gradient."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(E, N, H, generator=g)
    x[:, -2:] = 0.0
    weights = [torch.randn(F_, H, generator=g) * 0.3 for _ in range(2 * E)]
    weights += [torch.randn(H, F_, generator=g) * 0.3 for _ in range(E)]
    return x, weights, torch.randn(E, N, H, generator=g)


def _plain_swiglu_fp64(x, weights, dy):
    """``y[e] = (silu(x[e] Wg_e^T) * (x[e] Wu_e^T)) Wd_e^T`` in fp64, expert by expert, and the
    gradients of ``(y * dy).sum()`` in x and every weight (autograd)."""
    E = x.shape[0]
    x64 = x.double().requires_grad_(True)
    w64 = [w.double().requires_grad_(True) for w in weights]
    y = torch.stack([(F.silu(x64[e] @ w64[e].t()) * (x64[e] @ w64[E + e].t())) @ w64[2 * E + e].t()
                     for e in range(E)])
    return (y.detach(), *torch.autograd.grad(y, [x64, *w64], dy.double()))


def _fused(x, weights, dy):
    xa = x.clone().requires_grad_(True)
    wa = [w.clone().requires_grad_(True) for w in weights]
    y = _LocalExpertsSwiGLU.apply(xa, *wa)
    return (y.detach(), *torch.autograd.grad(y, [xa, *wa], dy))


def test_fused_swiglu_bmm_branch_equals_mm_branch_and_fp64():
    """The fused experts node (forward, input and weight gradients) on the CUDA branch (``stack`` +
    ``bmm``: 3 forward, 6 backward) and on the CPU branch (one ``mm`` per expert) against a plain
    fp64 SwiGLU, and against each other. Chain lengths (relative errors add along a path) with
    H = 16, F = 12, N = 9 rows: y: gate/up over H, silu, product, down over F: n = 30; the product
    a: 18; dm = dy Wd over H: 16; dg = silu_backward(dm * up, gate): 16 + 16 + 3 = 35; dx = dg Wg +
    du Wu over F, summed: 35 + 12 + 1 = 48; d down: a's 18 plus N = 9 rows: 27; d gate / d up: 35
    plus 9 rows: 44 (bounds of at most 5.3e-6 of the largest value; one expert's weights in
    another's place moves values by ~1x)."""
    x, weights, dy = _swiglu_case()
    E = x.shape[0]
    with device_branches(CUDA), _MatmulCalls() as seen:
        cuda = _fused(x, weights, dy)
    assert (seen.bmm, seen.mm) == (3 + 6, 0)
    with _MatmulCalls() as seen:
        cpu = _fused(x, weights, dy)
    assert (seen.bmm, seen.mm) == (0, (3 + 6) * E)
    ref = _plain_swiglu_fp64(x, weights, dy)
    n = [30, 48, *[44] * (2 * E), *[27] * E]
    for i, (a, b, r, k) in enumerate(zip(cuda, cpu, ref, n, strict=True)):
        assert_close_chain(a.double(), r, k, msg=f"bmm branch vs fp64, output {i}")
        assert_close_chain(b.double(), r, k, msg=f"mm branch vs fp64, output {i}")
        assert_close_chain(a, b, k, msg=f"bmm vs mm branch, output {i}")


class HostRead(RuntimeError):
    """A tensor was read on the host."""


class _NoHostRead(torch.Tensor):
    """A tensor that raises :class:`HostRead` when read on the host (``int()``, ``item``, ...)."""

    _READS = {torch.Tensor.tolist, torch.Tensor.item, torch.Tensor.__int__, torch.Tensor.__index__,
              torch.Tensor.__bool__, torch.Tensor.__float__}

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func in cls._READS:
            raise HostRead(getattr(func, "__name__", str(func)))
        return super().__torch_function__(func, types, args, kwargs or {})


def test_route_keeps_the_capacity_tensor_unread_until_logged():
    """Recording a visit reads neither the capacity nor the kept copies on the host: ``_route``
    runs with a capacity that raises when read; ``capacity`` and ``dropped_share`` read them when
    asked, with the values DeepSpeed's gate computed (capacity ``ceil(T / E * 0.5 * k)``, the
    share of copies its dispatch dropped)."""
    cfg = tiny_cfg(backend="deepspeed", capacity_factor=0.5, min_capacity=1, drop_tokens=True)
    model = moe_backends.apply_backend(build(tiny_cfg()), cfg)
    ids = shard_batches(1, 0)[0]
    model(ids[:, :-1], labels=ids[:, 1:])
    mlp = model.layers[3].mlp
    assert isinstance(mlp, deepspeed_moe.DeepSpeedMoE)
    l_aux, capacity, *rest = mlp.gate.last_gate_out
    assert isinstance(capacity, torch.Tensor) and capacity.dtype == torch.int64
    mlp.gate.last_gate_out = (l_aux, capacity.clone().as_subclass(_NoHostRead), *rest)
    route = mlp._route()  # raises HostRead if it reads the capacity
    assert isinstance(route, CapacityRouterOutput) and isinstance(route.capacity_t, _NoHostRead)
    with pytest.raises(HostRead):
        _ = route.capacity  # the read happens here, when the value is asked for
    route.capacity_t = capacity
    T = MICRO * SEQ
    assert route.capacity == -(-T * 2 // (4 * 2))  # ceil(T / E * capacity_factor * k), E = 4, k = 2
    dispatched_TK = rest[1].t()  # DeepSpeed's [K, T] expert of each copy, -1 where dropped
    want_share = float((dispatched_TK < 0).sum()) / dispatched_TK.numel()
    assert 0.0 < want_share < 1.0 and route.dropped_share == pytest.approx(want_share, rel=0, abs=1e-7)
