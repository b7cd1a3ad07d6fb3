"""One prepared script for one GPU: the user's journey, two ranks on one GPU, memory and MFU of smelt-ds.

    python bench/gpu_check.py --out DIR            # one CUDA GPU (an H100 or H200): under 8 minutes
    python bench/gpu_check.py --dry-run --out DIR  # CPU, fp32, tiny sizes: the same code, about a minute
    python bench/gpu_check.py --dry-run --sections sdpa,mfu_layer --out DIR   # some sections only

Each section runs in its own process with its own time budget; a section that fails, hangs or runs
out of time is recorded as such (the exception text, the tail of its traceback and log, and what it
had done until then) and the next section runs. In the order they run:

- ``sdpa``: which ``F.scaled_dot_product_attention`` backend the model's attention runs at recipe
  s's shapes (bf16): each of flash / memory-efficient / cuDNN / math forced with
  ``torch.nn.attention.sdpa_kernel`` (runs or not, forward+backward time), and the one the default
  dispatch picks, read from the aten op the profiler records.
- ``tiny_journey``: what a user does, through the real command line (``python -m smelt_ds.cli``):
  ``train recipes/tiny/smelt.yaml`` in bf16 on the GPU for 200 steps, stopped after 120 by
  ``train.exit_after_steps``, ``train --resume auto`` to the end, beside an uninterrupted run of
  the same 200 steps; ``export``; ``eval RUN --device cuda --training-windows`` (the windows the
  in-loop validation read, so its loss must equal the run's last ``val/all`` up to bf16 rounding)
  then the same of the export with ``--device cpu --dtype float32`` (the reference); ``generate EXPORT``
  (greedy, ``--no-stop``; ``--device cuda`` when its ``--help`` offers it, else it runs where the
  command runs its models). Records every command's exit status, that the resumed run's
  ``metrics.jsonl`` holds each step once, its losses against the uninterrupted run's, the eval
  numbers (against training's ``val/*`` and the CPU's float32) and the generated text's length.
- ``two_ranks_one_gpu``: 2 ranks on the one GPU (``python -m smelt_ds.train`` started here with
  ``RANK`` 0/1, ``WORLD_SIZE`` 2, ``LOCAL_RANK`` 0, ``SMELT_DIST_BACKEND=cuda:gloo``: CUDA tensors
  through gloo, no CPU backend; smelt-ds adds a gloo control group for host values), the tiny
  recipe in fp32 with AutoEP (EP 2) at ZeRO-3 for 20 steps, against the same recipe on 1 rank
  (reference MoE backend, ZeRO-3; the global batch kept, 1024 tokens, 256 in a dry run: micro-batch
  4, accumulation 2 on 1 rank, 1 on 2). A 2-rank configuration that fails (gloo may lack an operation on CUDA
  tensors that DeepSpeed needs) is retried with the next: AutoEP EP 2 at ZeRO-2, then the reference
  backend at ZeRO-3; the JSON says which ran and the line of the log that made the others fail.
  Per-step losses against the 1 rank's, next to the fp32 bound (``tests/numerics.py``).
- ``memory``: ``smelt-ds memory --measure --json`` for recipe s shrunk to 4 unique layers (6
  visits) of 16 experts at micro-batch 2 x 4096 tokens, ONE checkpointing policy per process
  (``none``, ``looped``, ``full``: each a fresh ``python -m smelt_ds.cli memory`` process, so no
  policy's peak holds another's leftovers): ``torch.cuda.max_memory_allocated`` of 2 steps
  through the DeepSpeed engine (bf16, ZeRO-2, 1 GPU) against the estimate
  (``smelt_ds.parallel.memory.estimate``'s total, via ``smelt_ds.study.memory_profile.measure``).
- ``mfu_layer``: one layer of recipe s (attention with 8 heads of 128 at width 1024, then the MoE
  layer: 94 experts of 448, top-8) forward+backward in bf16 on micro-batch 4 x 4096 tokens: CUDA
  events around each call, the median of 20 after 3 warm-up calls; achieved FLOP/s = 3 x the
  layer's forward FLOPs per token (``compute_budget(cfg).forward_flops_per_token`` less the output
  head's ``2 H V``, divided by the visits: every visit of recipe s runs an identical MoE layer) x
  tokens / time; MFU = that / the device's dense bf16 peak
  (``smelt_ds.train.metrics.device_peak_tflops``; none for a device it does not know).

Output (``--out DIR`` or ``$OUT``): ``gpu_check.json`` (machine, every section's numbers or error,
a summary), rewritten atomically after every section so that a killed run keeps what finished;
``gpu_check.txt`` (one table of every section's numbers); ``logs/SECTION.log`` (each section's
output, with the output of every command it ran); ``artifacts/SECTION/`` (the small files the
numbers come from: ``metrics.jsonl`` of the runs, ``eval.json``, the generated text, each memory
process's JSON). Exit status: 0 every section ran, 1 some section failed or was skipped (the reason
is in the JSON), 2 no output directory, no CUDA without ``--dry-run``. A Python module a section
needs (e.g. deepspeed) that is missing skips that section, recorded as such (nothing is installed).

Takes: at most ``--budget-s`` (default 420 s, shared among the sections; time one section leaves
unused goes to the later ones) plus the start-up of this process; a dry run on two CPU cores about
a minute. The dry run runs the same code on the CPU in fp32 at tiny sizes and fewer steps (12,
stopped at 6; 4 steps on 2 gloo ranks); its numbers are not measurements (the text says so).
Afterwards paste ``gpu_check.txt`` into docs/results/benchmarks.md under a dated "Measured on one
GPU" heading, with the commit it ran on.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import importlib.util
import json
import os
import platform
import re
import shutil
import signal
import socket
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
if str(ROOT) not in sys.path:  # smelt_ds (and tests.numerics) importable without installing
    sys.path.insert(0, str(ROOT))

JSON_NAME, TEXT_NAME, LOG_DIR, ARTIFACTS = "gpu_check.json", "gpu_check.txt", "logs", "artifacts"

#: sections in the order they run; the shares of ``--budget-s`` each may use
SECTIONS = ("sdpa", "tiny_journey", "two_ranks_one_gpu", "memory", "mfu_layer")
BUDGET_SHARE = {"sdpa": 0.05, "tiny_journey": 0.30, "two_ranks_one_gpu": 0.30, "memory": 0.26, "mfu_layer": 0.09}
_TRAINING = ("torch", "yaml", "pydantic", "deepspeed", "hjson", "tokenizers", "datasets")
#: importable modules each section needs (checked before it starts; nothing is installed)
NEEDS = {"sdpa": ("torch", "yaml", "pydantic"), "tiny_journey": _TRAINING, "two_ranks_one_gpu": _TRAINING,
         "memory": ("torch", "yaml", "pydantic", "deepspeed", "hjson"), "mfu_layer": ("torch", "yaml", "pydantic")}
FAIL_MODES = ("raise", "exit", "hang")
SDPA_BACKENDS = ("flash", "efficient", "cudnn", "math")
#: aten op of each SDPA backend (forward), as the profiler names it
SDPA_OPS = {"aten::_scaled_dot_product_flash_attention_for_cpu": "flash",
            "aten::_scaled_dot_product_flash_attention": "flash",
            "aten::_scaled_dot_product_efficient_attention": "efficient",
            "aten::_scaled_dot_product_cudnn_attention": "cudnn",
            "aten::_scaled_dot_product_attention_math": "math",
            "aten::_scaled_dot_product_fused_attention_overrideable": "overrideable"}
FLOPS_CONVENTION = ("smelt_ds.cost.budget.compute_budget: matrix multiplies only (2 FLOPs per multiply-add), "
                    "training = 3 x forward; per visit q/k/v/o projections, attention scores and values over "
                    "all seq_len keys ('full', Hoffmann et al. 2022 App. F; causal masking does half that "
                    "attention work: the *_causal numbers), router 2HE, top-k experts K x 6HF")
POLICIES = ("none", "looped", "full")
#: the 2-rank configurations tried in turn: (name, --set strings); the 1-rank comparison is REFERENCE_ONE_RANK
TWO_RANK_CONFIGS = (
    ("autoep_ep2_zero3", ["moe_runtime.backend=autoep", "moe_runtime.ep_size=2", "deepspeed.zero_stage=3"]),
    ("autoep_ep2_zero2", ["moe_runtime.backend=autoep", "moe_runtime.ep_size=2", "deepspeed.zero_stage=2"]),
    ("reference_zero3", ["moe_runtime.backend=reference", "moe_runtime.ep_size=1", "deepspeed.zero_stage=3"]),
)
REFERENCE_ONE_RANK = ["moe_runtime.backend=reference", "moe_runtime.ep_size=1", "deepspeed.zero_stage=3"]
#: a line of a rank's log saying that the process group lacks an operation (gloo on CUDA tensors)
GLOO_MISSING = re.compile(r"ProcessGroupGloo::\w+|does not support \w+|unsupported device( type)?|"
                          r"no backend type associated with device type|not (yet )?(implemented|supported)"
                          r".*(gloo|device|cuda)|(gloo|cuda).*not (yet )?(implemented|supported)|"
                          r"only (cpu|CPU) tensors", re.IGNORECASE)
#: a line of a Python traceback naming the exception: ``RuntimeError: ...``, ``torch.distributed.DistBackendError: ...``
EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Interrupt|Exit)\b:")
#: launcher variables of an outer job: never passed on to the commands a section runs
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
               "SMELT_LAUNCHER_PID", "SMELT_DIST_BACKEND")
MIN_SECTION_S = 5.0
#: seconds the other ranks of a run get to end by themselves after one failed (then they are killed)
LINKED_GRACE_S = 10.0
NOT_MEASURED = "not a measurement (CPU dry run)"


# ---------------------------------------------------------------------------------------------
# what to run: sizes of a GPU run and of a dry run
# ---------------------------------------------------------------------------------------------


def make_plan(args: argparse.Namespace) -> dict[str, Any]:
    """The sizes every section reads (passed to the section processes as JSON).

    GPU: the layer sections at recipe s's shapes (micro-batch 4 x 4096 tokens, its h100 layout) in
    bf16; the tiny recipe's own data and 200 steps stopped at 120; 20 steps on 2 ranks; recipe s
    shrunk to 4 layers of 16 experts for memory. Dry run: the tiny recipe's width, seq_len 32,
    fp32 on the CPU; a small built-in corpus (150 kB per domain, vocabulary 512); 12 steps of 4 x 32
    tokens stopped at 6; 4 steps of 256 tokens on 2 ranks."""
    dry = args.dry_run
    # the built-in corpus, tokenizer and shards of the dry run: small, so that preparing them takes seconds
    data = ["data.builtin_max_bytes=150000", "data.tokenizer.vocab_size=512", "model.vocab_size=512"] if dry else []
    # the dry run's windows: 4 x 32 tokens per micro-batch, not the tiny recipe's 8 x 128 (its steps cost 8x less)
    short = ["train.seq_len=32", "train.micro_batch_size=4"]
    return {
        "dry_run": dry, "device": "cpu" if dry else "cuda", "dtype": "float32" if dry else "bfloat16",
        "precision": "fp32" if dry else "bf16", "fail": dict(args.fail_section),
        "layer": {"recipe": "recipes/tiny/smelt.yaml" if dry else "recipes/s/smelt.yaml",
                  "batch": 2 if dry else 4, "seq_len": 32 if dry else 4096,
                  "warmup": 1 if dry else 3, "repeats": 3 if dry else 20, "sdpa_repeats": 2 if dry else 5},
        "journey": {"recipe": "recipes/tiny/smelt.yaml", "steps": 12 if dry else 200, "stop_at": 6 if dry else 120,
                    "sets": [*data, *short, "train.warmup_steps=2", "eval.eval_batches=1"] if dry else [],
                    "eval_args": (["--episodes", "2", "--shots", "0,1", "--tasks", "kv_recall"] if dry
                                  else ["--episodes", "16", "--shots", "0,4"]),
                    "eval_cpu_reference": not dry,  # on a GPU, the same eval on the CPU in float32 beside it
                    "prompt": "def ", "new_tokens": 16 if dry else 64},
        "two_ranks": {"recipe": "recipes/tiny/smelt.yaml", "steps": 4 if dry else 20, "micro_batch": 4,
                      "global_batch_tokens": 256 if dry else 1024, "precision": "fp32",
                      "sets": [*data, "train.seq_len=32", "train.warmup_steps=2", "eval.eval_batches=1"] if dry
                      else ["train.warmup_steps=5", "eval.eval_batches=1"],
                      "backend": None if dry else "cuda:gloo"},
        "memory": {"recipe": "recipes/tiny/smelt.yaml" if dry else "recipes/s/smelt.yaml",
                   "sets": [] if dry else ["model.num_layers=4", "moe.num_experts=16"],
                   "micro_batch": 2, "seq_len": 32 if dry else None, "steps": 1 if dry else 2,
                   "policies": list(POLICIES), "concurrent": dry},
    }


def _fail_arg(text: str) -> tuple[str, str]:
    """``NAME[:MODE]`` of ``--fail-section`` -> ``(NAME, MODE)``."""
    name, _, mode = text.partition(":")
    mode = mode or "raise"
    if name not in SECTIONS or mode not in FAIL_MODES:
        raise argparse.ArgumentTypeError(f"{text!r}: expected NAME[:MODE] with NAME in {', '.join(SECTIONS)} and "
                                         f"MODE in {', '.join(FAIL_MODES)} (default raise)")
    return name, mode


# ---------------------------------------------------------------------------------------------
# helpers of the section processes
# ---------------------------------------------------------------------------------------------

_PARTIAL: dict[str, Any] = {}  # what the running section has so far (kept when it fails)


def _progress(plan: dict[str, Any], **values: Any) -> None:
    """Record ``values`` as the running section's progress and write it, so that a section killed
    at its time limit keeps what it had."""
    _PARTIAL.update(values)
    write_json_atomic(Path(plan["result_path"]), {"status": "partial", "result": _PARTIAL})


def _torch_dtype(plan: dict[str, Any]):
    import torch

    return getattr(torch, plan["dtype"])


def _sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def _layer_config(plan: dict[str, Any]):
    """The config of the layer sections: the layer recipe at the plan's batch shape."""
    from smelt_ds.config.loading import load_config

    L = plan["layer"]
    return load_config(ROOT / L["recipe"], [f"train.seq_len={L['seq_len']}", f"train.micro_batch_size={L['batch']}"])


