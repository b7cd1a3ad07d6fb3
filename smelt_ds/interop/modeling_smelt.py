# STANDALONE FILE: imports only torch, transformers and the Python standard library (never smelt_ds).
# It is copied next to config.json into a Hugging Face model directory and loaded as remote code:
#     AutoModelForCausalLM.from_pretrained(OUT, trust_remote_code=True)
# Its config comes from the sibling file (`from .configuration_smelt import SmeltConfig`), the way
# transformers imports remote code. smelt_ds.interop.smelt_format writes the directory.
"""SmeltForCausalLM: a looped SMELT MoE decoder as a transformers ``PreTrainedModel``.

Token embedding -> the visit plan over the unique layers -> final RMSNorm -> output head. A unique
layer visited twice runs twice with the same weights; every visit keeps its **own KV-cache slot**
(slot index = position of the visit in ``config.visit_plan``), so the cache has
``len(visit_plan)`` layer slots, not ``num_hidden_layers``.

Weights are named as smelt-ds's ``SmeltLM`` with a ``model.`` prefix (``model.embed_tokens.weight``,
``model.layers.{i}.self_attn.q_proj.weight``, ``model.layers.{i}.mlp.experts.gate_up_proj`` ...,
``model.norm.weight``) plus ``lm_head.weight``.

Shape legend: B batch, S new tokens, P cached (past) tokens, H hidden, V vocabulary, Nq query heads,
Nkv key/value heads, D head size, T = B*S tokens, E experts, K top-k, N = T*K routed token copies,
F expert intermediate size.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers import initialization as init
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.modeling_utils import slice_logits_to_keep
from transformers.utils import can_return_tuple
from transformers.utils.deprecation import deprecate_kwarg

from .configuration_smelt import SmeltConfig

__all__ = ["SmeltConfig", "SmeltPreTrainedModel", "SmeltModel", "SmeltForCausalLM"]


# ---------------------------------------------------------------------------------------------
# norms, RoPE, attention
# ---------------------------------------------------------------------------------------------


class SmeltRMSNorm(nn.Module):
    """RMSNorm ``x / rms(x) * weight`` over the last dim, computed in fp32."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * self.weight.float()).to(x.dtype)


def resolved_head_dim(config: SmeltConfig) -> int:
    """``head_dim``, or ``hidden_size // num_attention_heads`` when unset."""
    return int(config.head_dim or config.hidden_size // config.num_attention_heads)


def rope_cos_sin(position_ids: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE tables, half-split convention: integer positions ``(B, S)`` -> ``cos, sin`` ``(B, S, D)`` fp32.

    The angles are computed in float64 and rounded once, so every position gets the same table
    entry whatever the batch or cache length.
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64, device=position_ids.device)
                                / head_dim))
    freqs = position_ids.to(torch.float64)[..., None] * inv_freq
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().float(), emb.sin().float()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x_BNSD: torch.Tensor, cos_BSD: torch.Tensor, sin_BSD: torch.Tensor) -> torch.Tensor:
    """Rotate queries or keys ``(B, N, S, D)`` by ``(B or 1, S, D)`` tables."""
    cos, sin = cos_BSD[:, None].to(x_BNSD.dtype), sin_BSD[:, None].to(x_BNSD.dtype)
    return (x_BNSD * cos) + (_rotate_half(x_BNSD) * sin)


class SmeltAttention(nn.Module):
    """Causal GQA self-attention with RoPE through ``F.scaled_dot_product_attention``.

    ``forward(x, cos, sin, mask, cache, slot)``: ``x`` ``(B, S, H)`` -> ``(B, S, H)``. ``mask``: None for
    plain causal attention over ``P`` cached + ``S`` new tokens, else a boolean ``(B, 1, S, P+S)`` mask
    (True = attend). ``cache.update`` stores the keys/values of this visit in layer slot ``slot``.
    """

    def __init__(self, config: SmeltConfig):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = int(config.num_key_value_heads or self.num_heads)
        self.head_dim = resolved_head_dim(config)
        H = config.hidden_size
        self.q_proj = nn.Linear(H, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(H, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(H, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, H, bias=False)
        self.q_norm: SmeltRMSNorm | None = None
        self.k_norm: SmeltRMSNorm | None = None
        if config.qk_norm:  # Qwen3: per-head RMSNorm(head_dim) on q and k before RoPE
            self.q_norm = SmeltRMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = SmeltRMSNorm(self.head_dim, config.rms_norm_eps)

    def forward(self, x_BSH: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | None,
                cache: Cache | None, slot: int) -> torch.Tensor:
        B, S, _ = x_BSH.shape
        q = self.q_proj(x_BSH).view(B, S, self.num_heads, self.head_dim)
        k = self.k_proj(x_BSH).view(B, S, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x_BSH).view(B, S, self.num_kv_heads, self.head_dim).transpose(1, 2)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q.transpose(1, 2), cos, sin), apply_rotary(k.transpose(1, 2), cos, sin)
        if cache is not None:
            k, v = cache.update(k, v, slot)
        groups = self.num_heads // self.num_kv_heads
        if groups > 1:
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        P = k.shape[2] - S
        if mask is not None:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        elif P == 0:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:  # query i (position P+i) sees keys 0..P+i
            causal = torch.ones(S, P + S, dtype=torch.bool, device=q.device).tril(diagonal=P)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=causal)
        return self.o_proj(out.transpose(1, 2).reshape(B, S, self.num_heads * self.head_dim))


