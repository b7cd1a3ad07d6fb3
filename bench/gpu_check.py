"""One script for the first GPU we get: speed, MFU, memory and attention kernels of smelt-ds on one GPU.

    python bench/gpu_check.py --out DIR            # one CUDA GPU (an H200): about 7 minutes
    python bench/gpu_check.py --dry-run --out DIR  # CPU, fp32, tiny sizes: the same code, about a minute
    python bench/gpu_check.py --dry-run --sections sdpa,memory --out DIR   # some sections only

What it measures, each section in its own process with its own time budget (a section that
fails, hangs or runs out of time is recorded as such, with the exception text and the tail of its
traceback and log, and the next section runs):

- ``sdpa`` (d): which ``F.scaled_dot_product_attention`` backend the model's attention runs for
  the recipe's shapes (bf16 on CUDA): each of flash / memory-efficient / cuDNN / math forced
  with ``torch.nn.attention.sdpa_kernel`` (works or not, and its forward+backward time), and the
  one the default dispatch picks, read from the aten op the profiler records.
- ``moe_layer`` (a): ``bench/moe_layer.py``'s forward+backward of our MoE layer (loop and
  grouped_mm experts) vs transformers' Qwen3-MoE block (eager, batched_mm, grouped_mm experts)
  at the recipe's MoE shape, as ratios to transformers' fastest.
- ``train_eager`` / ``train_compiled`` (b): optimizer steps of the single-GPU S-family recipe
  through the real training path (``smelt_ds.train.build.build`` -> DeepSpeed engine; forward,
  ``total_loss``, ``engine.backward``, the pre-step gradient norm, ``engine.step`` as
  ``smelt_ds/train/loop.py`` runs them) eager and with ``train.compile=layers``: median step
  time after warm-up, tokens/s, first-step (compile) time, achieved TFLOP/s from
  ``compute_budget(cfg).train_flops_per_token`` and MFU against the H200's dense bf16 peak, the
  allocator peak, and a short ``torch.profiler`` run (top 15 CUDA kernels by device time).
- ``memory`` (c): ``smelt-ds memory --measure``'s measurement
  (``smelt_ds.study.memory_profile.measure``) for the same recipe: the CUDA allocator peak
  next to the analytic prediction, and their ratio.

The single-GPU recipe is ``recipes/s/smelt.yaml`` with its architecture and loop plan unchanged
(11 unique layers, 16 visits, 94 experts): ``smelt-ds memory`` predicts it fits the H200's
140 GiB on one GPU (at most about 103 GiB) at ZeRO-2 with micro-batch 8 (the recipe's h200
layout), so no layers or experts are removed; what changes is one GPU and no gradient accumulation
(one micro-batch per optimizer step). A training leg that runs out of CUDA memory is retried once
with half the micro-batch, and the later sections use that size too; the output says so.

Output (``--out DIR`` or ``$OUT``): ``gpu_check.json`` (machine, every section's numbers or error,
a summary), rewritten atomically after every section so that a killed run keeps what finished;
``gpu_check.txt`` (the same as tables); ``logs/SECTION.log`` (each section's output). Exit status:
0 every section ran, 1 some section failed or was skipped (the reason is in the JSON), 2 no output directory, no
CUDA without ``--dry-run``. A Python module a section needs (e.g. deepspeed) that is missing skips that
section, recorded as such (nothing is installed).

Takes: about 7 minutes on one H200 (``--budget-s``, default 420 s, is shared among the sections;
time one section leaves unused goes to the later ones), about a minute for ``--dry-run`` on two
CPU cores. Afterwards paste ``gpu_check.txt`` into docs/results/benchmarks.md under a dated
"Measured on one GPU" heading, with the commit it ran on; a dry run's numbers are not measurements (the text says so).
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import importlib.util
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
BENCH = Path(__file__).resolve().parent
for _p in (str(BENCH), str(ROOT)):  # smelt_ds and bench/moe_layer.py importable without installing
    if _p not in sys.path:
        sys.path.insert(0, _p)

JSON_NAME, TEXT_NAME, LOG_DIR = "gpu_check.json", "gpu_check.txt", "logs"

#: sections in the order they run; the shares of ``--budget-s`` each may use
SECTIONS = ("sdpa", "moe_layer", "eval_device", "train_eager", "memory", "train_compiled")
BUDGET_SHARE = {"sdpa": 0.06, "moe_layer": 0.11, "eval_device": 0.04, "train_eager": 0.23, "memory": 0.18,
                "train_compiled": 0.36}
#: importable modules each section needs (checked before it starts; nothing is installed)
NEEDS = {"sdpa": ("torch", "yaml", "pydantic"),
         "moe_layer": ("torch", "yaml", "pydantic", "transformers"),
         "eval_device": ("torch", "yaml", "pydantic"),
         "train_eager": ("torch", "yaml", "pydantic", "deepspeed", "hjson"),
         "memory": ("torch", "yaml", "pydantic", "deepspeed", "hjson"),
         "train_compiled": ("torch", "yaml", "pydantic", "deepspeed", "hjson")}
TRAIN_SECTIONS = ("train_eager", "train_compiled")
FAIL_MODES = ("raise", "exit", "hang")
SDPA_BACKENDS = ("flash", "efficient", "cudnn", "math")
#: aten op of each SDPA backend (forward), as the profiler names it
SDPA_OPS = {"aten::_scaled_dot_product_flash_attention_for_cpu": "flash",
            "aten::_scaled_dot_product_flash_attention": "flash",
            "aten::_scaled_dot_product_efficient_attention": "efficient",
            "aten::_scaled_dot_product_cudnn_attention": "cudnn",
            "aten::_scaled_dot_product_attention_math": "math",
            "aten::_scaled_dot_product_fused_attention_overrideable": "overrideable"}
PEAK_SOURCE = ("NVIDIA H200 datasheet: 989 TFLOP/s BF16 Tensor Core, dense (the datasheet's 1979 is with 2:4 "
               "sparsity); smelt_ds.train.metrics.PEAK_TFLOPS['H200']")
FLOPS_CONVENTION = ("smelt_ds.cost.budget.compute_budget(cfg, seq_len).train_flops_per_token: 3 x forward, matrix "
                    "multiplies only (2 FLOPs per multiply-add): q/k/v/o projections, attention scores and values "
                    "over all seq_len keys ('full', Hoffmann et al. 2022 App. F; causal masking does half that "
                    "attention work, see the *_causal numbers), router, top-k experts, output head; per visit")
MIN_SECTION_S = 5.0


# ---------------------------------------------------------------------------------------------
# what to run: sizes of a GPU run and of a dry run
# ---------------------------------------------------------------------------------------------


def make_plan(args: argparse.Namespace) -> dict[str, Any]:
    """The sizes every section reads (passed to the section processes as JSON).

    GPU: ``recipes/s/smelt.yaml`` at micro-batch 8 (tokens per step ``8 * 4096``), bf16; MoE layer
    at T = 8192 and 32768 tokens. Dry run: ``recipes/tiny/smelt.yaml`` at micro-batch 2 and
    seq_len 32, fp32 on CPU, ZeRO-2 as the S recipe; MoE layer at T = 64."""
    dry = args.dry_run
    mb = args.micro_batch or (2 if dry else 8)
    recipe = args.recipe or ("recipes/tiny/smelt.yaml" if dry else "recipes/s/smelt.yaml")
    sizes = ["train.seq_len=32", "deepspeed.zero_stage=2"] if dry else []
    return {
        "dry_run": dry, "device": "cpu" if dry else "cuda", "dtype": "float32" if dry else "bfloat16",
        "recipe": recipe, "micro_batch": mb, "user_sets": list(args.set), "sizes": sizes,
        "precision": "fp32" if dry else "bf16",
        "warmup_steps": 1 if dry else 3, "timed_steps": 3 if dry else 10, "profile_steps": 1 if dry else 2,
        "moe_tokens": [64] if dry else [8192, 32768], "moe_repeats": 3 if dry else 10, "moe_warmup": 1 if dry else 3,
        "batched_mm_max_gib": 2.0 if dry else 24.0, "sdpa_repeats": 2 if dry else 5, "top_kernels": 15,
        "fail": dict(args.fail_section),
    }


def overrides(plan: dict[str, Any]) -> list[str]:
    """``--set`` strings applied to the recipe: the plan's sizes, one micro-batch per optimizer
    step (no gradient accumulation on one GPU), the precision, then the user's ``--set``."""
    return [*plan["sizes"], f"train.micro_batch_size={plan['micro_batch']}", "train.global_batch_tokens=null",
            "train.gradient_accumulation_steps=1", f"train.precision={plan['precision']}", *plan["user_sets"]]