def _short(argv: list[str], plan: dict[str, Any]) -> list[str]:
    """``argv`` as the JSON shows it: the interpreter as ``python``, the work directory as ``$WORK``."""
    work = plan["work"]
    return ["python" if a == sys.executable else a.replace(work, "$WORK").replace(str(ROOT) + "/", "")
            for a in argv]


def _env(plan: dict[str, Any], **extra: str) -> dict[str, str]:
    """A command's environment: this process's without an outer job's launcher variables, one
    thread per process on a dry run (several commands share the cores), then ``extra``."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    env["PYTHONUNBUFFERED"] = "1"
    if plan["dry_run"]:
        env["OMP_NUM_THREADS"] = "1"
    env.update(extra)
    return env


def _kill_tree(proc: subprocess.Popen) -> None:
    """Kill a process and everything it started (compile workers, ranks)."""
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
    try:
        proc.kill()
    except OSError:
        pass
    proc.wait()


def run_commands(plan: dict[str, Any], cmds: dict[str, tuple[list[str], dict[str, str]]], share: float = 1.0,
                 linked: tuple[str, ...] = ()) -> tuple[dict[str, dict[str, Any]], dict[str, str]]:
    """Run ``cmds`` (key -> (argv, extra environment)) at the same time in the section's work
    directory, each with its output in ``WORK/KEY.log``, until they end or ``share`` of the
    section's remaining time (less 3 s to write the result) is spent: then they are killed. The
    commands named in ``linked`` (the ranks of one run) end together: when one of them fails, the
    others are killed ``LINKED_GRACE_S`` later (they would wait for it in a collective). Appends every log to
    this process's output (the section log). Returns ``(records, logs)``: per key ``{"argv", "rc"
    (None when killed), "timed_out", "elapsed_s", "pid"}`` (and the log's tail when it failed), and
    the logs' text."""
    work = Path(plan["section_work"])
    end = time.time() + max(1.0, (plan["deadline"] - time.time() - 3.0) * share)
    procs: dict[str, subprocess.Popen] = {}
    t0: dict[str, float] = {}
    done: dict[str, tuple[int | None, float]] = {}
    try:
        for key, (argv, extra) in cmds.items():
            with open(work / f"{key}.log", "w") as log:
                procs[key] = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=_env(plan, **extra),
                                              cwd=str(ROOT))
            t0[key] = time.time()
        linked_failed_at: float | None = None
        while len(done) < len(procs):
            now = time.time()
            for key, proc in procs.items():
                if key in done:
                    continue
                rc = proc.poll()
                killed = now > end or (key in linked and linked_failed_at is not None
                                              and now > linked_failed_at + LINKED_GRACE_S)
                if rc is None and killed:
                    _kill_tree(proc)
                if rc is not None or killed:
                    done[key] = (rc, now - t0[key])
                    if key in linked and rc != 0 and linked_failed_at is None:
                        linked_failed_at = now
            time.sleep(0.1)
    finally:
        for key, proc in procs.items():
            if key not in done:
                _kill_tree(proc)
    recs: dict[str, dict[str, Any]] = {}
    texts: dict[str, str] = {}
    for key, (rc, elapsed) in done.items():
        text = texts[key] = (work / f"{key}.log").read_text(errors="replace")
        rec: dict[str, Any] = {"argv": _short(cmds[key][0], plan), "rc": rc, "timed_out": rc is None,
                               "elapsed_s": elapsed, "pid": procs[key].pid}
        if rc != 0:
            rec["log_tail"] = text[-2500:]
        recs[key] = rec
        print(f"===== {key}: {' '.join(rec['argv'])}\n===== exit status {rc}, {elapsed:.1f} s\n{text}", flush=True)
    return {k: recs[k] for k in cmds}, texts


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "smelt_ds.cli", *args]


