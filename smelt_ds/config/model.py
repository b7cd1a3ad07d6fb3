"""The ``model`` section of a recipe: the shape of the decoder, and its checks.

Sizes are in elements (hidden units), lengths in tokens. :func:`check_model` holds the rules
between the section's own fields; ``RunConfig`` runs it when a recipe is loaded.
"""

from __future__ import annotations

from pydantic import Field

from smelt_ds.config.schema import StrictModel
from smelt_ds.errors import fail

__all__ = ["ModelConfig", "check_model"]


class ModelConfig(StrictModel):
    """Shape of the decoder. Sizes are in elements (hidden units), lengths in tokens."""

    vocab_size: int = Field(512, gt=0, description="vocabulary size (tokens)")
    hidden_size: int = Field(64, gt=0, description="residual stream width H")
    num_layers: int = Field(4, gt=0, description="number of unique layers L (not visits)")
    num_heads: int = Field(4, gt=0, description="query heads")
    num_kv_heads: int = Field(4, gt=0, description="key/value heads (GQA); divides num_heads")
    head_dim: int | None = Field(None, gt=0, description="per-head size; default hidden_size / num_heads")
    max_seq_len: int = Field(256, gt=0, description="longest context (tokens) for RoPE and generation")
    rope_theta: float = Field(10000.0, gt=0, description="RoPE base")
    norm_eps: float = Field(1e-6, gt=0, description="RMSNorm epsilon")
    tie_embeddings: bool = Field(False, description="share token embedding and output head weights")
    qk_norm: bool = Field(False, description="per-head RMSNorm of queries and keys before RoPE (Qwen3's QK-norm, "
                                             "arXiv 2505.09388); needed to export as or import from qwen3_moe")
    first_k_dense: int = Field(0, ge=0, description="the first k unique layers use a dense SwiGLU FFN")
    dense_ffn_size: int = Field(256, gt=0, description="intermediate size of the dense SwiGLU FFN")
    dropout: float = Field(0.0, ge=0, lt=1, description="dropout on attention probs and residual branches")
    init_std: float = Field(0.02, gt=0, description="std of the normal weight init")

    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim if self.head_dim is not None else self.hidden_size // self.num_heads


def check_model(m: ModelConfig) -> None:
    """The head sizes divide the width (RoPE needs an even head size) and ``first_k_dense`` fits the
    depth. Raises ConfigError naming the field, its value and the fix."""
    if m.head_dim is None and m.hidden_size % m.num_heads:
        fail("model.num_heads", m.num_heads, f"must divide `model.hidden_size` ({m.hidden_size})",
              "choose num_heads that divides hidden_size, or set model.head_dim")
    if m.num_heads % m.num_kv_heads:
        fail("model.num_kv_heads", m.num_kv_heads, f"must divide `model.num_heads` ({m.num_heads})",
              "choose num_kv_heads among the divisors of num_heads")
    if m.resolved_head_dim % 2:
        fail("model.head_dim", m.resolved_head_dim, "must be even for RoPE",
              "pick hidden_size / num_heads even, or set model.head_dim")
    if m.first_k_dense > m.num_layers:
        fail("model.first_k_dense", m.first_k_dense, f"must be <= `model.num_layers` ({m.num_layers})",
              "lower first_k_dense")