def _fail_arg(text: str) -> tuple[str, str]:
    """``NAME[:MODE]`` of ``--fail-section`` -> ``(NAME, MODE)``."""
    name, _, mode = text.partition(":")
    mode = mode or "raise"
    if name not in SECTIONS or mode not in FAIL_MODES:
        raise argparse.ArgumentTypeError(f"{text!r}: expected NAME[:MODE] with NAME in {', '.join(SECTIONS)} and "
                                         f"MODE in {', '.join(FAIL_MODES)} (default raise)")
    return name, mode


# ---------------------------------------------------------------------------------------------
# section bodies (each runs in its own process: `--child NAME`)
# ---------------------------------------------------------------------------------------------


def _load(plan: dict[str, Any]):
    from smelt_ds.config.loading import load_config

    return load_config(ROOT / plan["recipe"], overrides(plan))


def _torch_dtype(plan: dict[str, Any]):
    import torch

    return getattr(torch, plan["dtype"])


def _sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def _soft_deadline(plan: dict[str, Any]) -> float:
    """``time.time()`` after which a section stops taking more samples (it keeps a quarter of its
    remaining time, at least 5 s, for the profiler and for writing its result)."""
    left = plan["deadline"] - time.time()
    return time.time() + left - max(5.0, 0.25 * left)


def top_ops(prof, device: str, steps: int, n: int) -> dict[str, Any]:
    """The ``n`` largest entries of a ``torch.profiler`` run of ``steps`` steps.

    CUDA: kernels (and copies) by device time, summed per kernel name over the run (each device
    event's ``time_range``, microseconds). CPU: aten ops by self CPU time (``key_averages``).
    Returns ``{"what", "steps", "total_ms", "top": [{"name", "ms", "ms_per_step", "share", "calls"}]}``
    with ``share`` = that entry's time / the total of all entries."""
    agg: dict[str, list[float]] = {}
    if device == "cuda":
        from torch.autograd import DeviceType

        for e in prof.events():
            if e.device_type == DeviceType.CUDA:
                a = agg.setdefault(e.name, [0.0, 0])
                a[0] += e.time_range.end - e.time_range.start
                a[1] += 1
        what = "CUDA kernels by device time"
    else:
        for k in prof.key_averages():
            agg[k.key] = [float(k.self_cpu_time_total), k.count]
        what = "CPU ops by self CPU time (no CUDA in a dry run)"
    total = sum(v[0] for v in agg.values())
    rows = sorted(agg.items(), key=lambda kv: -kv[1][0])[:n]
    return {"what": what, "steps": steps, "total_ms": total / 1e3,
            "top": [{"name": name[:160], "ms": t / 1e3, "ms_per_step": t / 1e3 / steps,
                     "share": t / total if total else 0.0, "calls": int(c)} for name, (t, c) in rows]}


def _profile(fn: Callable[[], Any], device: str, steps: int, n: int) -> dict[str, Any]:
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=acts) as prof:
        for _ in range(steps):
            fn()
        _sync(device)
    return top_ops(prof, device, steps, n)