def _sets(values: list[str]) -> list[str]:
    return [a for v in values for a in ("--set", v)]


def metrics_rows(path: Path) -> list[dict[str, Any]]:
    """The rows of a ``metrics.jsonl`` ([] when it does not exist)."""
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def step_losses(rows: list[dict[str, Any]]) -> dict[int, float]:
    """Training loss by optimizer step (the rows with a ``loss``)."""
    return {int(r["step"]): float(r["loss"]) for r in rows if "loss" in r}


def _json_block(text: str, first: str, last: str) -> str:
    """The JSON a command printed with ``indent`` among its other output: from the line that is
    ``first`` alone to the last line that is ``last`` alone."""
    lines = text.splitlines()
    start = lines.index(first)
    end = max(i for i, ln in enumerate(lines) if ln == last)
    return "\n".join(lines[start:end + 1])


def _keep(plan: dict[str, Any], src: Path, name: str) -> str | None:
    """Copy ``src`` into ``OUT/artifacts/SECTION/name``; returns that path relative to OUT (None
    when ``src`` does not exist)."""
    if not src.is_file():
        return None
    dest = Path(plan["out_dir"]) / ARTIFACTS / plan["section"] / name
    dest.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(src, dest)
    return str(dest.relative_to(plan["out_dir"]))


def _rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b) if b else abs(a - b)


def fp32_loss_bound(cfg, tokens_per_step: int, step: int) -> float | None:
    """``tests.numerics.prob_tol(step * lm_chain_length(cfg, tokens_per_step))``: how far apart two
    fp32 computations of the loss at optimizer step ``step`` may be in other summation orders
    (relative; as tests/runs/test_reshard.py); None when the tests are not importable."""
    try:
        from tests.numerics import lm_chain_length, prob_tol
    except ImportError:
        return None
    return prob_tol(step * lm_chain_length(cfg, tokens_per_step))


def _first_failure(plan: dict[str, Any], recs: dict[str, dict[str, Any]]) -> None:
    bad = {k: r["rc"] for k, r in recs.items() if r["rc"] != 0}
    if bad:
        raise RuntimeError(f"commands failed (exit status; None = killed at the time limit): {bad}; their logs are "
                           f"in {LOG_DIR}/{plan['section']}.log")


# ---------------------------------------------------------------------------------------------
# section bodies (each runs in its own process: `--child NAME`)
# ---------------------------------------------------------------------------------------------


