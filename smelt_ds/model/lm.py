"""SmeltLM: token embedding -> visit plan over unique layers -> final RMSNorm -> output head.

Pure PyTorch: DeepSpeed is applied from outside (``smelt_ds.parallel.engine``). A Baseline is a SmeltLM
whose loop position is ``none``.

Shape legend: B batch, S sequence (tokens), H hidden, V vocabulary, E experts, K top-k.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypedDict

import torch
import torch.nn.functional as F
from torch import nn

from smelt_ds.config.schedule import build_schedule
from smelt_ds.model.attention import AttnProbsHook, CausalSelfAttention, KVCache, RMSNorm, RotaryEmbedding
from smelt_ds.model.experts import SwiGLU
from smelt_ds.model.looping import LoopingBlockManager, Visit, VisitContext
from smelt_ds.model.moe import MoE
from smelt_ds.model.router import RouterOutput

if TYPE_CHECKING:
    from smelt_ds.config.loop import LoopConfig
    from smelt_ds.config.model import ModelConfig
    from smelt_ds.config.moe import MoEConfig

__all__ = ["Block", "VisitRecorder", "LMOutput", "SmeltLM", "routing_divergence"]


def routing_divergence(topk_a_TK: torch.Tensor, topk_b_TK: torch.Tensor) -> float:
    """Share of tokens whose top-k expert *set* differs between two visits (0 = identical routing).

    Inputs: ``(T, K)`` expert indices of the same T tokens on two visits of one layer
    (arXiv 2605.09165 credits this divergence for looped MoE scaling better than looped dense).
    """
    a, _ = topk_a_TK.sort(dim=-1)
    b, _ = topk_b_TK.sort(dim=-1)
    return (a != b).any(dim=-1).float().mean().item()


class RouterStats(TypedDict):
    """One visit's entry of :meth:`VisitRecorder.router_stats`."""

    load_max_over_mean: float
    dropped_share: float
    tokens_per_expert: list[int]


@dataclass
class VisitRecorder:
    """Per-visit MoE record of one forward pass, keyed by ``(layer, visit)``.

    Slots are overwritten, never accumulated: recomputation under activation checkpointing
    writes the same values again, so losses and statistics are not counted twice.
    """

    routes: dict[Visit, RouterOutput] = field(default_factory=dict)
    losses: dict[Visit, dict[str, torch.Tensor]] = field(default_factory=dict)

    def clear(self) -> None:
        self.routes.clear()
        self.losses.clear()

    def record(self, visit: Visit, route: RouterOutput | None, losses: dict[str, torch.Tensor]) -> None:
        if route is not None:
            self.routes[visit] = route
        if losses:
            self.losses[visit] = losses

    def mean_loss(self, name: str) -> torch.Tensor | None:
        """Mean of loss ``name`` over MoE *visits* (not unique layers); None without MoE visits."""
        vals = [d[name] for d in self.losses.values() if name in d]
        return torch.stack(vals).mean() if vals else None

    def router_stats(self) -> dict[Visit, RouterStats]:
        """Per visit: ``load_max_over_mean`` (max tokens per expert / mean), ``dropped_share`` (share of
        routed token copies dropped by a capacity limit; 0 for dropless backends) and
        ``tokens_per_expert`` (list of ints)."""
        out: dict[Visit, RouterStats] = {}
        for visit, r in sorted(self.routes.items()):
            counts = torch.bincount(r.topk_idx_TK.reshape(-1), minlength=r.logits_TE.shape[-1]).float()
            out[visit] = {"load_max_over_mean": (counts.max() / counts.mean()).item(),
                          "dropped_share": float(getattr(r, "dropped_share", 0.0)),
                          "tokens_per_expert": counts.long().tolist()}
        return out

    def divergence(self) -> dict[tuple[int, int, int], float]:
        """Routing divergence ``{(layer, visit_a, visit_b): share}`` for consecutive visits."""
        out = {}
        for visit, r in self.routes.items():
            nxt = Visit(visit.layer, visit.visit + 1)
            if nxt in self.routes:
                out[(visit.layer, visit.visit, nxt.visit)] = routing_divergence(r.topk_idx_TK,
                                                                                self.routes[nxt].topk_idx_TK)
        return dict(sorted(out.items()))


