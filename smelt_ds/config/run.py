"""The recipe schema: one validated config tree per run (DESIGN §7).

A recipe is a YAML file whose top-level keys are the sections of :class:`RunConfig`
(``model``, ``moe``, ``moe_runtime``, ``loop``, ``data``, ``train``, ``deepspeed``, ``eval``,
``cluster``). YAML keys equal field names; unknown keys are rejected with the list of bad keys and
the allowed ones; keys that moved out of ``moe:`` (runtime knobs, loss coefficients) are refused with their new place
(:data:`MOVED_MOE_KEYS`). Precedence: ``--set a.b=v`` on the command line > YAML > defaults.

Every violation raises :class:`smelt_ds.errors.ConfigError` whose message names the field path,
the value and the fix.
"""

from __future__ import annotations

import copy
import difflib
import os
import re
from pathlib import Path
from typing import Any, Literal, Mapping

import yaml
from pydantic import BaseModel, Field, ValidationError, model_validator

from smelt_ds.arguments import looks_like_override, override_hint
from smelt_ds.config.data import DataConfig
from smelt_ds.config.profile import ProfileConfig
from smelt_ds.config.schedule import LoopSchedule, build_schedule
from smelt_ds.config.schema import StrictModel
from smelt_ds.config.tracking import TrackingConfig
from smelt_ds.errors import ConfigError, fail

__all__ = [
    "ConfigError",
    "StrictModel",
    "ModelConfig",
    "MoEConfig",
    "MoERuntimeConfig",
    "MOVED_MOE_KEYS",
    "LoopRange",
    "LoopConfig",
    "TrainConfig",
    "DeepSpeedSection",
    "EvalConfig",
    "ClusterLayout",
    "ClusterConfig",
    "RunConfig",
    "build_schedule",
    "check_moe_backend",
    "load_config",
    "read_recipe",
    "deep_merge",
    "config_from_dict",
    "apply_overrides",
    "dump_config",
    "loop_with_repeats",
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
    qk_norm: bool = Field(False, description="per-head RMSNorm of queries and keys before RoPE (Qwen3's QK-norm, "
                                             "arXiv 2505.09388); needed to export as or import from qwen3_moe")
    first_k_dense: int = Field(0, ge=0, description="the first k unique layers use a dense SwiGLU FFN")
    dense_ffn_size: int = Field(256, gt=0, description="intermediate size of the dense SwiGLU FFN")
    dropout: float = Field(0.0, ge=0, lt=1, description="dropout on attention probs and residual branches")
    init_std: float = Field(0.02, gt=0, description="std of the normal weight init")

    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim if self.head_dim is not None else self.hidden_size // self.num_heads


class MoEConfig(StrictModel):
    """Mixture-of-Experts architecture: router and experts (what the model is). How the experts
    run (backend, expert parallelism, capacity) is :class:`MoERuntimeConfig`; the loss
    coefficients are in :class:`TrainConfig`."""

    num_experts: int = Field(8, gt=0, description="routed experts per MoE layer E")
    top_k: int = Field(2, gt=0, description="experts per token")
    expert_ffn_size: int = Field(128, gt=0, description="intermediate size F of one expert")
    shared_expert_ffn_size: int = Field(0, ge=0, description="intermediate size of the shared expert; 0 = none")
    score_func: Literal["softmax", "sigmoid"] = "softmax"
    norm_topk_prob: bool = Field(True, description="renormalise the top-k weights to sum to 1")
    router_jitter: float = Field(0.0, ge=0, description="multiplicative uniform noise on router input in training")
    aux_loss_free_bias: bool = Field(False, description="DeepSeek-V3 expert bias for selection, updated outside autograd")
    bias_update_rate: float = Field(1e-3, ge=0, description="step size of the aux-loss-free bias update")
    expert_impl: Literal["auto", "grouped_mm", "loop"] = Field(
        "auto", description="reference backend: torch._grouped_mm where available, else a per-expert loop")


class MoERuntimeConfig(StrictModel):
    """How the MoE layers run (not model architecture): the backend, expert parallelism, and the
    ``deepspeed`` backend's capacity and kernels. Cross-field rules against ``moe`` and
    ``deepspeed`` are checked when the recipe is loaded (:func:`check_moe_backend`)."""

    backend: Literal["reference", "deepspeed", "autoep"] = "reference"
    ep_size: int = Field(1, gt=0, description="expert-parallel size (deepspeed backend: ep_size, autoep: autoep_size)")
    capacity_factor: float = Field(1.0, gt=0, description="deepspeed backend: training capacity factor")
    eval_capacity_factor: float = Field(1.0, gt=0, description="deepspeed backend: eval capacity factor")
    min_capacity: int = Field(4, ge=0, description="deepspeed backend: minimum tokens per expert")
    drop_tokens: bool = Field(True, description="deepspeed backend: drop tokens over capacity")
    use_tutel: bool = Field(False, description="deepspeed backend: tutel kernels (optional package)")


#: Keys that used to be in ``moe:`` (older recipes), and the section that holds them now.
MOVED_MOE_KEYS: dict[str, str] = {
    **{k: "moe_runtime" for k in ("backend", "ep_size", "capacity_factor", "eval_capacity_factor",
                                  "min_capacity", "drop_tokens", "use_tutel")},
    "aux_loss_coef": "train", "z_loss_coef": "train",
}


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


class ActivationCheckpointing(StrictModel):
    """Which visits recompute their activations in backward (DESIGN §5)."""

    policy: Literal["none", "full", "looped", "every_n"] = Field(
        "none", description="none | full (every visit) | looped (visits of looped layers) | every_n")
    every_n: int = Field(2, gt=0, description="every_n policy: checkpoint every n-th visit of the plan")
    impl: Literal["torch", "deepspeed"] = Field(
        "torch", description="torch: non-reentrant torch.utils.checkpoint; deepspeed: deepspeed.checkpointing")
    partition_activations: bool = Field(False, description="deepspeed impl: shard checkpoints across model-parallel ranks")
    cpu_checkpointing: bool = Field(False, description="deepspeed impl: keep checkpoints in CPU memory")
    contiguous_memory_optimization: bool = Field(False, description="deepspeed impl: contiguous checkpoint buffers")


class TrainConfig(StrictModel):
    """Training loop settings. Lengths in tokens, durations in optimizer steps, LR in units of
    the optimizer's step size."""

    seed: int = 1234
    seq_len: int = Field(128, gt=0, description="tokens per training sample (window is seq_len + 1)")
    micro_batch_size: int = Field(8, gt=0, description="samples per micro-batch per data-parallel rank")
    gradient_accumulation_steps: int | None = Field(
        None, gt=0, description="micro-batches per optimizer step; default: from global_batch_tokens, else 1")
    global_batch_tokens: int | None = Field(
        None, gt=0, description="tokens per optimizer step over all ranks; must equal "
                                "micro_batch_size * seq_len * accumulation * data-parallel size")
    max_steps: int = Field(100, gt=0, description="optimizer steps")
    lr: float = Field(3e-3, gt=0, description="peak learning rate")
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="final LR as a fraction of the peak")
    warmup_steps: int = Field(10, ge=0, description="linear warmup steps")
    schedule: Literal["cosine", "wsd", "constant"] = Field(
        "cosine", description="cosine decay, warmup-stable-decay, or constant after warmup")
    decay_fraction: float = Field(0.2, gt=0, le=1, description="wsd: share of max_steps spent decaying (linear)")
    weight_decay: float = Field(0.1, ge=0, description="AdamW weight decay (not on norms, biases, embeddings)")
    betas: tuple[float, float] = Field((0.9, 0.95), description="AdamW betas")
    eps: float = Field(1e-8, gt=0, description="AdamW epsilon")
    grad_clip: float = Field(1.0, ge=0, description="global gradient-norm clip; 0 disables")
    aux_loss_coef: float = Field(0.01, ge=0, description="Switch-style load-balancing loss coefficient "
                                                         "(smelt_ds.train.objective.total_loss)")
    z_loss_coef: float = Field(0.001, ge=0, description="router z-loss coefficient (ST-MoE; "
                                                        "smelt_ds.train.objective.total_loss)")
    precision: Literal["auto", "fp32", "bf16"] = Field(
        "auto", description="auto: bf16 where the accelerator supports it (CUDA), else fp32")
    log_every: int = Field(10, gt=0, description="steps between metrics rows")
    eval_every: int = Field(50, gt=0, description="steps between validation runs (and at the end)")
    save_every: int = Field(50, gt=0, description="steps between checkpoints (and at the end)")
    keep_last: int = Field(2, gt=0, description="checkpoints kept on disk")
    reference_weights: Literal["every_save", "newest", "minimal"] = Field(
        "every_save", description="which checkpoints carry the fp32 reference-layout weights `smelt-ds export` reads "
                                  "(4 bytes per parameter per checkpoint): every_save; newest (written at every save, "
                                  "removed from a checkpoint once a newer one is complete); minimal (as newest, except "
                                  "on the reference backend at ZeRO 1-3, whose DeepSpeed files export every checkpoint: "
                                  "only the run's last save). The newest and the final checkpoint always export; "
                                  "docs/checkpoint_cost.md")
    exit_after_steps: int | None = Field(
        None, gt=0, description="stop after this many steps of this invocation, saving a checkpoint "
                                "(time-boxed jobs; the LR schedule still follows max_steps)")
    run_dir: str = Field("runs/{name}", description="output directory; {name} is replaced by the recipe name")
    init_from: str | None = Field(
        None, description="export directory (`smelt-ds export`) whose model.pt initialises the weights of a "
                          "new run, on any MoE backend; a run resumed from its own checkpoint ignores it")
    init_from_any_tokenizer: bool = Field(
        False, description="with init_from: allow data.tokenizer.path to name another tokenizer than the export's "
                           "(by default the export's tokenizer.json is used and another one is refused)")
    activation_checkpointing: ActivationCheckpointing = Field(default_factory=ActivationCheckpointing)
    compile: Literal["none", "layers", "model"] = Field(
        "none", description="torch.compile: none (eager); layers (regional: each unique layer compiled once, every "
                            "visit reuses it, and the output head; all backends and ZeRO stages); model (the whole forward through "
                            "DeepSpeed's engine.compile; reference backend, ZeRO 0-2)")
    compile_backend: Literal["inductor", "aot_eager", "eager"] = Field(
        "inductor", description="torch.compile backend for train.compile: inductor generates kernels; aot_eager and "
                                "eager only trace (debugging a graph break or a numerical difference)")
    deterministic: bool = Field(
        False, description="bit-identical reruns on CPU: torch.use_deterministic_algorithms and one intra-op thread "
                           "per rank (overrides the thread choice; slower); see docs/training.md 'Reproducibility'")


