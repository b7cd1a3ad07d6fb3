"""Shared pieces of the MoE tests (tests/model/test_moe.py, test_router.py, test_experts.py,
test_losses.py): the sizes, the tolerances derived from them, a layer with random weights, and a
routing constructed so that the losses can be computed by hand."""

from __future__ import annotations

import math

import torch

from smelt_ds.model.moe import MoE
from tests.numerics import FP32_U

H, E, K, FF = 16, 6, 2, 8
# Tolerances (tests/numerics.py: two computations in other orders within 2 n u of the tensor's
# largest value). Forward: router H, softmax E, gate/up H, down FF, top-k renormalisation and
# combine 2K, a shared expert (gate/up H, down 12, sigmoid gate H): n = 94 (1.1e-5). Backward
# adds each transposed reduction (as many again) and a weight gradient's sum over <= 21 tokens:
# n = 209 (2.5e-5). An output or gradient scaled by 1.0001 fails.
N_FWD = 4 * H + E + FF + 12 + 2 * K
N_BWD = 2 * N_FWD + 21
# By-hand checks against Python doubles: about 20 fp32 roundings (inputs |x| <= 3.5 rounded: 3.5u
# in exp; exp and log within 1 ulp = 2u; softmax over 3, means over 4, the square of the z-loss
# doubles its error): 32u = 1.9e-6 relative. A wrong normalisation (T vs T*K, a missing factor E)
# is off by 2x or more.
BY_HAND_RTOL = 32 * FP32_U


def make_moe(impl="loop", score_func="softmax", norm=True, shared=0, num_experts=E, top_k=K, hidden=H, ffn=FF):
    """A reference MoE layer with N(0, 0.5) weights."""
    moe = MoE(hidden, num_experts, top_k, ffn, shared_ffn_size=shared, score_func=score_func,
              norm_topk_prob=norm, expert_impl=impl)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0.0, 0.5)
    return moe


# 4 tokens, 3 experts, top-2. Router weight = identity, token t's input = its logits:
# log(a_t) + c_t, so softmax = a_t / sum(a_t) and logsumexp = log(sum a_t) + c_t.
A = [[1, 2, 3], [4, 1, 3], [2, 5, 1], [1, 3, 4]]
C = [0.0, 1.5, -2.0, 0.25]
TOPK = [{2, 1}, {0, 2}, {1, 0}, {2, 1}]


def constructed_moe(score_func="softmax"):
    """The layer and input of the constructed routing above: ``(moe, x (1, 4, 3))``."""
    moe = make_moe("auto", score_func, True, num_experts=3, top_k=2, hidden=3, ffn=4)
    with torch.no_grad():
        moe.gate.weight.copy_(torch.eye(3))
    x = torch.tensor([[math.log(a) + c for a in row] for row, c in zip(A, C, strict=True)]).reshape(1, 4, 3)
    return moe, x
