# STANDALONE FILE: imports only torch, transformers and the Python standard library (never smelt_ds).
# It is copied next to config.json into a Hugging Face model directory and loaded as remote code:
#     AutoModelForCausalLM.from_pretrained(OUT, trust_remote_code=True)
# smelt_ds.interop.smelt_format writes the directory; keep this file free of package imports.
"""SmeltConfig: the transformers configuration of a looped SMELT model (``model_type: smelt``).

A SMELT model runs a contiguous range of its unique layers more than once per forward pass with
shared weights. Each execution of a layer is a *visit*; the *visit plan* is the ordered list of
``[layer, visit]`` pairs one forward pass runs. ``num_hidden_layers`` counts the **unique** layers
L; the effective depth, and the number of KV-cache slots, is ``len(visit_plan)``.

Loop keys:
    loop_ranges: ``[[start, end, repeats], ...]``, non-overlapping ranges of unique layers
        ``[start, end)`` run ``repeats`` times (empty = no loop, a Baseline).
    loop_order: ``block`` runs a range as ``start..end-1`` repeated; ``layer`` runs each layer of
        a range ``repeats`` times in a row.
    input_injection: ``add`` re-adds the residual stream that entered a range at its first visit
        before every later visit of the range's first layer (``block`` order only).
    visit_plan: derived from the three keys above; when given it must equal the derived plan.

RoPE follows transformers 5: ``rope_parameters = {"rope_type": "default", "rope_theta": ...}``
(a legacy top-level ``rope_theta`` is moved there).
"""

from __future__ import annotations

import itertools
from typing import Any

from transformers import PretrainedConfig

__all__ = ["SmeltConfig", "derive_visit_plan"]

_SCORING_FUNCS = ("softmax", "sigmoid")
_LOOP_ORDERS = ("block", "layer")
_INJECTIONS = ("none", "add")


def _bad(key: str, value: Any, rule: str, fix: str) -> ValueError:
    return ValueError(f"config.json `{key}` ({value!r}) {rule}: {fix}")


def _check_ranges(loop_ranges: Any, num_layers: int) -> list[list[int]]:
    """``loop_ranges`` as a list of ``[start, end, repeats]`` int triples, checked against L."""
    if loop_ranges is None:
        return []
    if not isinstance(loop_ranges, (list, tuple)):
        raise _bad("loop_ranges", loop_ranges, "must be a list of [start, end, repeats] triples",
                   "write e.g. [[1, 3, 2]], or [] for no loop")
    out: list[list[int]] = []
    for i, r in enumerate(loop_ranges):
        if (not isinstance(r, (list, tuple)) or len(r) != 3
                or not all(isinstance(x, int) and not isinstance(x, bool) for x in r)):
            raise _bad(f"loop_ranges[{i}]", r, "must be a [start, end, repeats] triple of ints",
                       "write e.g. [1, 3, 2] (layers 1 and 2 run twice)")
        start, end, repeats = r
        if repeats < 1:
            raise _bad(f"loop_ranges[{i}]", r, f"has repeats {repeats} < 1", "use 1 for no loop, 2 to loop twice")
        if not 0 <= start < end <= num_layers:
            raise _bad(f"loop_ranges[{i}]", r, f"is out of [0, num_hidden_layers={num_layers})",
                       f"keep 0 <= start < end <= {num_layers}")
        out.append([start, end, repeats])
    spans = sorted(out)
    for prev, cur in itertools.pairwise(spans):
        if cur[0] < prev[1]:
            raise _bad("loop_ranges", out, f"has overlapping ranges {prev} and {cur}",
                       "loop ranges must not overlap: merge them or move one")
    return out


def derive_visit_plan(num_layers: int, loop_ranges: list[list[int]], loop_order: str) -> list[list[int]]:
    """The visit plan ``[[layer, visit], ...]`` (execution order) of L unique layers and loop ranges.

    ``visit`` counts how many times ``layer`` already ran in this forward pass (0 = first). For L=8
    and the range ``[2, 6, 2]``: block order runs ``0 1 2 3 4 5 2 3 4 5 6 7``, layer order
    ``0 1 2 2 3 3 4 4 5 5 6 7``.
    """
    counts = [0] * num_layers
    plan: list[list[int]] = []

    def emit(layer: int) -> None:
        plan.append([layer, counts[layer]])
        counts[layer] += 1

    layer = 0
    for start, end, repeats in sorted(loop_ranges):
        for i in range(layer, start):
            emit(i)
        if loop_order == "block":
            for _ in range(repeats):
                for i in range(start, end):
                    emit(i)
        else:
            for i in range(start, end):
                for _ in range(repeats):
                    emit(i)
        layer = end
    for i in range(layer, num_layers):
        emit(i)
    return plan


