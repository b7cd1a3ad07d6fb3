"""What training prints on rank 0 (stderr): a start-up banner, a line every ``train.log_every`` steps
and validation lines, in the style of Megatron-LM and torchtitan; the final summary block is
:func:`summary_lines` (``summary.txt``, printed by :func:`smelt_ds.train.metrics.write_summary`).

The formatting functions are pure (strings from numbers); :class:`Console` only decides where the
strings go: with stderr on a terminal, a tqdm progress bar runs below the lines (printed with
``tqdm.write`` so they never break the bar); otherwise (a log file, a pipe, a scheduler's output)
there is no bar and the lines are plain.

Units: losses in nats/token, throughput in tokens/s (all ranks), TFLOP/s per device, memory in GiB
(2**30 bytes), times in seconds.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any, TextIO

from smelt_ds.config.run import RunConfig
from smelt_ds.cost.budget import Budget
from smelt_ds.parallel.threads import ThreadChoice

__all__ = ["LABEL_WIDTH", "describe_loop", "banner", "step_line", "val_line", "summary_lines", "format_duration",
           "Console"]

#: width of the label column of the banner and of the summary block (characters)
LABEL_WIDTH = 14
_GIB = float(1 << 30)


def _plural(n: int, word: str) -> str:
    return f"{n:,} {word}{'s' * (n != 1)}"


def _three_digits(x: float) -> str:
    """Three significant digits without an exponent: 0.0340, 1.23, 123, 1234."""
    if not x > 0 or not math.isfinite(x):
        return f"{x:.0f}" if math.isfinite(x) else str(x)
    return f"{x:.{max(0, 2 - math.floor(math.log10(x)))}f}"


def _block(title: str, rows: list[tuple[str, str]]) -> str:
    return "\n".join([title] + [f"  {label:<{LABEL_WIDTH}}{value}" for label, value in rows])


def describe_loop(cfg: RunConfig) -> str:
    """``"SMELT: layers [1, 3) x2 (block order), 6 visits of 4 unique layers"``, or
    ``"Baseline (no loop), 8 visits of 8 unique layers"``."""
    schedule = cfg.schedule
    depth = f"{schedule.effective_depth} visits of {schedule.num_layers} unique layers"
    if not schedule.spans:
        return f"Baseline (no loop), {depth}"
    spans = ", ".join(f"[{s.start}, {s.end}) x{s.repeats}" for s in schedule.spans)
    return f"SMELT: layers {spans} ({schedule.order} order, loop.position {cfg.loop.position}), {depth}"


def banner(cfg: RunConfig, *, run_dir: str | Path, world: int, accum: int, budget: Budget, precision: str,
           device: str, threads: ThreadChoice, start_step: int = 0) -> str:
    """The start-up banner (about 11 lines): run, layout, parameters, the three budgets, batch,
    schedule, compilation and threads.

    Args:
        run_dir: the run directory.
        world: ranks (the data-parallel size: every rank reads its own micro-batches).
        accum: gradient-accumulation steps (micro-batches per optimizer step).
        budget: :func:`smelt_ds.cost.budget.compute_budget` of ``cfg`` at ``train.seq_len``.
        precision: the resolved training precision (``fp32`` or ``bf16``).
        device: e.g. ``"cpu"`` or ``"cuda (NVIDIA H100 80GB HBM3)"``.
        threads: this rank's CPU thread choice (:func:`smelt_ds.parallel.threads.thread_choice`).
        start_step: the step a resumed run continues from (0: a new run).
    """
    t, rt, ds = cfg.train, cfg.moe_runtime, cfg.deepspeed
    ep = rt.ep_size if rt.backend != "reference" else 1
    zero = f"ZeRO-{ds.zero_stage}"
    offload = [f"{what} offload {where}" for what, where in (("optimizer", ds.offload_optimizer),
                                                             ("parameter", ds.offload_param)) if where != "none"]
    if offload:
        zero += f" ({', '.join(offload)})"
    tokens_per_step = t.micro_batch_size * t.seq_len * accum * world
    total = budget.non_embedding_params + budget.embedding_params
    resumed = f"resumed at step {start_step:,}" if start_step else "new run"
    rows = [
        ("run dir", f"{run_dir} ({resumed})"),
        ("model", describe_loop(cfg)),
        ("layout", f"{world} rank{'s' * (world != 1)}: data-parallel {world}, expert-parallel {ep}, "
                   f"MoE backend {rt.backend}, {zero}, {precision} on {device}"),
        ("params", f"{total:,} total = {budget.non_embedding_params:,} non-embedding + {budget.embedding_params:,} "
                   f"embedding/head; {budget.active_non_embedding_params:,} non-embedding active per token"),
        ("budgets", f"{budget.forward_flops_per_token:,.0f} forward FLOPs/token | {budget.non_embedding_params:,} "
                    f"non-embedding params | {budget.kv_cache_bytes_per_token:,} KV-cache bytes/token "
                    f"({budget.kv_dtype})"),
        ("batch", f"{tokens_per_step:,} tokens/step = micro-batch {t.micro_batch_size} x seq_len {t.seq_len} "
                  f"x accumulation {accum} x data-parallel {world}"),
        ("schedule", f"{t.max_steps:,} steps = {t.max_steps * tokens_per_step:,} tokens; lr {t.lr:.2e} {t.schedule}, "
                     f"warmup {_plural(t.warmup_steps, 'step')}; log every {t.log_every}, "
                     f"validate every {t.eval_every}, save every {t.save_every}"),
        ("compile", f"{t.compile}" + (f" (backend {t.compile_backend})" if t.compile != "none" else "")
                    + f"; activation checkpointing {t.activation_checkpointing.policy}"),
        ("threads", threads.describe()),
        ("deterministic", "on (torch.use_deterministic_algorithms, 1 thread per rank)" if t.deterministic
                          else "off (train.deterministic: false)"),
    ]
    return _block(f"smelt-ds train: {cfg.name}", rows)


def format_duration(seconds: float) -> str:
    """``"45s"``, ``"3m05s"``, ``"2h07m"``."""
    s = max(0, int(round(seconds)))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def step_line(step: int, max_steps: int, row: dict[str, Any], cuda: bool = False, eta_s: float | None = None) -> str:
    """One periodic log line from a ``metrics.jsonl`` row, e.g.
    ``step   10/1000 | loss 5.1234 | lr 3.00e-04 | grad_norm 1.234 | 2,345 tok/s | 0.0284 TFLOP/s | rss 1.23 GiB``.

    ``loss`` is the row's (the mean over the steps since the previous row), ``tok/s`` over all
    ranks, ``TFLOP/s`` per device (training FLOPs of the budget), ``MFU`` where the row has it;
    memory is peak allocated CUDA memory (``mem``, ``cuda``) or this process's resident set
    (``rss``, CPU). ``eta_s``: estimated seconds to ``max_steps``."""
    width = len(str(max_steps))
    parts = [f"step {step:>{width}}/{max_steps}", f"loss {row.get('loss', float('nan')):.4f}", f"lr {row['lr']:.2e}"]
    if row.get("skipped_steps"):
        parts.append(f"skipped {row['skipped_steps']}")
    if row.get("grad_norm") is not None:
        parts.append(f"grad_norm {row['grad_norm']:.3f}")
    parts += [f"{row['tokens_per_s']:,.0f} tok/s", f"{_three_digits(row['tflops_per_device'])} TFLOP/s"]
    if row.get("mfu") is not None:
        parts.append(f"MFU {100 * row['mfu']:.1f}%")
    parts.append(f"{'mem' if cuda else 'rss'} {row['memory_bytes'] / _GIB:.2f} GiB")
    if eta_s is not None:
        parts.append(f"eta {format_duration(eta_s)}")
    return " | ".join(parts)


def val_line(step: int, val: dict[str, float]) -> str:
    """``val  step 50 | all 4.7812 | code 4.5134 | text 5.0490`` (nats/token; ``all`` first)."""
    keys = (["all"] if "all" in val else []) + sorted(k for k in val if k != "all")
    return " | ".join([f"val  step {step}"] + [f"{k} {val[k]:.4f}" for k in keys])


def summary_lines(summary: dict[str, Any], val_note: str, run_dir: str | Path, val_windows: str | None = None
                  ) -> list[str]:
    """The final summary block (``summary.txt``) from ``summary.json``'s dict.

    ``val_note`` says how ``all`` combines the domains, ``val_windows`` (a ``val windows`` row) which
    windows the validation read (:func:`smelt_ds.train.validation.describe_validation`); ``summary``
    keys used: name, steps, tokens, tokens_per_s, throughput_windows, first_window_s, startup_s, final_train_loss,
    final_lm_loss, final_loss_steps, validation_loss, unigram_entropy_nats, budget."""
    tps, n = summary.get("tokens_per_s"), summary.get("throughput_windows") or 0
    if tps is None:
        speed = "not measured (no logged window)"
    elif n >= 2:
        speed = (f"{tps:,.0f} tokens/s steady state ({_plural(n - 1, 'logged window')} after the first); first window "
                 f"{summary['first_window_s']:.1f} s, {summary['startup_s']:.1f} s of it start-up "
                 + ("(warm-up, compilation)" if summary.get("compile", "none") != "none" else "(warm-up)"))
    else:
        speed = f"{tps:,.0f} tokens/s (one logged window, start-up included)"
    rows = [("throughput", speed)]
    if summary.get("final_train_loss") is not None:
        k = summary.get("final_loss_steps") or 1
        rows.append(("train loss", f"{summary['final_train_loss']:.4f} (LM {summary['final_lm_loss']:.4f}), mean "
                                   f"over the last {_plural(k, 'step')} (the last train.log_every window)"))
    val = summary.get("validation_loss") or {}
    for key in (["all"] if "all" in val else []) + sorted(k for k in val if k != "all"):
        rows.append((f"val [{key}]", f"{val[key]:.4f} nats/token" + (f" ({val_note})" if key == "all" else "")))
    if val and val_windows:
        rows.append(("val windows", val_windows))
    if summary.get("unigram_entropy_nats") is not None:
        rows.append(("unigram", f"{summary['unigram_entropy_nats']:.4f} nats/token (entropy of the training "
                                "tokens: the loss of a model that ignores context)"))
    b = summary["budget"]
    rows.append(("budgets", f"{b['forward_flops_per_token']:,.0f} forward FLOPs/token | {b['non_embedding_params']:,} "
                            f"non-embedding params (embedding and head excluded) | {b['kv_cache_bytes_per_token']:,} "
                            f"KV-cache bytes/token ({b['kv_dtype']}) | {b['visits']} visits / {b['unique_layers']} "
                            "unique layers"))
    rows.append(("run dir", str(run_dir)))
    title = f"summary: {summary['name']}, {summary['steps']:,} steps, {summary['tokens']:,} tokens"
    return _block(title, rows).splitlines()


class Console:
    """Rank 0's console: :meth:`line` prints a line, :meth:`advance` moves the progress bar.

    With ``stream`` (default stderr) on a terminal a tqdm bar shows the steps and the last step's
    loss, and lines go through ``tqdm.write``; otherwise no bar and plain lines. Other ranks print
    nothing."""

    def __init__(self, enabled: bool, start: int, total: int, stream: TextIO | None = None):
        self.enabled, self.stream = enabled, stream if stream is not None else sys.stderr
        self.bar = None
        self._start, self._total = start, total

    def start_bar(self) -> None:
        """Show the bar (terminal only); call after the banner."""
        isatty = getattr(self.stream, "isatty", None)
        if self.enabled and isatty is not None and isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=self._total, initial=self._start, desc="train", unit="step", dynamic_ncols=True,
                            file=self.stream, leave=False)

    def line(self, text: str) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.write(text, file=self.stream)
        else:
            print(text, file=self.stream, flush=True)

    def advance(self, loss: float) -> None:
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(loss=f"{loss:.3f}")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