class Block(nn.Module):
    """Pre-norm decoder layer: ``x + attn(norm(x))`` then ``x + mlp(norm(x))``; the ``mlp`` slot
    holds a :class:`MoE` or a dense :class:`SwiGLU`. Layers do not know they are looped.

    Regional compilation (:meth:`compile_layer`, ``train.compile: layers``): a training or
    validation visit (no KV cache, no attention-probability hook) runs :meth:`compute`, a pure
    function of ``(x, cos, sin, count_tokens)`` whose outputs carry the route and the MoE losses;
    the visit's identity stays outside, in :meth:`forward`, which records them under
    ``(layer, visit)``. One compiled artifact per unique layer structure therefore serves every
    visit and every layer of that structure (parameters are graph inputs), with no recompilation
    per visit. A backend's MoE layer (DeepSpeed-MoE, AutoEP: all-to-all collectives) stays eager;
    only the attention half around it is compiled (as DeepSpeed's ``compile.autoep_non_moe``).
    """

    def __init__(self, model_cfg: ModelConfig, moe_cfg: MoEConfig, layer_idx: int):
        """``model_cfg``: a :class:`smelt_ds.config.model.ModelConfig`; ``moe_cfg``: a
        :class:`smelt_ds.config.moe.MoEConfig` (used when ``layer_idx >= model_cfg.first_k_dense``)."""
        m, moe = model_cfg, moe_cfg
        super().__init__()
        self.layer_idx = layer_idx
        self.input_layernorm = RMSNorm(m.hidden_size, m.norm_eps)
        self.self_attn = CausalSelfAttention(m.hidden_size, m.num_heads, m.num_kv_heads, m.resolved_head_dim,
                                             m.dropout, m.qk_norm, m.norm_eps)
        self.post_attention_layernorm = RMSNorm(m.hidden_size, m.norm_eps)
        self.is_moe = layer_idx >= m.first_k_dense
        self.mlp = MoE.from_config(m.hidden_size, moe) if self.is_moe else SwiGLU(m.hidden_size, m.dense_ffn_size)
        self.dropout = m.dropout
        self._compiled: dict[str, Callable[..., Any]] = {}  # "compute", "attention": torch.compile'd methods

    # -- compilation --------------------------------------------------------------------------
    def compile_layer(self, backend: str | Callable[..., Any] = "inductor", fullgraph: bool = True,
                      **options: Any) -> None:
        """Compile :meth:`compute` and :meth:`attention` with ``torch.compile(backend=backend,
        fullgraph=fullgraph, **options)`` (lazily: the first visit traces). ``fullgraph=False``
        lets the graph break where DeepSpeed's ZeRO-3 hooks (excluded from compilation) gather a
        submodule's parameters. The unbound methods are
        compiled and called with the layer as first argument, so a ``copy.deepcopy`` of the model
        runs its own weights through them."""
        self._compiled = {name: torch.compile(fn, backend=backend, fullgraph=fullgraph, **options)
                          for name, fn in (("compute", Block.compute), ("attention", Block.attention))}

    # -- forward ------------------------------------------------------------------------------
    def attention(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, visit: Visit | None = None,
                  kv_cache: KVCache | None = None, probs_hook: AttnProbsHook | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        """The attention half: ``x`` ``(B, S, H)`` -> ``(x + attn(norm(x)), post_norm(that))``, both
        ``(B, S, H)``; ``visit`` names the KV-cache slot and the hook's key (needed only with
        ``kv_cache`` or ``probs_hook``)."""
        a = self.self_attn(self.input_layernorm(x), cos, sin, visit, kv_cache, probs_hook)
        x = x + F.dropout(a, self.dropout, self.training)
        return x, self.post_attention_layernorm(x)

    def compute(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, count_tokens: bool
                ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...] | None, dict[str, torch.Tensor]]:
        """One visit without KV cache or hook, as a pure function: ``x`` ``(B, S, H)`` ->
        ``(y (B, S, H), route, losses)``. ``route`` is the reference MoE's
        ``(logits_TE, probs_TE, topk_idx_TK, topk_weight_TK)`` (None for a dense layer), ``losses``
        its unscaled ``{"aux", "z"}`` (empty for a dense layer). ``count_tokens``: see
        :meth:`smelt_ds.model.router.TopKRouter.forward`. Needs a reference ``mlp`` (:class:`MoE` or
        :class:`SwiGLU`); a backend's MoE layer runs through :meth:`forward`."""
        x, h = self.attention(x, cos, sin)
        route: tuple[torch.Tensor, ...] | None = None
        losses: dict[str, torch.Tensor] = {}
        if isinstance(self.mlp, MoE):
            # count_tokens only matters with the expert bias; not reading it otherwise keeps a
            # checkpoint's recompute (count_tokens False) on the forward's compiled graph
            h, route, losses = self.mlp(h, count_tokens=self.mlp.gate.use_bias and count_tokens, return_route=True)
        else:
            h = self.mlp(h)
        return x + F.dropout(h, self.dropout, self.training), route, losses

    def forward(self, x: torch.Tensor, ctx: VisitContext) -> torch.Tensor:
        """``x``: ``(B, S, H)`` -> ``(B, S, H)``; ``ctx``: the visit's
        :class:`smelt_ds.model.looping.VisitContext`."""
        plain = ctx.kv_cache is None and ctx.probs_hook is None  # compiled (when compiled) and pure
        if plain and isinstance(self.mlp, (MoE, SwiGLU)):
            compute = self._compiled.get("compute", Block.compute)
            y, route, losses = compute(self, x, ctx.cos, ctx.sin, ctx.counts_tokens)
            if ctx.recorder is not None and route is not None:
                ctx.recorder.record(ctx.visit, RouterOutput(*route), losses)
            return y
        attention = self._compiled.get("attention", Block.attention) if plain else Block.attention
        x, h = attention(self, x, ctx.cos, ctx.sin, *(() if plain else (ctx.visit, ctx.kv_cache, ctx.probs_hook)))
        if isinstance(self.mlp, MoE):  # the reference MoE: its router counts tokens once per forward
            h = self.mlp(h, count_tokens=ctx.counts_tokens)
        else:  # dense SwiGLU, or a backend's replacement (DeepSpeedMoE, AutoEP layer): forward(x)
            h = self.mlp(h)
        if ctx.recorder is not None and self.is_moe:  # any MoE backend's FFN (reference, deepspeed, autoep)
            mlp: Any = self.mlp  # MoE or a backend's replacement (DeepSpeedMoE, AutoEP layer)
            ctx.recorder.record(ctx.visit, mlp.last_route, mlp.last_losses)
        return x + F.dropout(h, self.dropout, self.training)


