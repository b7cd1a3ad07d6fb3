"""The ``deepspeed`` MoE backend: each reference MoE layer replaced by :class:`DeepSpeedMoE`, a
``deepspeed.moe.layer.MoE`` (capacity factor, token dropping, expert parallelism over
``moe_runtime.ep_size`` ranks, tutel kernels when installed) holding this rank's experts, with
our router statistics and the reference losses.

DeepSpeed is imported inside functions (the classes built on it on first use), so importing this
module does not import DeepSpeed.

Shape legend: T tokens, H hidden, E experts (``E_local`` on this rank), K top-k, F expert
intermediate size, G source ranks of an all-to-all, C capacity rows per expert and rank, N rows.
"""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from smelt_ds.model.experts import SwiGLU
from smelt_ds.model.grouped_gemm import branch_device_type
from smelt_ds.model.losses import load_balancing_loss, router_z_loss
from smelt_ds.model.moe import MoE
from smelt_ds.model.router import RouterOutput
from smelt_ds.parallel.moe_backends.expert_parallel import expert_parallel_rank, moe_blocks

__all__ = ["TUTEL_INSTALL_HINT", "tutel_available", "CapacityRouterOutput", "smelt_topk_gate_class",
           "smelt_fused_experts_class", "DeepSpeedMoE", "convert_to_deepspeed_moe"]

TUTEL_INSTALL_HINT = ("pip install --upgrade git+https://github.com/microsoft/tutel@main "
                      "(tutel is not on the package index; needs a CUDA build)")


def tutel_available() -> bool:
    """Whether the optional ``tutel`` package can be imported (DeepSpeed checks the same import)."""
    from deepspeed.moe import sharded_moe

    return importlib.util.find_spec("tutel") is not None and sharded_moe.TUTEL_INSTALLED


@dataclass
class CapacityRouterOutput(RouterOutput):
    """A :class:`RouterOutput` of a capacity-limited gate (DeepSpeed's TopKGate).

    ``topk_idx_TK`` are the experts the router chose (before capacity dropping, as the reference
    router would choose them); ``kept_TK`` (bool) marks the routed copies that fit into their
    expert's capacity; ``topk_weight_TK`` are the combine weights DeepSpeed applied (0 for dropped
    copies). ``capacity_t`` is the capacity in tokens per expert as DeepSpeed's gate returned it (a
    0-d int64 tensor on the gate's device, or an int), kept unread so that recording a visit
    reads nothing on the host; :attr:`capacity` and :attr:`dropped_share` read it when they are
    read (at logging time). ``ds_l_aux`` is DeepSpeed's own l_aux (detached, for comparison; it
    does not enter the loss).
    """

    kept_TK: torch.Tensor | None = None
    capacity_t: torch.Tensor | int = 0
    ds_l_aux: torch.Tensor | None = None

    @property
    def capacity(self) -> int:
        """Capacity in tokens per expert (reads ``capacity_t`` on the host)."""
        return int(self.capacity_t)

    @property
    def dropped_share(self) -> float:
        """Share of the T*K routed copies dropped by the capacity limit (0..1; reads ``kept_TK``
        on the host when read)."""
        return 0.0 if self.kept_TK is None else 1.0 - self.kept_TK.float().mean().item()

    def tokens_per_expert(self) -> list[int]:
        """Routed copies per expert before dropping (what the router asked for)."""
        return torch.bincount(self.topk_idx_TK.reshape(-1), minlength=self.logits_TE.shape[-1]).tolist()