def padding_causal_mask(attention_mask_BK: torch.Tensor, S: int) -> torch.Tensor:
    """Boolean ``(B, 1, S, K)`` mask (True = attend) of S new tokens after ``K - S`` cached ones from a 2-D
    padding mask ``(B, K)`` (1 = real token, 0 = padding): query i (cache position K-S+i) sees the real
    keys at positions <= its own, and always itself, so that a padding query row is never empty (SDPA of
    torch < 2.5 gives NaN for an empty row, which would reach real tokens through ``0 * NaN``)."""
    B, K = attention_mask_BK.shape
    q_pos = torch.arange(K - S, K, device=attention_mask_BK.device)[:, None]
    k_pos = torch.arange(K, device=attention_mask_BK.device)[None, :]
    allowed = (k_pos <= q_pos)[None] & attention_mask_BK.bool()[:, None, :]
    allowed = allowed | (k_pos == q_pos)[None]
    return allowed[:, None]


# ---------------------------------------------------------------------------------------------
# FFNs: dense SwiGLU, router, experts, MoE
# ---------------------------------------------------------------------------------------------


class SmeltMLP(nn.Module):
    """Dense SwiGLU ``down(silu(gate(x)) * up(x))``: ``(..., H)`` -> ``(..., H)``."""

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class SmeltTopKRouter(nn.Module):
    """Softmax or sigmoid top-k router: ``x_TH`` -> ``(topk_idx_TK int64, topk_weight_TK)``.

    With ``aux_loss_free_bias`` the buffer ``expert_bias`` ``[E]`` is added to the scores for the
    selection only; the combine weights are the unbiased scores (renormalised to sum 1 with
    ``norm_topk_prob``). Ties between exactly equal selection scores go to the lowest expert index
    (a stable descending sort), deterministically on every device.
    """

    expert_bias: torch.Tensor

    def __init__(self, config: SmeltConfig):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(config.num_experts, config.hidden_size))
        self.top_k, self.scoring_func = config.num_experts_per_tok, config.scoring_func
        self.norm_topk_prob, self.use_bias = config.norm_topk_prob, config.aux_loss_free_bias
        if self.use_bias:
            self.register_buffer("expert_bias", torch.zeros(config.num_experts))

    def forward(self, x_TH: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits_TE = F.linear(x_TH, self.weight).float()
        scores_TE = logits_TE.softmax(dim=-1) if self.scoring_func == "softmax" else logits_TE.sigmoid()
        select_TE = scores_TE + self.expert_bias if self.use_bias else scores_TE
        topk_idx_TK = select_TE.sort(dim=-1, descending=True, stable=True).indices[..., :self.top_k]
        weight_TK = scores_TE.gather(-1, topk_idx_TK)
        if self.norm_topk_prob:
            weight_TK = weight_TK / weight_TK.sum(dim=-1, keepdim=True)
        return topk_idx_TK, weight_TK.to(x_TH.dtype)


class SmeltExperts(nn.Module):
    """E SwiGLU experts as two 3-D tensors: ``gate_up_proj`` ``[E, 2F, H]``, ``down_proj`` ``[E, H, F]``.

    ``forward(x_NH, counts_E)``: rows sorted by expert, ``counts_E`` rows per expert -> ``(N, H)``.
    One grouped GEMM (``torch._grouped_mm``) where it runs, else one matmul per expert.
    """

    def __init__(self, config: SmeltConfig):
        super().__init__()
        E, H, Fi = config.num_experts, config.hidden_size, config.moe_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(E, 2 * Fi, H))
        self.down_proj = nn.Parameter(torch.empty(E, H, Fi))

    def _grouped_mm_runs(self, x_NH: torch.Tensor) -> bool:
        if not hasattr(torch, "_grouped_mm") or x_NH.dtype != self.gate_up_proj.dtype:
            return False
        size = x_NH.element_size()
        if (self.gate_up_proj.shape[-1] * size) % 16 or (self.down_proj.shape[-1] * size) % 16:
            return False  # row strides must be multiples of 16 bytes
        if x_NH.device.type == "cpu":
            return True
        if x_NH.device.type == "cuda":
            return x_NH.dtype == torch.bfloat16 and torch.cuda.get_device_capability(x_NH.device) >= (9, 0)
        return False

    def forward(self, x_NH: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
        if self._grouped_mm_runs(x_NH):
            offs_E = torch.cumsum(counts_E, dim=0).to(torch.int32)
            gate_NF, up_NF = torch._grouped_mm(x_NH, self.gate_up_proj.transpose(-2, -1), offs=offs_E).chunk(2, -1)
            return torch._grouped_mm(F.silu(gate_NF) * up_NF, self.down_proj.transpose(-2, -1), offs=offs_E)
        outs = []
        for x_nH, w_2FH, w_HF in zip(torch.split(x_NH, counts_E.tolist(), dim=0),
                                     self.gate_up_proj.unbind(0), self.down_proj.unbind(0), strict=True):
            gate_nF, up_nF = F.linear(x_nH, w_2FH).chunk(2, dim=-1)
            outs.append(F.linear(F.silu(gate_nF) * up_nF, w_HF))
        return torch.cat(outs, dim=0)


class SmeltMoE(nn.Module):
    """Routed experts (+ optional shared expert with a sigmoid gate): ``(B, S, H)`` -> ``(B, S, H)``.

    Stages: route (top-k) -> dispatch (stable sort of the N token copies by expert) -> experts ->
    combine (weighted ``index_add`` back to the tokens).
    """

    def __init__(self, config: SmeltConfig):
        super().__init__()
        self.num_experts = config.num_experts
        self.gate = SmeltTopKRouter(config)
        self.experts = SmeltExperts(config)
        shared = config.shared_expert_intermediate_size
        self.shared_expert = SmeltMLP(config.hidden_size, shared) if shared else None
        self.shared_expert_gate = nn.Linear(config.hidden_size, 1, bias=False) if shared else None

    def forward(self, x_BSH: torch.Tensor) -> torch.Tensor:
        B, S, H = x_BSH.shape
        x_TH = x_BSH.reshape(B * S, H)
        topk_idx_TK, weight_TK = self.gate(x_TH)
        flat_N = topk_idx_TK.reshape(-1)
        order_N = torch.argsort(flat_N, stable=True)
        counts_E = torch.bincount(flat_N, minlength=self.num_experts)
        token_N = order_N // topk_idx_TK.shape[1]
        y_NH = self.experts(x_TH[token_N], counts_E)
        weight_N = weight_TK.reshape(-1)[order_N]
        out_TH = torch.zeros_like(x_TH).index_add(0, token_N, y_NH * weight_N.unsqueeze(-1).to(y_NH.dtype))
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            out_TH = out_TH + torch.sigmoid(self.shared_expert_gate(x_TH)) * self.shared_expert(x_TH)
        return out_TH.reshape(B, S, H)


class SmeltDecoderLayer(nn.Module):
    """Pre-norm unique layer: ``x + attn(norm(x))`` then ``x + mlp(norm(x))``; ``mlp`` is dense for the
    first ``first_k_dense_replace`` layers, MoE after. Called once per visit."""

    def __init__(self, config: SmeltConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.input_layernorm = SmeltRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = SmeltAttention(config)
        self.post_attention_layernorm = SmeltRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp: nn.Module
        if layer_idx < config.first_k_dense_replace:
            self.mlp = SmeltMLP(config.hidden_size, config.intermediate_size)
        else:
            self.mlp = SmeltMoE(config)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | None,
                cache: Cache | None, slot: int) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, cache, slot)
        return x + self.mlp(self.post_attention_layernorm(x))


