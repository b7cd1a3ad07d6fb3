"""The CUDA branches of the grouped experts, run on CPU tensors (issue 45, item 5).

smelt_ds/model/grouped_gemm.py and smelt_ds/model/experts.py decide "CUDA or CPU" by
:func:`~smelt_ds.model.grouped_gemm.branch_device_type`; ``device_branches({"cpu": "cuda"})``
makes CPU tensors take the CUDA branches. ``torch._grouped_mm`` has CPU kernels for every mode
these branches use (2-D x 3-D forward and input gradient, 2-D x 2-D weight gradient grouped along
the reduction), so the CUDA branches' index and layout arithmetic runs here as written, on the
CPU kernel. Each branch is compared with the branch CPU training takes and with a plain per-expert
PyTorch computation in fp64, forward and backward; and the grouped path is shown to read no
tensor on the host (a synchronisation on CUDA).

Tolerances: tests/numerics.py, ``assert_close_chain(got, want, n, u)``: two computations of a chain
of reductions of total length ``n`` in unit roundoff ``u`` differ by at most ``2 n u`` of the
tensor's largest value (Higham 2002, section 3.1; first order). Against fp64 the reference's own
error is negligible (2^-53 per operation), so the bound holds with a factor 2 to spare.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F

from smelt_ds.model.experts import CPU_BF16_ROW_BLOCK, GroupedExperts, has_grouped_mm
from smelt_ds.model.grouped_gemm import (
    DEVICE_BRANCHES,
    _grouped_linear_op,
    branch_device_type,
    device_branches,
    grouped_linear,
)
from tests.numerics import BF16_U, FP32_U, assert_close_chain

pytestmark = pytest.mark.skipif(not has_grouped_mm(), reason="torch._grouped_mm not available in this torch")

CUDA = {"cpu": "cuda"}


class _Kernels(torch.utils._python_dispatch.TorchDispatchMode):
    """Which matmul kernels ran: the number of ``aten._grouped_mm`` and ``aten.mm`` calls, and the
    row counts of the groups ``_grouped_mm`` was given (differences of ``offs``) and of every
    ``mm`` operand (the per-expert products). A dispatch mode does not see inside the
    ``smelt_ds::`` operators: :func:`_op_kernels` counts those."""

    def __init__(self):
        super().__init__()
        self.grouped = self.mm = 0
        self.rows: set[int] = set()

    def record(self, grouped: bool, args, kwargs) -> None:
        if grouped:
            self.grouped += 1
            offs = (kwargs["offs"] if "offs" in kwargs else args[2]).tolist()
            self.rows |= {b - a for a, b in zip([0, *offs], offs, strict=False)}
        else:
            self.mm += 1
            self.rows |= {*args[0].shape, args[1].shape[1]}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._grouped_mm.default:
            self.record(True, args, kwargs)
        elif func in (torch.ops.aten.mm.default, torch.ops.aten.mm.out):
            self.record(False, args, kwargs)
        return func(*args, **kwargs)


@contextlib.contextmanager
def _op_kernels() -> Iterator[_Kernels]:
    """:class:`_Kernels` of the Python calls ``torch._grouped_mm`` and ``torch.mm`` (what the
    ``smelt_ds::`` operators' implementations call), counted by wrapping both for the block."""
    seen = _Kernels()
    grouped_mm, mm = torch._grouped_mm, torch.mm

    def counted(fn, grouped):
        def call(*args, **kwargs):
            seen.record(grouped, args, kwargs)
            return fn(*args, **kwargs)
        return call

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch, "_grouped_mm", counted(grouped_mm, True))
        mp.setattr(torch, "mm", counted(mm, False))
        yield seen


def test_device_branches_maps_and_restores():
    x = torch.zeros(1)
    assert branch_device_type(x) == "cpu" and DEVICE_BRANCHES == {}
    with device_branches(CUDA):
        assert branch_device_type(x) == "cuda"
        with device_branches({"cpu": "xpu"}):
            assert branch_device_type(x) == "xpu"
        assert branch_device_type(x) == "cuda"
    assert branch_device_type(x) == "cpu" and DEVICE_BRANCHES == {}


# ---------------------------------------------------------------------------------------------
# smelt_ds::grouped_linear (the operator torch.compile keeps opaque; on CUDA its three
# torch._grouped_mm calls)
# ---------------------------------------------------------------------------------------------