class DeepSpeedSection(StrictModel):
    """DeepSpeed settings. ``config`` is merged last into the DeepSpeed JSON, unchanged."""

    zero_stage: Literal[0, 1, 2, 3] = 0
    offload_optimizer: Literal["none", "cpu"] = Field("none", description="ZeRO offload of optimizer states")
    offload_param: Literal["none", "cpu"] = Field("none", description="ZeRO-3 offload of parameters")
    template: str | None = Field(None, description="ds_configs/ template name; default from zero_stage/offload")
    zero3_loop_tuning: Literal["auto", "off"] = Field(
        "auto", description="derive ZeRO-3 reuse distance / live parameters from the visit plan")
    comms_logger: bool = Field(False, description="enable DeepSpeed's comms logger")
    config: dict[str, Any] = Field(default_factory=dict, description="raw DeepSpeed keys, passed through")

    @property
    def effective_zero_stage(self) -> int:
        """The ZeRO stage DeepSpeed will see: ``config.zero_optimization.stage`` (merged last into
        the DeepSpeed JSON) wins over ``zero_stage``."""
        raw = self.config.get("zero_optimization", {}) or {}
        return int(raw.get("stage", self.zero_stage))


class EvalConfig(StrictModel):
    """Evaluation during training: validation loss every ``train.eval_every`` steps, and in-loop
    downstream evaluation with lm-evaluation-harness tasks every ``harness_interval`` steps
    (:mod:`smelt_ds.train.harness_eval`; OLMo-core's in-loop evaluator callback in spirit).

    The harness fields are checked here, at load time: ``harness_tasks`` and ``harness_interval``
    come together, and ``harness_include_path`` must be an existing directory. Whether each task
    name is known to lm-evaluation-harness is checked when training starts (indexing the
    harness's task YAMLs takes seconds, too long for every config load).
    """

    eval_batches: int = Field(8, gt=0, description="validation micro-batches per domain")
    harness_tasks: list[str] = Field(
        default_factory=list, description="lm-evaluation-harness task, group or tag names run on the model "
                                          "during training, every `eval.harness_interval` steps")
    harness_interval: int | None = Field(
        None, gt=0, description="steps between in-loop harness evaluations (at steps that are multiples of it); "
                                "required with `eval.harness_tasks`")
    harness_include_path: str | None = Field(
        None, description="directory of extra task YAMLs (lm-eval's --include_path), e.g. the offline tasks "
                          "`smelt-ds eval build-tasks OUT` writes; must exist")
    harness_num_fewshot: int = Field(0, ge=0, description="in-context examples (shots) per prompt, every task")
    harness_limit: int | None = Field(None, gt=0, description="examples per task (the first N); default: all")
    harness_batch_size: int = Field(8, gt=0, description="requests (sequences) per forward pass of the harness")

    @model_validator(mode="after")
    def _check_harness(self) -> "EvalConfig":
        _check_harness_fields(self)
        return self