# ---------------------------------------------------------------------------------------------
# models
# ---------------------------------------------------------------------------------------------


class SmeltPreTrainedModel(PreTrainedModel):
    config_class = SmeltConfig
    config: SmeltConfig
    base_model_prefix = "model"
    _no_split_modules = ["SmeltDecoderLayer"]
    _supports_sdpa = True

    @classmethod
    def from_pretrained(cls, *args, **kwargs):
        """transformers' ``from_pretrained``, but a checkpoint whose weights do not fit its config.json
        (missing, unexpected or mismatched tensors: e.g. an edited ``num_hidden_layers`` or
        ``num_experts``) raises ValueError naming them, where transformers would only warn and
        initialise the missing weights at random."""
        want_info = kwargs.pop("output_loading_info", False)
        model, info = super().from_pretrained(*args, output_loading_info=True, **kwargs)
        bad = {k: sorted(info[k])[:4] for k in ("missing_keys", "unexpected_keys", "mismatched_keys") if info.get(k)}
        if bad:
            where = args[0] if args else kwargs.get("pretrained_model_name_or_path", "the checkpoint")
            raise ValueError(f"{where}: the weights do not fit config.json ({bad}): config.json must describe the "
                             "model the weights were saved from (num_hidden_layers, num_experts, sizes); restore it "
                             "or export the model again")
        return (model, info) if want_info else model

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        super()._init_weights(module)  # Linear, Embedding: normal(initializer_range); RMSNorm: ones
        std = self.config.initializer_range
        if isinstance(module, SmeltExperts):
            init.normal_(module.gate_up_proj, mean=0.0, std=std)
            init.normal_(module.down_proj, mean=0.0, std=std)
        elif isinstance(module, SmeltTopKRouter):
            init.normal_(module.weight, mean=0.0, std=std)
            if module.use_bias:
                init.zeros_(module.expert_bias)