def section_sdpa(plan: dict[str, Any]) -> dict[str, Any]:
    """SDPA backends for the model's own attention module at the layer recipe's shapes."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.profiler import ProfilerActivity, profile

    from smelt_ds.model.attention import CausalSelfAttention, RotaryEmbedding
    from smelt_ds.model.looping import Visit

    cfg, dev, dtype = _layer_config(plan), plan["device"], _torch_dtype(plan)
    m, B, S = cfg.model, cfg.train.micro_batch_size, cfg.train.seq_len
    torch.manual_seed(0)
    attn = CausalSelfAttention(m.hidden_size, m.num_heads, m.num_kv_heads, m.resolved_head_dim, m.dropout,
                               m.qk_norm, m.norm_eps).to(dev, dtype).train()
    cos, sin = RotaryEmbedding(m.resolved_head_dim, m.max_seq_len, m.rope_theta).to(dev).span(0, S)
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
                for _ in range(plan["layer"]["sdpa_repeats"]):
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


def section_tiny_journey(plan: dict[str, Any]) -> dict[str, Any]:
    """train (stopped part-way), train --resume auto, an uninterrupted run beside it, export, eval,
    generate: each through ``python -m smelt_ds.cli``."""
    j, dev, work = plan["journey"], plan["device"], Path(plan["section_work"])
    N, stop = j["steps"], j["stop_at"]
    run, full, export, evald = work / "run", work / "uninterrupted", work / "export", work / "eval"
    sets = [f"data.cache_dir={plan['cache_dir']}", f"train.max_steps={N}", f"train.precision={plan['precision']}",
            "train.log_every=1", f"train.eval_every={N}", f"train.save_every={N}", *j["sets"]]
    recipe = str(ROOT / j["recipe"])
    train = _cli("train", recipe, *_sets(sets))
    out: dict[str, Any] = {"recipe": j["recipe"], "overrides": sets, "steps": N, "stopped_at": stop,
                           "precision": plan["precision"], "device": dev, "commands": {}}
    _progress(plan, **out)

    def step(cmds: dict[str, tuple[list[str], dict[str, str]]], share: float) -> dict[str, str]:
        recs, texts = run_commands(plan, cmds, share)
        out["commands"].update(recs)
        _progress(plan, **out)
        _first_failure(plan, recs)
        return texts

    # 1. stopped part-way by train.exit_after_steps (it saves a checkpoint and says how to continue);
    # beside it, whether `generate` takes --device (its --help says)
    texts = step({"train_stop": ([*train, "--run-dir", str(run), "--set", f"train.exit_after_steps={stop}"], {}),
                  "generate_help": (_cli("generate", "--help"), {})}, 0.35)
    gen_device = "--device" in texts["generate_help"]
    out["steps_before_resume"] = sorted(step_losses(metrics_rows(run / "metrics.jsonl")))
    # 2. resumed to the end, and the same run uninterrupted (the data are prepared: they may run together)
    step({"train_resume": ([*train, "--run-dir", str(run), "--resume", "auto"], {}),
          "train_uninterrupted": ([*train, "--run-dir", str(full)], {})}, 0.55)
    rows, rows_full = metrics_rows(run / "metrics.jsonl"), metrics_rows(full / "metrics.jsonl")
    resumed, uninterrupted = step_losses(rows), step_losses(rows_full)
    out["steps_logged"] = [int(r["step"]) for r in rows if "loss" in r]  # in file order, repeats kept
    out["each_step_once"] = out["steps_logged"] == list(range(1, N + 1))
    out["losses"] = {"resumed": [resumed.get(s) for s in range(1, N + 1)],
                     "uninterrupted": [uninterrupted.get(s) for s in range(1, N + 1)]}
    both = [s for s in range(1, N + 1) if s in resumed and s in uninterrupted]
    out["resumed_vs_uninterrupted"] = {
        "max_rel_diff_before_stop": max((_rel(resumed[s], uninterrupted[s]) for s in both if s <= stop), default=None),
        "max_rel_diff_after_stop": max((_rel(resumed[s], uninterrupted[s]) for s in both if s > stop), default=None),
        "steps_compared": len(both),
        "note": "the same recipe, data and seed: the resumed steps continue the uninterrupted run's trajectory; "
                "on a GPU nondeterministic kernels (atomic adds) let the two drift apart"}
    val = [r for r in rows if "val/all" in r]
    out["training_val"] = {"step": int(val[-1]["step"]), "all": float(val[-1]["val/all"]),
                           **{k.removeprefix("val/"): float(v) for k, v in val[-1].items()
                              if k.startswith("val/")}} if val else None
    out["artifacts"] = {"resumed_metrics": _keep(plan, run / "metrics.jsonl", "resumed.metrics.jsonl"),
                        "uninterrupted_metrics": _keep(plan, full / "metrics.jsonl", "uninterrupted.metrics.jsonl")}
    _progress(plan, **out)
    # 3. export, and eval of the run on the device (the in-loop validation's windows); 4. generation from the
    # export and, on a GPU, the same eval of the export on the CPU in float32 (the reference; not of the run
    # directory beside the first: each would write the run's own export)
    def eval_cmd(source: Path, device: str, out_dir: Path, *extra: str) -> list[str]:
        return _cli("eval", str(source), "--device", device, *extra, "--training-windows", "--no-plots", "-o",
                    str(out_dir), *j["eval_args"])

    step({"export": (_cli("export", str(run), "-o", str(export)), {}), "eval": (eval_cmd(run, dev, evald), {})}, 0.6)
    gen = _cli("generate", str(export), "--prompt", j["prompt"], "--max-new-tokens", str(j["new_tokens"]),
               "--mode", "greedy", "--no-stop", "--json", *(["--device", dev] if gen_device else []))
    cmds: dict[str, tuple[list[str], dict[str, str]]] = {"generate": (gen, {})}
    if j["eval_cpu_reference"]:
        cmds["eval_cpu"] = (eval_cmd(export, "cpu", work / "eval_cpu", "--dtype", "float32"), {})
    texts = step(cmds, 1.0)
    name, domains, described = eval_domains(evald / "eval.json")
    out["eval"] = {"device": dev, "run": name, "domains": domains, "run_described": described,
                   "loss_rel_diff_to_training_val": (_rel(domains["all"]["loss"], out["training_val"]["all"])
                                                     if out["training_val"] else None)}
    if j["eval_cpu_reference"]:
        _, ref, _ = eval_domains(work / "eval_cpu" / "eval.json")
        out["eval"]["cpu_float32"] = {"domains": ref, "loss_rel_diff": {
            d: _rel(v["loss"], ref[d]["loss"]) for d, v in domains.items() if d in ref},
            "note": "the device's loss (--dtype auto: bfloat16 on a GPU) against the CPU's in float32: bfloat16's "
                    "8-bit significand moves it by about 1e-3 to 1e-2"}
    text = texts["generate"]
    gens = json.loads(_json_block(text, "[", "]"))  # --json: a list, one entry per mode
    g = gens[0]
    (work / "generate.json").write_text(json.dumps(gens, indent=1))
    out["generate"] = {"device": dev if gen_device else "where `smelt-ds generate` runs its models (it has no "
                                                           "--device here)",
                       "device_flag": gen_device, "mode": g.get("mode"), "prompt": j["prompt"],
                       "prompt_tokens": g.get("prompt_tokens"), "new_tokens": g.get("new_tokens"),
                       "requested_tokens": j["new_tokens"], "text_chars": len(g.get("text", "")),
                       "tokens_per_s": g.get("tokens_per_s")}
    out["artifacts"].update({"eval": _keep(plan, evald / "eval.json", "eval.json"),
                             "eval_cpu": _keep(plan, work / "eval_cpu" / "eval.json", "eval_cpu.json"),
                             "generate": _keep(plan, work / "generate.json", "generate.json")})
    return out


def eval_domains(path: Path) -> tuple[str, dict[str, dict[str, Any]], dict[str, Any]]:
    """``smelt-ds eval``'s ``eval.json``: the first run's name, its loss, bits per byte, windows
    and tokens per domain (``all`` included), and its description's plain values."""
    result = json.loads(path.read_text())
    name = result["runs"][0]["name"]
    domains = {d: {k: v[k] for k in ("loss", "bits_per_byte", "windows", "tokens") if k in v}
               for d, v in result["domains"][name].items()}
    return name, domains, {k: v for k, v in result["runs"][0].items() if isinstance(v, (str, int, float))}


