"""What a training run logs: per-step means over micro-batches and ranks, their means over each
logging interval, routing statistics, throughput and MFU, ``metrics.jsonl`` + TensorBoard rows
(rank 0), and ``summary.json`` / ``summary.txt``.

A training row of ``metrics.jsonl`` (every ``train.log_every`` optimizer steps and the last):
``loss``, ``lm_loss``, ``aux_loss``, ``z_loss`` are means over the ``loss_steps`` optimizer steps
since the previous row (each step's value is itself the mean over its micro-batches and the
data-parallel ranks); ``loss_last_step`` is the last of those steps' ``loss``. ``tokens_per_s`` is
the interval's tokens over its wall-clock seconds, validation and harness evaluations left out
(checkpoint saves counted). :attr:`RunResult.losses` holds every step's loss.

Units: losses in nats/token, throughput in tokens/s, TFLOP/s per device, memory in bytes, times in
seconds.
"""

from __future__ import annotations

import json
import os
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from smelt_ds.config.run import RunConfig
from smelt_ds.runs.validation_loss import ALL_DEFINITION
from smelt_ds.train.console import summary_lines
from smelt_ds.train.trackers import Tracker, scalars
from smelt_ds.train.validation import describe_validation, validation_windows

__all__ = ["RunResult", "FORM_PEAK_TFLOPS", "DEVICE_PEAK_TFLOPS", "PEAK_TFLOPS", "peak_tflops",
           "layout_peak_tflops", "device_peak_tflops", "memory_bytes", "MicroStats", "IntervalMeans",
           "routing_metrics", "MetricsWriter", "throughput", "write_summary", "VAL_ALL_NOTE"]

#: how validation ``all`` combines the domains (smelt_ds.train.validation.evaluate), said wherever it is printed
VAL_ALL_NOTE = ALL_DEFINITION


#: Dense bf16 Tensor Core peak, TFLOP/s per GPU (no 2:4 structured sparsity: the datasheets'
#: headline bf16 figures are with sparsity, twice these), by GPU family and form factor ("SXM",
#: "PCIE", "NVL"). Sources:
#:
#: * H100 SXM5 989.4, H100 PCIe 756: NVIDIA H100 Tensor Core GPU Architecture whitepaper (2022),
#:   table "NVIDIA H100 compared to A100", Peak BF16 Tensor TFLOPS with FP32 accumulate (dense /
#:   sparse 989.4 / 1978.9 and 756 / 1513).
#: * H100 NVL 835.5: NVIDIA H100 datasheet, H100 NVL column, BF16 Tensor Core 1,671 TFLOPS per GPU
#:   "with sparsity" (half: 835.5 dense).
#: * H200 SXM 989.4, H200 NVL 835.5: NVIDIA H200 datasheet, BF16 Tensor Core 1,979 (SXM) and 1,671
#:   (NVL) TFLOPS with sparsity; the H200 SXM is the H100 SXM's GH100 compute at its clocks, whose
#:   dense value the whitepaper gives as 989.4.
#: * A100 312 (SXM4 and PCIe, 40 GB and 80 GB alike): NVIDIA A100 datasheet, BF16 Tensor Core
#:   312 TFLOPS (624 with sparsity).
#: * B200 2250: NVIDIA GB200 NVL72 / HGX B200 specifications, HGX B200 FP16/BF16 Tensor Core 4.5
#:   PFLOPS per GPU with sparsity (half: 2.25 PFLOPS dense).
FORM_PEAK_TFLOPS: dict[tuple[str, str], float] = {
    ("H100", "SXM"): 989.4, ("H100", "PCIE"): 756.0, ("H100", "NVL"): 835.5,
    ("H200", "SXM"): 989.4, ("H200", "NVL"): 835.5,
    ("A100", "SXM"): 312.0, ("A100", "PCIE"): 312.0,
    ("B200", "SXM"): 2250.0,
}