class SmeltModel(SmeltPreTrainedModel):
    """Embedding, the visit plan over ``num_hidden_layers`` unique layers, final norm.

    ``forward(input_ids (B, S), attention_mask (B, P+S), position_ids (B|1, S), cache, inputs_embeds,
    use_cache)`` -> ``BaseModelOutputWithPast(last_hidden_state (B, S, H), cache, hidden_states)``;
    with ``output_hidden_states`` the hidden states are the embeddings and the residual stream after
    every visit (``1 + len(visit_plan)`` tensors).
    """

    def __init__(self, config: SmeltConfig):
        super().__init__(config)
        self.embed_tokens: nn.Module = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(SmeltDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = SmeltRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.visit_plan: list[tuple[int, int]] = [(int(layer), int(visit)) for layer, visit in config.visit_plan or []]
        ranges = config.loop_ranges or []
        starts = {int(r[0]) for r in ranges} if config.input_injection == "add" else set()
        self.head_dim = resolved_head_dim(config)
        self.rope_theta = float((config.rope_parameters or {}).get("rope_theta", 10000.0))
        # per visit: "store" the stream entering a range at its first visit, "add" it before a later visit
        self.injection = ["store" if layer in starts and visit == 0 else "add" if layer in starts else ""
                          for layer, visit in self.visit_plan]
        self.post_init()

    def get_input_embeddings(self) -> nn.Module:
        return self.embed_tokens

    def set_input_embeddings(self, value: nn.Module) -> None:
        self.embed_tokens = value

    def new_cache(self, offloading: bool = False) -> DynamicCache:
        """An empty ``DynamicCache`` with one layer slot per visit (``len(visit_plan)`` slots)."""
        return DynamicCache(ddp_cache_data=[(None, None)] * len(self.visit_plan), offloading=offloading)

    def _checked_cache(self, cache: Cache) -> Cache:
        """``cache`` with one slot per visit. A cache built from the config (``num_hidden_layers`` empty
        dynamic slots) gets the missing slots; any other slot count is refused."""
        n = len(self.visit_plan)
        if cache.layer_class_to_replicate is not None or len(cache) == n:
            return cache
        if (isinstance(cache, DynamicCache) and len(cache) < n and cache.get_seq_length() == 0
                and all(type(layer) is DynamicLayer for layer in cache.layers)):
            cache.layers.extend(DynamicLayer() for _ in range(n - len(cache)))
            return cache
        raise ValueError(f"the KV cache has {len(cache)} layer slots but this SMELT model runs {n} visits per forward "
                         f"(visit_plan of {self.config.num_hidden_layers} unique layers) and keeps one slot per "
                         "visit: pass model.model.new_cache() or DynamicCache() (it grows one slot per visit)")

    @can_return_tuple
    @deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        output_hidden_states: bool | None = None,
        output_attentions: bool | None = None,
        **kwargs,
    ) -> BaseModelOutputWithPast:
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids or inputs_embeds")
        if output_attentions:
            raise ValueError("SmeltModel does not return attention probabilities (SDPA): leave output_attentions off")
        use_cache = self.config.use_cache if use_cache is None else use_cache
        output_hidden_states = (self.config.output_hidden_states if output_hidden_states is None
                                else output_hidden_states)
        x = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        B, S, _ = x.shape
        if use_cache and cache is None:
            cache = self.new_cache()
        if cache is not None:
            cache = self._checked_cache(cache)
        past = cache.get_seq_length() if cache is not None else 0
        positions = torch.arange(past, past + S, device=x.device)[None] if position_ids is None else position_ids
        cos, sin = rope_cos_sin(positions, self.head_dim, self.rope_theta)
        mask = self._mask(attention_mask, B, S, past)
        hidden = [x] if output_hidden_states else None
        x = self._run_visits(x, cos, sin, mask, cache, hidden)
        x = self.norm(x)
        return BaseModelOutputWithPast(last_hidden_state=x, cache=cache if use_cache else None,
                                       hidden_states=tuple(hidden) if hidden is not None else None)

    def _run_visits(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | None,
                    cache: Cache | None, hidden: list[torch.Tensor] | None) -> torch.Tensor:
        """Every visit of the plan in order; visit ``slot`` writes KV-cache slot ``slot``."""
        block_input: dict[int, torch.Tensor] = {}
        for slot, ((layer, _), inject) in enumerate(zip(self.visit_plan, self.injection, strict=True)):
            if inject == "store":
                block_input[layer] = x
            elif inject == "add":
                x = x + block_input[layer]
            x = self.layers[layer](x, cos, sin, mask, cache, slot)
            if hidden is not None:
                hidden.append(x)
        return x

    @staticmethod
    def _mask(attention_mask: torch.Tensor | None, B: int, S: int, past: int) -> torch.Tensor | None:
        """None (plain causal attention) without padding, else the boolean ``(B, 1, S, P+S)`` mask."""
        if attention_mask is None:
            return None
        if attention_mask.dim() == 4:  # already expanded by the caller
            return attention_mask if attention_mask.dtype == torch.bool else attention_mask == 0
        if attention_mask.shape != (B, past + S):
            raise ValueError(f"attention_mask has shape {tuple(attention_mask.shape)}; expected (batch, cached + new "
                             f"tokens) = ({B}, {past + S})")
        if bool(attention_mask.bool().all()):
            return None
        return padding_causal_mask(attention_mask, S)