def _check_harness_fields(ev: EvalConfig) -> None:
    """The in-loop harness fields of ``ev`` together (see :class:`EvalConfig`). Raises ConfigError
    naming the fields, the values and the fix."""
    tasks, interval = ev.harness_tasks, ev.harness_interval
    if tasks and interval is None:
        fail("eval.harness_interval", None, f"is required with `eval.harness_tasks` ({tasks})",
             "set eval.harness_interval to the steps between harness evaluations (e.g. --set "
             "eval.harness_interval=500), or remove eval.harness_tasks")
    if interval is not None and not tasks:
        fail("eval.harness_tasks", tasks, f"is empty but `eval.harness_interval` ({interval}) is set",
             "name the tasks to run (e.g. --set 'eval.harness_tasks=[lambada_local]'), or remove "
             "eval.harness_interval")
    bad = [t for t in tasks if not isinstance(t, str) or not t.strip()]
    if bad:
        fail("eval.harness_tasks", tasks, "holds an empty task name", "remove the empty entry")
    twice = sorted({t for t in tasks if tasks.count(t) > 1})
    if twice:
        fail("eval.harness_tasks", tasks, f"names {twice} more than once", "list each task once")
    path = ev.harness_include_path
    if path is not None and not Path(path).expanduser().is_dir():
        what = "is a file" if Path(path).expanduser().exists() else "does not exist"
        fail("eval.harness_include_path", path, f"{what}: it must be a directory of lm-evaluation-harness task "
             "YAMLs", "write the offline tasks there with `smelt-ds eval build-tasks DIR`, point it at an "
             "existing directory, or remove it")


class ClusterLayout(StrictModel):
    """One hardware layout a recipe is sized for: ``nodes x gpus_per_node`` GPUs of one type.

    Read by ``smelt-ds render-job``, ``smelt-ds recipes table`` and the memory verdicts; training
    itself never reads it. ``overrides`` are ``--set KEY=VALUE`` strings applied to the recipe on
    this layout (e.g. a larger ``train.micro_batch_size`` on GPUs with more memory).
    """

    gpu: str = Field(..., description="GPU model, e.g. 'H100-SXM5-80GB'; 'cpu' for CPU processes")
    device_memory_gib: float = Field(..., gt=0, description="usable memory per GPU in GiB (2**30 bytes), "
                                                            "as torch.cuda.get_device_properties reports it")
    nodes: int = Field(1, gt=0, description="number of nodes")
    gpus_per_node: int = Field(8, gt=0, description="GPUs (ranks) per node")
    overrides: list[str] = Field(default_factory=list,
                                 description="`--set KEY=VALUE` overrides applied to the recipe on this layout")


class ClusterConfig(StrictModel):
    """Cluster layouts of a recipe, by name (e.g. ``h100``, ``h200``); ``default`` names the one used
    when none is chosen. Empty for CPU recipes."""

    default: str | None = Field(None, description="name of the default layout; default: the first one")
    layouts: dict[str, ClusterLayout] = Field(default_factory=dict, description="layouts by name")

    @model_validator(mode="after")
    def _check_default(self) -> "ClusterConfig":
        if self.default is not None and self.default not in self.layouts:
            raise ConfigError(f"`cluster.default` ({self.default!r}) names no layout of `cluster.layouts` "
                              f"({sorted(self.layouts)}): use one of them or remove it")
        return self


