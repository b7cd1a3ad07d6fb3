"""Throughput of `prepare` on the built-in corpus vs a bare `tokenizers` `encode_batch`, in one run.

    python bench/data_prepare.py [--num-proc 1 2] [--repeats 3] [--vocab-size 4096]

Both sides tokenise the same documents with the same tokenizer (built and cached first, not
timed). `prepare` is timed end to end: reading the JSONL sources into Arrow, tokenising with
`datasets.map`, the train/validation split, writing the uint16 memmap shards with their sha256,
and opening the result with checksum verification. The bare side is one
`Tokenizer.encode_batch(all_documents)` call on texts already in memory. Tokens count one
end-of-text per document on both sides. Each side runs `--repeats` times, alternating; the best
time of each is reported (the least disturbed by other load on the machine).

Prints tokens/s of both and the ratio prepare / bare (target: >= 0.5 on 2 cores).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import datasets
from tokenizers import Tokenizer

from smelt_ds.config.data import DataConfig
from smelt_ds.data.builtin import builtin_corpus_dir
from smelt_ds.data.prepare import build_tokenizer, prepare_from_config


def bare_seconds(tok: Tokenizer, docs: list[str], method: str = "encode_batch") -> tuple[int, float]:
    start = time.perf_counter()
    tokens = sum(len(e.ids) + 1 for e in getattr(tok, method)(docs))  # + 1 end-of-text per document
    return tokens, time.perf_counter() - start


def prepare_seconds(cfg: DataConfig, out: Path) -> tuple[int, float]:
    shutil.rmtree(out, ignore_errors=True)
    start = time.perf_counter()
    prepared = prepare_from_config(cfg.model_copy(update={"output_dir": str(out)}))
    seconds = time.perf_counter() - start
    assert prepared.created
    return sum(s["tokens"] for s in prepared.meta["shards"]), seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--num-proc", type=int, nargs="+", default=[1, 2], help="data.num_proc values to time")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--vocab-size", type=int, default=4096)
    ap.add_argument("--cache-dir", help="cache (default: a temporary directory)")
    args = ap.parse_args()
    datasets.disable_progress_bars()
    with tempfile.TemporaryDirectory() as tmp:
        cache = Path(args.cache_dir or tmp)
        corpus = builtin_corpus_dir(cache)
        base = DataConfig(cache_dir=str(cache), tokenizer={"vocab_size": args.vocab_size})
        tok_path, _ = build_tokenizer(base)
        cfg = base.model_copy(update={"tokenizer": base.tokenizer.model_copy(update={"path": str(tok_path)})})
        docs = [json.loads(line)["text"] for d in ("code", "text")
                for line in (corpus / f"{d}.jsonl").read_text(encoding="utf-8").splitlines()]
        tok = Tokenizer.from_file(str(tok_path))
        mb = sum(len(d.encode()) for d in docs) / 1e6
        print(f"built-in corpus: {len(docs)} documents, {mb:.2f} MB; vocab {tok.get_vocab_size()}; "
              f"{os.cpu_count()} CPUs; best of {args.repeats}")
        bare: dict[str, list[tuple[int, float]]] = {"encode_batch": [], "encode_batch_fast": []}
        for num_proc in args.num_proc:
            run_cfg = cfg.model_copy(update={"num_proc": num_proc})
            timed = []
            for _ in range(args.repeats):
                for method, runs in bare.items():
                    runs.append(bare_seconds(tok, docs, method))
                timed.append(prepare_seconds(run_cfg, Path(tmp) / "out"))
            tokens, seconds = min(timed, key=lambda t: t[1])
            line = f"num_proc={num_proc}: prepare {tokens / seconds:,.0f} tokens/s ({seconds:.2f} s)"
            for method, runs in bare.items():
                bare_tokens, bare_s = min(runs, key=lambda t: t[1])
                assert tokens == bare_tokens, f"prepare wrote {tokens} tokens, {method} gave {bare_tokens}"
                ratio = (tokens / seconds) / (bare_tokens / bare_s)
                line += f" | bare {method} {bare_tokens / bare_s:,.0f} tokens/s, ratio {ratio:.2f}"
            print(line + "  (target: ratio vs encode_batch >= 0.5)")


if __name__ == "__main__":
    main()