#: Dense bf16 peak TFLOP/s per GPU (:data:`FORM_PEAK_TFLOPS`) by the exact name
#: ``torch.cuda.get_device_name()`` returns for the device (the driver's product name). A name not
#: listed has no peak: no MFU is reported rather than another part's peak.
DEVICE_PEAK_TFLOPS: dict[str, float] = {
    "NVIDIA H100 80GB HBM3": FORM_PEAK_TFLOPS[("H100", "SXM")],
    "NVIDIA H100 PCIe": FORM_PEAK_TFLOPS[("H100", "PCIE")],
    "NVIDIA H100 NVL": FORM_PEAK_TFLOPS[("H100", "NVL")],
    "NVIDIA H200": FORM_PEAK_TFLOPS[("H200", "SXM")],
    "NVIDIA H200 NVL": FORM_PEAK_TFLOPS[("H200", "NVL")],
    "NVIDIA A100-SXM4-40GB": FORM_PEAK_TFLOPS[("A100", "SXM")],
    "NVIDIA A100-SXM4-80GB": FORM_PEAK_TFLOPS[("A100", "SXM")],
    "NVIDIA A100-PCIE-40GB": FORM_PEAK_TFLOPS[("A100", "PCIE")],
    "NVIDIA A100 80GB PCIe": FORM_PEAK_TFLOPS[("A100", "PCIE")],
    "NVIDIA B200": FORM_PEAK_TFLOPS[("B200", "SXM")],
}

#: Dense bf16 peak TFLOP/s of each family's SXM part (:data:`FORM_PEAK_TFLOPS`), by family name:
#: what a cluster layout that names the family and the SXM form factor gets
#: (:func:`layout_peak_tflops`); never matched against a device name.
PEAK_TFLOPS: dict[str, float] = {family: v for (family, form), v in FORM_PEAK_TFLOPS.items() if form == "SXM"}

#: a word of a layout's GPU name -> its form factor
_FORMS = {"SXM": "SXM", "SXM4": "SXM", "SXM5": "SXM", "SXM6": "SXM", "PCIE": "PCIE", "NVL": "NVL"}


def peak_tflops(device_name: str) -> float | None:
    """Dense bf16 peak of the GPU called ``device_name``, in TFLOP/s per GPU, or None for a name
    not in :data:`DEVICE_PEAK_TFLOPS` (matched exactly, surrounding blanks ignored; sources there)."""
    return DEVICE_PEAK_TFLOPS.get(device_name.strip())


def layout_peak_tflops(gpu: str) -> float | None:
    """Dense bf16 peak in TFLOP/s per GPU of a cluster layout's ``gpu`` (``cluster.layouts.*.gpu``,
    e.g. ``'H100-SXM5-80GB'``), or None. A device name of :data:`DEVICE_PEAK_TFLOPS` is read as
    such; otherwise the name's words (split at blanks, ``-``, ``_``, ``/``; case ignored) must hold
    one family of :data:`FORM_PEAK_TFLOPS` and at most one form factor (``SXM``, ``SXM4/5/6``,
    ``PCIe``, ``NVL``); other words (memory sizes) are ignored. Without a form factor, a family
    whose parts differ (H100, H200) has no peak, one whose parts agree (A100, B200) has theirs."""
    exact = peak_tflops(gpu)
    if exact is not None:
        return exact
    words = [w for w in re.split(r"[\s\-_/]+", gpu.strip().upper()) if w]
    families = {w for w in words if any(w == f for f, _ in FORM_PEAK_TFLOPS)}
    forms = {_FORMS[w] for w in words if w in _FORMS}
    if len(families) != 1 or len(forms) > 1:
        return None
    family = families.pop()
    if forms:
        return FORM_PEAK_TFLOPS.get((family, forms.pop()))
    values = {v for (f, _), v in FORM_PEAK_TFLOPS.items() if f == family}
    return values.pop() if len(values) == 1 else None


