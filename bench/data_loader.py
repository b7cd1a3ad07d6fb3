"""Loader throughput against the training step's consumption, side by side in one run.

    python bench/data_loader.py                        # recipes/tiny/smelt.yaml on the CPU
    python bench/data_loader.py --device cuda --rounds 50

The recipe's own data (the built-in corpus and its 4096-token tokenizer, prepared and cached
first, not timed) are written out as a Megatron-LM indexed dataset (megatron-core's
IndexedDatasetBuilder, every document with its end-of-text: preprocess_data.py --append-eod; left
out when megatron-core is absent) and as one flat ``np.save`` uint16 file, and both are prepared
as token sources with the same tokenizer. Then, round after round, one training step of the
recipe's model (forward + backward + AdamW on a loader batch, ``seq_len`` x ``micro_batch_size``
tokens; on CUDA synchronised) and ``--batches`` micro-batches of each loader (the recipe's text
shards, the Megatron source, the flat source) are timed alternately, after ``--warmup`` rounds.

Prints tokens/s of the step (median) and of each loader (median per batch) and the ratio
loader / step: target >= 20 for every loader, so data never limit a step.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from smelt_ds.config.data import DataConfig
from smelt_ds.config.loading import load_config
from smelt_ds.data.loader import TrainLoader
from smelt_ds.data.prepare import PreparedData, prepare_from_config
from smelt_ds.model import SmeltLM
from smelt_ds.train.objective import total_loss

ROOT = Path(__file__).resolve().parents[1]


def _documents(prepared: PreparedData) -> list[np.ndarray]:
    """Every document of the prepared text data (train then validation), each with its end-of-text."""
    docs = []
    for split in ("train", "validation"):
        for shard in prepared.shards(split):
            ids = np.asarray(prepared.tokens(shard), dtype=np.int64)
            docs += np.split(ids, np.flatnonzero(ids == prepared.eot_id)[:-1] + 1)
    return docs


def _token_sources(docs: list[np.ndarray], out: Path, eot_id: int) -> dict[str, dict]:
    sources: dict[str, dict] = {}
    try:
        from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

        builder = IndexedDatasetBuilder(str(out / "corpus_text_document.bin"), dtype=np.uint16)
        for d in docs:
            builder.add_document(d, [len(d)])
        builder.finalize(str(out / "corpus_text_document.idx"))
        sources["megatron"] = {"megatron": str(out / "corpus_text_document")}
    except ImportError:
        print("megatron-core is not installed: the Megatron source is left out")
    np.save(out / "corpus.npy", np.concatenate(docs).astype(np.uint16))
    sources["flat numpy"] = {"tokens": str(out / "corpus.npy"), "eot_id": eot_id}
    return sources


def _step(model, opt, batch, train_cfg, device: torch.device) -> float:
    t0 = time.perf_counter()
    x, y = batch["input_ids"].to(device), batch["labels"].to(device)
    loss = total_loss(model(x, labels=y), train_cfg)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def _batch_seconds(loader: TrainLoader, n: int) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        next(loader)
    return (time.perf_counter() - t0) / n


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--recipe", default="recipes/tiny/smelt.yaml")
    p.add_argument("--rounds", type=int, default=20, help="timed rounds (medians reported)")
    p.add_argument("--warmup", type=int, default=3, help="untimed rounds first")
    p.add_argument("--batches", type=int, default=20, help="loader micro-batches timed per round and loader")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--cache-dir", help="data cache (default: the recipe's, i.e. $SMELT_DS_CACHE or ~/.cache/smelt-ds)")
    args = p.parse_args(argv)
    cfg = load_config(ROOT / args.recipe)
    data = cfg.data if args.cache_dir is None else cfg.data.model_copy(update={"cache_dir": args.cache_dir})
    text = prepare_from_config(data)
    S, B = cfg.train.seq_len, cfg.train.micro_batch_size
    loaders = {"text shards": TrainLoader(text, S, B, seed=cfg.data.seed, dp_rank=0, dp_world_size=1)}
    with tempfile.TemporaryDirectory() as tmp:
        docs = _documents(text)
        raw = data.model_dump(mode="json")
        raw["tokenizer"]["path"], raw["cache_dir"] = str(text.root / "tokenizer.json"), str(Path(tmp) / "cache")
        for name, src in _token_sources(docs, Path(tmp), text.eot_id).items():
            prepared = prepare_from_config(DataConfig.model_validate({**raw, "sources": [src]}))
            loaders[name] = TrainLoader(prepared, S, B, seed=cfg.data.seed, dp_rank=0, dp_world_size=1)
        device = torch.device(args.device)
        torch.manual_seed(0)
        model = SmeltLM(cfg.model, cfg.moe, cfg.loop).to(device)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        steps: list[float] = []
        per_batch: dict[str, list[float]] = {n: [] for n in loaders}
        for r in range(args.warmup + args.rounds):
            dt = _step(model, opt, next(loaders["text shards"]), cfg.train, device)
            times = {n: _batch_seconds(ld, args.batches) for n, ld in loaders.items()}
            if r >= args.warmup:
                steps.append(dt)
                for n, t in times.items():
                    per_batch[n].append(t)
    tokens = S * B
    step_tps = tokens / statistics.median(steps)
    print(f"{args.recipe}: {len(docs):,} documents ({sum(len(d) for d in docs):,} tokens), seq_len {S}, "
          f"micro-batch {B} ({tokens:,} tokens); device {device}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads on {os.cpu_count()} cores (load average {os.getloadavg()[0]:.1f}); "
          f"medians of {args.rounds} interleaved rounds after {args.warmup} warm-up\n")
    print(f"{'':24s}{'tokens/s':>14s}{'ratio to step':>15s}")
    print(f"{'training step':24s}{step_tps:14,.0f}{1:15.1f}")
    for name, ts in per_batch.items():
        tps = tokens / statistics.median(ts)
        print(f"{'loader, ' + name:24s}{tps:14,.0f}{tps / step_tps:15.1f}   target >= 20: "
              f"{'met' if tps / step_tps >= 20 else 'missed'}")


if __name__ == "__main__":
    main()