def section_sdpa(plan: dict[str, Any]) -> dict[str, Any]:
    """(d) SDPA backends for the model's own attention module at the recipe's shapes."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.profiler import ProfilerActivity, profile

    from smelt_ds.model.attention import CausalSelfAttention, RotaryEmbedding
    from smelt_ds.model.looping import Visit

    cfg, dev, dtype = _load(plan), plan["device"], _torch_dtype(plan)
    m, B, S = cfg.model, cfg.train.micro_batch_size, cfg.train.seq_len
    torch.manual_seed(0)
    attn = CausalSelfAttention(m.hidden_size, m.num_heads, m.num_kv_heads, m.resolved_head_dim, m.dropout,
                               m.qk_norm, m.norm_eps).to(dev, dtype).train()
    cos, sin = RotaryEmbedding(m.resolved_head_dim, m.max_seq_len, m.rope_theta).to(dev)(torch.arange(S, device=dev))
    x = torch.randn(B, S, m.hidden_size, device=dev, dtype=dtype, requires_grad=True)

    def fwd_bwd() -> None:
        attn(x, cos, sin, Visit(0, 0)).float().square().mean().backward()

    backends = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
                "cudnn": SDPBackend.CUDNN_ATTENTION, "math": SDPBackend.MATH}
    forced: dict[str, Any] = {}
    for name in SDPA_BACKENDS:
        try:
            with warnings.catch_warnings(record=True) as caught, sdpa_kernel([backends[name]]):
                warnings.simplefilter("always")
                fwd_bwd()  # warm-up (and the "no kernel" error, if any)
                _sync(dev)
                t: list[float] = []
                for _ in range(plan["sdpa_repeats"]):
                    t0 = time.perf_counter()
                    fwd_bwd()
                    _sync(dev)
                    t.append(time.perf_counter() - t0)
            forced[name] = {"ok": True, "fwd_bwd_ms": statistics.median(t) * 1e3}
        except Exception as e:  # a backend that cannot run these shapes raises RuntimeError, warning why
            why = [str(w.message).strip().splitlines()[0][:200] for w in caught]
            forced[name] = {"ok": False, "error": f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300]}",
                            "reasons": why[:4]}
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev == "cuda" else [])
    with profile(activities=acts) as prof:
        fwd_bwd()
        _sync(dev)
    names = {e.name for e in prof.events()}
    ops = sorted(n for n in names if n in SDPA_OPS)
    kernels = sorted(n[:160] for n in names if dev == "cuda" and any(
        w in n.lower() for w in ("flash", "fmha", "cudnn", "attention", "sdpa")) and not n.startswith("aten::"))
    picked = sorted({SDPA_OPS[o] for o in ops})
    return {"shape": {"batch": B, "heads": m.num_heads, "kv_heads": m.num_kv_heads, "seq_len": S,
                      "head_dim": m.resolved_head_dim, "dtype": plan["dtype"], "is_causal": True,
                      "dropout": m.dropout, "device": dev},
            "forced": forced, "available": [n for n in SDPA_BACKENDS if forced[n]["ok"]],
            "default_backend": picked[0] if len(picked) == 1 else (picked or None),
            "default_aten_ops": ops, "default_kernels": kernels[:10]}


def section_moe_layer(plan: dict[str, Any]) -> dict[str, Any]:
    """(a) bench/moe_layer.py at the recipe's MoE shape on the plan's device and dtype."""
    from moe_layer import batched_mm_gib, build, measure

    cfg, dev, dtype = _load(plan), plan["device"], _torch_dtype(plan)
    H, F, E, K = cfg.model.hidden_size, cfg.moe.expert_ffn_size, cfg.moe.num_experts, cfg.moe.top_k
    cands = build(H, F, E, K, device=dev, dtype=dtype)
    soft = _soft_deadline(plan)
    rows: list[dict[str, Any]] = []
    for T in plan["moe_tokens"]:
        if rows and time.time() > soft:
            break
        skip = {"hf:batched_mm"} if batched_mm_gib(T, H, F, K) > plan["batched_mm_max_gib"] else set()
        here = {n: mod for n, mod in cands.items() if n not in skip}
        med = measure(here, T, H, plan["moe_repeats"], plan["moe_warmup"], device=dev, dtype=dtype)
        hf = {n: v for n, v in med.items() if n.startswith("hf:")}
        best = min(hf, key=lambda n: hf[n])
        dropped = dict(getattr(measure, "dropped", {}))  # candidates that cannot run on this device, and why
        rows.append({"tokens": T, "median_ms": {n: v * 1e3 for n, v in med.items()}, "skipped": sorted(skip),
                     "dropped": dropped,
                     "hf_fastest": best,
                     "ratio_to_hf_fastest": {n: v / med[best] for n, v in med.items() if n.startswith("ours:")}})
    return {"shape": {"hidden": H, "expert_ffn": F, "experts": E, "top_k": K}, "device": dev, "dtype": plan["dtype"],
            "repeats": plan["moe_repeats"], "warmup": plan["moe_warmup"], "rows": rows,
            "note": "forward+backward per call, median of interleaved rounds (bench/moe_layer.py measure); "
                    "ratio < 1: ours faster than transformers' fastest experts implementation at that shape"}


def section_eval_device(plan: dict[str, Any]) -> dict[str, Any]:
    """(e) ``smelt-ds eval --device``: the tiny SMELT (random weights, seed 0) scored on the same
    random windows by the evaluation's own loss and in-context functions
    (:func:`smelt_ds.eval.loss.token_losses`, :func:`smelt_ds.eval.icl.score_episodes`) on the CPU
    in float32 (the reference) and on the plan's device in float32 and in the dtype
    ``--dtype auto`` picks there (:mod:`smelt_ds.eval.device`). Relative differences of the mean
    loss: float32 on another device differs by reduction order only (~1e-6); bfloat16 by its
    8-bit significand (~1e-3 to 1e-2)."""
    import copy

    import torch

    from smelt_ds.config.loading import load_config
    from smelt_ds.eval.device import resolve_device, resolve_dtype
    from smelt_ds.eval.icl import Episode, score_episodes
    from smelt_ds.eval.loss import token_losses
    from smelt_ds.model import SmeltLM

    cfg = load_config(ROOT / "recipes" / "tiny" / "smelt.yaml", ["train.seq_len=64"])
    torch.manual_seed(0)
    ref = SmeltLM(cfg.model, cfg.moe, cfg.loop).eval()
    g = torch.Generator().manual_seed(0)
    V, S = cfg.model.vocab_size, 64
    ids = torch.randint(0, V, (4, S + 1), generator=g)
    episodes = [Episode(tokens=torch.randint(0, V, (S,), generator=g).tolist(), answer_start=S - 8, answer_len=8)
                for _ in range(8)]

    def score(model) -> dict[str, float]:
        nll, mask = token_losses(model, ids[:, :-1], ids[:, 1:])
        icl = score_episodes(model, episodes, pad_id=0)
        return {"loss": float(nll.sum() / mask.sum()), "icl_nats": icl["nats"], "icl_correct": icl["correct_tokens"]}

    dev = resolve_device(plan["device"])
    want = score(ref)
    legs = {"reference: cpu float32": want}
    # on a GPU: float32 and what --dtype auto picks there; on the CPU (dry run): float32 and bfloat16
    for dtype in ("float32", "auto" if dev.type == "cuda" else "bfloat16"):
        dt = resolve_dtype(dtype, dev)
        legs[f"{dev} {str(dt).removeprefix('torch.')} (--dtype {dtype})"] = score(
            copy.deepcopy(ref).to(device=dev, dtype=dt))
    rel = {k: abs(v["loss"] - want["loss"]) / abs(want["loss"]) for k, v in legs.items()}
    return {"device": str(dev), "legs": legs, "loss_rel_diff_to_cpu_float32": rel,
            "note": "the same model and windows; the float32 leg on the device must match the CPU to ~1e-6"}


def _train_step(engine, cfg, batches: list, i: int):
    """One optimizer step as ``smelt_ds.train.loop._train_step`` runs it: per micro-batch forward,
    ``total_loss``, ``engine.backward``, at the boundary the gradient norm before clipping
    (``clip_before_step``), ``engine.step``. Returns the last micro-batch's loss (a tensor)."""
    from smelt_ds.parallel.grad_norm import clip_before_step
    from smelt_ds.train.objective import total_loss

    accum = engine.gradient_accumulation_steps()
    loss = None
    for m in range(accum):
        ids, labels = batches[(i * accum + m) % len(batches)]
        loss = total_loss(engine(ids, labels=labels), cfg.train)
        engine.backward(loss)
        if m == accum - 1:
            clip_before_step(engine, cfg.train.grad_clip)
        engine.step()
    return loss