def device_peak_tflops() -> float | None:
    """Dense bf16 peak of the current CUDA device in TFLOP/s per GPU (:func:`peak_tflops` of
    ``torch.cuda.get_device_name()``), or None: no CUDA, or a device not in
    :data:`DEVICE_PEAK_TFLOPS` (no MFU is reported then)."""
    if not torch.cuda.is_available():
        return None
    return peak_tflops(torch.cuda.get_device_name())


def memory_bytes() -> int:
    """Peak CUDA memory allocated (bytes), or this process's resident set size on CPU."""
    if torch.cuda.is_available():
        return int(torch.cuda.max_memory_allocated())
    import psutil

    return int(psutil.Process().memory_info().rss)


class MicroStats:
    """Sums over this rank's micro-batches of one optimizer step, kept on the loss's device in
    float64 (no host sync per micro-batch: the values travel to the host once per step, in the
    step's control all-reduce, :mod:`smelt_ds.train.loop`).

    :meth:`local` is the vector ``[finite loss sum, non-finite count, micro-batches, loss sum,
    lm_loss sum, aux_loss sum, z_loss sum]`` (:data:`WIDTH` values); :meth:`means` turns its sum
    over the ranks into the step's means."""

    KEYS = ("loss", "lm_loss", "aux_loss", "z_loss")
    #: values per rank in :meth:`local`
    WIDTH = 3 + len(KEYS)

    def __init__(self) -> None:
        self.acc: torch.Tensor | None = None
        self.present: tuple[str, ...] = ()

    def add(self, out, loss: torch.Tensor) -> None:
        """Add one micro-batch: ``loss`` is the training objective
        (:func:`smelt_ds.train.objective.total_loss`), ``out`` the model's ``LMOutput`` (its
        unweighted ``lm_loss``, ``aux_loss``, ``z_loss``; a None one is left out of the means)."""
        values = dict(zip(self.KEYS, (loss, out.lm_loss, out.aux_loss, out.z_loss), strict=True))
        self.present = tuple(k for k, v in values.items() if v is not None)
        value = loss.detach().double().reshape(())
        finite = torch.isfinite(value)
        zero = torch.zeros((), dtype=torch.float64, device=value.device)
        row = torch.stack([torch.where(finite, value, zero), (~finite).double(), torch.ones_like(value),
                           *(v.detach().double().reshape(()).to(value.device) if v is not None else zero
                             for v in values.values())])
        self.acc = row if self.acc is None else self.acc + row

    def local(self) -> torch.Tensor:
        """This rank's sums since the last call (``(WIDTH,)`` float64 on the loss's device); resets."""
        if self.acc is None:
            raise ValueError("MicroStats.local() without a micro-batch since the last call")
        acc, self.acc = self.acc, None
        return acc

    def means(self, totals: list[float]) -> dict[str, float]:
        """The step's means over every rank's micro-batches, from :meth:`local`'s vector summed
        over the ranks: ``{loss, lm_loss, aux_loss, z_loss}`` (those the model returned; a
        non-finite loss on any rank makes ``loss`` non-finite)."""
        n = max(totals[2], 1.0)
        return {k: totals[3 + i] / n for i, k in enumerate(self.KEYS) if k in self.present}


@dataclass
class IntervalMeans:
    """Per-step means (``MicroStats.means()``) since the last log row: :meth:`pop` returns their
    means over the steps of the interval, ``loss_last_step`` and ``loss_steps`` (steps averaged)."""

    n: int = 0
    sums: dict[str, float] = field(default_factory=dict)
    last: dict[str, float] = field(default_factory=dict)

    def add(self, step_means: dict[str, float]) -> None:
        self.n += 1
        self.last = dict(step_means)
        for k, v in step_means.items():
            self.sums[k] = self.sums.get(k, 0.0) + v

    def pop(self) -> dict[str, float]:
        """``{loss, lm_loss, ...: interval means, loss_last_step, loss_steps}``; resets. Raises
        ValueError when no step was added since the last call."""
        if not self.n:
            raise ValueError("IntervalMeans.pop() without a step since the last pop")
        out: dict[str, float] = {k: v / self.n for k, v in self.sums.items()}
        if "loss" in self.last:
            out["loss_last_step"] = self.last["loss"]
        out["loss_steps"] = self.n
        self.n, self.sums, self.last = 0, {}, {}
        return out