def _two_rank_cmds(plan: dict[str, Any], recipe: str, sets: list[str], run: Path, port: int,
                   backend: str | None) -> dict[str, tuple[list[str], dict[str, str]]]:
    """The two ranks of one run: ``python -m smelt_ds.train`` with the launcher's variables set
    here, both ``LOCAL_RANK`` 0 (so both take ``cuda:0``)."""
    argv = [sys.executable, "-m", "smelt_ds.train", recipe, "--run-dir", str(run), *_sets(sets)]
    common = {"WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
              **({"SMELT_DIST_BACKEND": backend} if backend else {})}
    return {f"rank{r}": (argv, {**common, "RANK": str(r)}) for r in (0, 1)}


def find_free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (as smelt_ds.parallel.distributed's,
    without importing torch into this process)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _failure_line(texts: dict[str, str]) -> tuple[str | None, bool]:
    """The line of the ranks' logs (in rank order) that says why they failed: the first exception
    line saying that the process group lacks an operation (``(line, True)``), else the first other
    line naming gloo that says so (a warning naming another device does not count), else the last
    exception line (``(line, False)``)."""
    lines = [ln.strip() for t in texts.values() for ln in t.splitlines()]
    errors = [ln for ln in lines if EXCEPTION_LINE.match(ln)]
    for ln in errors:
        if GLOO_MISSING.search(ln):
            return ln[:500], True
    for ln in lines:
        if GLOO_MISSING.search(ln) and "gloo" in ln.lower() and not ln.startswith(("File ", "warnings.warn")):
            return ln[:500], True
    return (errors[-1][:500] if errors else None), False


def section_two_ranks_one_gpu(plan: dict[str, Any]) -> dict[str, Any]:
    """2 ranks on one device against 1 rank, per-step losses; the 2-rank configuration falls back
    (AutoEP ZeRO-3, AutoEP ZeRO-2, reference ZeRO-3) when one fails."""
    from smelt_ds.config.loading import load_config

    t, work = plan["two_ranks"], Path(plan["section_work"])
    N, recipe = t["steps"], str(ROOT / t["recipe"])
    common = [f"data.cache_dir={plan['cache_dir']}", f"train.max_steps={N}", f"train.precision={t['precision']}",
              f"train.micro_batch_size={t['micro_batch']}", f"train.global_batch_tokens={t['global_batch_tokens']}",
              "train.log_every=1", f"train.eval_every={N}", f"train.save_every={N}", *t["sets"]]
    out: dict[str, Any] = {"recipe": t["recipe"], "overrides": common, "steps": N, "precision": t["precision"],
                           "dist_backend": t["backend"] or "gloo (SMELT_DIST_BACKEND unset: the CPU accelerator's)",
                           "one_rank": {"overrides": REFERENCE_ONE_RANK}, "attempts": []}
    _progress(plan, **out)
    one = work / "one_rank"
    one_cmd: tuple[list[str], dict[str, str]] = ([sys.executable, "-m", "smelt_ds.train", recipe, "--run-dir", str(one),
                *_sets([*common, *REFERENCE_ONE_RANK])], {})
    ran = None
    for i, (name, extra) in enumerate(TWO_RANK_CONFIGS):
        run = work / f"two_ranks_{name}"
        cmds = _two_rank_cmds(plan, recipe, [*common, *extra], run, find_free_port(), t["backend"])
        if i == 0:  # beside the first attempt (rank 0 and it prepare the data, if not yet, each in its own
            cmds["one_rank"] = one_cmd  # temporary directory: the first rename wins, data.cache.build_dir_atomically)
        left = len(TWO_RANK_CONFIGS) - i
        recs, texts = run_commands(plan, cmds, 1.0 if left == 1 else 0.55, linked=("rank0", "rank1"))
        if "one_rank" in recs:
            out["one_rank"]["command"] = recs.pop("one_rank")
            texts.pop("one_rank")
        ok = all(r["rc"] == 0 for r in recs.values())
        line, missing = (None, False) if ok else _failure_line(texts)
        out["attempts"].append({"config": name, "overrides": extra, "ranks": recs, "ok": ok,
                                "failure_line": line, "process_group_lacks_an_operation": missing})
        _progress(plan, **out)
        if ok:
            ran = (name, extra, run)
            break
    if out["one_rank"].get("command", {}).get("rc") != 0:
        raise RuntimeError(f"the 1-rank run failed: {out['one_rank'].get('command')}")
    if ran is None:
        raise RuntimeError("no 2-rank configuration ran: " + "; ".join(
            f"{a['config']}: {a['failure_line']}" for a in out["attempts"]))
    name, extra, run = ran
    failed = [a for a in out["attempts"] if not a["ok"]]
    out["configuration"] = name
    kind = {True: "the process group lacks an operation", False: "another error"}
    out["why"] = ("the first choice (AutoEP EP 2, ZeRO-3)" if not failed else "; ".join(
        f"{a['config']} failed ({kind[a['process_group_lacks_an_operation']]}): {a['failure_line']}" for a in failed))
    two, ref = step_losses(metrics_rows(run / "metrics.jsonl")), step_losses(metrics_rows(one / "metrics.jsonl"))
    out["artifacts"] = {"two_ranks_metrics": _keep(plan, run / "metrics.jsonl", "two_ranks.metrics.jsonl"),
                        "one_rank_metrics": _keep(plan, one / "metrics.jsonl", "one_rank.metrics.jsonl")}
    cfg = load_config(recipe, [*common, *extra])
    tokens: int = t["global_batch_tokens"]
    rows: list[dict[str, Any]] = [{"step": s, "two_ranks": two.get(s), "one_rank": ref.get(s),
                                   "rel_diff": _rel(two[s], ref[s]) if s in two and s in ref else None,
                                   "fp32_bound": fp32_loss_bound(cfg, tokens, s)} for s in range(1, N + 1)]
    diffs = [r["rel_diff"] for r in rows if r["rel_diff"] is not None]
    complete = len(diffs) == N and all(r["fp32_bound"] is not None for r in rows)
    out.update({"losses": rows, "global_batch_tokens": tokens, "steps_compared": len(diffs),
                "max_rel_diff": max(diffs) if len(diffs) == N else None,
                "within_fp32_bound": all(r["rel_diff"] <= r["fp32_bound"] for r in rows) if complete else None,
                "bound_note": "tests.numerics.prob_tol(step * lm_chain_length(cfg, global_batch_tokens)): fp32 sums "
                              "in other orders (Higham & Mary 2019), as tests/runs/test_reshard.py"})
    return out