# groups with empty ones first, in the middle and last: 40 rows, K = 16 in, M = 24 out
_COUNTS = (0, 5, 0, 17, 18, 0)


def _op_case(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    N, K, M = sum(_COUNTS), 16, 24
    x = torch.randn(N, K, generator=g)
    w = torch.randn(len(_COUNTS), M, K, generator=g)
    return x, w, torch.tensor(_COUNTS).cumsum(0).to(torch.int32), torch.randn(N, M, generator=g)


def _per_group_fp64(x, w, dy):
    """``(y, dx, dw)`` group by group in fp64: ``y_e = x_e w_e^T``, ``dx_e = dy_e w_e``,
    ``dw_e = dy_e^T x_e`` (zero for an empty group)."""
    x, w, dy = x.double(), w.double(), dy.double()
    y, dx, dw = torch.zeros_like(dy), torch.zeros_like(x), torch.zeros_like(w)
    start = 0
    for e, c in enumerate(_COUNTS):
        rows = slice(start, start + c)
        y[rows], dx[rows], dw[e] = x[rows] @ w[e].t(), dy[rows] @ w[e], dy[rows].t() @ x[rows]
        start += c
    return y, dx, dw


@pytest.mark.parametrize("branch", ["cuda", "cpu"])
def test_grouped_linear_op_branches_equal_per_group_fp64(branch):
    """The operator's forward and both backward kernels: the CUDA branch (three
    ``torch._grouped_mm`` calls, no ``mm``) and the CPU branch (one ``mm`` per non-empty group,
    no ``_grouped_mm``) each equal the fp64 per-group products; the two branches agree; empty
    groups get an exactly zero weight gradient."""
    x, w, offs, dy = _op_case()
    x.requires_grad_(True)
    w.requires_grad_(True)
    with device_branches(CUDA if branch == "cuda" else {}), _op_kernels() as seen:
        y = _grouped_linear_op(x, w, offs)
        dx, dw = torch.autograd.grad(y, (x, w), dy)
    if branch == "cuda":
        assert (seen.grouped, seen.mm) == (3, 0)
        assert seen.rows == set(_COUNTS)  # the groups as they are, empty ones included
    else:
        assert seen.grouped == 0 and seen.mm == 3 * sum(c > 0 for c in _COUNTS)
    y64, dx64, dw64 = _per_group_fp64(x.detach(), w.detach(), dy)
    # y: one dot product over K = 16; dx: over M = 24; dw: over a group's rows, at most 18
    assert_close_chain(y.double(), y64, 16)
    assert_close_chain(dx.double(), dx64, 24)
    assert_close_chain(dw.double(), dw64, 18)
    for e, c in enumerate(_COUNTS):
        if c == 0:
            assert torch.count_nonzero(dw[e]) == 0, e


def test_grouped_linear_cuda_branch_equals_cpu_branch():
    """The two branches of the operator on the same inputs, to fp32 rounding (2 n u: the same
    sums in possibly other orders)."""
    x, w, offs, dy = _op_case(seed=1)
    out = {}
    for name, mapping in (("cuda", CUDA), ("cpu", {})):
        xa, wa = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
        with device_branches(mapping):
            y = _grouped_linear_op(xa, wa, offs)
            out[name] = (y, *torch.autograd.grad(y, (xa, wa), dy))
    for a, b, n in zip(out["cuda"], out["cpu"], (16, 24, 18), strict=True):
        assert_close_chain(a, b, n)


@pytest.mark.slow
def test_grouped_linear_compiled_under_cuda_branches():
    """What a compiled fp32 model runs on CUDA: ``grouped_linear`` traced by torch.compile goes
    through the operator, whose CUDA branch runs; equal to the fp64 per-group products."""
    x, w, offs, dy = _op_case(seed=2)
    x.requires_grad_(True)
    w.requires_grad_(True)
    compiled = torch.compile(grouped_linear, backend="aot_eager", fullgraph=True)
    torch._dynamo.reset()
    torch.autograd.grad(compiled(x, w, offs), (x, w), dy)  # compiles forward and backward first
    with device_branches(CUDA), _op_kernels() as seen:  # (wrapping torch.mm upsets inductor's import)
        y = compiled(x, w, offs)
        dx, dw = torch.autograd.grad(y, (x, w), dy)
    torch._dynamo.reset()
    assert seen.grouped == 3 and seen.mm == 0
    y64, dx64, dw64 = _per_group_fp64(x.detach(), w.detach(), dy)
    assert_close_chain(y.double(), y64, 16)
    assert_close_chain(dx.double(), dx64, 24)
    assert_close_chain(dw.double(), dw64, 18)


# ---------------------------------------------------------------------------------------------
# GroupedExperts: the CUDA path (groups as they are, torch._grouped_mm, in bf16 too)
# ---------------------------------------------------------------------------------------------

# 4 experts, H = F = 8 (bf16 rows of 16 bytes, as torch._grouped_mm needs), 32 sorted copies in
# groups of 13, 0, 17 and 2 rows (not multiples of CPU_BF16_ROW_BLOCK: a row-block layout would
# show up as groups of 32 rows)
_EXPERT_COUNTS = (13, 0, 17, 2)
_HF = 8


def _experts_case(dtype: torch.dtype, seed: int = 0):
    """``(experts, x_NH, counts_E, g_NH)``: N(0, 0.5) weights, N(0, 1) inputs and upstream gradient."""
    gen = torch.Generator().manual_seed(seed)
    ex = GroupedExperts(len(_EXPERT_COUNTS), _HF, _HF, "grouped_mm")
    with torch.no_grad():
        for p in ex.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    N = sum(_EXPERT_COUNTS)
    x = torch.randn(N, _HF, generator=gen)
    g = torch.randn(N, _HF, generator=gen)
    return ex.to(dtype), x.to(dtype), torch.tensor(_EXPERT_COUNTS), g.to(dtype)


def _plain_experts_fp64(ex: GroupedExperts, x: torch.Tensor, g: torch.Tensor):
    """``(y, dx, d gate_up_proj, d down_proj)`` in fp64, expert by expert with plain PyTorch:
    ``y_e = (silu(x_e Wg_e^T) * (x_e Wu_e^T)) Wd_e^T``, its gradients by autograd."""
    F_ = _HF
    wgu = ex.gate_up_proj.detach().double().requires_grad_(True)
    wd = ex.down_proj.detach().double().requires_grad_(True)
    x64 = x.detach().double().requires_grad_(True)
    outs, start = [], 0
    for e, c in enumerate(_EXPERT_COUNTS):
        xe = x64[start:start + c]
        outs.append((F.silu(xe @ wgu[e, :F_].t()) * (xe @ wgu[e, F_:].t())) @ wd[e].t())
        start += c
    y = torch.cat(outs)
    dx, dgu, dd = torch.autograd.grad(y, (x64, wgu, wd), g.double())
    return y, dx, dgu, dd


def _run(ex: GroupedExperts, fn, x: torch.Tensor, counts: torch.Tensor, g: torch.Tensor):
    """``fn(x, counts)`` and its gradients ``(y, dx, d gate_up_proj, d down_proj)``."""
    ex.zero_grad(set_to_none=True)
    xa = x.clone().requires_grad_(True)
    y = fn(xa, counts)
    y.backward(g)
    return y.detach(), xa.grad, ex.gate_up_proj.grad.clone(), ex.down_proj.grad.clone()


# Chain lengths (tests/numerics.py), counting every operation as if rounded in the dtype (torch
# accumulates bf16 products in fp32: fewer roundings). Forward: gate/up over H = 8, silu and the
# product, down over F = 8: n = 18. dx: d a over H = 8 after the forward's 10 and the SwiGLU
# backward's 3, then over 2F = 16: n = 37. d down: a's 10 plus a sum over a group's <= 17 rows:
# 27. d gate_up: d h's 21 plus 17 rows: 38. A wrong group boundary (a row of another expert's
# weights) or a lost row is off by a share of the largest value far above these (0.14 of it
# in bf16 at n = 38 would be the bound; a swapped expert moves values by ~1x).
_N = (18, 37, 38, 27)


@pytest.mark.parametrize("dtype,u", [(torch.float32, FP32_U), (torch.bfloat16, BF16_U)], ids=["fp32", "bf16"])
def test_experts_cuda_path_equals_loop_and_plain_fp64(dtype, u):
    """``GroupedExperts`` as it runs on CUDA (grouped_mm on the groups as they are, bf16 without
    row blocks: six ``torch._grouped_mm`` calls, no ``mm``, the groups' own row counts) equals the
    per-expert loop path (``_forward_loop``, same dtype and weights) and a plain fp64 per-expert
    SwiGLU, forward and backward; the empty expert gets an exactly zero weight gradient."""
    ex, x, counts, g = _experts_case(dtype)
    with device_branches(CUDA), _Kernels() as seen:
        cuda = _run(ex, ex, x, counts, g)
    assert (seen.grouped, seen.mm) == (6, 0)  # gate/up and down: forward, input and weight gradients
    assert seen.rows == set(_EXPERT_COUNTS) and CPU_BF16_ROW_BLOCK not in seen.rows
    loop = _run(ex, ex._forward_loop, x, counts, g)
    ref = _plain_experts_fp64(ex, x, g)
    for name, a, b, r, n in zip(("y", "dx", "d gate_up_proj", "d down_proj"), cuda, loop, ref, _N, strict=True):
        assert a.dtype == dtype
        assert_close_chain(a.double(), r, n, u, msg=f"cuda path vs fp64 {name}")
        assert_close_chain(a, b, n, u, msg=f"cuda path vs loop {name}")
    for grad in cuda[2:]:
        assert torch.count_nonzero(grad[1]) == 0


def test_bf16_cpu_branch_uses_row_blocks_cuda_branch_does_not():
    """The branch decision itself: bf16 on CPU runs whole row blocks (groups of 32 rows after
    padding 13 and 17, or 0), the same tensors under the CUDA branches the groups as they are;
    both give the same values to bf16 rounding."""
    ex, x, counts, g = _experts_case(torch.bfloat16, seed=3)
    with _Kernels() as cpu_seen:
        cpu = _run(ex, ex, x, counts, g)
    with device_branches(CUDA), _Kernels() as cuda_seen:
        cuda = _run(ex, ex, x, counts, g)
    assert cpu_seen.rows == {0, CPU_BF16_ROW_BLOCK} and cuda_seen.rows == set(_EXPERT_COUNTS)
    for a, b, n in zip(cuda, cpu, _N, strict=True):
        assert_close_chain(a, b, n, BF16_U)


# ---------------------------------------------------------------------------------------------
# host reads: none on the grouped (CUDA) path
# ---------------------------------------------------------------------------------------------


class HostRead(RuntimeError):
    """A tensor was read on the host (on CUDA: a synchronisation with the device)."""


_READS = {torch.Tensor.tolist, torch.Tensor.item, torch.Tensor.__int__, torch.Tensor.__index__,
          torch.Tensor.__bool__, torch.Tensor.__float__, torch.Tensor.numpy}


class _NoHostRead(torch.Tensor):
    """A tensor whose values (and those of every tensor computed from it) must stay on the
    device: reading one on the host (``tolist``, ``item``, ``int()``, ``bool()``, ...) raises
    :class:`HostRead`. Kernels read it as usual."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func in _READS:
            raise HostRead(getattr(func, "__name__", str(func)))
        return super().__torch_function__(func, types, args, kwargs or {})


def test_grouped_cuda_path_reads_no_counts_on_the_host():
    """The grouped experts on the CUDA branches run forward and backward with counts that may not
    be read on the host (their offsets are a ``torch.cumsum`` on the device); the per-expert loop
    and the CPU bf16 row-block layout, which do read them, raise: the guard works."""
    for dtype in (torch.float32, torch.bfloat16):
        ex, x, counts, g = _experts_case(dtype)
        guarded = counts.clone().as_subclass(_NoHostRead)
        with device_branches(CUDA):
            y = ex(x, guarded)
            y.backward(g)
        assert ex.down_proj.grad is not None and torch.count_nonzero(ex.down_proj.grad[0]) > 0
        assert_close_chain(y.as_subclass(torch.Tensor).double(), _plain_experts_fp64(ex, x, g)[0], _N[0],
                           FP32_U if dtype == torch.float32 else BF16_U)
    with pytest.raises(HostRead, match="tolist"):
        ex._forward_loop(x, guarded)
    with pytest.raises(HostRead):
        ex(x, guarded)  # bf16 on the CPU branches: the row-block layout reads the sums