def _dynamo_counters() -> dict[str, Any]:
    from torch._dynamo.utils import counters

    out: dict[str, Any] = {k: dict(counters[k]) for k in ("stats", "frames", "aot_autograd") if k in counters}
    breaks: dict[str, int] = dict(counters.get("graph_break", {}))
    out["graph_breaks"] = int(sum(breaks.values()))
    out["graph_break_reasons"] = [str(r)[:200] for r in list(breaks)[:5]]
    return out


def _variant(cfg, plan: dict[str, Any], device_memory: int | None) -> dict[str, Any]:
    """What the single-GPU recipe is, its budgets and the memory estimate at its ZeRO stage."""
    from smelt_ds.cost.budget import compute_budget
    from smelt_ds.parallel.memory import estimate

    b = compute_budget(cfg, cfg.train.seq_len)
    mem = device_memory or 141 * 10**9
    rep = estimate(cfg, 1, 1, mem, policies=[cfg.train.activation_checkpointing.policy])
    row = rep.configured
    gib = 2**30
    pred = f"{row.total / gib:.1f} GiB of {mem / gib:.1f} GiB" if row else "no estimate"
    text = (f"{plan['recipe']} with its architecture and loop plan unchanged ({cfg.model.num_layers} unique layers, "
            f"{b.visits} visits, {cfg.moe.num_experts} experts of {cfg.moe.expert_ffn_size}, top-{cfg.moe.top_k}); "
            f"{'1 GPU' if device_memory else '1 CPU process'}, ZeRO-{cfg.deepspeed.zero_stage}, "
            f"micro-batch {cfg.train.micro_batch_size} x {cfg.train.seq_len} "
            f"tokens, no gradient accumulation, {plan['precision']}; smelt-ds memory predicts {pred}, so no layers "
            f"or experts were removed")
    return {"recipe": plan["recipe"], "overrides": overrides(plan), "description": text,
            "unique_layers": cfg.model.num_layers, "visits": b.visits, "num_experts": cfg.moe.num_experts,
            "non_embedding_params": b.non_embedding_params,
            "active_non_embedding_params": b.active_non_embedding_params,
            "embedding_params": b.embedding_params, "predicted_total_bytes": row.total if row else None,
            "device_memory_bytes": mem}


def _peak(device_name: str) -> tuple[float, str]:
    """Dense bf16 peak TFLOP/s of this GPU and where the number comes from (the H200's when the
    device is not in ``smelt_ds.train.metrics.PEAK_TFLOPS``)."""
    from smelt_ds.train.metrics import PEAK_TFLOPS, device_peak_tflops

    known = device_peak_tflops()
    if "H200" in device_name or known is None:
        return PEAK_TFLOPS["H200"], PEAK_SOURCE + ("" if known else f" (assumed: {device_name!r} is not in the table)")
    return known, f"smelt_ds.train.metrics.PEAK_TFLOPS for {device_name!r} (vendor datasheet, dense bf16)"


def _progress(plan: dict[str, Any], partial: dict[str, Any]) -> None:
    """Write what a section has so far, so that a section killed at its time limit keeps it."""
    write_json_atomic(Path(plan["result_path"]), {"status": "partial", "result": partial})