@dataclass
class LMOutput:
    """Result of :meth:`SmeltLM.forward`. Losses are unweighted scalars (None without labels):
    ``lm_loss`` is the next-token cross-entropy (nats/token), ``aux_loss`` / ``z_loss`` the
    load-balancing and router z-losses, means over MoE visits (None without MoE layers). The
    training objective weights them: :func:`smelt_ds.train.objective.total_loss`."""

    logits: torch.Tensor  # (B, S, V)
    lm_loss: torch.Tensor | None = None
    aux_loss: torch.Tensor | None = None
    z_loss: torch.Tensor | None = None


class SmeltLM(nn.Module):
    """A SMELT or Baseline decoder built from its architecture only: ``SmeltLM(model_cfg, moe_cfg,
    loop_cfg)`` with the ``model``, ``moe`` and ``loop`` sections of a recipe
    (:class:`smelt_ds.config.model.ModelConfig`, ``MoEConfig``, ``LoopConfig``). How the MoE runs
    (``moe_runtime``) and the loss coefficients (``train``) are applied from outside.

    Attributes:
        model_cfg, moe_cfg, loop_cfg: the three sections it was built from.
        schedule: the :class:`LoopSchedule` (visit plan).
        blocks: the :class:`LoopingBlockManager` over ``layers`` (unique layers).
        recorder: the :class:`VisitRecorder` of the last forward pass.
    """

    def __init__(self, model_cfg: ModelConfig, moe_cfg: MoEConfig, loop_cfg: LoopConfig):
        super().__init__()
        self.model_cfg, self.moe_cfg, self.loop_cfg = model_cfg, moe_cfg, loop_cfg
        m = model_cfg
        self.schedule = build_schedule(loop_cfg, m.num_layers)
        self.embed_tokens = nn.Embedding(m.vocab_size, m.hidden_size)
        self.layers = nn.ModuleList(Block(m, moe_cfg, i) for i in range(m.num_layers))
        self.blocks = LoopingBlockManager(self.layers, self.schedule, loop_cfg.input_injection)
        self.norm = RMSNorm(m.hidden_size, m.norm_eps)
        self.lm_head = nn.Linear(m.hidden_size, m.vocab_size, bias=False)
        if m.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rotary = RotaryEmbedding(m.resolved_head_dim, m.max_seq_len, m.rope_theta)
        self.recorder = VisitRecorder()
        self._compiled_head: Callable[..., Any] | None = None
        self.reset_parameters()

    # -- parameters ---------------------------------------------------------------------------
    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Normal(0, model.init_std) for every matrix, ones for norms, zeros for the router bias."""
        std = self.model_cfg.init_std
        for name, p in self.named_parameters():
            if name.endswith(("layernorm.weight", "q_norm.weight", "k_norm.weight")) or name == "norm.weight":
                p.fill_(1.0)
            else:
                p.normal_(0.0, std)

    def embedding_parameter_names(self) -> set[str]:
        """Names of the token embedding and output head parameters (excluded from budgets)."""
        return {"embed_tokens.weight", "lm_head.weight"}

    def num_non_embedding_params(self) -> int:
        """Total non-embedding parameters (all experts counted; embedding and head excluded)."""
        skip = {id(p) for n, p in self.named_parameters() if n in self.embedding_parameter_names()}
        return sum(p.numel() for p in self.parameters() if id(p) not in skip)

    def looped_parameter_names(self) -> set[str]:
        """Names of parameters in unique layers visited more than once (shared across visits)."""
        return {n for n, _ in self.named_parameters()
                if n.startswith("layers.") and self.schedule.is_looped(int(n.split(".")[1]))}

    def set_loop(self, loop_cfg: LoopConfig) -> LoopConfig:
        """Run another visit plan with the same weights (a test-time loop count, see
        :func:`smelt_ds.config.loop.loop_with_repeats`); returns the loop section it replaced.

        Parameters are untouched (they belong to the unique layers, not to the plan); the per-visit
        KV cache of a later ``forward``/``generate`` has one slot per visit of the new plan.
        Raises ConfigError when ``loop_cfg`` is invalid for ``model.num_layers``."""
        schedule = build_schedule(loop_cfg, self.model_cfg.num_layers)
        old, self.loop_cfg = self.loop_cfg, loop_cfg
        self.schedule = schedule
        self.blocks.schedule = schedule
        self.blocks.input_injection = loop_cfg.input_injection
        return old

    # -- forward ------------------------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None,
                kv_cache: KVCache | None = None, probs_hook: AttnProbsHook | None = None,
                visit_hook: Callable[[Visit, torch.Tensor], None] | None = None) -> LMOutput:
        """``input_ids`` ``(B, S)`` int64 -> :class:`LMOutput` with logits ``(B, S, V)``.

        ``labels`` ``(B, S)`` are the next tokens (-100 = ignore). With ``kv_cache`` the tokens are
        placed after the cached ones. ``visit_hook(visit, x)`` sees the residual stream
        ``(B, S, H)`` after every visit (logit lens).
        """
        B, S = input_ids.shape
        past = kv_cache.past_length() if kv_cache is not None else 0
        cos, sin = self.rotary.span(past, S)
        self.recorder = VisitRecorder()  # a new record per forward (a compiled forward guards on none)
        x = self.embed_tokens(input_ids)
        x = self.blocks(x, visit_hook=visit_hook, cos=cos, sin=sin, kv_cache=kv_cache,
                        recorder=self.recorder, probs_hook=probs_hook)
        head = self._compiled_head or SmeltLM.head
        logits, lm_loss = head(self, x, labels)
        out = LMOutput(logits=logits, lm_loss=lm_loss)
        if labels is not None:
            out.aux_loss = self.recorder.mean_loss("aux")
            out.z_loss = self.recorder.mean_loss("z")
        return out

    def head(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Final RMSNorm, output head and next-token cross-entropy (fp32, nats/token, -100 ignored):
        ``x`` ``(B, S, H)`` -> ``(logits (B, S, V), lm_loss or None)``."""
        logits = self.lm_head(self.norm(x))
        if labels is None:
            return logits, None
        V = logits.shape[-1]
        return logits, F.cross_entropy(logits.float().reshape(-1, V), labels.reshape(-1), ignore_index=-100)

    def compile_head(self, backend: str | Callable[..., Any] = "inductor", fullgraph: bool = True) -> None:
        """Compile :meth:`head` (``torch.compile``, the unbound method, as :meth:`Block.compile_layer`):
        inductor fuses the fp32 cast, log-softmax and loss of the ``(B, S, V)`` logits."""
        self._compiled_head = torch.compile(SmeltLM.head, backend=backend, fullgraph=fullgraph)

    # -- generation ---------------------------------------------------------------------------
    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, max_new_tokens: int, temperature: float = 0.0,
                 top_p: float = 1.0, eos_token_id: int | None = None,
                 generator: torch.Generator | None = None,
                 stop: Callable[[torch.Tensor], bool] | None = None) -> torch.Tensor:
        """Decode with the per-visit KV cache. ``input_ids`` ``(B, S)`` -> ``(B, S + new)``.

        ``temperature == 0`` is greedy; otherwise sample from softmax(logits / temperature)
        restricted to the smallest set of tokens with cumulative probability >= ``top_p``.
        Decoding ends after ``max_new_tokens``, when every row has produced ``eos_token_id``, or
        when ``stop(new_ids)`` (the new tokens so far, ``(B, n)``) returns True, e.g. once every
        row holds a stop string; the tokens up to that step are the same as without ``stop``.
        Raises ValueError when the result would exceed ``model.max_seq_len``.
        """
        total = input_ids.shape[1] + max_new_tokens
        if total > self.model_cfg.max_seq_len:
            raise ValueError(f"prompt + max_new_tokens = {total} tokens > model.max_seq_len "
                             f"({self.model_cfg.max_seq_len}); shorten the prompt or lower max_new_tokens")
        was_training = self.training
        self.eval()
        cache = KVCache()
        ids = input_ids
        logits = self(ids, kv_cache=cache).logits[:, -1]
        done = torch.zeros(ids.shape[0], dtype=torch.bool, device=ids.device)
        for _ in range(max_new_tokens):
            nxt = _sample(logits, temperature, top_p, generator)
            if eos_token_id is not None:
                nxt = torch.where(done, torch.full_like(nxt, eos_token_id), nxt)
                done |= nxt == eos_token_id
            ids = torch.cat([ids, nxt[:, None]], dim=1)
            if eos_token_id is not None and bool(done.all()):
                break
            if stop is not None and stop(ids[:, input_ids.shape[1]:]):
                break
            logits = self(nxt[:, None], kv_cache=cache).logits[:, -1]
        self.train(was_training)
        return ids


def _sample(logits_BV: torch.Tensor, temperature: float, top_p: float,
            generator: torch.Generator | None) -> torch.Tensor:
    if temperature <= 0:
        return logits_BV.argmax(dim=-1)
    probs = (logits_BV.float() / temperature).softmax(dim=-1)
    if top_p < 1.0:
        sorted_p, sorted_i = probs.sort(dim=-1, descending=True)
        keep = sorted_p.cumsum(dim=-1) - sorted_p < top_p
        sorted_p = sorted_p * keep
        probs = torch.zeros_like(probs).scatter(-1, sorted_i, sorted_p)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