def throughput(windows: list[tuple[int, float]]) -> dict[str, float | int | None]:
    """Throughput of the logged windows ``[(tokens, seconds), ...]`` of one invocation.

    With two windows or more the first (compilation, allocator and cache warm-up) is left out:
    ``tokens_per_s`` = tokens / seconds summed over the later windows (token-weighted), and
    ``startup_s`` = the first window's seconds minus what its tokens take at that rate (the
    start-up cost: compile time when ``train.compile`` is set). With one window, that window's rate
    and ``startup_s`` None; with none, all None. Also ``first_window_s`` (seconds) and
    ``throughput_windows`` (windows logged)."""
    out: dict[str, float | int | None] = {"tokens_per_s": None, "first_window_s": None, "startup_s": None,
                                          "throughput_windows": len(windows)}
    if not windows:
        return out
    first_tokens, first_s = windows[0]
    out["first_window_s"] = first_s
    later = windows[1:] or windows
    tps = sum(t for t, _ in later) / max(sum(s for _, s in later), 1e-9)
    out["tokens_per_s"] = tps
    if len(windows) >= 2:
        out["startup_s"] = max(0.0, first_s - first_tokens / tps)
    return out


def routing_metrics(model) -> dict[str, float]:
    """``router/L{l}V{v}/load_max_over_mean`` and ``router/L{l}/divergence_{a}{b}`` of the last
    micro-batch on this rank."""
    rec = getattr(model, "recorder", None)
    if rec is None:
        return {}
    out = {}
    for visit, s in rec.router_stats().items():
        out[f"router/L{visit.layer}V{visit.visit}/load_max_over_mean"] = s["load_max_over_mean"]
        out[f"router/L{visit.layer}V{visit.visit}/dropped_share"] = s["dropped_share"]
    for (layer, a, b), d in rec.divergence().items():
        out[f"router/L{layer}/divergence_v{a}v{b}"] = d
    return out


class MetricsWriter:
    """``metrics.jsonl`` rows and TensorBoard scalars, and the same rows to the experiment
    trackers (:mod:`smelt_ds.train.trackers`), written by rank 0 only."""

    def __init__(self, run_dir: Path, enabled: bool, start_step: int, trackers: Sequence[Tracker] = ()):
        """``start_step``: the step training continues from (0 for a new run). Rows logged after
        it by an earlier, interrupted invocation are dropped from ``metrics.jsonl`` (rewritten
        atomically) and hidden in TensorBoard (``SummaryWriter(purge_step=start_step + 1)``), so a
        resumed run's logs hold each step once. ``trackers``: started trackers
        (:func:`smelt_ds.train.trackers.start_trackers`), each given every row's numeric fields
        (:func:`smelt_ds.train.trackers.scalars`); one that raises is reported and dropped, the
        others and the files go on."""
        self.enabled = enabled
        self.path = run_dir / "metrics.jsonl"
        self.trackers = list(trackers)
        self.tb = None
        if enabled:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(run_dir / "tb"), purge_step=start_step + 1)
            if self.path.exists():
                keep = [line for line in self.path.read_text().splitlines()
                        if start_step and line.strip() and json.loads(line).get("step", 0) <= start_step]
                tmp = self.path.with_name(self.path.name + ".tmp")
                tmp.write_text("".join(line + "\n" for line in keep))
                os.replace(tmp, self.path)

    def write(self, step: int, row: dict[str, Any]) -> None:
        if not self.enabled:
            return
        row = {"step": step, **row}
        with self.path.open("a") as f:
            f.write(json.dumps(row) + "\n")
        values = scalars(row)
        assert self.tb is not None  # created when enabled
        for k, v in values.items():
            self.tb.add_scalar(k, v, step)
        for tracker in list(self.trackers):
            try:
                tracker.log(step, values)
            except Exception as e:  # noqa: BLE001 - a tracker's outage must not stop training
                self.trackers.remove(tracker)
                print(f"tracking: {tracker.name} failed at step {step} ({type(e).__name__}: {e}); no further rows "
                      "go to it (metrics.jsonl, TensorBoard and the other trackers go on)", file=sys.stderr)

    def flush(self) -> None:
        """Write TensorBoard's buffered events now (``metrics.jsonl`` rows are on disk as written)."""
        if self.tb is not None:
            self.tb.flush()

    def close(self) -> None:
        if self.tb is not None:
            self.tb.flush()
            self.tb.close()
        for tracker in self.trackers:
            tracker.close()
        self.trackers = []