class RunConfig(StrictModel):
    """The whole recipe."""

    name: str = "smelt"
    model: ModelConfig = Field(default_factory=ModelConfig)
    moe: MoEConfig = Field(default_factory=MoEConfig)
    moe_runtime: MoERuntimeConfig = Field(default_factory=MoERuntimeConfig)
    loop: LoopConfig = Field(default_factory=LoopConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    deepspeed: DeepSpeedSection = Field(default_factory=DeepSpeedSection)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    cluster: ClusterConfig = Field(default_factory=ClusterConfig)
    tracking: TrackingConfig = Field(default_factory=TrackingConfig)
    profile: ProfileConfig = Field(default_factory=ProfileConfig)

    @model_validator(mode="before")
    @classmethod
    def _moved_keys(cls, raw: Any) -> Any:
        check_moved_keys(raw)
        return raw

    @model_validator(mode="after")
    def _cross_checks(self) -> "RunConfig":
        check_run_config(self)
        return self

    @property
    def schedule(self) -> LoopSchedule:
        """The visit plan of this recipe: ``loop`` over ``model.num_layers`` unique layers."""
        return build_schedule(self.loop, self.model.num_layers)


# --------------------------------------------------------------------------------------------
# cross-field checks (field paths are known here)
# --------------------------------------------------------------------------------------------


def check_moved_keys(raw: Any) -> None:
    """Refuse a recipe in the older layout: ``moe.<key>`` for a key of
    :data:`MOVED_MOE_KEYS`. One ConfigError names every moved key, its new place and the YAML
    to write (``--set moe.ep_size=2`` overrides land here too)."""
    moe = raw.get("moe") if isinstance(raw, dict) else None
    if not isinstance(moe, dict):
        return
    moved = [k for k in MOVED_MOE_KEYS if k in moe]
    if not moved:
        return
    lines = []
    for k in moved:
        new, v = MOVED_MOE_KEYS[k], _flow_yaml(moe[k])
        lines.append(f"`moe.{k}` moved to `{new}.{k}`: write `{new}: {{{k}: {v}}}` "
                     f"(or --set {new}.{k}={v})")
    raise ConfigError("recipe uses the old `moe:` layout:\n  " + "\n  ".join(lines))


def _flow_yaml(value: Any) -> str:
    """``value`` as inline YAML (``autoep``, ``0.01``, ``true``)."""
    text = yaml.safe_dump(value, default_flow_style=True).strip()
    return text.removesuffix("...").strip()


def check_run_config(cfg: RunConfig) -> None:
    """Cross-field checks of a parsed config. Raises ConfigError naming the field path."""
    _check_model(cfg.model)
    _check_moe(cfg.moe)
    check_moe_backend(cfg.moe, cfg.moe_runtime, cfg.deepspeed.effective_zero_stage)
    _check_train(cfg)
    build_schedule(cfg.loop, cfg.model.num_layers)


def _check_model(m: ModelConfig) -> None:
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


def _check_moe(moe: MoEConfig) -> None:
    if moe.top_k > moe.num_experts:
        fail("moe.top_k", moe.top_k, f"must be <= `moe.num_experts` ({moe.num_experts})",
              "lower moe.top_k or raise moe.num_experts")


def check_moe_backend(moe: MoEConfig, rt: MoERuntimeConfig, zero_stage: int) -> None:
    """What ``moe_runtime.backend`` can run, given the architecture and the ZeRO stage
    (``DeepSpeedSection.effective_zero_stage``). One ConfigError per rule, naming field, value
    and fix. Checked at load time; :func:`smelt_ds.parallel.moe_backends.apply_backend` repeats
    it for an explicit ZeRO stage and adds the runtime checks (tutel installed, world size).

    Rules: ``reference`` has no expert parallelism. ``deepspeed`` and ``autoep``: ``moe.num_experts``
    divisible by ``moe_runtime.ep_size``. ``deepspeed``: no ZeRO-3 (DeepSpeed raises ``Native
    DeepSpeed MoE is not supported with ZeRO Stage 3`` inside ``deepspeed.initialize``), softmax
    only (TopKGate), no ``aux_loss_free_bias`` (no expert bias in TopKGate), ``norm_topk_prob``
    equal to DeepSpeed's fixed choice (top-1: raw softmax weight; top-k >= 2: renormalised).
    ``autoep``: no ``aux_loss_free_bias`` (AutoEP rejects ``load_balance_coeff``), no
    ``router_jitter`` (AutoEP's router has none). ``use_tutel`` and a capacity other than the
    defaults (``capacity_factor``, ``eval_capacity_factor``, ``min_capacity``) only with ``deepspeed``.
    """
    b = rt.backend
    if b == "reference" and rt.ep_size != 1:
        fail("moe_runtime.ep_size", rt.ep_size, "needs an expert-parallel backend",
              "set moe_runtime.backend to 'deepspeed' or 'autoep', or moe_runtime.ep_size to 1")
    if rt.use_tutel and b != "deepspeed":
        fail("moe_runtime.use_tutel", True, f"only applies to moe_runtime.backend 'deepspeed' (this recipe: {b!r})",
              "set moe_runtime.backend to 'deepspeed' (tutel kernels for DeepSpeed-MoE) or moe_runtime.use_tutel "
              "to false")
    if b != "deepspeed":  # reference and AutoEP are dropless: a capacity would claim what does not run
        defaults = MoERuntimeConfig()
        for name in ("capacity_factor", "eval_capacity_factor", "min_capacity"):
            if getattr(rt, name) != getattr(defaults, name):
                fail(f"moe_runtime.{name}", getattr(rt, name), f"only applies to moe_runtime.backend 'deepspeed' "
                     f"(backend {b!r} routes every token: no capacity, nothing dropped)",
                     f"remove moe_runtime.{name} or set moe_runtime.backend to 'deepspeed'")
    if b == "reference":
        return
    if moe.num_experts % rt.ep_size:
        fail("moe.num_experts", moe.num_experts, f"must be divisible by `moe_runtime.ep_size` ({rt.ep_size})",
              "choose an expert count that is a multiple of ep_size, or another moe_runtime.ep_size")
    if moe.aux_loss_free_bias:
        why = ("TopKGate has no expert bias" if b == "deepspeed" else
               "DeepSpeed AutoEP rejects expert_parallel.load_balance_coeff")
        fail("moe.aux_loss_free_bias", True, f"is not supported by moe_runtime.backend {b!r} ({why})",
              "set moe.aux_loss_free_bias to false, or use moe_runtime.backend 'reference'")
    if b == "deepspeed":
        if zero_stage == 3:
            fail("moe_runtime.backend", b, "does not support ZeRO stage 3 (`deepspeed.zero_stage` or "
                  "`deepspeed.config.zero_optimization.stage`; DeepSpeed raises 'Native DeepSpeed MoE is not "
                  "supported with ZeRO Stage 3')", "use moe_runtime.backend 'autoep' (ZeRO 0-3), or ZeRO stage <= 2")
        if moe.score_func != "softmax":
            fail("moe.score_func", moe.score_func, "is not supported by moe_runtime.backend 'deepspeed' (TopKGate "
                  "is softmax-only)", "set moe.score_func to 'softmax', or use moe_runtime.backend 'autoep' or "
                  "'reference'")
        want = moe.top_k >= 2
        if moe.norm_topk_prob != want:
            how = ("renormalises the top-k weights to sum to 1" if want else
                   "weights the top-1 expert by its raw softmax probability")
            fail("moe.norm_topk_prob", moe.norm_topk_prob, f"differs from DeepSpeed's gate, which for top_k "
                  f"{moe.top_k} {how}", f"set moe.norm_topk_prob to {str(want).lower()}, or use "
                  "moe_runtime.backend 'autoep' or 'reference'")
    elif moe.router_jitter > 0:
        fail("moe.router_jitter", moe.router_jitter, "is not supported by moe_runtime.backend 'autoep' (AutoEP's "
              "TokenChoiceTopKRouter has no input jitter)", "set moe.router_jitter to 0, or use "
              "moe_runtime.backend 'deepspeed' or 'reference'")


def _check_train(cfg: RunConfig) -> None:
    t = cfg.train
    if t.seq_len > cfg.model.max_seq_len:
        fail("train.seq_len", t.seq_len, f"must be <= `model.max_seq_len` ({cfg.model.max_seq_len})",
              "raise model.max_seq_len or shorten train.seq_len")
    if t.warmup_steps > t.max_steps:
        fail("train.warmup_steps", t.warmup_steps, f"must be <= `train.max_steps` ({t.max_steps})",
              "shorten the warmup or train longer")
    if cfg.deepspeed.offload_param != "none" and cfg.deepspeed.zero_stage != 3:
        fail("deepspeed.offload_param", cfg.deepspeed.offload_param, "needs `deepspeed.zero_stage` 3",
              "set zero_stage: 3 or offload_param: none")
    _check_compile(cfg)
    if cfg.deepspeed.offload_optimizer != "none" and cfg.deepspeed.zero_stage == 0:
        fail("deepspeed.offload_optimizer", cfg.deepspeed.offload_optimizer, "needs ZeRO stage 1-3",
              "set deepspeed.zero_stage >= 1 or offload_optimizer: none")


def _check_compile(cfg: RunConfig) -> None:
    """``train.compile: model`` (one graph of the whole forward, DeepSpeed's engine.compile) runs
    with the reference MoE at ZeRO 0-2 and without DeepSpeed's activation checkpointing; each other
    combination names ``layers``, which compiles per unique layer and runs everywhere."""
    t = cfg.train
    if t.compile == "none" and t.compile_backend != "inductor":
        fail("train.compile_backend", t.compile_backend, "only applies when train.compile is 'layers' or 'model' "
             "(this recipe compiles nothing)", "set train.compile: layers, or remove train.compile_backend")
    if t.compile != "model":
        return
    alt = "or use train.compile: layers (each unique layer compiled; every backend and ZeRO stage)"
    if cfg.moe_runtime.backend != "reference":
        fail("train.compile", "model", f"cannot compile moe_runtime.backend {cfg.moe_runtime.backend!r} into one "
             "graph (its all-to-all collectives and capacity bookkeeping stay eager)",
             "use train.compile: layers (the expert layer eager, the rest of each layer compiled)")
    if cfg.deepspeed.effective_zero_stage == 3:
        fail("train.compile", "model", "does not run under ZeRO stage 3 (its parameter hooks on every submodule "
             "are excluded from compilation and split a whole-model graph everywhere)",
             "use train.compile: layers (each layer compiled; under ZeRO-3 its graph breaks at DeepSpeed's "
             "parameter hooks)")
    if t.activation_checkpointing.policy != "none" and t.activation_checkpointing.impl == "deepspeed":
        fail("train.compile", "model", "cannot trace deepspeed.checkpointing (train.activation_checkpointing.impl "
             "'deepspeed')", f"set train.activation_checkpointing.impl: torch, {alt}")


def resolve_batch(cfg: RunConfig, data_parallel_size: int) -> tuple[int, int]:
    """``(gradient_accumulation_steps, global_batch_tokens)`` for ``data_parallel_size`` ranks.

    global_batch_tokens = micro_batch_size * seq_len * accumulation * data_parallel_size. Raises
    ConfigError when ``train.global_batch_tokens`` is not a multiple of the per-step tokens or
    disagrees with an explicit ``train.gradient_accumulation_steps``.
    """
    t = cfg.train
    per_micro = t.micro_batch_size * t.seq_len * data_parallel_size
    if t.global_batch_tokens is None:
        accum = t.gradient_accumulation_steps or 1
        return accum, per_micro * accum
    if t.global_batch_tokens % per_micro:
        fail("train.global_batch_tokens", t.global_batch_tokens,
              f"must be a multiple of micro_batch_size * seq_len * data-parallel size "
              f"({t.micro_batch_size} * {t.seq_len} * {data_parallel_size} = {per_micro})",
              "change global_batch_tokens, micro_batch_size or the number of ranks")
    accum = t.global_batch_tokens // per_micro
    if t.gradient_accumulation_steps is not None and t.gradient_accumulation_steps != accum:
        fail("train.gradient_accumulation_steps", t.gradient_accumulation_steps,
              f"disagrees with `train.global_batch_tokens` ({t.global_batch_tokens}), which needs {accum} "
              f"on {data_parallel_size} rank(s)", "set only one of them")
    return accum, t.global_batch_tokens


# --------------------------------------------------------------------------------------------
# loading, overrides, dumping
# --------------------------------------------------------------------------------------------


#: key path (``model.num_layers``, ``data.sources[0].path``) -> its line in the recipe file, or
#: ``(file, line)`` for a recipe assembled from several files (:func:`read_recipe`)
KeyLines = Mapping[str, "int | tuple[str, int]"]


class _Origin:
    """Where each value of a raw recipe came from: a line of a YAML file, or a ``--set``."""

    def __init__(self, file: str | None, lines: KeyLines | None, overrides: list[str] | None):
        #: key path -> (file, line); a bare line number is a line of ``file``
        self.lines = {k: v if isinstance(v, tuple) else (str(file), v) for k, v in (lines or {}).items()}
        self.overrides = _override_paths(overrides)

    def override_for(self, path: str) -> str | None:
        """The last ``--set`` item that set ``path``, a section above it or a field below it."""
        hits = [item for p, item in self.overrides if _related(path, p)]
        return hits[-1] if hits else None

    def line_of(self, path: str) -> tuple[str, int] | None:
        """``(file, line)`` of ``path`` (or of the nearest section above it that is in a file): the
        recipe's, or with ``base:`` the file of the chain that set it last."""
        while path:
            if path in self.lines:
                return self.lines[path]
            path = _parent_path(path)
        return None

    def at(self, paths: list[str]) -> str:
        """`` (line N of FILE)`` / `` (lines N, M of FILE; line K of BASE)`` for the paths read from files."""
        by_file: dict[str, set[int]] = {}
        for where in (self.line_of(p) for p in paths):
            if where is not None:
                by_file.setdefault(where[0], set()).add(where[1])
        if not by_file:
            return ""
        return " (" + "; ".join(f"line{'s' if len(ns) > 1 else ''} {', '.join(map(str, sorted(ns)))} of {f}"
                                for f, ns in by_file.items()) + ")"


def _parent_path(path: str) -> str:
    cut = max(path.rfind("."), path.rfind("["))
    return path[:cut] if cut > 0 else ""


def _related(a: str, b: str) -> bool:
    """Whether key paths ``a`` and ``b`` are the same field or one is a section holding the other."""
    if not a or not b:
        return False
    return a == b or a.startswith((b + ".", b + "[")) or b.startswith((a + ".", a + "["))


def _override_paths(overrides: list[str] | None) -> list[tuple[str, str]]:
    """``(key path, item)`` per ``--set`` item in the order applied (list indices as ``[i]``)."""
    out = []
    for item in overrides or []:
        key = item.split("=", 1)[0].strip()
        path = ""
        for part in key.split("."):
            path = f"{path}[{part}]" if part.isdigit() and path else (f"{path}.{part}" if path else part)
        out.append((path, item))
    return out


def _set_flag(item: str) -> str:
    """``--set ITEM`` as a shell would take it back (quoted only where needed)."""
    import shlex

    return f"--set {shlex.quote(item)}"


#: backticked field paths in a message: `moe.top_k`, `data.sources[1].path`
_FIELD_IN_MESSAGE = r"`([A-Za-z_]\w*(?:\.[A-Za-z_]\w*|\[\d+\])*)`"


def _validation_problems(err: ValidationError, root: type[BaseModel], origin: _Origin) -> list[tuple[str | None, str]]:
    """``(--set item or None, problem)`` per problem of ``err``, unknown keys first: a close match
    among the allowed keys is suggested (``difflib.get_close_matches``), else the allowed keys are
    listed; problems read from the file name their line."""
    unknown: dict[str, list[str]] = {}
    values: list[tuple[str | None, str]] = []
    for e in err.errors():
        loc = [f"[{p}]" if isinstance(p, int) else str(p) for p in e["loc"]]  # list items: ranges[0]
        path = ".".join(loc).replace(".[", "[")
        if e["type"] == "extra_forbidden":
            unknown.setdefault(".".join(loc[:-1]).replace(".[", "["), []).append(loc[-1])
            continue
        blame = origin.override_for(path)
        values.append((blame, f"`{path}` ({e.get('input')!r}){'' if blame else origin.at([path])}: {e['msg']}"))
    out: list[tuple[str | None, str]] = []
    for parent, keys in unknown.items():
        allowed = _allowed_keys(parent, root)
        where = f"in `{parent}`" if parent else "at the top level"
        rest: dict[str | None, list[str]] = {}
        for key in keys:
            path = f"{parent}.{key}" if parent else key
            blame = origin.override_for(path)
            match = difflib.get_close_matches(key, allowed, n=1)
            if match:
                out.append((blame, f"unknown key `{key}` {where}{'' if blame else origin.at([path])}: "
                                   f"did you mean `{match[0]}`?"))
            else:
                rest.setdefault(blame, []).append(key)
        for blame, bad in rest.items():
            paths = [f"{parent}.{k}" if parent else k for k in bad]
            out.append((blame, f"unknown keys in `{parent or '<top level>'}`: {sorted(bad)}"
                               f"{'' if blame else origin.at(paths)}; allowed keys: {allowed}: remove or rename "
                               f"{'it' if len(bad) == 1 else 'them'}"))
    return out + values


def _join_problems(problems: list[tuple[str | None, str]], source: str) -> str:
    """One message: ``--set ITEM: problem`` when every problem comes from one ``--set``, else
    ``SOURCE: invalid configuration:`` and one line per problem (``--set ITEM: `` before those a
    ``--set`` caused)."""
    blames = {b for b, _ in problems}
    if len(problems) == 1 and None not in blames:
        blame, text = problems[0]
        return f"{_set_flag(blame or '')}: {text}"
    lines = [f"{_set_flag(b)}: {t}" if b else t for b, t in problems]
    head = "invalid --set overrides" if None not in blames else f"{source}: invalid configuration"
    return head + ":\n  " + "\n  ".join(lines)


def _blame_config_error(e: ConfigError, source: str, origin: _Origin) -> str:
    """A cross-field ConfigError, prefixed with the ``--set`` items that set a field it names
    (and the file lines of the other fields it names), else with ``source``."""
    msg = str(e)
    fields = list(dict.fromkeys(re.findall(_FIELD_IN_MESSAGE, msg)))
    blamed = list(dict.fromkeys(item for path, item in origin.overrides if any(_related(f, path) for f in fields)))
    if not blamed:
        return f"{source}: {msg}"
    from_file = {f: w for f in fields if origin.override_for(f) is None and (w := origin.line_of(f)) is not None}
    where = ""
    if from_file:
        files = {w[0] for w in from_file.values()}
        one = files.pop() if len(files) == 1 else None
        where = " (" + ", ".join(f"`{f}` at line {line}" + ("" if one else f" of {file}")
                                 for f, (file, line) in from_file.items()) + (f" of {one})" if one else ")")
    return f"{' '.join(_set_flag(b) for b in blamed)}: {msg}{where}"


def _allowed_keys(path: str, root: type[BaseModel]) -> list[str]:
    cls: Any = root
    for part in [p.split("[")[0] for p in path.split(".") if p]:
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


def config_from_dict(raw: dict[str, Any], source: str = "<dict>", overrides: list[str] | None = None,
                     key_lines: KeyLines | None = None) -> RunConfig:
    """Validate a raw recipe dict. Raises ConfigError naming ``source`` and the bad fields (see
    :func:`validate_model` for ``overrides`` and ``key_lines``)."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: a recipe must be a YAML mapping of sections, got {type(raw).__name__}")
    return validate_model(RunConfig, raw, source, overrides, key_lines)


def validate_model(cls: type[BaseModel], raw: Any, source: str, overrides: list[str] | None = None,
                   key_lines: KeyLines | None = None):
    """``cls.model_validate(raw)``; a pydantic or cross-field error becomes one ConfigError
    naming each bad field, its value and the fix.

    An unknown key gets the closest allowed key (``did you mean `hidden_size`?``), or the list of
    allowed keys when none is close. A problem is blamed on where its value came from: the
    ``--set`` item of ``overrides`` (the ``--set KEY=VALUE`` strings applied to ``raw``) that set
    the field or a section holding it (``--set model.hiden_size=64: unknown key ...``), else
    ``source``, naming the line when ``key_lines`` (:data:`KeyLines`, from
    :func:`read_yaml_with_lines` or :func:`read_recipe`) knows it: ``(line 5 of SOURCE)``. A cross-field error naming a
    field a ``--set`` set starts with that ``--set``."""
    origin = _Origin(source, key_lines, overrides)
    try:
        return cls.model_validate(raw)
    except ValidationError as e:
        raise ConfigError(_join_problems(_validation_problems(e, cls, origin), source)) from None
    except ConfigError as e:
        raise ConfigError(_blame_config_error(e, source, origin)) from None


def apply_overrides(raw: dict[str, Any], overrides: list[str] | None) -> dict[str, Any]:
    """Apply ``a.b=value`` overrides (values parsed as YAML) to a copy of a raw recipe dict.

    A path part that is an integer indexes a list (``--set loop.ranges.0.repeats=3``); index
    ``len(list)`` appends. Raises ConfigError for an override without ``=``, an empty path, a
    path through a plain value, or a list index out of range. Unknown keys are caught by
    validation afterwards (with the allowed keys listed).
    """
    out = copy.deepcopy(raw)
    for item in overrides or []:
        if "=" not in item:
            raise ConfigError(f"--set {item!r}: expected KEY.PATH=VALUE, e.g. --set moe.top_k=2")
        key, value = item.split("=", 1)
        parts = [p for p in key.strip().split(".")]
        if not all(parts):
            raise ConfigError(f"--set {item!r}: empty key path; write it like model.hidden_size=128")
        try:
            parsed = yaml.safe_load(value) if value.strip() else None
        except yaml.YAMLError as e:
            raise ConfigError(f"--set {item!r}: the value {value.strip()!r} is not valid YAML "
                              f"({getattr(e, 'problem', None) or e}): quote it as a string, e.g. "
                              f"--set \"{key.strip()}='{value.strip()}'\", or fix the brackets") from None
        if len(parts) >= 2 and parts[0] == "moe" and parts[1] in MOVED_MOE_KEYS:
            new_key = f"{MOVED_MOE_KEYS[parts[1]]}.{'.'.join(parts[1:])}"
            raise ConfigError(f"--set {item!r}: `{key.strip()}` moved to `{new_key}`; write "
                              f"--set {new_key}={value.strip()}")
        node: Any = out
        for depth, p in enumerate(parts):
            last = depth == len(parts) - 1
            where = ".".join(parts[:depth]) or "the recipe"
            if isinstance(node, list):
                if not p.isdigit():
                    example = ".".join(parts[:depth] + ["0"] + parts[depth + 1:])
                    raise ConfigError(f"--set {item!r}: `{where}` is a list; index it with a number from 0 "
                                      f"(e.g. {example}), got {p!r}")
                idx = int(p)
                if idx > len(node) or (idx == len(node) and not last):
                    raise ConfigError(f"--set {item!r}: index {idx} is out of range for `{where}` "
                                      f"({len(node)} items; use 0..{len(node) - 1}, or {len(node)} to append)")
                if last:
                    if idx == len(node):
                        node.append(parsed)
                    else:
                        node[idx] = parsed
                    break
                node = node[idx]
            elif isinstance(node, dict):
                if last:
                    node[p] = parsed
                    break
                nxt = node.get(p)
                if nxt is None:
                    nxt = node[p] = {}
                node = nxt
            else:
                raise ConfigError(f"--set {item!r}: `{where}` is a value ({node!r}), not a section")
    return out


def config_diff(new: Any, old: Any, path: str = "", labels: tuple[str, str] = ("planned", "there")) -> list[str]:
    """Differences between two raw config dicts, one ``"path: OLD <labels[1]>, NEW <labels[0]>"``
    string per differing leaf (dicts are walked, other values compared whole)."""
    if isinstance(new, dict) and isinstance(old, dict):
        return [d for k in sorted(set(new) | set(old))
                for d in config_diff(new.get(k), old.get(k), f"{path}.{k}".lstrip("."), labels)]
    return [] if new == old else [f"{path}: {old!r} {labels[1]}, {new!r} {labels[0]}"]


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that rejects a key given twice in one mapping (PyYAML keeps the last silently).

    ``source`` names the file in messages; key paths (``model.num_layers``, ``data.sources[0].path``)
    are computed from the node tree before construction. Merge keys (``<<: *anchor``) may be
    overridden by the mapping's own keys, as YAML specifies.
    """

    source = "<yaml>"

    def construct_document(self, node: yaml.Node) -> Any:
        self._paths: dict[int, str] = {}
        self.key_lines: dict[str, int] = {}  # key path -> 1-based line of the key
        self._index_paths(node, "")
        return super().construct_document(node)

    def _index_paths(self, node: yaml.Node, path: str) -> None:
        if id(node) in self._paths:  # an alias: keep the first path, do not walk twice
            return
        self._paths[id(node)] = path
        if isinstance(node, yaml.MappingNode):
            for key_node, value_node in node.value:
                key = key_node.value if isinstance(key_node, yaml.ScalarNode) else "?"
                child = f"{path}.{key}" if path else str(key)
                if key_node.tag != "tag:yaml.org,2002:merge":
                    self.key_lines.setdefault(child, key_node.start_mark.line + 1)
                self._index_paths(value_node, child)
        elif isinstance(node, yaml.SequenceNode):
            for i, item in enumerate(node.value):
                self._index_paths(item, f"{path}[{i}]")

    def construct_mapping(self, node: yaml.Node, deep: bool = False) -> dict[Any, Any]:
        if isinstance(node, yaml.MappingNode):
            seen: dict[Any, int] = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=True)
                line = key_node.start_mark.line + 1
                try:
                    first = seen.get(key)
                except TypeError:  # unhashable key: SafeConstructor raises its own error below
                    continue
                seen.setdefault(key, line)
                if first is not None:
                    parent = self._paths.get(id(node), "")
                    where = f"{parent}.{key}" if parent else str(key)
                    raise ConfigError(f"{self.source}: key `{where}` is given twice (lines {first} and {line}); "
                                      "YAML would silently keep only the last one: delete or merge one of them")
        return super().construct_mapping(node, deep=deep)


