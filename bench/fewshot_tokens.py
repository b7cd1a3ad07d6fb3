"""How many in-context examples of the field's benchmarks fit in a model's context, with its tokenizer.

    python bench/fewshot_tokens.py                                  # the ladder's tokenizer and context
    python bench/fewshot_tokens.py --tasks arc_easy_val,piqa_val --max-shots 16
    python bench/fewshot_tokens.py --context 512,1024 --limit 1000  # two contexts; 1000 documents a task
    python bench/fewshot_tokens.py --tokenizer path/to/tokenizer.json --context 2048

Builds each benchmark task's requests (``smelt-ds eval --harness smelt_benchmarks``, the data of
``smelt-ds eval fetch-benchmarks``) with lm-eval's own few-shot formatting and sampler at 0 to
``--max-shots`` examples, and counts each request's tokens as the harness feeds them: end-of-text,
then ``context + continuation`` encoded as one text (``SmeltHarnessLM._encode_pair``). A document
fits at k shots when its longest request does: ``1 + tokens <= context + 1`` (the model reads the
last ``context + 1`` tokens less the last; lm-eval cuts longer ones on the left, dropping the
first examples). Per task it prints the documents counted, the median tokens of one example (the
median over documents of the 1-shot request less the 0-shot one), the median request at 0, 5 and 8
shots and, per ``--context``, the share of documents that fit at 8 shots and the most shots at
which half and nine in ten of the documents fit (the shots before the first count at which fewer
do).

Defaults: the tokenizer of ``--sweep``'s prepared data (``recipes/sweeps/ladder.yaml``; prepare it
first: ``smelt-ds sweep recipes/sweeps/ladder.yaml --dry-run`` names it) and that sweep's
``model.max_seq_len`` as the context. Results: docs/scaling.md, the ladder section.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

from tokenizers import Tokenizer

from smelt_ds.data.cache import is_complete
from smelt_ds.data.prepare import prepared_path
from smelt_ds.eval.benchmarks import TASK_NAMES
from smelt_ds.eval.harness import task_manager
from smelt_ds.study.sweep import load_sweep, plan_sweep

ROOT = Path(__file__).resolve().parents[1]


def request_tokens(task_name: str, shots: int, tok: Tokenizer, limit: int | None) -> dict[int, int]:
    """``{doc_id: tokens of its longest request}`` of ``task_name`` at ``shots`` examples, for ``limit``
    documents evenly spaced over the split (all when None)."""
    from lm_eval.tasks import get_task_dict

    task = get_task_dict([task_name], task_manager([task_name]))[task_name]
    task.set_config(key="num_fewshot", value=shots)
    task.set_fewshot_seed(seed=1234)  # lm-eval's default fewshot_random_seed
    n = len(task.eval_docs)
    samples = None if limit is None or limit >= n else [i * n // limit for i in range(limit)]
    task.build_all_requests(samples=samples, rank=0, world_size=1)
    out: dict[int, int] = {}
    for inst in task.instances:
        ctx, cont = inst.args[:2]
        n = 1 + len(tok.encode(ctx + cont, add_special_tokens=False).ids)
        out[inst.doc_id] = max(out.get(inst.doc_id, 0), n)
    return out


def share(tokens: dict[int, int], context: int) -> float:
    """The share of documents whose longest request fits in ``context`` tokens (see the module)."""
    return sum(n <= context + 1 for n in tokens.values()) / len(tokens)


def most(per_k: list[dict[int, int]], q: float, context: int) -> str:
    """The shots before the first count at which fewer than ``q`` of the documents fit."""
    k = next((k for k, tokens in enumerate(per_k) if share(tokens, context) < q), None)
    return f">= {len(per_k) - 1}" if k is None else "none" if k == 0 else str(k - 1)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sweep", default=str(ROOT / "recipes" / "sweeps" / "ladder.yaml"))
    p.add_argument("--tokenizer", help="tokenizer.json (default: that of the sweep's prepared data)")
    p.add_argument("--context", help="tokens the model reads, comma-separated (default: the sweep's "
                                     "model.max_seq_len)")
    p.add_argument("--tasks", default=",".join(TASK_NAMES))
    p.add_argument("--max-shots", type=int, default=12)
    p.add_argument("--limit", type=int, help="documents per task, evenly spaced over its split (default: all)")
    args = p.parse_args(argv)
    if args.max_shots < 8:
        p.error("--max-shots must be at least 8")
    tok_path = args.tokenizer
    contexts = [int(c) for c in args.context.split(",")] if args.context else []
    if tok_path is None or not contexts:
        plan = plan_sweep(load_sweep(args.sweep), args.sweep)
        cfg = plan.runs[0].config
        data = prepared_path(cfg.data)
        if tok_path is None and not is_complete(data):
            sys.exit(f"the data of {args.sweep} is not prepared ({data}): run smelt-ds data prepare --recipe "
                     f"{plan.runs[0].recipe_path} after smelt-ds sweep {args.sweep} --dry-run, or pass --tokenizer")
        tok_path = tok_path or str(data / "tokenizer.json")
        contexts = contexts or [cfg.model.max_seq_len]
    tok = Tokenizer.from_file(tok_path)
    print(f"tokenizer {tok_path} ({tok.get_vocab_size()} tokens); median tokens of one example and of the "
          f"longest request at 0, 5 and 8 shots; per context: documents that fit at 8 shots, the most shots at "
          f"which half and 90% fit\n")
    print("| task | documents | per example | 0-shot | 5-shot | 8-shot | "
          + " | ".join(f"{c}: fit at 8 | {c}: most, half | {c}: most, 90%" for c in contexts) + " |")
    print("|---|" + "---:|" * (5 + 3 * len(contexts)))
    for name in args.tasks.split(","):
        per_k = [request_tokens(name, k, tok, args.limit) for k in range(args.max_shots + 1)]
        docs = sorted(per_k[0])
        one = statistics.median(per_k[1][d] - per_k[0][d] for d in docs)

        cells = [f"{len(docs):,}", f"{one:g}"] + [f"{statistics.median(per_k[k].values()):g}" for k in (0, 5, 8)]
        for c in contexts:
            cells += [f"{share(per_k[8], c):.0%}", most(per_k, 0.5, c), most(per_k, 0.9, c)]
        print(f"| {name} | " + " | ".join(cells) + " |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