@dataclass
class RunResult:
    """What :func:`train` returns (rank-local view, reduced values where noted)."""

    run_dir: Path
    step: int
    tokens_seen: int
    losses: list[float]  # loss per optimizer step (mean over micro-batches and ranks)
    lrs: list[float]
    val: dict[str, float]
    sample_ids: list[list[int]]  # per optimizer step, this rank's sample ids (data order checks)
    stopped_early: bool = False
    #: why training stopped before max_steps: "signal", "stop_file", "launcher" (smelt_ds.train.stop),
    #: "skips" (train.step_guard) or "exit_after_steps"
    stop_reason: str | None = None
    windows: list[tuple[int, float]] = field(default_factory=list)  # logged windows: (tokens, seconds)
    threads: dict[str, Any] = field(default_factory=dict)  # CPU thread choice: {"torch_threads", "reason"}


def write_summary(out_dir: Path, cfg: RunConfig, result: RunResult, budget, data) -> None:
    """Write ``summary.json`` and ``summary.txt`` (and print the text) at the end of a run.

    ``final_train_loss`` / ``final_lm_loss``: the last training row of ``metrics.jsonl``, i.e. the
    mean over its ``loss_steps`` (``final_loss_steps``) steps, the last ``train.log_every`` window.
    ``tokens_per_s``: :func:`throughput` of this invocation's windows (the first one left out when
    there are two or more), with ``first_window_s``, ``startup_s`` and ``throughput_windows``.
    ``validation_loss``: the last validation (nats/token; ``all`` as :data:`VAL_ALL_NOTE` says), on
    ``validation_windows`` windows per domain (:func:`smelt_ds.train.validation.validation_windows`).
    ``threads``: this rank's CPU thread choice."""
    metrics = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    last: dict[str, Any] = next((m for m in reversed(metrics) if "loss" in m), {})
    summary = {
        "name": cfg.name, "steps": result.step, "tokens": result.tokens_seen,
        "final_train_loss": last.get("loss"), "final_lm_loss": last.get("lm_loss"),
        "final_loss_steps": last.get("loss_steps", 1 if last else None),
        "validation_loss": result.val, "validation_windows": validation_windows(data) if result.val else {},
        **throughput(result.windows),
        "unigram_entropy_nats": getattr(data, "unigram_entropy", None),
        "threads": result.threads,
        "compile": cfg.train.compile,
        "budget": budget.as_dict(),
    }
    tmp = out_dir / "summary.json.tmp"
    tmp.write_text(json.dumps(summary, indent=2))
    os.replace(tmp, out_dir / "summary.json")
    val_windows = describe_validation(data, cfg) if result.val else None
    text = "\n".join(summary_lines(summary, VAL_ALL_NOTE, out_dir, val_windows))
    (out_dir / "summary.txt").write_text(text + "\n")
    print(text)