def _train(plan: dict[str, Any], compile_mode: str) -> dict[str, Any]:
    """(b) One training leg: build, warm-up, timed steps, profiler."""
    import torch

    from smelt_ds.cost.budget import compute_budget
    from smelt_ds.parallel.distributed import init_distributed
    from smelt_ds.parallel.hardware import training_precision
    from smelt_ds.train.build import build

    if compile_mode != "none":  # the config key train.compile (none | layers | model) selects it
        plan = {**plan, "user_sets": [f"train.compile={compile_mode}", *plan["user_sets"]]}
    cfg, dev = _load(plan), plan["device"]
    init_distributed()
    total_mem = torch.cuda.get_device_properties(0).total_memory if dev == "cuda" else None
    variant = _variant(cfg, plan, total_mem)
    partial: dict[str, Any] = {"compile": compile_mode, "variant": variant, "phase": "build"}
    _progress(plan, partial)
    t_build = time.perf_counter()
    built = build(cfg, 1)
    build_s = time.perf_counter() - t_build
    partial.update({"phase": "first step (compiles when compiled)", "build_s": build_s, "step_s": []})
    _progress(plan, partial)
    engine = built.engine
    device = engine.device
    if dev == "cuda":
        torch.cuda.reset_peak_memory_stats()
    B, S, V = cfg.train.micro_batch_size, cfg.train.seq_len, cfg.model.vocab_size
    accum = engine.gradient_accumulation_steps()
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randint(0, V, (B, S), generator=g).to(device),
                torch.randint(0, V, (B, S), generator=g).to(device)) for _ in range(4)]
    soft = _soft_deadline(plan)
    times: list[float] = []
    losses: list[float] = []
    n_warm, n_timed = plan["warmup_steps"], plan["timed_steps"]
    for i in range(n_warm + n_timed):
        if i >= n_warm + 2 and time.time() > soft:  # out of time: keep the steps taken (at least 2)
            break
        _sync(dev)
        t0 = time.perf_counter()
        loss = _train_step(engine, cfg, batches, i)
        _sync(dev)
        times.append(time.perf_counter() - t0)
        losses.append(float(loss))
        partial.update({"phase": f"step {i + 2}", "step_s": times, "losses": losses})
        _progress(plan, partial)
    warm, timed = times[:n_warm], times[n_warm:]
    med = statistics.median(timed)
    tokens_per_step = B * S * accum
    tps = tokens_per_step / med
    fpt = compute_budget(cfg, S).train_flops_per_token
    fpt_causal = compute_budget(cfg, S, attention_convention="causal").train_flops_per_token
    tflops = tps * fpt / 1e12
    precision = training_precision(cfg)
    on_gpu_bf16 = dev == "cuda" and precision == "bf16"
    peak, peak_source = _peak(torch.cuda.get_device_name()) if on_gpu_bf16 else (None, None)
    out: dict[str, Any] = {
        "compile": compile_mode, "variant": variant, "device": str(device), "precision": precision,
        "bf16_note": "DeepSpeed bf16 (the training path): bf16 weights and activations, fp32 master weights and Adam "
                     "states; no autocast" if precision == "bf16" else "fp32",
        "zero_stage": built.ds_config.get("zero_optimization", {}).get("stage"),
        "micro_batch": B, "seq_len": S, "grad_accum": accum, "tokens_per_step": tokens_per_step,
        "build_s": build_s, "warmup_step_s": warm, "timed_step_s": timed, "median_step_s": med,
        "first_step_s": times[0], "compile_s": max(0.0, times[0] - med),
        "tokens_per_s": tps, "train_flops_per_token": fpt, "tflops_per_s": tflops,
        "train_flops_per_token_causal": fpt_causal, "tflops_per_s_causal": tps * fpt_causal / 1e12,
        "peak_tflops": peak, "peak_source": peak_source,
        "mfu": tflops / peak if peak else None,
        "mfu_causal": tps * fpt_causal / 1e12 / peak if peak else None,
        "flops_convention": FLOPS_CONVENTION, "losses": losses,
        "peak_allocated_bytes": int(torch.cuda.max_memory_allocated()) if dev == "cuda" else None,
        "note": "median over timed optimizer steps after warm-up, random tokens already on the device (no data "
                "loading); compile_s = first step - median step (compilation and other first-step work)",
    }
    if compile_mode != "none":
        out["dynamo_counters"] = _dynamo_counters()
    partial.update({**out, "phase": "profile"})
    _progress(plan, partial)
    if time.time() < soft:
        steps = plan["profile_steps"]
        out["profile"] = _profile(lambda: _train_step(engine, cfg, batches, 0), dev, steps, plan["top_kernels"])
    else:
        out["profile"] = None
        out["profile_skipped"] = "out of the section's time"
    return out


def section_train_eager(plan: dict[str, Any]) -> dict[str, Any]:
    return _train(plan, "none")


def section_train_compiled(plan: dict[str, Any]) -> dict[str, Any]:
    return _train(plan, "layers")


def section_memory(plan: dict[str, Any]) -> dict[str, Any]:
    """(c) ``smelt-ds memory --measure`` for the same recipe (smelt_ds.study.memory_profile.measure)."""
    from smelt_ds.study.memory_profile import measure

    cfg, dev = _load(plan), plan["device"]
    policy = cfg.train.activation_checkpointing.policy
    m = measure(cfg, [policy], steps=2, device=dev)[0]
    if dev == "cuda":
        measured, predicted = m.peak_allocated, m.predicted_total
        what = ("CUDA allocator peak (torch.cuda.max_memory_allocated) of 2 training steps through the DeepSpeed "
                "engine vs smelt_ds.parallel.memory.estimate's total (model states + activations + temporaries)")
    else:
        measured, predicted = m.saved_activations, m.predicted_activations
        what = ("CPU (no allocator peak): bytes autograd saved for backward (SavedTensorCounter) vs "
                "smelt_ds.parallel.memory.activation_bytes(...).stored, fp32, plain PyTorch AdamW (ZeRO-0)")
    return {"policy": policy, "device": dev, "what": what, "measured_bytes": measured, "predicted_bytes": predicted,
            "ratio": measured / predicted if measured is not None and predicted else None,
            "measurement": m.as_dict(), "recipe": plan["recipe"], "overrides": overrides(plan)}


SECTION_FUNCS: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
    "eval_device": section_eval_device,
    "sdpa": section_sdpa, "moe_layer": section_moe_layer, "train_eager": section_train_eager,
    "memory": section_memory, "train_compiled": section_train_compiled}


def error_record(e: BaseException) -> dict[str, Any]:
    """``{"type", "message", "traceback_tail"}`` of an exception (the last 40 traceback lines)."""
    tb = "".join(traceback.format_exception(type(e), e, e.__traceback__)).splitlines()
    return {"type": type(e).__name__, "message": str(e)[:2000], "traceback_tail": "\n".join(tb[-40:])}


def _forced_failure(name: str, mode: str) -> None:
    if mode == "exit":
        os._exit(3)
    if mode == "hang":
        time.sleep(10**6)
    raise RuntimeError(f"forced failure of section {name!r} (--fail-section, a test hook)")


def child_main(name: str, params_path: str, result_path: str) -> None:
    """Run one section and write ``{"status", "result" | "error", "elapsed_s"}`` to ``result_path``;
    then leave without interpreter teardown (process groups, compile workers)."""
    t0 = time.time()
    plan = {**json.loads(Path(params_path).read_text()), "result_path": result_path}
    try:
        if name in plan["fail"]:
            _forced_failure(name, plan["fail"][name])
        rec: dict[str, Any] = {"status": "ok", "result": SECTION_FUNCS[name](plan)}
    except BaseException as e:  # SystemExit too: bench/moe_layer.py's parity check raises it
        traceback.print_exc()
        rec = {"status": "failed", "error": error_record(e)}
    rec["elapsed_s"] = time.time() - t0
    write_json_atomic(Path(result_path), rec)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# ---------------------------------------------------------------------------------------------
# the orchestrating process
# ---------------------------------------------------------------------------------------------


