"""Forward+backward time of smelt_ds' reference MoE layer vs transformers' Qwen3-MoE sparse block.

Same shapes, same weights, same inputs, on CPU. For each token count the candidates (ours with
``expert_impl`` loop and grouped_mm; transformers with every experts implementation that runs on
CPU: eager, batched_mm, grouped_mm; batched_mm is skipped where its per-token copies of the
expert weights would exceed ``--batched-mm-max-gib``) are timed alternately in one run -- round
r times every candidate once, in a rotated order -- and the median over rounds is reported. The table prints
each of ours as a ratio to transformers' fastest implementation at that shape (< 1: ours faster).

    python bench/moe_layer.py                       # T = 256, 1024, 4096; H=256 F=512 E=16 K=2
    python bench/moe_layer.py --tokens 512 --repeats 30 --threads 1

transformers is a test/bench-only dependency (``pip install smelt-ds[dev]``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from smelt_ds.model.moe import MoE, has_grouped_mm

HF_IMPLS = ("eager", "batched_mm", "grouped_mm")


def build(H: int, F: int, E: int, K: int):
    """Ours (loop, grouped_mm) and transformers' block per experts implementation, same weights."""
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    torch.manual_seed(0)
    ref = MoE(H, E, K, F, expert_impl="loop")
    with torch.no_grad():
        for p in ref.parameters():
            p.normal_(0.0, 0.05)
    state = ref.state_dict()
    cands = {}
    for impl in ("loop", "grouped_mm"):
        if impl == "grouped_mm" and not has_grouped_mm():
            continue
        m = MoE(H, E, K, F, expert_impl=impl)
        m.load_state_dict(state)
        cands[f"ours:{impl}"] = m
    for impl in HF_IMPLS:
        cfg = Qwen3MoeConfig(hidden_size=H, moe_intermediate_size=F, num_experts=E, num_experts_per_tok=K,
                             norm_topk_prob=True, hidden_act="silu", experts_implementation=impl)
        m = Qwen3MoeSparseMoeBlock(cfg)
        m.load_state_dict(state)
        cands[f"hf:{impl}"] = m
    return cands


def step(module: torch.nn.Module, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """One forward + backward; returns the output (for the parity check)."""
    module.zero_grad(set_to_none=True)
    xg = x.detach().requires_grad_()
    y = module(xg)
    (y * w).sum().backward()
    return y.detach()


def batched_mm_gib(T: int, H: int, F: int, K: int) -> float:
    """Memory transformers' batched_mm gathers: one copy of the expert weights per routed token."""
    return T * K * 3 * F * H * 4 / 2**30


def check_parity(cands: dict, x: torch.Tensor, w: torch.Tensor) -> None:
    outs = {name: step(m, x, w) for name, m in cands.items()}
    ref = outs["hf:eager"]
    for name, y in outs.items():
        err = (y - ref).abs().max().item()
        if err > 1e-4:
            raise SystemExit(f"{name} disagrees with hf:eager: max abs diff {err:.2e}")


def measure(cands: dict, T: int, H: int, repeats: int, warmup: int) -> dict[str, float]:
    x = torch.randn(1, T, H)
    w = torch.randn(1, T, H)
    check_parity(cands, x, w)
    names = list(cands)
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(warmup + repeats):
        order = names[r % len(names):] + names[:r % len(names)]  # rotate who goes first
        for n in order:
            t0 = time.perf_counter()
            step(cands[n], x, w)
            dt = time.perf_counter() - t0
            if r >= warmup:
                times[n].append(dt)
    return {n: statistics.median(v) for n, v in times.items()}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[256, 1024, 4096])
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--ffn", type=int, default=512)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=15, help="timed rounds per shape (median reported)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    ap.add_argument("--batched-mm-max-gib", type=float, default=2.0,
                    help="skip hf:batched_mm where its per-token weight copies exceed this (GiB)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    import transformers

    cands = build(args.hidden, args.ffn, args.experts, args.top_k)
    print(f"MoE layer forward+backward, CPU, fp32, torch {torch.__version__}, transformers "
          f"{transformers.__version__}, {torch.get_num_threads()} threads on {os.cpu_count()} cores "
          f"(load average {os.getloadavg()[0]:.1f}: other processes on these cores make multi-thread "
          "timings noisy; --threads 1 is steadier)")
    print(f"H={args.hidden} F={args.ffn} E={args.experts} K={args.top_k}; median of {args.repeats} "
          f"interleaved rounds (after {args.warmup} warm-up); times in ms; our expert_impl 'auto' runs "
          f"{MoE(8, 2, 1, 8).experts.impl}\n")
    ours = [n for n in cands if n.startswith("ours:")]
    hf = [n for n in cands if n.startswith("hf:")]
    head = f"{'tokens':>7} " + " ".join(f"{n:>15}" for n in ours + hf) + f" {'hf fastest':>14} " + \
        " ".join(f"{n + '/hf':>18}" for n in ours)
    print(head)
    print("-" * len(head))
    worst = 0.0
    for T in args.tokens:
        skip = {"hf:batched_mm"} if batched_mm_gib(T, args.hidden, args.ffn, args.top_k) > args.batched_mm_max_gib \
            else set()
        here = {n: m for n, m in cands.items() if n not in skip}
        med = measure(here, T, args.hidden, args.repeats, args.warmup)
        best = min((n for n in hf if n in med), key=lambda n: med[n])
        ratios = [med[n] / med[best] for n in ours]
        worst = max(worst, min(ratios))
        print(f"{T:>7} " + " ".join(f"{med[n] * 1e3:>15.2f}" if n in med else f"{'skip (mem)':>15}"
                                    for n in ours + hf)
              + f" {best[3:]:>14} " + " ".join(f"{r:>18.2f}" for r in ratios))
    print(f"\nours (best impl) / transformers (fastest impl), worst shape: {worst:.2f} "
          f"({'ours no slower' if worst <= 1.0 else 'ours slower somewhere'})")


if __name__ == "__main__":
    main()
