"""Greedy decode speed of an HF export through transformers' ``generate`` vs ``SmeltLM.generate``.

    python bench/hf_decode.py [--recipe recipes/tiny/smelt.yaml] [--repeats 8] [--prompt-len 32]
                              [--new-tokens 64] [--batch 1] [--threads 1]

The tiny SMELT recipe (random weights) is written as a Hugging Face directory the way
``smelt-ds export --format hf`` writes it (``model_type: smelt`` with its modeling code; a
Baseline recipe that maps onto a transformers architecture is written as that architecture) and
loaded with ``AutoModelForCausalLM.from_pretrained``. Both decode the same random prompts
greedily (prefill, then one token per step through their KV caches; transformers' ``DynamicCache``
with one slot per visit), timed alternately in one run (these machines are noisy, so only the
ratio of medians means anything). Before timing, the two outputs are compared token for token.

Printed: median seconds per new token (prefill included, divided by new tokens), tokens/s and the
ratio HF / SmeltLM. Target (issue 16): the HF path within 1.5x of ours on CPU (report it; the
transformers side is not tuned: ``generate`` defaults apart from greedy and no EOS stop).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from smelt_ds.config.loading import load_config
from smelt_ds.interop import known_archs, smelt_format
from smelt_ds.model import SmeltLM

ROOT = Path(__file__).resolve().parents[1]


def _time(fn, new_tokens: int) -> float:
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) / new_tokens


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--recipe", default="recipes/tiny/smelt.yaml")
    p.add_argument("--repeats", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--prompt-len", type=int, default=32, help="prompt tokens")
    p.add_argument("--new-tokens", type=int, default=64, help="tokens decoded per measurement")
    p.add_argument("--batch", type=int, default=1, help="sequences decoded together")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (1: steadier on shared CPUs)")
    args = p.parse_args()
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(args.threads)
    cfg = load_config(ROOT / args.recipe)
    torch.manual_seed(0)
    ours = SmeltLM(cfg.model, cfg.moe, cfg.loop).eval()
    model_type, _ = known_archs.match_hf_architecture(cfg)
    V = cfg.model.vocab_size
    prompt = torch.randint(2, V, (args.batch, args.prompt_len), generator=torch.Generator().manual_seed(0))
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "hf"
        out.mkdir()
        if model_type is None:
            smelt_format.write_hf_dir(ours, cfg, out, eot_id=0, pad_id=1)
        else:
            known_archs.build_known_hf(ours, cfg, 0, 1).save_pretrained(out)
        hf = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=model_type is None,
                                                  dtype=torch.float32).eval()
    gen = {"max_new_tokens": args.new_tokens, "min_new_tokens": args.new_tokens, "do_sample": False,
           "attention_mask": torch.ones_like(prompt), "pad_token_id": 1}
    runs = {"smelt_ds": lambda: ours.generate(prompt, args.new_tokens),
            "transformers": lambda: hf.generate(prompt, **gen)}
    with torch.no_grad():
        a, b = runs["smelt_ds"](), runs["transformers"]()
        same = torch.equal(a, b)
        times: dict[str, list[float]] = {k: [] for k in runs}
        for i in range(args.warmup + args.repeats):
            for name in (list(runs) if i % 2 == 0 else list(reversed(runs))):
                dt = _time(runs[name], args.new_tokens)
                if i >= args.warmup:
                    times[name].append(dt)
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"{args.recipe}: model_type {model_type or 'smelt'}, threads {torch.get_num_threads()}, batch "
          f"{args.batch}, prompt {args.prompt_len} tokens, {args.new_tokens} new tokens, {args.repeats} repeats "
          f"(alternating); greedy outputs identical: {same}")
    for k in runs:
        print(f"{k:13s} {med[k] * 1e3:7.2f} ms/token  {args.batch / med[k]:8.1f} tokens/s")
    print(f"decode-time ratio transformers/smelt_ds: {med['transformers'] / med['smelt_ds']:.3f}  (target <= 1.5)")


if __name__ == "__main__":
    main()