@functools.cache
def smelt_topk_gate_class() -> type[nn.Module]:
    """The class ``SmeltTopKGate`` (below), a subclass of DeepSpeed's ``TopKGate``, built on first
    use so that importing smelt_ds does not import DeepSpeed (``smelt-ds budget`` and the other
    analytic commands never need it)."""
    from deepspeed.moe import sharded_moe
    from deepspeed.moe.sharded_moe import TopKGate

    class SmeltTopKGate(TopKGate):
        """DeepSpeed's :class:`TopKGate` that keeps the router logits of its last call.

        Same dispatch maths as ``TopKGate.forward`` (``top1gating`` for k=1, ``top2gating`` for k=2,
        ``topkgating`` for k>2, with ``sparse_routes``), with three differences: the fp32 logits
        ``(T, E)`` and the gating result are kept in ``last_logits_TE`` / ``last_gate_out`` so the
        wrapper can compute our aux loss, z-loss and statistics; router jitter is the reference
        router's (``x * U(1 - jitter, 1 + jitter)`` in training) instead of DeepSpeed's fixed 1e-2;
        ``min_capacity`` is clipped to the token count, because ``top1gating`` asserts
        ``T >= min_capacity`` (which a 1-token decode step would fail). Top-2 never samples its
        second expert (``top2_2nd_expert_sampling=False``), so routing is deterministic like ours.
        """

        def __init__(self, hidden_size: int, num_experts: int, k: int, capacity_factor: float,
                     eval_capacity_factor: float, min_capacity: int, drop_tokens: bool, use_rts: bool = True,
                     jitter: float = 0.0):
            super().__init__(hidden_size, num_experts, k, capacity_factor, eval_capacity_factor, min_capacity,
                             noisy_gate_policy=None, drop_tokens=drop_tokens, use_rts=use_rts, ep_group=None,
                             top2_2nd_expert_sampling=False)
            self.jitter = jitter
            self.last_logits_TE: torch.Tensor | None = None
            self.last_gate_out: tuple | None = None

        def forward(self, input: torch.Tensor, used_token: torch.Tensor | None = None, sparse_routes: bool = False,
                    use_tutel: bool = False):
            x_TH = input.float()
            if self.training and self.jitter > 0:
                x_TH = x_TH * torch.empty_like(x_TH).uniform_(1.0 - self.jitter, 1.0 + self.jitter)
            logits_TE = F.linear(x_TH, self.wg.weight.float())
            cf = self.capacity_factor if self.training else self.eval_capacity_factor
            min_cap = min(self.min_capacity, logits_TE.shape[0])
            if self.k == 1:
                out = sharded_moe.top1gating(logits_TE, cf, min_cap, used_token, None, self.drop_tokens, self.use_rts,
                                             self.ep_group, sparse_routes, use_tutel)
            elif self.k == 2:
                out = sharded_moe.top2gating(logits_TE, cf, min_cap, self.drop_tokens, self.ep_group, False,
                                             sparse_routes)
            else:
                out = sharded_moe.topkgating(logits_TE, self.k, cf, min_cap, self.drop_tokens, self.ep_group,
                                             sparse_routes=sparse_routes)
            self.last_logits_TE, self.last_gate_out = logits_TE, out
            return out

    SmeltTopKGate.__module__ = __name__
    return SmeltTopKGate


def _use_bmm(t: torch.Tensor) -> bool:
    """Whether :func:`_per_expert_mm` runs one ``torch.bmm`` (any device but the CPU; the device
    type as :func:`smelt_ds.model.grouped_gemm.branch_device_type` gives it, so that tests run
    the ``bmm`` branch on CPU tensors)."""
    return branch_device_type(t) != "cpu"


def _per_expert_mm(a_ENK: torch.Tensor, b_EKM: torch.Tensor | list[torch.Tensor]) -> torch.Tensor:
    """``a_ENK[e] @ b_EKM[e]`` for every expert e -> ``(E, N, M)``; ``b_EKM`` a 3-D tensor or a list
    of E matrices (e.g. transposed weight views). On CPU one ``torch.mm`` per expert, written in
    place: the very GEMM ``nn.Linear`` runs, so results equal DeepSpeed's per-expert loop bit for
    bit at any thread count (``torch.bmm`` there takes another, slower MKL path with different
    rounding). Elsewhere one ``torch.bmm`` (list operands are stacked first)."""
    if _use_bmm(a_ENK):
        b = torch.stack(b_EKM) if isinstance(b_EKM, list) else b_EKM
        return torch.bmm(a_ENK, b)
    out = a_ENK.new_empty(a_ENK.shape[0], a_ENK.shape[1], b_EKM[0].shape[1])
    for e in range(a_ENK.shape[0]):
        torch.mm(a_ENK[e], b_EKM[e], out=out[e])
    return out