def section_memory(plan: dict[str, Any]) -> dict[str, Any]:
    """``smelt-ds memory --measure --json``, one checkpointing policy per process."""
    mem, dev = plan["memory"], plan["device"]
    shape = ["--micro-batch", str(mem["micro_batch"]), *(["--seq-len", str(mem["seq_len"])] if mem["seq_len"] else [])]
    out: dict[str, Any] = {"recipe": mem["recipe"], "overrides": mem["sets"], "micro_batch": mem["micro_batch"],
                           "seq_len": mem["seq_len"], "steps": mem["steps"], "device": dev, "policies": {},
                           "section_pid": os.getpid()}
    if dev == "cuda":
        out["what"] = ("torch.cuda.max_memory_allocated of the steps through the DeepSpeed engine (the recipe's ZeRO "
                       "stage and bf16, 1 GPU) against smelt_ds.parallel.memory.estimate's total for that setting "
                       "(model states + activations + temporaries), smelt_ds.study.memory_profile.measure")
    else:
        out["what"] = ("CPU: bytes autograd saved for backward (SavedTensorCounter) against "
                       "smelt_ds.parallel.memory.activation_bytes(...).stored, fp32, plain PyTorch AdamW; "
                       + NOT_MEASURED)
    _progress(plan, **out)
    argv = {p: _cli("memory", str(ROOT / mem["recipe"]), "--measure", "--policies", p, "--steps", str(mem["steps"]),
                    "--json", "--nodes", "1", "--gpus-per-node", "1", *shape, *_sets(mem["sets"]))
            for p in mem["policies"]}
    # one after the other on a GPU (the allocators of several processes would share its memory); on
    # the CPU (a dry run) at the same time: each process counts its own saved tensors
    batches = [mem["policies"]] if mem["concurrent"] else [[p] for p in mem["policies"]]
    for i, batch in enumerate(batches):
        recs, texts = run_commands(plan, {p: (argv[p], {}) for p in batch}, 1.0 / (len(batches) - i))
        for policy in batch:
            rec, text = recs[policy], texts[policy]
            row: dict[str, Any] = {"command": rec, "pid": rec["pid"]}
            out["policies"][policy] = row
            if rec["rc"] not in (0, 3):  # 3: the recipe's own setting does not fit its layout (still measured)
                _progress(plan, **out)
                raise RuntimeError(f"`smelt-ds memory --measure --policies {policy}` failed: exit status {rec['rc']}")
            report = json.loads(_json_block(text, "{", "}"))
            (Path(plan["section_work"]) / f"{policy}.json").write_text(json.dumps(report, indent=1))
            m = report["measured"][0]
            est, got = ((m["predicted_total"], m["peak_allocated"]) if dev == "cuda"
                        else (m["predicted_activations"], m["saved_activations"]))
            row.update({"estimate_bytes": est, "measured_bytes": got,
                        "ratio": got / est if got is not None and est else None, "measurement": m,
                        "artifact": _keep(plan, Path(plan["section_work"]) / f"{policy}.json", f"{policy}.json")})
            if dev != "cuda":
                row["ratio_note"] = NOT_MEASURED
        _progress(plan, **out)
    return out


def layer_forward_flops(cfg, attention_convention: str = "full") -> float:
    """Forward FLOPs per token of one visit of a layer of ``cfg``: ``compute_budget(cfg)``'s forward
    FLOPs less the output head's ``2 H V``, divided by the visits (every visit runs an identical MoE
    layer: no dense first layers). Raises ValueError for a recipe with dense first layers."""
    from smelt_ds.cost.budget import compute_budget

    if cfg.model.first_k_dense:
        raise ValueError("the layers differ (model.first_k_dense): one layer's FLOPs are not the mean")
    b = compute_budget(cfg, cfg.train.seq_len, attention_convention=attention_convention)
    return (b.forward_flops_per_token - 2 * cfg.model.hidden_size * cfg.model.vocab_size) / b.visits


def section_mfu_layer(plan: dict[str, Any]) -> dict[str, Any]:
    """One layer of the layer recipe, forward+backward: time, FLOP/s and MFU."""
    import torch

    from smelt_ds.model.attention import RotaryEmbedding
    from smelt_ds.model.lm import Block
    from smelt_ds.train.metrics import device_peak_tflops

    cfg, dev, dtype, L = _layer_config(plan), plan["device"], _torch_dtype(plan), plan["layer"]
    m, moe = cfg.model, cfg.moe
    B, S = cfg.train.micro_batch_size, cfg.train.seq_len
    torch.manual_seed(0)
    block = Block(m, moe, 0).to(dev, dtype).train()
    cos, sin = RotaryEmbedding(m.resolved_head_dim, m.max_seq_len, m.rope_theta).to(dev).span(0, S)
    x = torch.randn(B, S, m.hidden_size, device=dev, dtype=dtype, requires_grad=True)
    grad = torch.randn(B, S, m.hidden_size, device=dev, dtype=dtype)

    def fwd_bwd() -> None:
        y, _, _ = block.compute(x, cos, sin, True)
        torch.autograd.backward([y], [grad])
        block.zero_grad(set_to_none=True)
        x.grad = None

    times: list[float] = []
    for i in range(L["warmup"] + L["repeats"]):
        if dev == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fwd_bwd()
            end.record()
            torch.cuda.synchronize()
            dt = start.elapsed_time(end) / 1e3
        else:
            t0 = time.perf_counter()
            fwd_bwd()
            dt = time.perf_counter() - t0
        if i >= L["warmup"]:
            times.append(dt)
        _progress(plan, times_s=times)
    med = statistics.median(times)
    tokens = B * S
    fwd, fwd_causal = layer_forward_flops(cfg), layer_forward_flops(cfg, "causal")
    tflops, tflops_causal = tokens * 3 * fwd / med / 1e12, tokens * 3 * fwd_causal / med / 1e12
    peak = device_peak_tflops() if dev == "cuda" and plan["dtype"] == "bfloat16" else None
    name = torch.cuda.get_device_name() if dev == "cuda" else "cpu"
    return {"recipe": L["recipe"], "device": dev, "device_name": name, "dtype": plan["dtype"],
            "shape": {"hidden": m.hidden_size, "heads": m.num_heads, "kv_heads": m.num_kv_heads,
                      "head_dim": m.resolved_head_dim, "experts": moe.num_experts, "top_k": moe.top_k,
                      "expert_ffn": moe.expert_ffn_size, "batch": B, "seq_len": S, "vocab": m.vocab_size},
            "expert_impl": getattr(block.mlp.experts, "impl", None) if hasattr(block.mlp, "experts") else None,
            "tokens": tokens, "forward_flops_per_token": fwd, "train_flops_per_token": 3 * fwd,
            "train_flops_per_token_causal": 3 * fwd_causal, "warmup": L["warmup"], "times_s": times,
            "median_s": med, "tflops_per_s": tflops, "tflops_per_s_causal": tflops_causal,
            "peak_tflops": peak, "mfu": tflops / peak if peak else None,
            "mfu_causal": tflops_causal / peak if peak else None,
            "mfu_note": (None if peak else "n/a: CPU dry run" if dev != "cuda" else
                         f"n/a: device_peak_tflops() does not know {name!r}"),
            "flops_convention": FLOPS_CONVENTION,
            "timing": "CUDA events around each forward+backward" if dev == "cuda" else "time.perf_counter (CPU)"}


