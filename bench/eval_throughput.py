"""loglikelihood throughput of the lm-evaluation-harness model vs a bare batched forward.

    python bench/eval_throughput.py [--contexts 64] [--choices 4] [--batch-size 8] [--repeats 5]

The tiny SMELT recipe (recipes/tiny/smelt.yaml, random weights) scores the same multiple-choice
style requests two ways, timed alternately in one run (these machines are noisy, so only the
ratio of medians means anything):

- **harness**: ``SmeltHarnessLM.loglikelihood(instances)``: everything a harness run does per
  request: tokenisation and the context/continuation split, sorting by length, batching,
  right padding, the one-token-continuation cache, scoring and restoring the request order.
- **bare**: the same token windows in the same batches, already padded into tensors before the
  clock starts: ``model(batch).logits``, then ``log_softmax`` + ``gather`` at the continuation
  positions in one vectorised step (the arithmetic any scorer needs).

tokens/s counts the model's input tokens (the windows' own tokens, padding excluded; the same for
both). Target (issue 15): harness >= 0.8x bare. The tokenizer is a byte-level BPE trained on the
package's own source text in a second (ids < the model's vocabulary); the requests are pieces of
the same text.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from lm_eval.api.instance import Instance
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from smelt_ds.config.loading import load_config
from smelt_ds.eval.harness import SmeltHarnessLM
from smelt_ds.model import SmeltLM

ROOT = Path(__file__).resolve().parents[1]


def source_text() -> list[str]:
    return [p.read_text() for p in sorted((ROOT / "smelt_ds").rglob("*.py"))]


def train_tokenizer(texts: list[str], vocab_size: int) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def make_requests(texts: list[str], contexts: int, choices: int, seed: int) -> list[Instance]:
    """``contexts`` pieces of source (80-700 characters), each with ``choices`` continuations of
    5-60 characters (the true next characters and pieces from elsewhere)."""
    rng = random.Random(seed)
    blob = "\n".join(texts)
    out = []
    for _ in range(contexts):
        start, n = rng.randrange(len(blob) - 1000), rng.randrange(80, 700)
        ctx = blob[start:start + n]
        conts = [blob[start + n:start + n + rng.randrange(5, 60)]]
        while len(conts) < choices:
            s = rng.randrange(len(blob) - 100)
            conts.append(blob[s:s + rng.randrange(5, 60)])
        out += [Instance("loglikelihood", {}, (ctx, x), len(out)) for x in conts]
    return out


def bare_batches(lm: SmeltHarnessLM, requests: list[Instance]) -> tuple[list[tuple], int]:
    """The harness's windows, sorted and batched as it does, padded into tensors: ``[(input (B, S),
    rows (N,), cols (N,), targets (N,))]`` and the number of input tokens."""
    pairs = [lm._encode_pair(*r.args) for r in requests]
    wins = sorted((((c + t)[-(lm.max_length + 1):][:-1], t) for c, t in pairs), key=lambda w: -len(w[0]))
    out, tokens = [], 0
    for i in range(0, len(wins), lm.batch_size):
        chunk = wins[i:i + lm.batch_size]
        S = len(chunk[0][0])
        batch = torch.full((len(chunk), S), lm.eot_token_id, dtype=torch.long)
        rows, cols, targets = [], [], []
        for j, (inp, cont) in enumerate(chunk):
            batch[j, : len(inp)] = torch.tensor(inp)
            rows += [j] * len(cont)
            cols += range(len(inp) - len(cont), len(inp))
            targets += cont
            tokens += len(inp)
        out.append((batch, torch.tensor(rows), torch.tensor(cols), torch.tensor(targets)))
    return out, tokens


@torch.no_grad()
def bare(model, batches) -> float:
    total = 0.0
    for batch, rows, cols, targets in batches:
        logp = F.log_softmax(model(batch).logits[rows, cols].float(), dim=-1)
        total += float(logp.gather(1, targets[:, None]).sum())
    return total


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--recipe", default="recipes/tiny/smelt.yaml")
    p.add_argument("--contexts", type=int, default=64, help="contexts (requests = contexts x choices)")
    p.add_argument("--choices", type=int, default=4, help="continuations per context")
    p.add_argument("--batch-size", type=int, default=8, help="rows per forward (both paths)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (1: steadier on shared CPUs)")
    p.add_argument("--device", default="cpu")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    cfg = load_config(ROOT / args.recipe)
    torch.manual_seed(0)
    model = SmeltLM(cfg.model, cfg.moe, cfg.loop).eval().to(args.device)
    texts = source_text()
    tok = train_tokenizer(texts, cfg.model.vocab_size)
    lm = SmeltHarnessLM.from_model(model, tok, tok.token_to_id("<|endoftext|>"), batch_size=args.batch_size,
                                   device=args.device)
    # a continuation that BPE merges into the context's last token scores no token (the harness refuses it)
    requests = [r for r in make_requests(texts, args.contexts, args.choices, seed=0) if lm._encode_pair(*r.args)[1]]
    batches, tokens = bare_batches(lm, requests)
    if args.device != "cpu":
        batches = [tuple(t.to(args.device) for t in b) for b in batches]
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    runs = {"harness": lambda: lm.loglikelihood(requests, disable_tqdm=True), "bare": lambda: bare(model, batches)}
    times: dict[str, list[float]] = {k: [] for k in runs}
    for i in range(args.warmup + args.repeats):
        for name in (list(runs) if i % 2 == 0 else list(reversed(runs))):
            sync()
            t0 = time.perf_counter()
            runs[name]()
            sync()
            if i >= args.warmup:
                times[name].append(time.perf_counter() - t0)
    harness_sum = sum(ll for ll, _ in lm.loglikelihood(requests, disable_tqdm=True))
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"{cfg.name}: {model.schedule.effective_depth} visits, {len(requests)} requests ({args.contexts} contexts x "
          f"{args.choices} continuations), {tokens:,} input tokens, batch {args.batch_size}, device {args.device}, "
          f"threads {torch.get_num_threads()}, {args.repeats} repeats (alternating)")
    for k in runs:
        print(f"{k:8s} {med[k]:8.3f} s  {tokens / med[k]:10.0f} tokens/s")
    print(f"sum of log-likelihoods: harness {harness_sum:.4f}, bare {bare(model, batches):.4f} nats")
    print(f"throughput ratio harness/bare: {med['bare'] / med['harness']:.3f}   (target >= 0.8)")


if __name__ == "__main__":
    main()