def write_json_atomic(path: Path, data: Any) -> None:
    """Write ``data`` as JSON to ``path`` through a temporary file beside it and ``os.replace``."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        json.dump(data, f, indent=2, default=str)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _write_text_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def machine_info(dry_run: bool) -> dict[str, Any]:
    """Versions, the device and what the sections need that is missing."""
    import torch

    info: dict[str, Any] = {
        "date_utc": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "host": platform.node(), "python": platform.python_version(), "platform": platform.platform(),
        "cpu_count": os.cpu_count(), "torch": torch.__version__, "cuda_version": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
        "packages": {d: _version(d) for d in ("deepspeed", "transformers", "pydantic", "triton", "numpy")},
        "missing_modules": sorted({m for ms in NEEDS.values() for m in ms if importlib.util.find_spec(m) is None}),
    }
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        info.update({"device_name": torch.cuda.get_device_name(0),
                     "capability": list(torch.cuda.get_device_capability(0)),
                     "bf16_supported": bool(torch.cuda.is_bf16_supported()), "gpu_memory_bytes": int(p.total_memory),
                     "multiprocessors": p.multi_processor_count, "cudnn": torch.backends.cudnn.version(),
                     "device_count": torch.cuda.device_count()})
    else:
        info.update({"device_name": None, "capability": None, "bf16_supported": None, "gpu_memory_bytes": None})
    info["device_used"] = "cpu (dry run)" if dry_run else info["device_name"]
    return info


def _kill_tree(proc: subprocess.Popen) -> None:
    """Kill a section process and everything it started (compile workers)."""
    try:
        import psutil

        kids = psutil.Process(proc.pid).children(recursive=True)
    except Exception:
        kids = []
    for k in kids:
        try:
            k.kill()
        except Exception:
            pass
    proc.kill()
    proc.wait()


class _Interrupted(Exception):
    pass


def _on_signal(signum, frame) -> None:
    raise _Interrupted(f"signal {signum}")


def _log_tail(path: Path, n: int = 4000) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return ""


def run_section(name: str, plan: dict[str, Any], timeout: float, out_dir: Path, work: Path) -> dict[str, Any]:
    """Run section ``name`` in a child process with a wall-clock limit; returns its record."""
    params, result = work / f"{name}.params.json", work / f"{name}.result.json"
    result.unlink(missing_ok=True)
    params.write_text(json.dumps({**plan, "deadline": time.time() + timeout}))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    env["PYTHONUNBUFFERED"] = "1"
    if plan["dry_run"]:
        env["CUDA_VISIBLE_DEVICES"] = ""  # the dry run is the CPU path, on any machine
    log_path = out_dir / LOG_DIR / f"{name}.log"
    t0 = time.time()
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--child", name, "--params",
                                 str(params), "--result", str(result)], stdout=log, stderr=subprocess.STDOUT,
                                env=env, cwd=str(ROOT))
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill_tree(proc)
            rec: dict[str, Any] = {"status": "timeout", "elapsed_s": time.time() - t0,
                   "error": {"type": "Timeout", "message": f"section {name!r} ran past its {timeout:.0f} s and was "
                                                           "killed", "traceback_tail": _log_tail(log_path)}}
            if result.exists():  # what it had measured when it was killed
                partial: dict[str, Any] = json.loads(result.read_text()).get("result") or {}
                rec["partial"] = partial
                if partial.get("phase") == "profile":  # killed in the profiler: its numbers are complete
                    rec["result"] = {**partial, "profile": None, "profile_skipped": "killed at the time limit"}
            return rec
        except BaseException:
            _kill_tree(proc)
            raise
    if result.exists() and json.loads(result.read_text())["status"] != "partial":
        rec = json.loads(result.read_text())
        rec["elapsed_s"] = time.time() - t0
        if rec["status"] != "ok":
            rec["error"]["log_tail"] = _log_tail(log_path, 2000)
        return rec
    rec = {"status": "failed", "elapsed_s": time.time() - t0,
           "error": {"type": "ChildExit", "message": f"section {name!r} exited with status {rc} without a result",
                     "traceback_tail": _log_tail(log_path)}}
    if result.exists():  # died (e.g. killed for memory) after writing progress
        rec["partial"] = json.loads(result.read_text()).get("result")
    return rec


def _is_oom(rec: dict[str, Any]) -> bool:
    err = rec.get("error") or {}
    return err.get("type") == "OutOfMemoryError" or "CUDA out of memory" in err.get("message", "")


def _timeout_for(name: str, selected: list[str], budget: float, deadline: float) -> float:
    """Its share of the budget, or more when earlier sections left time: the remaining time minus
    the shares of the sections still to come; never past the deadline."""
    share = sum(BUDGET_SHARE[s] for s in selected)
    own = budget * BUDGET_SHARE[name] / share
    later = sum(budget * BUDGET_SHARE[s] / share for s in selected[selected.index(name) + 1:])
    left = deadline - time.time()
    return min(left, max(own, left - later))


def run_all(args: argparse.Namespace, out_dir: Path) -> dict[str, Any]:
    """Every selected section in order, writing the JSON and text after each."""
    plan = make_plan(args)
    selected = [s for s in SECTIONS if s in args.sections]
    start = time.time()
    deadline = start + args.budget_s
    state: dict[str, Any] = {"script": "bench/gpu_check.py", "dry_run": plan["dry_run"], "device": plan["device"],
                             "budget_s": args.budget_s, "started_utc": None, "finished_utc": None, "elapsed_s": None,
                             "machine": machine_info(plan["dry_run"]), "plan": {**plan, "overrides": overrides(plan)},
                             "sections": {}, "summary": {}}
    state["started_utc"] = state["machine"]["date_utc"]
    (out_dir / LOG_DIR).mkdir(parents=True, exist_ok=True)
    missing = set(state["machine"]["missing_modules"])

    def save() -> None:
        state["elapsed_s"] = time.time() - start
        state["summary"] = summarize(state)
        write_json_atomic(out_dir / JSON_NAME, state)
        _write_text_atomic(out_dir / TEXT_NAME, render_text(state))

    old = {s: signal.signal(s, _on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    work = Path(tempfile.mkdtemp(prefix="gpu_check_"))
    try:
        for name in selected:
            lacking = sorted(set(NEEDS[name]) & missing)
            timeout = _timeout_for(name, selected, args.budget_s, deadline)
            if lacking or timeout < MIN_SECTION_S:
                why = (f"missing Python modules {lacking} (this script installs nothing)" if lacking
                       else f"the budget ({args.budget_s:.0f} s) is spent")
                state["sections"][name] = {"status": "skipped", "reason": why}
                save()
                continue
            state["sections"][name] = {"status": "running", "budget_s": timeout}
            save()
            rec = run_section(name, plan, timeout, out_dir, work)
            if name in TRAIN_SECTIONS and _is_oom(rec) and plan["micro_batch"] > 1 and not plan["dry_run"]:
                retry_timeout = _timeout_for(name, selected, args.budget_s, deadline)
                if retry_timeout >= MIN_SECTION_S:
                    plan = {**plan, "micro_batch": plan["micro_batch"] // 2}  # later sections use it too
                    first = rec
                    rec = run_section(name, plan, retry_timeout, out_dir, work)
                    rec["oom_retry"] = {"micro_batch": plan["micro_batch"], "first_error": first.get("error")}
                    state["plan"] = {**plan, "overrides": overrides(plan)}
            rec["budget_s"] = timeout
            state["sections"][name] = rec
            save()
    except _Interrupted as e:
        for rec in state["sections"].values():
            if rec.get("status") == "running":
                rec.update({"status": "interrupted", "reason": str(e)})
        state["interrupted"] = str(e)
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        state["finished_utc"] = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
        save()
        for f in work.iterdir():
            f.unlink()
        work.rmdir()
    return state


# ---------------------------------------------------------------------------------------------
# summary and text
# ---------------------------------------------------------------------------------------------


def _ok(state: dict[str, Any], name: str) -> dict[str, Any] | None:
    """A section's result: it ran, or it was killed after all its numbers but the profile."""
    rec = state["sections"].get(name) or {}
    return rec.get("result") if rec.get("status") in ("ok", "timeout") else None


