"""``smelt-ds memory``: what fits on a GPU before launch, per ZeRO option and checkpointing policy."""

from __future__ import annotations

import argparse
import json

from smelt_ds.config import load_config
from smelt_ds.memory import POLICIES, ZERO_OPTIONS, estimate, format_table, parse_bytes
from smelt_ds.memory_profile import measure


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "memory", help="memory per GPU for each ZeRO option and activation-checkpointing policy",
        description="Estimate parameters, gradients, optimizer states, activations, temporary buffers and the "
                    "inference KV cache per GPU for every ZeRO stage / offload option and checkpointing policy, "
                    "with a fits / does-not-fit verdict against the device memory. --measure runs a few real "
                    "steps here and prints measured next to predicted.")
    p.add_argument("recipe", help="YAML recipe, e.g. recipes/tiny/smelt.yaml")
    p.add_argument("--nodes", type=int, default=1, help="number of nodes (default 1)")
    p.add_argument("--gpus-per-node", type=int, default=1, help="GPUs per node (default 1)")
    p.add_argument("--device-memory", default="80GiB",
                   help="memory per GPU, e.g. 80GiB (H100/A100 80GB), 141GB (H200); GB = 1e9, GiB = 2^30 bytes")
    p.add_argument("--seq-len", type=int, default=None, help="tokens per sample (default: train.seq_len)")
    p.add_argument("--micro-batch", type=int, default=None, help="samples per GPU (default: train.micro_batch_size)")
    p.add_argument("--precision", default=None, choices=["bf16", "fp32"],
                   help="training precision (default: the recipe's train.precision; its 'auto' counts as bf16, "
                        "the GPU case)")
    p.add_argument("--context-len", type=int, default=None,
                   help="inference context (tokens) for the KV-cache line (default: model.max_seq_len)")
    p.add_argument("--kv-dtype", default="bf16", help="KV-cache element type (bf16, fp16, fp32, fp8)")
    p.add_argument("--options", default=None, metavar="LIST",
                   help=f"comma-separated ZeRO options to show (default all: {','.join(o[0] for o in ZERO_OPTIONS)})")
    p.add_argument("--policies", default=None, metavar="LIST",
                   help=f"comma-separated checkpointing policies (default all: {','.join(POLICIES)})")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a recipe field, e.g. --set train.activation_checkpointing.every_n=3")
    p.add_argument("--measure", action="store_true",
                   help="run a few real steps per policy here and report measured next to predicted "
                        "(CUDA: allocator peak; CPU: saved-tensor bytes and model-state storage)")
    p.add_argument("--steps", type=int, default=2, help="steps per policy with --measure (default 2)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=run_memory)


def _split(text: str | None) -> list[str] | None:
    return [t.strip() for t in text.split(",") if t.strip()] if text else None


def run_memory(args: argparse.Namespace) -> int:
    cfg = load_config(args.recipe, args.set)
    device_memory = parse_bytes(args.device_memory, "--device-memory")
    report = estimate(cfg, args.nodes, args.gpus_per_node, device_memory, seq_len=args.seq_len,
                      micro_batch=args.micro_batch, precision=args.precision, context_len=args.context_len,
                      kv_dtype=args.kv_dtype, options=_split(args.options), policies=_split(args.policies))
    if args.measure:
        import torch

        from smelt_ds.memory import _with_batch

        run_cfg = _with_batch(cfg, args.seq_len, args.micro_batch)
        pols = _split(args.policies)
        report.measured = [m.as_dict() for m in measure(run_cfg, pols, args.steps)]
        if not torch.cuda.is_available():
            report.notes.append("measured on CPU: fp32, ZeRO-0, one process; compare with `estimate(..., "
                                "precision='fp32', device='cpu')` for exact activation numbers")
    print(json.dumps(report.as_dict(), indent=2) if args.json else format_table(report))
    return 0