def read_yaml_mapping(path: str | Path, what: str = "recipe file", example: str = "recipes/tiny/smelt.yaml"
                      ) -> dict[str, Any]:
    """The YAML mapping in ``path`` (empty file = {}). Raises ConfigError naming ``what`` and the
    file for a missing file, bad YAML, a key given twice in one mapping (at any level; both line
    numbers), or a document that is not a mapping."""
    return read_yaml_with_lines(path, what, example)[0]


def read_yaml_with_lines(path: str | Path, what: str = "recipe file", example: str = "recipes/tiny/smelt.yaml"
                         ) -> tuple[dict[str, Any], dict[str, int]]:
    """:func:`read_yaml_mapping` and the line of every key: ``(mapping, key_lines)`` with key paths
    such as ``model.hidden_size`` or ``data.sources[0].path`` -> 1-based line, for
    :func:`validate_model`'s messages. Raises ConfigError as :func:`read_yaml_mapping` does."""
    path = Path(path)
    if not path.is_file():
        if looks_like_override(str(path)):
            raise ConfigError(override_hint(str(path)))
        raise ConfigError(f"{what} {str(path)!r} does not exist: pass the path of a YAML file, e.g. {example}")
    loader = _UniqueKeyLoader(path.read_text())
    loader.source = f"{what} {str(path)!r}"
    try:
        raw = loader.get_single_data() or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{what} {str(path)!r} is not valid YAML: {e}") from None
    finally:
        loader.dispose()
    if not isinstance(raw, dict):
        raise ConfigError(f"{what} {str(path)!r} must be a YAML mapping of sections, got {type(raw).__name__}")
    return raw, dict(getattr(loader, "key_lines", {}))