class SmeltForCausalLM(SmeltPreTrainedModel, GenerationMixin):
    """SMELT decoder with its output head; ``generate`` uses a KV cache with one slot per visit.

    ``forward(input_ids, attention_mask, position_ids, cache, inputs_embeds, labels, use_cache,
    logits_to_keep)`` -> ``CausalLMOutputWithPast(loss, logits (B, S', V), cache)``; ``labels`` ``(B, S)``
    are the input ids themselves (shifted inside, -100 = ignore), ``loss`` the mean next-token
    cross-entropy (nats/token); ``logits_to_keep``: 0 = every position, n = the last n.
    """

    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: SmeltConfig):
        super().__init__(config)
        self.model = SmeltModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_output_embeddings(self) -> nn.Module:
        return self.lm_head

    def set_output_embeddings(self, new_embeddings: nn.Module) -> None:
        self.lm_head = new_embeddings

    @can_return_tuple
    @deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        **kwargs,
    ) -> CausalLMOutputWithPast:
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, cache=cache,
                         inputs_embeds=inputs_embeds, use_cache=use_cache,
                         output_hidden_states=kwargs.pop("output_hidden_states", None),
                         output_attentions=kwargs.pop("output_attentions", None))
        logits = self.lm_head(slice_logits_to_keep(out.last_hidden_state, logits_to_keep))
        loss = None
        if labels is not None:
            loss = self.loss_function(logits, labels, self.vocab_size, **kwargs)
        return CausalLMOutputWithPast(loss=loss, logits=logits, cache=out.cache, hidden_states=out.hidden_states)

    def _prepare_cache_for_generation(self, generation_config, model_kwargs, *args, **kwargs):
        """GenerationMixin's cache, with one layer slot per visit: the default ``DynamicCache`` built from
        the config has ``num_hidden_layers`` slots, which would hold only one visit of each looped layer."""
        impl = generation_config.cache_implementation
        if (model_kwargs.get("cache") is None and generation_config.use_cache is not False
                and impl not in (None, "dynamic", "offloaded")):
            raise ValueError(f"generation_config.cache_implementation {impl!r} is not supported by SmeltForCausalLM: "
                             "use the default dynamic cache (or 'offloaded'), which keeps one slot per visit")
        super()._prepare_cache_for_generation(generation_config, model_kwargs, *args, **kwargs)
        cache = model_kwargs.get("cache")
        if isinstance(cache, DynamicCache) and not getattr(cache, "_is_user_defined", False):
            model_kwargs["cache"] = self.model.new_cache(offloading=cache.offloading)
