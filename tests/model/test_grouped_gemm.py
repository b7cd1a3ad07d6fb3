"""smelt_ds::grouped_linear: equals a per-group ``x_e @ w_e^T`` (and its gradients) in eager and
compiled fp32, empty groups included, and passes torch.library.opcheck (fake kernel, autograd
registration, schema)."""

from __future__ import annotations

import pytest
import torch

from smelt_ds.model.grouped_gemm import _grouped_linear_op, grouped_linear
from tests.numerics import assert_close_chain


def _case(seed=0, N=40, K=16, M=24, counts=(5, 0, 17, 18)):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, K, generator=g, requires_grad=True)
    w = torch.randn(len(counts), M, K, generator=g, requires_grad=True)
    offs = torch.tensor(counts).cumsum(0).to(torch.int32)
    dy = torch.randn(N, M, generator=g)
    return x, w, offs, dy


def _reference(x, w, offs):
    out, start = [], 0
    for e, end in enumerate(offs.tolist()):
        out.append(x[start:end] @ w[e].t())
        start = end
    return torch.cat(out)


@pytest.mark.parametrize("fn", ["op", "dispatch", "compiled"])
def test_grouped_linear_equals_per_group_matmul(fn):
    x, w, offs, dy = _case()
    y0 = _reference(x, w, offs)
    gx0, gw0 = torch.autograd.grad(y0, (x, w), dy)
    f = {"op": _grouped_linear_op, "dispatch": grouped_linear,
         "compiled": torch.compile(grouped_linear, backend="aot_eager", fullgraph=True)}[fn]
    y1 = f(x, w, offs)
    gx1, gw1 = torch.autograd.grad(y1, (x, w), dy)
    # reductions over K = 16 (y), M = 24 (dx) and a group's rows, <= 18 (dw); tests/numerics.py
    for a, b, n in ((y0, y1, 16), (gx0, gx1, 24), (gw0, gw1, 18)):
        assert_close_chain(b, a, n)
    assert gw1[1].abs().sum() == 0  # the empty group gets a zero gradient


def test_opcheck():
    x, w, offs, _ = _case(seed=1)
    torch.library.opcheck(_grouped_linear_op, (x, w, offs))
