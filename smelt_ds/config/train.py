"""The ``train`` section of a recipe: the training loop (lengths in tokens, durations in optimizer
steps), its activation checkpointing, the loss coefficients, compilation; and the batch it
resolves to on a number of data-parallel ranks (:func:`resolve_batch`).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from smelt_ds.config.schema import StrictModel
from smelt_ds.errors import fail

__all__ = ["ActivationCheckpointing", "StepGuard", "TrainConfig", "Watchdog", "check_train", "resolve_batch"]


class ActivationCheckpointing(StrictModel):
    """Which visits recompute their activations in backward (docs/memory.md)."""

    policy: Literal["none", "full", "looped", "every_n"] = Field(
        "none", description="none | full (every visit) | looped (visits of looped layers) | every_n")
    every_n: int = Field(2, gt=0, description="every_n policy: checkpoint every n-th visit of the plan")
    impl: Literal["torch", "deepspeed"] = Field(
        "torch", description="torch: non-reentrant torch.utils.checkpoint; deepspeed: deepspeed.checkpointing")
    partition_activations: bool = Field(
        False, description="deepspeed impl: shard checkpoints across model-parallel ranks")
    cpu_checkpointing: bool = Field(False, description="deepspeed impl: keep checkpoints in CPU memory")
    contiguous_memory_optimization: bool = Field(False, description="deepspeed impl: contiguous checkpoint buffers")


class StepGuard(StrictModel):
    """What a step with a non-finite loss or gradient norm, or a loss spike, does: the update is
    skipped on every rank together (the weights, optimizer moments and LR schedule stay as they
    were; the batch is consumed), and a run that skips too many steps in a row stops with its
    last good state saved (docs/faults.md)."""

    max_consecutive_skips: int = Field(
        5, gt=0, description="stop (exit status 3, after saving the last good state) once this many consecutive "
                             "steps were skipped")
    loss_spike_factor: float | None = Field(
        None, gt=1, description="also skip a step whose loss (mean over the ranks) exceeds this factor times the "
                                "median of the last loss_spike_window kept steps' losses; null: off")
    loss_spike_window: int = Field(
        100, ge=10, description="steps of loss history for loss_spike_factor (the check starts once 10 are kept)")


class Watchdog(StrictModel):
    """Hang detection: a rank that finishes no step within the timeout dumps every thread's Python
    stack into ``<run_dir>/hangs/`` (and asks the other ranks on its host to dump theirs) and
    exits with status 124, so the job ends and a scheduler can requeue it; and the process
    group's collective timeouts (torch.distributed), set explicitly rather than left at the
    backends' defaults (gloo 30 min, NCCL 10 min)."""

    enabled: bool = Field(True, description="run the hang watchdog")
    timeout_s: float | None = Field(
        None, gt=0, description="seconds a step may take before the watchdog fires; null: derived, "
                                "max(min_timeout_s, step_time_factor x the slowest step so far)")
    step_time_factor: float = Field(10.0, gt=1, description="derived timeout: this many times the slowest step")
    min_timeout_s: float = Field(300.0, gt=0, description="derived timeout: never below this many seconds")
    startup_timeout_s: float = Field(
        1800.0, gt=0, description="timeout of the first startup_steps steps (compilation, first collectives) and "
                                  "of every checkpoint save, validation and harness evaluation")
    startup_steps: int = Field(2, ge=1, description="steps measured before the derived timeout applies")
    init_timeout_s: float = Field(
        1800.0, gt=0, description="collective timeout (seconds) while the process group starts and until the "
                                  "first steps are done (torch.distributed init_process_group timeout)")
    collective_timeout_s: float = Field(
        600.0, gt=0, description="collective timeout (seconds) after the first startup_steps steps: a collective "
                                 "that waits longer for a peer fails (exit status 75)")


