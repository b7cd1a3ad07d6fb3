"""Cost and saving of activation checkpointing per policy on the tiny SMELT recipe, in one run.

For each policy (none, full, looped, every_n) the same model (same weights, same batch) runs a
forward + backward pass; rounds time every policy once, in a rotated order, and the median over
rounds is reported as a ratio to ``none``. The saved-activation bytes (exact, through
``torch.autograd.graph.saved_tensors_hooks``, :class:`smelt_ds.study.memory_profile.SavedTensorCounter`) are
reported as a ratio to ``none`` as well, next to the prediction of :mod:`smelt_ds.parallel.memory`.

Targets (issue 5): ``full`` costs at most 1.4x ``none`` in step time (theory: recomputing every
forward adds one forward to forward + backward = 3 forwards, 4/3 = 1.33x); ``looped`` saves at
least the looped visits' share of the visits' activation memory (4 of 6 visits for the tiny
SMELT recipe).

    python bench/recompute.py                                   # recipes/tiny/smelt.yaml, 15 rounds
    python bench/recompute.py --rounds 30 --threads 1 --impl deepspeed
    python bench/recompute.py --set train.seq_len=256 --set model.max_seq_len=256
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from smelt_ds.config.loading import config_from_dict, config_to_dict, load_config
from smelt_ds.model import SmeltLM
from smelt_ds.parallel.engine import configure_activation_checkpointing
from smelt_ds.parallel.memory import POLICIES, activation_bytes
from smelt_ds.study.memory_profile import SavedTensorCounter
from smelt_ds.train.objective import total_loss


def build(cfg, policy: str, impl: str):
    raw = config_to_dict(cfg)
    raw["train"]["activation_checkpointing"].update(policy=policy, impl=impl)
    c = config_from_dict(raw)
    torch.manual_seed(0)
    model = SmeltLM(c.model, c.moe, c.loop).train()
    configure_activation_checkpointing(model, c)
    return c, model


def step(model, ids, labels, train_cfg) -> float:
    """Seconds of one forward + backward (of the training objective)."""
    model.zero_grad(set_to_none=True)
    t = time.perf_counter()
    out = model(ids, labels=labels)
    total_loss(out, train_cfg).backward()
    return time.perf_counter() - t


def saved_bytes(model, ids, labels, train_cfg) -> int:
    counter = SavedTensorCounter([*model.parameters(), *model.buffers()])
    ckpt = model.blocks.checkpointing
    model.blocks.wrap_checkpoint_fn(counter.wrap_checkpoint)
    with counter:
        out = model(ids, labels=labels)
    n = counter.saved_bytes()
    total_loss(out, train_cfg).backward()
    if ckpt is not None:  # back to the unwrapped function
        model.blocks.configure_checkpointing(ckpt.visits, ckpt.fn, ckpt.frees_inputs)
    return n


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--recipe", default="recipes/tiny/smelt.yaml")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--rounds", type=int, default=15, help="timed rounds (each times every policy once)")
    p.add_argument("--warmup", type=int, default=2, help="untimed rounds first")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--impl", default="torch", choices=["torch", "deepspeed"],
                   help="checkpoint implementation (deepspeed initialises a one-process gloo group)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.impl == "deepspeed":
        from smelt_ds.parallel.distributed import init_distributed

        init_distributed()
    cfg = load_config(args.recipe, args.set)
    B, S = cfg.train.micro_batch_size, cfg.train.seq_len
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.model.vocab_size, (B, S), generator=g)
    labels = torch.randint(0, cfg.model.vocab_size, (B, S), generator=g)
    models = {pol: build(cfg, pol, args.impl) for pol in POLICIES}
    times: dict[str, list[float]] = {pol: [] for pol in POLICIES}
    for r in range(args.warmup + args.rounds):
        order = POLICIES[r % len(POLICIES):] + POLICIES[:r % len(POLICIES)]
        for pol in order:
            dt = step(models[pol][1], ids, labels, cfg.train)
            if r >= args.warmup:
                times[pol].append(dt)
    saved = {pol: saved_bytes(m, ids, labels, cfg.train) for pol, (_, m) in models.items()}
    pred = {pol: activation_bytes(c, pol, B, S, 4, "cpu") for pol, (c, _) in models.items()}
    med = {pol: statistics.median(v) for pol, v in times.items()}
    plan = models["none"][1].schedule.plan
    looped = [i for i, v in enumerate(plan) if models["none"][1].schedule.is_looped(v.layer)]
    visit_part = sum(pred["none"].per_visit)
    looped_share = sum(pred["none"].per_visit[i] for i in looped) / visit_part

    print(f"{cfg.name}: micro-batch {B} x {S} tokens, {len(plan)} visits ({len(looped)} looped), "
          f"impl {args.impl}, {torch.get_num_threads()} threads, {args.rounds} rounds (median)")
    print("| policy  | checkpointed visits | fwd+bwd ms | time vs none | saved MiB | bytes vs none | predicted MiB |")
    print("|---------|---------------------|------------|--------------|-----------|---------------|---------------|")
    for pol in POLICIES:
        print(f"| {pol:<7} | {pred[pol].checkpointed:>19} | {1e3 * med[pol]:>10.1f} "
              f"| {med[pol] / med['none']:>11.3f}x | {saved[pol] / 2**20:>9.2f} "
              f"| {saved[pol] / saved['none']:>12.3f}x | {pred[pol].stored / 2**20:>13.2f} |")
    full_ratio = med["full"] / med["none"]
    saved_share = (saved["none"] - saved["looped"]) / visit_part
    kept = len(looped) * 4 * B * S * cfg.model.hidden_size  # each checkpointed visit keeps its fp32 input
    bound = looped_share - kept / visit_part
    verdict = "OK" if full_ratio <= 1.4 else "MISSED"
    print(f"full: {full_ratio:.3f}x step time (target <= 1.40x, theory 1.33x): {verdict}")
    print(f"looped: saves {saved_share:.1%} of the visits' activation bytes (target >= the looped visits' share "
          f"{looped_share:.1%}): {'OK' if saved_share >= looped_share else 'MISSED'}; that is "
          f"{(saved['none'] - saved['looped']) / (looped_share * visit_part):.1%} of the looped visits' own bytes, "
          f"all but the {len(looped)} inputs the checkpoints keep ({kept / 2**20:.2f} MiB; bound for per-visit "
          f"recomputation {bound:.1%}: {'reached' if saved_share >= bound - 1e-9 else 'not reached'})")


if __name__ == "__main__":
    main()