def deep_merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    """Recursive dict merge; values of ``override`` win (dicts merge, everything else, lists
    included, replaces)."""
    out = copy.deepcopy(base)
    for k, v in override.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = deep_merge(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out


def _replaced_paths(base: Any, override: Any, path: str = "") -> list[str]:
    """Key paths where :func:`deep_merge` of ``override`` over ``base`` replaces a value whole."""
    if not (isinstance(base, dict) and isinstance(override, dict)):
        return [path]
    return [p for k, v in override.items() for p in _replaced_paths(base.get(k), v, f"{path}.{k}" if path else str(k))]


def read_recipe(path: str | Path, what: str = "recipe file", example: str = "recipes/tiny/smelt.yaml"
                ) -> tuple[dict[str, Any], dict[str, tuple[str, int]]]:
    """A recipe file with its ``base:`` chain resolved: ``(raw, key_lines)``, ``key_lines`` mapping
    each key path to ``(file, line)`` of the file that set it (for :func:`validate_model`).

    ``base: PATH`` (relative to the recipe file) names another recipe; this file's keys are
    deep-merged over it (:func:`deep_merge`: sections merge key by key, every other value, lists
    included, replaces the base's whole). The base may name a base in turn; a chain that comes
    back to a file is refused naming the files. Raises ConfigError as :func:`read_yaml_with_lines`
    does, and for a ``base`` that is not a path string or names no file."""
    return _read_recipe(Path(path), what, example, ())


def _read_recipe(path: Path, what: str, example: str, chain: tuple[Path, ...]
                 ) -> tuple[dict[str, Any], dict[str, tuple[str, int]]]:
    raw, lines = read_yaml_with_lines(path, what, example)
    shown = os.path.normpath(path) if chain else str(path)  # the recipe as given; its bases as found
    own = {k: (shown, n) for k, n in lines.items() if k != "base" and not k.startswith(("base.", "base["))}
    if "base" not in raw:
        return raw, own
    rel = raw.pop("base")
    where = f"{what} {shown!r}: `base` ({rel!r}, line {lines.get('base')})"
    if not isinstance(rel, str) or not rel.strip():
        raise ConfigError(f"{where} must be the path of the recipe this one extends, relative to this file, "
                          "e.g. base: baseline.yaml")
    base_path = path.parent / rel
    if not base_path.is_file():
        raise ConfigError(f"{where} does not exist (looked for {os.path.normpath(base_path)}); the path is "
                          "relative to the recipe file")
    chain += (path.resolve(),)
    if base_path.resolve() in chain:
        loop = " -> ".join(os.path.normpath(p) for p in chain + (base_path.resolve(),))
        raise ConfigError(f"{where} makes a cycle of bases: {loop}: remove one of these `base:` keys")
    base_raw, base_lines = _read_recipe(base_path, what, example, chain)
    replaced = _replaced_paths(base_raw, raw)
    kept = {k: v for k, v in base_lines.items() if not any(_related(k, r) for r in replaced)}
    return deep_merge(base_raw, raw), {**kept, **own}


def load_config(path: str | Path, overrides: list[str] | None = None) -> RunConfig:
    """Load a YAML recipe (its ``base:`` chain resolved: :func:`read_recipe`), apply ``--set``
    overrides and validate.

    Raises ConfigError for a missing file, bad YAML, a bad ``base``, unknown keys or invalid
    values, naming the file and line, or the ``--set`` item, the bad value came from
    (:func:`validate_model`).
    """
    raw, lines = read_recipe(path)
    return config_from_dict(apply_overrides(raw, overrides), source=str(path), overrides=overrides, key_lines=lines)


def config_to_dict(cfg: RunConfig) -> dict[str, Any]:
    """Plain-data form of a config (JSON/YAML serialisable)."""
    return cfg.model_dump(mode="json")


def dump_config(cfg: RunConfig, path: str | Path | None = None) -> str:
    """Serialise a resolved config to YAML (and write it to ``path`` when given)."""
    text = yaml.safe_dump(config_to_dict(cfg), sort_keys=False)
    if path is not None:
        Path(path).write_text(text)
    return text


def loop_with_repeats(loop: LoopConfig, num_layers: int, repeats: int | None = None,
                   exit_after: int | None = None) -> LoopConfig:
    """The ``loop`` section of a test-time loop count: the trained loop ranges with other repeats.

    ``repeats`` R sets every loop range's repeat count to R (R = 1: the looped layers run once,
    as in an unlooped model of the same unique layers; R = 3: a third visit). ``exit_after`` P is an
    early exit at a loop boundary: every range stops after at most P passes (P = 1: after the
    first pass of the looped block, then the layers above it). Both may be given (``exit_after``
    then caps ``repeats``); neither returns ``loop`` unchanged. The result is ``position: custom``
    with explicit ``ranges`` (same ``order`` and ``input_injection``), so
    ``build_schedule``, ``SmeltLM.set_loop`` and ``cost.budget.compute_budget`` (via
    ``cfg.model_copy(update={"loop": ...})``) all follow the plan actually run. Weights do not depend on
    the loop: unique layers are the same for every repeat count.

    Test-time loop counts follow the looped-LM literature (Ouro's ``total_ut_steps``, Huginn's
    ``num_steps``; early exit at loop boundaries, arXiv 2605.09165).

    Raises ConfigError for R or P < 1, or for a loop section without loop ranges (a Baseline:
    there is nothing to repeat; pass no loop option for it).
    """
    for flag, v in (("--loop-repeats", repeats), ("--exit-after", exit_after)):
        if v is not None and v < 1:
            raise ConfigError(f"`{flag}` ({v}) must be >= 1: 1 runs the looped layers once, "
                              "2 twice (the SMELT default)")
    if repeats is None and exit_after is None:
        return loop
    spans = build_schedule(loop, num_layers).spans
    if not spans:
        raise ConfigError(f"`loop.position` ({loop.position!r}) has no loop range: a test-time loop count "
                          "(`--loop-repeats` / `--exit-after`) applies to looped runs only; evaluate this "
                          "run without it")
    ranges = []
    for s in spans:
        r = s.repeats if repeats is None else repeats
        if exit_after is not None:
            r = min(r, exit_after)
        ranges.append(LoopRange(start=s.start, end=s.end, repeats=r))
    return loop.model_copy(update={"position": "custom", "ranges": ranges})