class TrainConfig(StrictModel):
    """Training loop settings. Lengths in tokens, durations in optimizer steps, LR in units of
    the optimizer's step size."""

    seed: int = Field(1234, description="torch seed set before the weights are initialised (weight init, dropout, "
                                        "router jitter); the data order has its own data.seed")
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
                                  "(4 bytes per parameter per checkpoint; 12 with train.layout_free_state): "
                                  "every_save; newest (written at every save, "
                                  "removed from a checkpoint once a newer one is complete); minimal (as newest, except "
                                  "on the reference backend at ZeRO 1-3, whose DeepSpeed files export every "
                                  "checkpoint: "
                                  "only the run's last save). The newest and the final checkpoint always export; "
                                  "docs/checkpoint_cost.md")
    layout_free_state: bool = Field(
        True, description="every checkpoint carries the reference-layout weights and AdamW's moments and step in "
                          "the same layout (12 bytes per parameter; train.reference_weights minimal then acts as "
                          "newest: older checkpoints drop them), so that --resume continues the run at another "
                          "number of ranks, expert-parallel size, ZeRO stage or MoE backend (docs/changing_scale.md)")
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
                            "visit reuses it, and the output head; all backends and ZeRO stages); model (the "
                            "whole forward through DeepSpeed's engine.compile; reference backend, ZeRO 0-2)")
    compile_backend: Literal["inductor", "aot_eager", "eager"] = Field(
        "inductor", description="torch.compile backend for train.compile: inductor generates kernels; aot_eager and "
                                "eager only trace (debugging a graph break or a numerical difference)")
    step_guard: StepGuard = Field(default_factory=StepGuard)
    watchdog: Watchdog = Field(default_factory=Watchdog)
    deterministic: bool = Field(
        False, description="bit-identical reruns on CPU: torch.use_deterministic_algorithms and one intra-op thread "
                           "per rank (overrides the thread choice; slower); see docs/training.md 'Reproducibility'")


def check_train(t: TrainConfig) -> None:
    """The warmup fits in the run; a compile backend is named only for a run that compiles. Raises
    ConfigError naming the field, its value and the fix."""
    if t.warmup_steps > t.max_steps:
        fail("train.warmup_steps", t.warmup_steps, f"must be <= `train.max_steps` ({t.max_steps})",
              "shorten the warmup or train longer")
    if t.compile == "none" and t.compile_backend != "inductor":
        fail("train.compile_backend", t.compile_backend, "only applies when train.compile is 'layers' or 'model' "
             "(this recipe compiles nothing)", "set train.compile: layers, or remove train.compile_backend")


def _batch_fix(t: TrainConfig, data_parallel_size: int) -> str:
    """The nearest values that make ``resolve_batch`` work: data-parallel sizes (ranks) below and
    above ``data_parallel_size`` that divide the global batch's micro-batches, and the multiples of
    the per-step tokens around ``train.global_batch_tokens``."""
    assert t.global_batch_tokens is not None
    per_rank = t.micro_batch_size * t.seq_len
    micro_batches = t.global_batch_tokens // per_rank if t.global_batch_tokens % per_rank == 0 else 0
    ranks = [d for d in range(1, micro_batches + 1) if micro_batches % d == 0]
    below = max((d for d in ranks if d < data_parallel_size), default=None)
    above = min((d for d in ranks if d > data_parallel_size), default=None)
    near = " or ".join(str(d) for d in (below, above) if d is not None)
    per_micro = per_rank * data_parallel_size
    lower = (t.global_batch_tokens // per_micro) * per_micro
    upper = lower + per_micro
    tokens = " or ".join(f"{v:,}" for v in (lower, upper) if v > 0)
    where = f"run on {near} ranks (nodes x GPUs per node; every rank reads its own micro-batches), or " if near else ""
    return (f"{where}set train.global_batch_tokens to {tokens} on {data_parallel_size} rank(s), or change "
            "micro_batch_size")


def resolve_batch(t: TrainConfig, data_parallel_size: int) -> tuple[int, int]:
    """``(gradient_accumulation_steps, global_batch_tokens)`` of the ``train`` section ``t`` on
    ``data_parallel_size`` ranks.

    global_batch_tokens = micro_batch_size * seq_len * accumulation * data_parallel_size. Raises
    ConfigError when ``train.global_batch_tokens`` is not a multiple of the per-step tokens or
    disagrees with an explicit ``train.gradient_accumulation_steps``.
    """
    per_micro = t.micro_batch_size * t.seq_len * data_parallel_size
    if t.global_batch_tokens is None:
        accum = t.gradient_accumulation_steps or 1
        return accum, per_micro * accum
    if t.global_batch_tokens % per_micro:
        fail("train.global_batch_tokens", t.global_batch_tokens,
              f"must be a multiple of micro_batch_size * seq_len * data-parallel size "
              f"({t.micro_batch_size} * {t.seq_len} * {data_parallel_size} = {per_micro})",
              _batch_fix(t, data_parallel_size))
    accum = t.global_batch_tokens // per_micro
    if t.gradient_accumulation_steps is not None and t.gradient_accumulation_steps != accum:
        fail("train.gradient_accumulation_steps", t.gradient_accumulation_steps,
              f"disagrees with `train.global_batch_tokens` ({t.global_batch_tokens}), which needs {accum} "
              f"on {data_parallel_size} rank(s)", "set only one of them")
    return accum, t.global_batch_tokens
