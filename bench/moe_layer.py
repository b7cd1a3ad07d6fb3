"""Forward+backward time of smelt_ds' reference MoE layer vs transformers' Qwen3-MoE sparse block.

Same shapes, same weights, same inputs, fp32 on CPU by default. For each shape the candidates (ours
with ``expert_impl`` loop and grouped_mm; transformers with every experts implementation: eager,
batched_mm, grouped_mm; batched_mm is skipped where its per-token copies of the expert weights would
exceed ``--batched-mm-max-gib``) are timed alternately in one run -- round r times every candidate
once, in a rotated order -- and the median over rounds is reported. With ``--compile`` the whole
module of ours grouped_mm and of transformers' grouped_mm / batched_mm is also run through
``torch.compile`` (backend inductor), compiled once per shape before timing (warm-up excluded), and
timed in the same rounds. The table prints each of ours as a ratio to transformers' fastest
implementation at that shape (< 1: ours faster), eager and compiled separately, and the worst
shape's ratio of our best against the issue-17 target (0.67, i.e. 1.5x faster).

    python bench/moe_layer.py --threads 1                 # the default shapes (below)
    python bench/moe_layer.py --threads 1 --compile
    python bench/moe_layer.py --shapes 512x256x512x16x2   # TxHxFxExK
    python bench/moe_layer.py --tokens 512 --hidden 256 --ffn 512 --experts 16 --top-k 2

Default shapes (``--shapes default``): T = 256, 1024, 4096 at H=256 F=512 E=16 K=2 and the many
small experts shape H=256 F=128 E=64 K=8 at T = 1024, 4096. transformers is a test/bench-only
dependency (``pip install smelt-ds[dev]``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch._dynamo

from smelt_ds.model.experts import has_grouped_mm
from smelt_ds.model.moe import MoE

HF_IMPLS = ("eager", "batched_mm", "grouped_mm")
TARGET = 0.67  # issue 17: ours / transformers' fastest <= 0.67 at every shape
PRESETS: dict[str, list[tuple[int, int, int, int, int]]] = {  # (T, H, F, E, K)
    "qwen": [(256, 256, 512, 16, 2), (1024, 256, 512, 16, 2), (4096, 256, 512, 16, 2)],
    "small-experts": [(1024, 256, 128, 64, 8), (4096, 256, 128, 64, 8)],
}
PRESETS["default"] = PRESETS["qwen"] + PRESETS["small-experts"]
COMPILED = ("ours:grouped_mm", "hf:grouped_mm", "hf:batched_mm")  # candidates --compile adds


def build(H: int, F: int, E: int, K: int, *, device: str | torch.device = "cpu",
          dtype: torch.dtype = torch.float32) -> dict[str, torch.nn.Module]:
    """Ours (loop, grouped_mm) and transformers' block per experts implementation, same weights,
    on ``device`` in ``dtype``. Names ``ours:<impl>`` / ``hf:<impl>``."""
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    torch.manual_seed(0)
    ref = MoE(H, E, K, F, expert_impl="loop")
    with torch.no_grad():
        for p in ref.parameters():
            p.normal_(0.0, 0.05)
    state = ref.state_dict()
    cands: dict[str, torch.nn.Module] = {}
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
    return {n: m.to(device=device, dtype=dtype) for n, m in cands.items()}


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


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def check_parity(cands: dict, x: torch.Tensor, w: torch.Tensor) -> dict[str, str]:
    """Runs every candidate once; raises SystemExit if one disagrees with ``hf:eager`` (max abs diff
    over 1e-4 in fp32, 3e-2 relative to the output's scale in 16-bit), drops (and returns, with
    the reason) the candidates that cannot run here (e.g. an implementation without this device)."""
    outs, dropped = {}, {}
    for name in list(cands):
        try:
            outs[name] = step(cands[name], x, w)
        except Exception as e:  # noqa: BLE001 -- an implementation that does not run on this device/dtype
            if name == "hf:eager":
                raise
            dropped[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"
            del cands[name]
    ref = outs["hf:eager"]
    tol = 1e-4 if ref.dtype == torch.float32 else 3e-2 * ref.abs().max().item()
    for name, y in outs.items():
        err = (y.float() - ref.float()).abs().max().item()
        if err > tol:
            raise SystemExit(f"{name} disagrees with hf:eager: max abs diff {err:.2e} (tolerance {tol:.1e})")
    return dropped


def measure(cands: dict, T: int, H: int, repeats: int, warmup: int, *, device: str | torch.device = "cpu",
            dtype: torch.dtype = torch.float32) -> dict[str, float]:
    """Median seconds of one forward + backward per candidate at T tokens, timed in interleaved
    rounds after ``warmup`` untimed ones (which also absorb compilation). Candidates that cannot run
    on ``device`` are left out of the result (``measure.dropped`` names them and why)."""
    dev = torch.device(device)
    g = torch.Generator().manual_seed(T)
    x = torch.randn(1, T, H, generator=g).to(dev, dtype)
    w = torch.randn(1, T, H, generator=g).to(dev, dtype)
    cands = dict(cands)
    measure.dropped = check_parity(cands, x, w)  # type: ignore[attr-defined]
    names = list(cands)
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(warmup + repeats):
        order = names[r % len(names):] + names[:r % len(names)]  # rotate who goes first
        for n in order:
            _sync(dev)
            t0 = time.perf_counter()
            step(cands[n], x, w)
            _sync(dev)
            dt = time.perf_counter() - t0
            if r >= warmup:
                times[n].append(dt)
    return {n: statistics.median(v) for n, v in times.items()}


def parse_shapes(specs: list[str]) -> list[tuple[int, int, int, int, int]]:
    """Preset names (``default``, ``qwen``, ``small-experts``) or ``TxHxFxExK`` specs."""
    out: list[tuple[int, int, int, int, int]] = []
    for s in specs:
        if s in PRESETS:
            out += PRESETS[s]
            continue
        parts = s.lower().split("x")
        if len(parts) != 5 or not all(p.isdigit() for p in parts):
            raise SystemExit(f"--shapes: {s!r} is neither a preset ({', '.join(PRESETS)}) nor TxHxFxExK, "
                             "e.g. 1024x256x512x16x2")
        T, H, F, E, K = (int(p) for p in parts)
        out.append((T, H, F, E, K))
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--shapes", nargs="+", default=None,
                    help="presets (default, qwen, small-experts) or TxHxFxExK; default: 'default' "
                         "unless --tokens is given")
    ap.add_argument("--tokens", type=int, nargs="+", default=None, help="token counts at --hidden/--ffn/...")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--ffn", type=int, default=512)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=15, help="timed rounds per shape (median reported)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    ap.add_argument("--compile", action="store_true",
                    help=f"also time {', '.join(COMPILED)} under torch.compile (inductor), whole module")
    ap.add_argument("--batched-mm-max-gib", type=float, default=2.0,
                    help="skip hf:batched_mm where its per-token weight copies exceed this (GiB)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    import transformers

    if args.tokens:
        shapes = [(T, args.hidden, args.ffn, args.experts, args.top_k) for T in args.tokens]
        shapes += parse_shapes(args.shapes or [])
    else:
        shapes = parse_shapes(args.shapes or ["default"])
    print(f"MoE layer forward+backward, CPU, fp32, torch {torch.__version__}, transformers "
          f"{transformers.__version__}, {torch.get_num_threads()} threads on {os.cpu_count()} cores "
          f"(load average {os.getloadavg()[0]:.1f}: other processes on these cores make multi-thread "
          "timings noisy; --threads 1 is steadier)")
    print(f"median of {args.repeats} interleaved rounds "
          f"(after {args.warmup} warm-up{', which compile' if args.compile else ''})"
          f"; times in ms; our expert_impl 'auto' runs {MoE(8, 2, 1, 8).experts.impl}; "
          f"'c:' = torch.compile(module, backend='inductor')\n")
    worst = {"eager": 0.0, "compiled": 0.0}
    built: dict[tuple[int, int, int, int], dict] = {}
    for T, H, F, E, K in shapes:
        if (H, F, E, K) not in built:
            base = build(H, F, E, K)
            if args.compile:
                torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
                base.update({f"c:{n}": torch.compile(base[n], backend="inductor", dynamic=False)  # type: ignore[misc]
                             for n in COMPILED if n in base})
            built = {(H, F, E, K): base}  # one shape's modules alive at a time
        cands = built[(H, F, E, K)]
        skip = {"hf:batched_mm", "c:hf:batched_mm"} \
            if batched_mm_gib(T, H, F, K) > args.batched_mm_max_gib else set()
        here = {n: m for n, m in cands.items() if n not in skip}
        med = measure(here, T, H, args.repeats, args.warmup)
        dropped = getattr(measure, "dropped", {})
        print(f"T={T} H={H} F={F} E={E} K={K}" + (f"  (could not run: {dropped})" if dropped else ""))
        print("  " + "  ".join(f"{n}={med[n] * 1e3:.2f}" if n in med else f"{n}=skip(mem)" for n in cands))
        for kind, prefix in (("eager", ""), ("compiled", "c:")):
            hf = [n for n in med if n.startswith(prefix + "hf:")]
            ours = [n for n in med if n.startswith(prefix + "ours:")]
            if not hf or not ours:
                continue
            best = min(hf, key=lambda n: med[n])
            ratios = {n: med[n] / med[best] for n in ours}
            worst[kind] = max(worst[kind], min(ratios.values()))
            print(f"  {kind:>8}: hf fastest {best} {med[best] * 1e3:.2f} ms; "
                  + "  ".join(f"{n}/hf = {r:.2f}" for n, r in ratios.items()))
    for kind, v in worst.items():
        if v:
            print(f"\n{kind}: ours (best impl) / transformers (fastest impl), worst shape: {v:.2f} "
                  f"(target <= {TARGET}: {'met' if v <= TARGET else f'missed by {v / TARGET:.2f}x'})", end="")
    print()


if __name__ == "__main__":
    main()