def summarize(state: dict[str, Any]) -> dict[str, Any]:
    """Headline numbers of the sections that ran."""
    s: dict[str, Any] = {}
    eager, comp = _ok(state, "train_eager"), _ok(state, "train_compiled")
    for leg, r in (("eager", eager), ("compiled", comp)):
        if r:
            s[f"tokens_per_s_{leg}"] = r["tokens_per_s"]
            s[f"mfu_{leg}"] = r["mfu"]
    if eager and comp:
        s["compiled_speedup"] = comp["tokens_per_s"] / eager["tokens_per_s"]
    mfus = [r["mfu"] for r in (eager, comp) if r and r["mfu"] is not None]
    if mfus:
        s["mfu_best"] = max(mfus)
        s["mfu_target_0.40_met"] = max(mfus) >= 0.40
    moe = _ok(state, "moe_layer")
    if moe:
        s["moe_ours_grouped_mm_over_hf_fastest"] = {str(r["tokens"]): r["ratio_to_hf_fastest"].get("ours:grouped_mm")
                                                    for r in moe["rows"]}
    mem = _ok(state, "memory")
    if mem:
        s["memory_measured_over_predicted"] = mem["ratio"]
    sdpa = _ok(state, "sdpa")
    if sdpa:
        s["sdpa_default_backend"] = sdpa["default_backend"]
    ev = _ok(state, "eval_device")
    if ev:
        s["eval_loss_rel_diff_to_cpu"] = ev["loss_rel_diff_to_cpu_float32"]
    s["sections_ok"] = [n for n, r in state["sections"].items() if r.get("status") == "ok"]
    s["sections_not_ok"] = [n for n, r in state["sections"].items() if r.get("status") != "ok"]
    return s


def fmt(x: Any) -> str:
    """A table cell: 4 significant digits, ``-`` for None."""
    if x is None:
        return "-"
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, float):
        return f"{x:.4g}"
    return str(x)


def _table(head: list[str], rows: list[list[Any]]) -> list[str]:
    cells = [head] + [[fmt(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(head))]
    lines = ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True)))
             for r in cells]
    return [lines[0], "-" * len(lines[0])] + lines[1:] + [""]  # a blank line ends a table


TRAIN_HEAD = ["leg", "tokens/step", "median_step_s", "tokens/s", "TFLOP/s", "MFU", "MFU_causal", "first_step_s",
              "compile_s", "peak_GiB"]
MOE_HEAD_FIXED = ["tokens", "hf_fastest"]


def _render_header(state: dict[str, Any]) -> list[str]:
    m = state["machine"]
    kind = ("DRY RUN on CPU (fp32, tiny sizes): checks the script, these numbers are not measurements"
            if state["dry_run"] else "one GPU, bf16")
    gpu = (f"{m['device_name']} (sm_{''.join(map(str, m['capability']))}, {m['gpu_memory_bytes'] / 2**30:.1f} GiB, "
           f"bf16 {fmt(m['bf16_supported'])})" if m.get("device_name") else "no CUDA device")
    L = [f"smelt-ds gpu_check {m['date_utc']}  ({kind})",
         f"machine: {gpu}; torch {m['torch']}, CUDA {m['cuda_version']}, deepspeed {m['packages']['deepspeed']}, "
         f"transformers {m['packages']['transformers']}, python {m['python']}, {m['cpu_count']} CPUs"]
    if m["missing_modules"]:
        L.append(f"MISSING Python modules: {', '.join(m['missing_modules'])} (sections needing them are skipped)")
    L.append("")
    L += _table(["section", "status", "elapsed_s", "budget_s"],
                [[n, r.get("status"), r.get("elapsed_s"), r.get("budget_s")] for n, r in state["sections"].items()])
    for n, r in state["sections"].items():
        if r.get("status") not in ("ok", "running"):
            err = r.get("error") or {}
            L.append(f"  {n}: {err.get('type', '')}: {(err.get('message') or r.get('reason', ''))[:300]}")
    return L if L[-1] == "" else L + [""]


def _render_train(state: dict[str, Any]) -> list[str]:
    legs: list[tuple[str, dict[str, Any]]] = [(leg, r) for leg in ("eager", "compiled")
                                              if (r := _ok(state, f"train_{leg}")) is not None]
    if not legs:
        return []
    first = legs[0][1]
    v = first["variant"]
    L = ["(b) training steps", f"recipe: {v['description']}", f"overrides: {' '.join(v['overrides'])}",
         f"non-embedding params {v['non_embedding_params']:,} (all experts; embeddings excluded), active "
         f"{v['active_non_embedding_params']:,}; train FLOPs/token {first['train_flops_per_token']:.4g}",
         f"precision: {first['bf16_note']}",
         f"MFU = TFLOP/s / {first['peak_tflops']:g} ({first['peak_source']})" if first["peak_tflops"]
         else "MFU: not reported (CPU / not bf16)",
         f"FLOPs: {FLOPS_CONVENTION}"]
    L += _table(TRAIN_HEAD, [[leg, r["tokens_per_step"], r["median_step_s"], r["tokens_per_s"], r["tflops_per_s"],
                              r["mfu"], r["mfu_causal"], r["first_step_s"], r["compile_s"],
                              None if r["peak_allocated_bytes"] is None else r["peak_allocated_bytes"] / 2**30]
                             for leg, r in legs])
    if "compiled_speedup" in state["summary"]:
        L += [f"compiled / eager throughput: {fmt(state['summary']['compiled_speedup'])}x", ""]
    for leg, r in legs:
        if r.get("dynamo_counters"):
            c = r["dynamo_counters"]
            L += [f"{leg} dynamo: {c.get('stats', {})}, graph breaks {c.get('graph_breaks')}", ""]
        if r.get("profile"):
            p = r["profile"]
            L += [f"profile, {leg}: top {len(p['top'])} {p['what']} over {p['steps']} step(s), "
                      f"total {fmt(p['total_ms'])} ms"]
            L += _table(["name", "ms_per_step", "share", "calls"],
                        [[e["name"][:90], e["ms_per_step"], e["share"], e["calls"]] for e in p["top"]])
    return L