class _LocalExpertsSwiGLU(torch.autograd.Function):
    """E SwiGLU experts on their capacity buffers as one autograd node: ``x_ENH`` (E experts, N
    rows each) and the experts' ``gate_proj`` / ``up_proj`` ``[F, H]`` and ``down_proj`` ``[H, F]``
    weights (E of each, in that order) -> ``(E, N, H)``, row block e =
    ``down_e(silu(gate_e(x_e)) * up_e(x_e))``, with the GEMMs of :func:`_per_expert_mm`.

    Saves ``x`` and the two projections (``silu`` and the product are recomputed in backward) and
    references to the weights, never a stacked copy of them. Forward and gradients equal the
    per-expert ``nn.Linear`` loop's bit for bit on CPU (the input gradient's two terms are
    summed once, which commutes)."""

    @staticmethod
    def forward(ctx, x_ENH: torch.Tensor, *weights: torch.Tensor) -> torch.Tensor:
        E = x_ENH.shape[0]
        wg, wu, wd = weights[:E], weights[E:2 * E], weights[2 * E:]
        hg_ENF = _per_expert_mm(x_ENH, [w.t() for w in wg])
        hu_ENF = _per_expert_mm(x_ENH, [w.t() for w in wu])
        ctx.save_for_backward(x_ENH, hg_ENF, hu_ENF, *weights)
        return _per_expert_mm(F.silu(hg_ENF) * hu_ENF, [w.t() for w in wd])

    @staticmethod
    def backward(ctx, dy_ENH: torch.Tensor):
        x_ENH, hg_ENF, hu_ENF, *weights = ctx.saved_tensors
        E = x_ENH.shape[0]
        wg, wu, wd = list(weights[:E]), list(weights[E:2 * E]), list(weights[2 * E:])
        dy_ENH = dy_ENH.contiguous()
        s_ENF = F.silu(hg_ENF)
        dm_ENF = _per_expert_mm(dy_ENH, wd)
        dwd_EHF = _per_expert_mm(dy_ENH.transpose(1, 2), s_ENF * hu_ENF)
        dg_ENF = torch.ops.aten.silu_backward(dm_ENF * hu_ENF, hg_ENF)
        du_ENF = dm_ENF * s_ENF
        dx_ENH = _per_expert_mm(dg_ENF, wg) + _per_expert_mm(du_ENF, wu)
        dwg_EFH = _per_expert_mm(dg_ENF.transpose(1, 2), x_ENH)
        dwu_EFH = _per_expert_mm(du_ENF.transpose(1, 2), x_ENH)
        return (dx_ENH, *dwg_EFH.unbind(0), *dwu_EFH.unbind(0), *dwd_EHF.unbind(0))


@functools.cache
def smelt_fused_experts_class() -> type[nn.Module]:
    """The class ``SmeltFusedExperts``, a subclass of DeepSpeed's ``Experts`` (built on first use,
    as :func:`smelt_topk_gate_class`): the same ``deepspeed_experts`` ModuleList of
    :class:`SwiGLU` experts (same parameters, names and expert-parallel attributes, so DeepSpeed's
    per-expert checkpoint files and optimizer groups are unchanged) whose local experts run as one
    autograd node (:class:`_LocalExpertsSwiGLU`) instead of DeepSpeed's Python loop of ``3 *
    E_local`` ``nn.Linear`` modules: the same GEMMs on CPU without the per-module and per-node
    overhead, one ``bmm`` per projection elsewhere (3 kernels per visit instead of ``3 * E_local``),
    and ``2F`` fewer saved activation elements per capacity row (``H + 2F`` instead of ``H + 4F``)."""
    from deepspeed.moe.experts import Experts

    class SmeltFusedExperts(Experts):
        """DeepSpeed's ``Experts`` whose forward runs all local SwiGLU experts in one autograd node.

        ``forward(inputs)``: ``(G, E_local, C, H)`` (G = ``ep_size`` source ranks, C capacity
        rows per expert and rank, as ``MOELayer`` passes it) -> the same shape, equal to
        ``Experts.forward`` (which chunks ``E_local`` and concatenates)."""

        def forward(self, inputs: torch.Tensor) -> torch.Tensor:
            G, E, C, H = inputs.shape
            experts = cast(Iterable[SwiGLU], self.deepspeed_experts)
            weights = [w for name in ("gate_proj", "up_proj", "down_proj")
                       for w in (getattr(e, name).weight for e in experts)]
            x_ENH = inputs.transpose(0, 1).reshape(E, G * C, H)
            y_ENH = cast(torch.Tensor, _LocalExpertsSwiGLU.apply(x_ENH, *weights))
            return y_ENH.view(E, G, C, H).transpose(0, 1)

    SmeltFusedExperts.__module__ = __name__
    return SmeltFusedExperts


