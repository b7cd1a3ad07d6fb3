"""The recipe schema: one validated config tree per run (DESIGN §7).

A recipe is a YAML file whose top-level keys are the sections of :class:`RunConfig`
(``model``, ``moe``, ``loop``, ``data``, ``train``, ``deepspeed``, ``eval``). YAML keys equal field
names; unknown keys are rejected with the list of bad keys and the allowed ones. Precedence:
``--set a.b=v`` on the command line > YAML > defaults.

Every violation raises :class:`smelt_ds.errors.ConfigError` whose message names the field path,
the value and the fix.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, Field, ValidationError, model_validator

from smelt_ds.data.config import DataConfig
from smelt_ds.errors import ConfigError
from smelt_ds.schema import StrictModel

__all__ = [
    "ConfigError",
    "StrictModel",
    "ModelConfig",
    "MoEConfig",
    "LoopRange",
    "LoopConfig",
    "TrainConfig",
    "DeepSpeedSection",
    "EvalConfig",
    "RunConfig",
    "load_config",
    "config_from_dict",
    "apply_overrides",
    "dump_config",
]


# --------------------------------------------------------------------------------------------
# model / moe / loop
# --------------------------------------------------------------------------------------------


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
    first_k_dense: int = Field(0, ge=0, description="the first k unique layers use a dense SwiGLU FFN")
    dense_ffn_size: int = Field(256, gt=0, description="intermediate size of the dense SwiGLU FFN")
    dropout: float = Field(0.0, ge=0, lt=1, description="dropout on attention probs and residual branches")
    init_std: float = Field(0.02, gt=0, description="std of the normal weight init")

    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim if self.head_dim is not None else self.hidden_size // self.num_heads


class MoEConfig(StrictModel):
    """Mixture-of-Experts FFN: router, experts and their losses, and the backend that runs them."""

    num_experts: int = Field(8, gt=0, description="routed experts per MoE layer E")
    top_k: int = Field(2, gt=0, description="experts per token")
    expert_ffn_size: int = Field(128, gt=0, description="intermediate size F of one expert")
    shared_expert_ffn_size: int = Field(0, ge=0, description="intermediate size of the shared expert; 0 = none")
    score_func: Literal["softmax", "sigmoid"] = "softmax"
    norm_topk_prob: bool = Field(True, description="renormalise the top-k weights to sum to 1")
    aux_loss_coef: float = Field(0.01, ge=0, description="Switch-style load-balancing loss coefficient")
    z_loss_coef: float = Field(0.001, ge=0, description="router z-loss coefficient (ST-MoE)")
    router_jitter: float = Field(0.0, ge=0, description="multiplicative uniform noise on router input in training")
    aux_loss_free_bias: bool = Field(False, description="DeepSeek-V3 expert bias for selection, updated outside autograd")
    bias_update_rate: float = Field(1e-3, ge=0, description="step size of the aux-loss-free bias update")
    expert_impl: Literal["auto", "grouped_mm", "loop"] = Field(
        "auto", description="reference backend: torch._grouped_mm where available, else a per-expert loop")
    backend: Literal["reference", "deepspeed", "autoep"] = "reference"
    ep_size: int = Field(1, gt=0, description="expert-parallel size (deepspeed backend: ep_size, autoep: autoep_size)")
    capacity_factor: float = Field(1.0, gt=0, description="deepspeed backend: training capacity factor")
    eval_capacity_factor: float = Field(1.0, gt=0, description="deepspeed backend: eval capacity factor")
    min_capacity: int = Field(4, ge=0, description="deepspeed backend: minimum tokens per expert")
    drop_tokens: bool = Field(True, description="deepspeed backend: drop tokens over capacity")
    use_tutel: bool = Field(False, description="deepspeed backend: tutel kernels (optional package)")


LoopPosition = Literal["none", "uniform", "bottom", "middle", "top", "asymmetric", "custom"]


class LoopRange(StrictModel):
    """A contiguous range of unique layers ``[start, end)`` run ``repeats`` times."""

    start: int
    end: int
    repeats: int


class LoopConfig(StrictModel):
    """Which unique layers are looped (DESIGN §1).

    ``position`` picks a preset range for depth L and ``fraction`` f (floor(f*L) layers):
    ``none`` (Baseline), ``uniform`` [0, L), ``bottom`` [0, w), ``middle`` [(L-w)//2, +w),
    ``top`` [L-w, L), ``asymmetric`` (the middle range split at its centre, lower part run
    ``repeats + 1`` times, upper part ``repeats`` times). ``custom`` takes ``ranges``; explicit
    ``ranges`` are also accepted with ``asymmetric``.
    """

    position: LoopPosition = "middle"
    fraction: float = Field(0.5, gt=0, le=1, description="share of unique layers in a preset range")
    repeats: int = Field(2, description="visits per looped layer for presets")
    ranges: list[LoopRange] | None = Field(None, description="explicit loop ranges (custom / asymmetric)")
    order: Literal["block", "layer"] = "block"
    input_injection: Literal["none", "add"] = Field(
        "none", description="add: re-add the looped block's input before each repeat (block order)")
    shared_lr_scale: float = Field(1.0, gt=0, description="LR multiplier for looped (shared) parameters")


# --------------------------------------------------------------------------------------------
# placeholders that later stages fill
# --------------------------------------------------------------------------------------------


class TrainConfig(StrictModel):
    """Training loop settings. Lengths in tokens, durations in optimizer steps."""

    seed: int = 1234
    seq_len: int = Field(128, gt=0, description="tokens per training sample (window is seq_len + 1)")
    micro_batch_size: int = Field(8, gt=0, description="samples per micro-batch per data-parallel rank")


class DeepSpeedSection(StrictModel):
    """DeepSpeed settings; ``config`` passes through to the DeepSpeed JSON unchanged."""

    zero_stage: Literal[0, 1, 2, 3] = 0
    config: dict[str, Any] = Field(default_factory=dict, description="raw DeepSpeed keys, passed through")


class EvalConfig(StrictModel):
    """Evaluation settings."""

    eval_batches: int = Field(8, gt=0, description="validation micro-batches per domain")


class RunConfig(StrictModel):
    """The whole recipe."""

    name: str = "smelt"
    model: ModelConfig = Field(default_factory=ModelConfig)
    moe: MoEConfig = Field(default_factory=MoEConfig)
    loop: LoopConfig = Field(default_factory=LoopConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    deepspeed: DeepSpeedSection = Field(default_factory=DeepSpeedSection)
    eval: EvalConfig = Field(default_factory=EvalConfig)

    @model_validator(mode="after")
    def _cross_checks(self) -> "RunConfig":
        check_run_config(self)
        return self


# --------------------------------------------------------------------------------------------
# cross-field checks (field paths are known here)
# --------------------------------------------------------------------------------------------


def _fail(path: str, value: Any, rule: str, fix: str) -> None:
    raise ConfigError(f"`{path}` ({value!r}) {rule}: {fix}")


def check_run_config(cfg: RunConfig) -> None:
    """Cross-field checks of a parsed config. Raises ConfigError naming the field path."""
    _check_model(cfg.model)
    _check_moe(cfg.moe, cfg.model)
    from smelt_ds.model.looping import LoopSchedule

    LoopSchedule.from_config(cfg.loop, cfg.model.num_layers)


def _check_model(m: ModelConfig) -> None:
    if m.head_dim is None and m.hidden_size % m.num_heads:
        _fail("model.num_heads", m.num_heads, f"must divide `model.hidden_size` ({m.hidden_size})",
              "choose num_heads that divides hidden_size, or set model.head_dim")
    if m.num_heads % m.num_kv_heads:
        _fail("model.num_kv_heads", m.num_kv_heads, f"must divide `model.num_heads` ({m.num_heads})",
              "choose num_kv_heads among the divisors of num_heads")
    if m.resolved_head_dim % 2:
        _fail("model.head_dim", m.resolved_head_dim, "must be even for RoPE",
              "pick hidden_size / num_heads even, or set model.head_dim")
    if m.first_k_dense > m.num_layers:
        _fail("model.first_k_dense", m.first_k_dense, f"must be <= `model.num_layers` ({m.num_layers})",
              "lower first_k_dense")


def _check_moe(moe: MoEConfig, m: ModelConfig) -> None:
    if moe.top_k > moe.num_experts:
        _fail("moe.top_k", moe.top_k, f"must be <= `moe.num_experts` ({moe.num_experts})",
              "lower moe.top_k or raise moe.num_experts")
    if moe.backend in ("deepspeed", "autoep") and moe.num_experts % moe.ep_size:
        _fail("moe.num_experts", moe.num_experts, f"must be divisible by `moe.ep_size` ({moe.ep_size})",
              "choose an expert count that is a multiple of ep_size")
    if moe.backend == "reference" and moe.ep_size != 1:
        _fail("moe.ep_size", moe.ep_size, "needs an expert-parallel backend",
              "set moe.backend to 'deepspeed' or 'autoep', or moe.ep_size to 1")


# --------------------------------------------------------------------------------------------
# loading, overrides, dumping
# --------------------------------------------------------------------------------------------


def _format_validation_error(err: ValidationError, prefix: str = "") -> str:
    """Turn pydantic's error list into one message with field paths, values and fixes."""
    extra: dict[str, list[str]] = {}
    lines: list[str] = []
    for e in err.errors():
        loc = [str(p) for p in e["loc"]]
        if prefix:
            loc = [prefix] + loc
        if e["type"] == "extra_forbidden":
            parent = ".".join(loc[:-1]) or "<top level>"
            extra.setdefault(parent, []).append(loc[-1])
            continue
        path = ".".join(loc)
        lines.append(f"`{path}` ({e.get('input')!r}): {e['msg']}")
    for parent, keys in extra.items():
        allowed = _allowed_keys(parent if parent != "<top level>" else "")
        lines.insert(0, f"unknown keys in `{parent}`: {sorted(keys)}; allowed keys: {allowed}: "
                        "remove or rename them")
    return "invalid configuration:\n  " + "\n  ".join(lines)


def _allowed_keys(path: str) -> list[str]:
    cls: Any = RunConfig
    for part in [p for p in path.split(".") if p]:
        field = getattr(cls, "model_fields", {}).get(part)
        if field is None:
            return []
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            cls = ann
        else:  # list[...] / Optional[...] of a model
            args = [a for a in getattr(ann, "__args__", ()) if isinstance(a, type)]
            inner = [a for a in args if issubclass(a, BaseModel)]
            if not inner:
                for a in getattr(ann, "__args__", ()):
                    inner += [x for x in getattr(a, "__args__", ()) if isinstance(x, type) and issubclass(x, BaseModel)]
            if not inner:
                return []
            cls = inner[0]
    return sorted(getattr(cls, "model_fields", {}).keys())


def config_from_dict(raw: dict[str, Any], source: str = "<dict>") -> RunConfig:
    """Validate a raw recipe dict. Raises ConfigError naming ``source`` and the bad fields."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: a recipe must be a YAML mapping of sections, got {type(raw).__name__}")
    try:
        return RunConfig.model_validate(raw)
    except ValidationError as e:
        raise ConfigError(f"{source}: {_format_validation_error(e)}") from None
    except ConfigError as e:
        raise ConfigError(f"{source}: {e}") from None


def apply_overrides(raw: dict[str, Any], overrides: list[str] | None) -> dict[str, Any]:
    """Apply ``a.b=value`` overrides (values parsed as YAML) to a copy of a raw recipe dict.

    Raises ConfigError for an override without ``=`` or an empty path. Unknown paths are caught
    by validation afterwards (with the allowed keys listed).
    """
    out = copy.deepcopy(raw)
    for item in overrides or []:
        if "=" not in item:
            raise ConfigError(f"--set {item!r}: expected KEY.PATH=VALUE, e.g. --set moe.top_k=2")
        key, value = item.split("=", 1)
        parts = [p for p in key.strip().split(".")]
        if not all(parts):
            raise ConfigError(f"--set {item!r}: empty key path; write it like model.hidden_size=128")
        node = out
        for p in parts[:-1]:
            nxt = node.get(p)
            if nxt is None:
                nxt = node[p] = {}
            if not isinstance(nxt, dict):
                raise ConfigError(f"--set {item!r}: `{p}` is a value ({nxt!r}), not a section")
            node = nxt
        node[parts[-1]] = yaml.safe_load(value) if value.strip() else None
    return out


def load_config(path: str | Path, overrides: list[str] | None = None) -> RunConfig:
    """Load a YAML recipe, apply ``--set`` overrides and validate.

    Raises ConfigError for a missing file, bad YAML, unknown keys or invalid values.
    """
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"recipe file {str(path)!r} does not exist: pass the path of a YAML recipe, "
                          "e.g. recipes/tiny/smelt.yaml")
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"recipe file {str(path)!r} is not valid YAML: {e}") from None
    return config_from_dict(apply_overrides(raw, overrides), source=str(path))


def config_to_dict(cfg: RunConfig) -> dict[str, Any]:
    """Plain-data form of a config (JSON/YAML serialisable)."""
    return cfg.model_dump(mode="json")


def dump_config(cfg: RunConfig, path: str | Path | None = None) -> str:
    """Serialise a resolved config to YAML (and write it to ``path`` when given)."""
    text = yaml.safe_dump(config_to_dict(cfg), sort_keys=False)
    if path is not None:
        Path(path).write_text(text)
    return text