def _render_moe(moe: dict[str, Any]) -> list[str]:
    sh = moe["shape"]
    names = sorted({n for r in moe["rows"] for n in r["median_ms"]}, key=lambda n: (not n.startswith("ours"), n))
    ours = [n for n in names if n.startswith("ours:")]
    L = [f"(a) MoE layer forward+backward, {moe['device']} {moe['dtype']}, H={sh['hidden']} F={sh['expert_ffn']} "
             f"E={sh['experts']} K={sh['top_k']}, median ms (ratio < 1: ours faster)"]
    return L + _table(["tokens"] + [f"{n}_ms" for n in names] + ["hf_fastest"] + [f"{n}/hf" for n in ours],
                      [[r["tokens"]] + [r["median_ms"].get(n) for n in names] + [r["hf_fastest"]]
                       + [r["ratio_to_hf_fastest"][n] for n in ours] for r in moe["rows"]])


def _render_memory(mem: dict[str, Any]) -> list[str]:
    return [f"(c) memory, policy {mem['policy']}: {mem['what']}"] + _table(
        ["measured_bytes", "predicted_bytes", "measured/predicted"],
        [[mem["measured_bytes"], mem["predicted_bytes"], mem["ratio"]]])


def _render_sdpa(sdpa: dict[str, Any]) -> list[str]:
    sh = sdpa["shape"]
    L = [f"(d) SDPA for (B={sh['batch']}, heads={sh['heads']}, S={sh['seq_len']}, D={sh['head_dim']}) "
             f"{sh['dtype']} causal on {sh['device']}: default dispatch -> {sdpa['default_backend']} "
             f"({', '.join(sdpa['default_aten_ops'])})"]
    L += _table(["backend", "runs", "fwd_bwd_ms", "why_not"],
                [[b, f["ok"], f.get("fwd_bwd_ms"), ((f.get("reasons") or [f.get("error") or ""])[0])[:110]]
                 for b, f in sdpa["forced"].items()])
    if sdpa["default_kernels"]:
        L.append(f"attention kernels: {', '.join(sdpa['default_kernels'])}")
    return L


def _render_eval(ev: dict[str, Any]) -> list[str]:
    return [f"(e) smelt-ds eval --device: the tiny SMELT's loss on {ev['device']} against the CPU in float32"] + _table(
        ["leg", "loss", "rel_diff_to_cpu", "icl_correct"],
        [[k, v["loss"], ev["loss_rel_diff_to_cpu_float32"][k], v["icl_correct"]] for k, v in ev["legs"].items()])


def render_text(state: dict[str, Any]) -> str:
    """``gpu_check.txt``: the machine, the section statuses and one table per section."""
    L = _render_header(state) + _render_train(state)
    for name, render in (("moe_layer", _render_moe), ("memory", _render_memory), ("sdpa", _render_sdpa),
                         ("eval_device", _render_eval)):
        r = _ok(state, name)
        if r is not None:
            L += render(r)
    return "\n".join(L) + "\n"


# ---------------------------------------------------------------------------------------------
# command line
# ---------------------------------------------------------------------------------------------


def _sections_arg(text: str) -> list[str]:
    names = [t.strip() for t in text.split(",") if t.strip()]
    bad = [n for n in names if n not in SECTIONS]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"unknown sections {bad}: choose from {', '.join(SECTIONS)}")
    return names


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="gpu_check.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="sections: " + ", ".join(SECTIONS))
    p.add_argument("--out", default=None, help="output directory (default: $OUT)")
    p.add_argument("--dry-run", action="store_true", help="CPU, fp32, tiny sizes: the same code path, for CI")
    p.add_argument("--budget-s", type=float, default=420.0,
                   help="wall-clock seconds for all sections together (default 420: done within 8 minutes)")
    p.add_argument("--sections", type=_sections_arg, default=list(SECTIONS),
                   help="comma-separated subset to run (default: all)")
    p.add_argument("--recipe", default=None,
                   help="recipe for every section (default recipes/s/smelt.yaml; dry run recipes/tiny/smelt.yaml)")
    p.add_argument("--micro-batch", type=int, default=None, help="samples per step (default 8; dry run 2)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="extra recipe override for every section, e.g. --set moe.expert_impl=grouped_mm")
    p.add_argument("--fail-section", action="append", default=[], metavar="NAME[:MODE]", type=_fail_arg,
                   help="TEST-ONLY HOOK: make section NAME fail (MODE raise: an exception; exit: the process dies "
                        "without a result; hang: it sleeps until its time is up), to test that failures are "
                        "recorded and the other sections still run")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--params", default=None, help=argparse.SUPPRESS)
    p.add_argument("--result", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child:
        child_main(args.child, args.params, args.result)
    out = args.out or os.environ.get("OUT")
    if not out:
        print("gpu_check.py: error: no output directory: pass --out DIR or set $OUT", file=sys.stderr)
        return 2
    import torch

    if not args.dry_run and not torch.cuda.is_available():
        print(f"gpu_check.py: error: no CUDA device (torch {torch.__version__}, CUDA build: {torch.version.cuda}); "
              "this script measures one GPU. On CPU, use --dry-run (tiny sizes, fp32, the same code path)",
              file=sys.stderr)
        return 2
    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    state = run_all(args, out_dir)
    print(render_text(state))
    print(f"wrote {out_dir / JSON_NAME} and {out_dir / TEXT_NAME}")
    return 0 if all(r.get("status") == "ok" for r in state["sections"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