class DeepSpeedMoE(nn.Module):
    """The ``deepspeed`` backend's FFN: ``deepspeed.moe.layer.MoE`` + our losses and statistics.

    ``forward(x)``: ``(B, S, H)`` -> ``(B, S, H)``, like the reference :class:`MoE`, and leaves
    ``last_route`` (a :class:`CapacityRouterOutput`) and ``last_losses`` (``{"aux", "z"}``, the
    reference definitions: ``aux = E * sum_e f_e P_e`` over the T*K routed copies before capacity
    dropping, ``z = mean_t logsumexp(logits_t)^2``) for the block's visit recorder.

    Parameters: ``moe.deepspeed_moe.gate.wg.weight`` ``[E, H]`` (replicated, data-parallel) and
    ``moe.deepspeed_moe.experts.deepspeed_experts.{j}.{gate_proj,up_proj,down_proj}.weight``
    for the ``E / ep_size`` local experts ``j`` (global expert ``ep_rank * E / ep_size + j``;
    ``param.allreduce = False``, ``param.group_name = "ep_size_{ep_size}"``), plus the unchanged
    ``shared_expert`` / ``shared_expert_gate`` of the reference layout. The local experts run in
    one autograd node (``moe.deepspeed_moe.experts`` is a :func:`smelt_fused_experts_class`), the
    gating is :func:`smelt_topk_gate_class`'s; the rest (dispatch into ``(E, C, H)`` capacity
    buffers, all-to-all, combine) is DeepSpeed's ``MOELayer``.
    """

    def __init__(self, hidden_size: int, moe_cfg, runtime_cfg):
        """``moe_cfg``: the architecture (:class:`smelt_ds.config.moe.MoEConfig`); ``runtime_cfg``:
        how it runs (:class:`smelt_ds.config.moe.MoERuntimeConfig`: ``ep_size``, capacity, tutel)."""
        super().__init__()
        rt, ep_size = runtime_cfg, runtime_cfg.ep_size
        self.num_experts, self.num_experts_per_tok = moe_cfg.num_experts, moe_cfg.top_k
        self.ep_size, self.hidden_size, self.ffn_size = ep_size, hidden_size, moe_cfg.expert_ffn_size
        from deepspeed.moe.layer import MoE as DeepSpeedMoELayer

        self.moe = DeepSpeedMoELayer(hidden_size, SwiGLU(hidden_size, moe_cfg.expert_ffn_size),
                                     num_experts=moe_cfg.num_experts, ep_size=ep_size, k=moe_cfg.top_k,
                                     capacity_factor=rt.capacity_factor,
                                     eval_capacity_factor=rt.eval_capacity_factor,
                                     min_capacity=rt.min_capacity, drop_tokens=rt.drop_tokens,
                                     use_rts=True, use_tutel=rt.use_tutel, top2_2nd_expert_sampling=False)
        self.moe.deepspeed_moe.gate = smelt_topk_gate_class()(hidden_size, moe_cfg.num_experts, moe_cfg.top_k,
                                                    rt.capacity_factor, rt.eval_capacity_factor,
                                                    rt.min_capacity, rt.drop_tokens,
                                                    jitter=moe_cfg.router_jitter)
        # same module and parameters, one autograd node for the local experts (DeepSpeed's loops)
        self.moe.deepspeed_moe.experts.__class__ = smelt_fused_experts_class()
        self.shared_expert: nn.Module | None = None
        self.shared_expert_gate: nn.Module | None = None
        self.last_route: CapacityRouterOutput | None = None
        self.last_losses: dict[str, torch.Tensor] = {}

    @property
    def gate(self) -> Any:
        return self.moe.deepspeed_moe.gate

    @property
    def local_experts(self) -> nn.ModuleList:
        return self.moe.deepspeed_moe.experts.deepspeed_experts

    @classmethod
    @torch.no_grad()
    def from_reference(cls, ref: MoE, moe_cfg, runtime_cfg, ep_rank: int = 0) -> DeepSpeedMoE:
        """Build from a reference :class:`MoE` (``moe_cfg``, ``runtime_cfg`` as in the constructor;
        ``ep_rank`` this rank's index in its expert-parallel group), copying the router and this rank's experts
        (``gate_up_proj[e]`` rows ``[:F]`` -> ``gate_proj``, ``[F:]`` -> ``up_proj``,
        ``down_proj[e]`` -> ``down_proj``) and taking over the shared expert modules."""
        hidden = ref.gate.weight.shape[1]
        ep_size = runtime_cfg.ep_size
        new = cls(hidden, moe_cfg, runtime_cfg).to(device=ref.gate.weight.device, dtype=ref.gate.weight.dtype)
        new.gate.wg.weight.copy_(ref.gate.weight)
        F_ = moe_cfg.expert_ffn_size
        first = ep_rank * (moe_cfg.num_experts // ep_size)
        for j, expert in enumerate(cast(Iterable[SwiGLU], new.local_experts)):
            e = first + j
            expert.gate_proj.weight.copy_(ref.experts.gate_up_proj[e, :F_])
            expert.up_proj.weight.copy_(ref.experts.gate_up_proj[e, F_:])
            expert.down_proj.weight.copy_(ref.experts.down_proj[e])
        new.shared_expert, new.shared_expert_gate = ref.shared_expert, ref.shared_expert_gate
        new.train(ref.training)
        return new

    def forward(self, x_BSH: torch.Tensor) -> torch.Tensor:
        B, S, H = x_BSH.shape
        out_BSH, _, _ = self.moe(x_BSH)
        route = self._route()
        if self.shared_expert is not None:
            assert self.shared_expert_gate is not None  # the reference MoE has both or neither
            x_TH = x_BSH.reshape(B * S, H)
            shared_TH = torch.sigmoid(self.shared_expert_gate(x_TH)) * self.shared_expert(x_TH)
            out_BSH = out_BSH + shared_TH.reshape(B, S, H)
        self.last_route = route
        self.last_losses = {"aux": load_balancing_loss(route.probs_TE, route.topk_idx_TK),
                            "z": router_z_loss(route.logits_TE)}
        return out_BSH

    def _route(self) -> CapacityRouterOutput:
        """Our :class:`RouterOutput` view of the gate's last call (``sparse_routes`` layout:
        ``indices [K, T]`` with -1 for dropped copies, ``gates [K, T]``). Reads nothing on the
        host: the capacity stays the gate's tensor (DeepSpeed's gating itself reads it, to size
        its capacity buffers)."""
        logits_TE, gate_out = self.gate.last_logits_TE, self.gate.last_gate_out
        assert logits_TE is not None and gate_out is not None  # set by the gate's forward
        l_aux, capacity, _, idx_KT, _, gates_KT, _ = gate_out
        probs_TE = logits_TE.softmax(dim=-1)
        topk_idx_TK = _gate_choices(logits_TE, probs_TE, self.num_experts_per_tok)
        return CapacityRouterOutput(logits_TE, probs_TE, topk_idx_TK, gates_KT.t(), kept_TK=idx_KT.t() >= 0,
                                    capacity_t=capacity, ds_l_aux=l_aux.detach())


def _gate_choices(logits_TE: torch.Tensor, probs_TE: torch.Tensor, k: int) -> torch.Tensor:
    """The experts DeepSpeed's gating functions choose, before capacity dropping, as ``(T, K)``
    (``argmax`` for k=1, ``argmax`` twice for k=2, ``topk`` for k>2: the same as the reference
    router's ``topk`` except for exact ties)."""
    if k > 2:
        return probs_TE.topk(k, dim=-1).indices
    first_T = probs_TE.argmax(dim=-1)
    if k == 1:
        return first_T[:, None]
    masked_TE = logits_TE.masked_fill(F.one_hot(first_T, logits_TE.shape[-1]).bool(), float("-inf"))
    return torch.stack([first_T, masked_TE.argmax(dim=-1)], dim=-1)


def convert_to_deepspeed_moe(model: nn.Module, cfg, use_data_before_expert_parallel: bool = False) -> int:
    """Replace every reference :class:`MoE` in ``model.layers[i].mlp`` by a :class:`DeepSpeedMoE`
    built from the same weights (this rank's experts only). Returns the number of layers converted.

    Must run on every rank before ``deepspeed.initialize`` (the engine then binds the expert
    groups via ``set_deepspeed_parallelism``). Raises RuntimeError as :func:`expert_parallel_rank`.
    """
    ep_rank = expert_parallel_rank(cfg.moe_runtime.ep_size, use_data_before_expert_parallel)
    n = 0
    for _, block in moe_blocks(model):
        if isinstance(block.mlp, MoE):
            block.mlp = DeepSpeedMoE.from_reference(block.mlp, cfg.moe, cfg.moe_runtime, ep_rank)
            n += 1
    return n