SECTION_FUNCS: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
    "sdpa": section_sdpa, "tiny_journey": section_tiny_journey, "two_ranks_one_gpu": section_two_ranks_one_gpu,
    "memory": section_memory, "mfu_layer": section_mfu_layer}


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
    """Run one section and write ``{"status", "result" | "error" (and "partial"), "elapsed_s"}`` to
    ``result_path``; then leave without interpreter teardown (process groups, compile workers)."""
    t0 = time.time()
    plan = {**json.loads(Path(params_path).read_text()), "result_path": result_path}
    try:
        if name in plan["fail"]:
            _forced_failure(name, plan["fail"][name])
        rec: dict[str, Any] = {"status": "ok", "result": SECTION_FUNCS[name](plan)}
    except BaseException as e:
        traceback.print_exc()
        rec = {"status": "failed", "error": error_record(e)}
        if _PARTIAL:
            rec["partial"] = _PARTIAL
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
    section_work = work / name
    section_work.mkdir(parents=True, exist_ok=True)
    params.write_text(json.dumps({**plan, "deadline": time.time() + timeout, "section": name,
                                  "section_work": str(section_work), "out_dir": str(out_dir)}))
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
                                   "error": {"type": "Timeout",
                                             "message": f"section {name!r} ran past its {timeout:.0f} s and was killed",
                                             "traceback_tail": _log_tail(log_path)}}
            if result.exists():  # what it had done when it was killed
                rec["partial"] = json.loads(result.read_text()).get("result") or {}
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
    work = Path(tempfile.mkdtemp(prefix="gpu_check_"))
    # one data cache for the sections (the tokenizer and shards of the tiny recipe are the same)
    plan = {**make_plan(args), "work": str(work), "cache_dir": str(work / "data_cache")}
    selected = [s for s in SECTIONS if s in args.sections]
    start = time.time()
    deadline = start + args.budget_s
    state: dict[str, Any] = {"script": "bench/gpu_check.py", "dry_run": plan["dry_run"], "device": plan["device"],
                             "budget_s": args.budget_s, "started_utc": None, "finished_utc": None, "elapsed_s": None,
                             "machine": machine_info(plan["dry_run"]), "plan": plan, "sections": {}, "summary": {}}
    state["started_utc"] = state["machine"]["date_utc"]
    (out_dir / LOG_DIR).mkdir(parents=True, exist_ok=True)
    missing = set(state["machine"]["missing_modules"])

    def save() -> None:
        state["elapsed_s"] = time.time() - start
        state["summary"] = summarize(state)
        write_json_atomic(out_dir / JSON_NAME, state)
        _write_text_atomic(out_dir / TEXT_NAME, render_text(state))

    old = {s: signal.signal(s, _on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
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
        shutil.rmtree(work, ignore_errors=True)
    return state


# ---------------------------------------------------------------------------------------------
# summary and text
# ---------------------------------------------------------------------------------------------


def _ok(state: dict[str, Any], name: str) -> dict[str, Any] | None:
    """A section's result, when it ran to its end."""
    rec = state["sections"].get(name) or {}
    return rec.get("result") if rec.get("status") == "ok" else None


def summarize(state: dict[str, Any]) -> dict[str, Any]:
    """Headline numbers of the sections that ran."""
    s: dict[str, Any] = {}
    sdpa = _ok(state, "sdpa")
    if sdpa:
        s["sdpa_default_backend"] = sdpa["default_backend"]
    j = _ok(state, "tiny_journey")
    if j:
        s["journey_commands_ok"] = all(c["rc"] == 0 for c in j["commands"].values())
        s["journey_each_step_once"] = j["each_step_once"]
        s["journey_resumed_max_rel_diff"] = j["resumed_vs_uninterrupted"]["max_rel_diff_after_stop"]
        s["journey_eval_loss"] = j["eval"]["domains"]["all"]["loss"]
    t = _ok(state, "two_ranks_one_gpu")
    if t:
        s["two_ranks_configuration"] = t["configuration"]
        s["two_ranks_max_rel_loss_diff"] = t["max_rel_diff"]
        s["two_ranks_within_fp32_bound"] = t["within_fp32_bound"]
    mem = _ok(state, "memory")
    if mem:
        s["memory_measured_over_estimate"] = {p: r["ratio"] for p, r in mem["policies"].items()}
    mfu = _ok(state, "mfu_layer")
    if mfu:
        s["layer_tflops_per_s"] = mfu["tflops_per_s"]
        s["layer_mfu"] = mfu["mfu"]
    s["sections_ok"] = [n for n, r in state["sections"].items() if r.get("status") == "ok"]
    s["sections_not_ok"] = [n for n, r in state["sections"].items() if r.get("status") != "ok"]
    return s


def fmt(x: Any) -> str:
    """A table cell: 4 significant digits, ``-`` for None, ``yes``/``no`` for booleans."""
    if x is None:
        return "-"
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, float):
        return f"{x:.4g}"
    return str(x).replace("  ", " ") or "-"


TABLE_HEAD = ("section", "item", "value", "note")


def table_rows(state: dict[str, Any]) -> list[tuple[str, str, Any, str]]:
    """The rows of the one table: ``(section, item, value, note)``; every section's status and
    time, then its numbers (from its result) or its error."""
    rows: list[tuple[str, str, Any, str]] = []
    dry = state["dry_run"]
    for name, rec in state["sections"].items():
        status = rec.get("status")
        budget = rec.get("budget_s")
        rows.append((name, "status", status, rec.get("reason", "")))
        rows.append((name, "elapsed_s", rec.get("elapsed_s"), f"of {budget:.0f} s" if budget else ""))
        if status not in ("ok", "running", "skipped"):
            err = rec.get("error") or {}
            rows.append((name, "error", err.get("type"), " ".join((err.get("message") or "").split())[:300]))
        r = rec.get("result") if status == "ok" else None
        if r is None:  # what a section that did not finish had done
            part = rec.get("partial") or {}
            for key, c in (part.get("commands") or {}).items():
                rows.append((name, f"{key}.exit_status", c["rc"], f"{c['elapsed_s']:.1f} s (before it stopped)"))
            for a in part.get("attempts") or []:
                rows.append((name, f"attempt.{a['config']}", "ok" if a["ok"] else "failed",
                             a.get("failure_line") or ""))
            continue
        if name == "sdpa":
            sh = r["shape"]
            rows.append((name, "default_backend", r["default_backend"] if isinstance(r["default_backend"], str)
                         else ",".join(r["default_backend"] or []) or None,
                         f"B={sh['batch']} heads={sh['heads']} S={sh['seq_len']} D={sh['head_dim']} {sh['dtype']} "
                         f"causal on {sh['device']}"))
            for b, f in r["forced"].items():
                rows.append((name, f"{b}.fwd_bwd_ms", f.get("fwd_bwd_ms"),
                             "" if f["ok"] else ((f.get("reasons") or [f.get("error") or ""])[0])[:150]))
        elif name == "tiny_journey":
            for key, c in r["commands"].items():
                rows.append((name, f"{key}.exit_status", c["rc"], f"{c['elapsed_s']:.1f} s"))
            rows.append((name, "each_step_once", r["each_step_once"],
                         f"metrics.jsonl of the run stopped at {r['stopped_at']} and resumed: steps 1..{r['steps']}"))
            rv = r["resumed_vs_uninterrupted"]
            rows.append((name, "resumed_max_rel_diff", rv["max_rel_diff_after_stop"],
                         f"losses of steps {r['stopped_at'] + 1}..{r['steps']} against the uninterrupted run"))
            if r["training_val"]:
                rows.append((name, "training_val_loss", r["training_val"]["all"],
                             f"val/all of metrics.jsonl at step {r['training_val']['step']}"))
            ev = r["eval"]
            for dom, v in ev["domains"].items():
                rows.append((name, f"eval.{dom}.loss", v["loss"], f"nats/token, smelt-ds eval --device {ev['device']} "
                             "--training-windows"))
            rows.append((name, "eval_rel_diff_to_training_val", ev["loss_rel_diff_to_training_val"],
                         "eval's val/all against training's at the same step"))
            for dom, d in (ev.get("cpu_float32") or {}).get("loss_rel_diff", {}).items():
                rows.append((name, f"eval.{dom}.rel_diff_to_cpu_float32", d, f"--device {ev['device']} against "
                             "--device cpu --dtype float32"))
            g = r["generate"]
            rows.append((name, "generated_tokens", g["new_tokens"], f"asked {g['requested_tokens']}, --no-stop"))
            rows.append((name, "generated_chars", g["text_chars"], f"device: {g['device']}"))
        elif name == "two_ranks_one_gpu":
            rows.append((name, "configuration", r["configuration"], r["why"][:300]))
            rows.append((name, "attempts", len(r["attempts"]), f"process group: {r['dist_backend']}"))
            rows.append((name, "max_rel_loss_diff", r["max_rel_diff"],
                         f"per step, {r['steps']} steps, 2 ranks against 1 rank, {r['precision']}"))
            last = r["losses"][-1]["fp32_bound"] if r["losses"] else None
            rows.append((name, "fp32_bound_last_step", last, "tests.numerics.prob_tol(step * lm_chain_length)"))
            rows.append((name, "within_fp32_bound", r["within_fp32_bound"], "every step"))
        elif name == "memory":
            for p, v in r["policies"].items():
                rows.append((name, f"{p}.estimate_bytes", v["estimate_bytes"], f"pid {v['pid']}"))
                rows.append((name, f"{p}.measured_bytes", v["measured_bytes"], ""))
                rows.append((name, f"{p}.ratio", v["ratio"], NOT_MEASURED if dry else "measured / estimate"))
        elif name == "mfu_layer":
            sh = r["shape"]
            rows.append((name, "tokens", r["tokens"], f"B={sh['batch']} x S={sh['seq_len']}, H={sh['hidden']} "
                         f"E={sh['experts']} K={sh['top_k']} F={sh['expert_ffn']}, {r['dtype']} on {r['device_name']}"))
            rows.append((name, "train_flops_per_token", r["train_flops_per_token"], "3 x forward, one layer"))
            rows.append((name, "median_ms", r["median_s"] * 1e3, f"forward+backward, median of {len(r['times_s'])}"))
            rows.append((name, "tflops_per_s", r["tflops_per_s"], "full attention convention"))
            rows.append((name, "tflops_per_s_causal", r["tflops_per_s_causal"], "causal convention"))
            rows.append((name, "mfu", "n/a" if r["mfu"] is None else r["mfu"],
                         r["mfu_note"] or f"dense bf16 peak {r['peak_tflops']:g} TFLOP/s"))
            rows.append((name, "mfu_causal", "n/a" if r["mfu_causal"] is None else r["mfu_causal"], ""))
    return rows


def render_table(rows: list[tuple[str, str, Any, str]]) -> list[str]:
    """The table as text: columns separated by at least two spaces (cells hold none), the note
    last; a header, a line of dashes, the rows, a blank line."""
    cells = [list(TABLE_HEAD)] + [[s, i, fmt(v), " ".join(str(n).split())] for s, i, v, n in rows]
    widths = [max(len(r[c]) for r in cells) for c in range(3)]
    lines = ["  ".join([*(r[c].ljust(widths[c]) for c in range(3)), r[3]]).rstrip() for r in cells]
    return [lines[0], "-" * max(len(ln) for ln in lines)] + lines[1:] + [""]


def render_text(state: dict[str, Any]) -> str:
    """``gpu_check.txt``: the machine, then one table of every section's numbers."""
    m = state["machine"]
    kind = ("DRY RUN on CPU (fp32, tiny sizes): checks the script, these numbers are not measurements"
            if state["dry_run"] else "one GPU")
    gpu = (f"{m['device_name']} (sm_{''.join(map(str, m['capability']))}, {m['gpu_memory_bytes'] / 2**30:.1f} GiB, "
           f"bf16 {fmt(m['bf16_supported'])})" if m.get("device_name") else "no CUDA device")
    L = [f"smelt-ds gpu_check {m['date_utc']}  ({kind})",
         f"machine: {gpu}; torch {m['torch']}, CUDA {m['cuda_version']}, deepspeed {m['packages']['deepspeed']}, "
         f"python {m['python']}, {m['cpu_count']} CPUs"]
    if m["missing_modules"]:
        L.append(f"MISSING Python modules: {', '.join(m['missing_modules'])} (sections needing them are skipped)")
    L += [f"FLOPs: {FLOPS_CONVENTION}", ""]
    return "\n".join(L + render_table(table_rows(state))) + "\n"


def parse_table(text: str) -> list[tuple[str, str, str, str]]:
    """The rows of the table in ``text`` (as :func:`render_table` writes it): ``(section, item,
    value, note)`` strings."""
    lines = text.splitlines()
    head = next(i for i, ln in enumerate(lines) if ln.split()[:4] == list(TABLE_HEAD))
    rows = []
    for ln in lines[head + 2:]:
        if not ln.strip():
            break
        parts = re.split(r"\s{2,}", ln.strip(), maxsplit=3)
        rows.append((*parts, *[""] * (4 - len(parts))))
    return [tuple(r[:4]) for r in rows]  # type: ignore[misc]


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
    p = argparse.ArgumentParser(prog="gpu_check.py", description=(__doc__ or "").split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="sections, in the order they run: " + ", ".join(SECTIONS))
    p.add_argument("--out", default=None, help="output directory (default: $OUT)")
    p.add_argument("--dry-run", action="store_true", help="CPU, fp32, tiny sizes: the same code path, for CI")
    p.add_argument("--budget-s", type=float, default=420.0,
                   help="wall-clock seconds for all sections together (default 420: done within 8 minutes)")
    p.add_argument("--sections", type=_sections_arg, default=list(SECTIONS),
                   help="comma-separated subset to run (default: all)")
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