class SmeltConfig(PretrainedConfig):
    """Configuration of :class:`SmeltForCausalLM`. Sizes in elements, lengths in tokens.

    Architecture keys (transformers names): ``vocab_size``, ``hidden_size``, ``num_hidden_layers``
    (unique layers L), ``num_attention_heads``, ``num_key_value_heads`` (GQA), ``head_dim``
    (default hidden_size / heads), ``max_position_embeddings``, ``rope_parameters``,
    ``rms_norm_eps``, ``tie_word_embeddings``, ``qk_norm`` (per-head RMSNorm on q and k before RoPE,
    as Qwen3), ``hidden_act`` (``silu`` only). FFN: the first ``first_k_dense_replace`` unique
    layers are dense SwiGLU of ``intermediate_size``; the others are MoE with ``num_experts``
    experts of ``moe_intermediate_size``, ``num_experts_per_tok`` (top-k) per token, a router
    ``scoring_func`` (softmax | sigmoid), ``norm_topk_prob`` (renormalise the top-k weights),
    ``aux_loss_free_bias`` (a per-expert bias ``mlp.gate.expert_bias`` added to the scores for
    selection only, DeepSeek-V3) and an optional shared expert of
    ``shared_expert_intermediate_size`` (0 = none) with a sigmoid gate. Loop keys: see the module
    docstring. Raises ValueError naming the config.json key, its value and the fix.
    """

    model_type = "smelt"
    keys_to_ignore_at_inference = ["cache"]

    vocab_size: int = 512
    hidden_size: int = 64
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    max_position_embeddings: int = 256
    rope_parameters: dict | None = None
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    qk_norm: bool = False
    hidden_act: str = "silu"
    initializer_range: float = 0.02
    use_cache: bool = True
    first_k_dense_replace: int = 0
    intermediate_size: int = 256
    num_experts: int = 8
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 128
    shared_expert_intermediate_size: int = 0
    scoring_func: str = "softmax"
    norm_topk_prob: bool = True
    aux_loss_free_bias: bool = False
    loop_ranges: list | None = None
    loop_order: str = "block"
    input_injection: str = "none"
    visit_plan: list | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None

    def __post_init__(self, **kwargs):
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None and self.num_attention_heads > 0:
            self.head_dim = self.hidden_size // self.num_attention_heads
        super().__post_init__(**kwargs)
        self._check_shapes()
        self._check_moe()
        self._check_loop()

    # -- validation ----------------------------------------------------------------------------
    def _check_shapes(self) -> None:
        for key in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                    "head_dim", "max_position_embeddings", "intermediate_size"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise _bad(key, value, "must be a positive integer", f"set {key} to the model's size")
        kv_heads, head_dim = int(self.num_key_value_heads or 0), int(self.head_dim or 0)  # checked positive above
        if self.num_attention_heads % kv_heads:
            raise _bad("num_key_value_heads", kv_heads, f"must divide num_attention_heads ({self.num_attention_heads})",
                       "use a divisor of the query heads (GQA groups)")
        if head_dim % 2:
            raise _bad("head_dim", self.head_dim, "must be even for RoPE (half-split rotation)", "use an even head_dim")
        if self.hidden_act != "silu":
            raise _bad("hidden_act", self.hidden_act, "is not supported", "SMELT's SwiGLU FFNs use 'silu'")
        rope = self.rope_parameters or {}
        if rope.get("rope_type", "default") != "default":
            raise _bad("rope_parameters.rope_type", rope.get("rope_type"), "is not supported",
                       "SMELT uses plain RoPE: rope_type 'default'")

    def _check_moe(self) -> None:
        if not isinstance(self.first_k_dense_replace, int) or not 0 <= self.first_k_dense_replace <= \
                self.num_hidden_layers:
            raise _bad("first_k_dense_replace", self.first_k_dense_replace,
                       f"must be in [0, num_hidden_layers={self.num_hidden_layers}]",
                       "count the leading dense layers")
        if self.scoring_func not in _SCORING_FUNCS:
            raise _bad("scoring_func", self.scoring_func, "is unknown", f"use one of {list(_SCORING_FUNCS)}")
        if self.first_k_dense_replace == self.num_hidden_layers:
            return  # no MoE layer: the expert keys are unused
        for key in ("num_experts", "num_experts_per_tok", "moe_intermediate_size"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise _bad(key, value, "must be a positive integer", f"set {key} to the model's size")
        if self.num_experts_per_tok > self.num_experts:
            raise _bad("num_experts_per_tok", self.num_experts_per_tok,
                       f"must be <= num_experts ({self.num_experts})", "lower the top-k or add experts")
        if not isinstance(self.shared_expert_intermediate_size, int) or self.shared_expert_intermediate_size < 0:
            raise _bad("shared_expert_intermediate_size", self.shared_expert_intermediate_size,
                       "must be an integer >= 0", "use 0 for no shared expert")

    def _check_loop(self) -> None:
        if self.loop_order not in _LOOP_ORDERS:
            raise _bad("loop_order", self.loop_order, "is unknown", f"use one of {list(_LOOP_ORDERS)}")
        if self.input_injection not in _INJECTIONS:
            raise _bad("input_injection", self.input_injection, "is unknown", f"use one of {list(_INJECTIONS)}")
        self.loop_ranges = _check_ranges(self.loop_ranges, self.num_hidden_layers)
        if self.input_injection == "add" and self.loop_order != "block":
            raise _bad("input_injection", "add", f"needs loop_order 'block' (got {self.loop_order!r})",
                       "injection re-adds a looped block's input before each repeat of the whole block")
        derived = derive_visit_plan(self.num_hidden_layers, self.loop_ranges, self.loop_order)
        if self.visit_plan is not None:
            given = self.visit_plan
            try:
                normalised = [[int(layer), int(visit)] for layer, visit in given]
            except (TypeError, ValueError):
                normalised = None
            if normalised != derived:
                raise _bad("visit_plan", given,
                           f"does not match the plan of loop_ranges {self.loop_ranges} in loop_order "
                           f"{self.loop_order!r} over num_hidden_layers={self.num_hidden_layers}, which is {derived}",
                           "correct loop_ranges/loop_order to the trained model's loop, or delete visit_plan to "
                           "derive it")
        self.visit_plan = derived

    # -- derived -------------------------------------------------------------------------------
    @property
    def num_visits(self) -> int:
        """Effective depth: visits per forward pass = KV-cache layer slots."""
        return len(self.visit_plan or [])
