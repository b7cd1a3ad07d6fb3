"""``smelt-ds eval``, ``smelt-ds analyze`` and ``smelt-ds generate``.

    smelt-ds eval RUN [RUN ...] [-o DIR]       # per-domain loss, bits/byte, loss by position, ICL curves
    smelt-ds analyze RUN [RUN ...] [-o DIR]    # attention sink, routing, logit lens per (layer, visit)
    smelt-ds generate RUN --prompt TEXT        # greedy and/or sampled decoding, tokens/s

RUN is a run directory (its newest complete checkpoint is exported once to RUN/exports/), a
checkpoint directory or an export directory. The first RUN is the reference (the Baseline):
tables show every other run's difference to it.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from smelt_ds.errors import ConfigError
from smelt_ds.eval.data import corpus_config, open_eval_data
from smelt_ds.eval.generation import encode_prompt, generate_text
from smelt_ds.eval.icl import TASK_NAMES, check_task_names, parse_shots
from smelt_ds.eval.loss import parse_buckets
from smelt_ds.eval.plots import plot_analysis, plot_eval, safe_name
from smelt_ds.eval.report import analysis_table, eval_table, to_markdown, write_report
from smelt_ds.eval.runs import load_run, load_runs
from smelt_ds.eval.suite import AnalysisSettings, EvalSettings, analyze_runs, evaluate_runs


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("runs", nargs="+", metavar="RUN", help="run directories, checkpoint or export directories; "
                                                           "the first is the reference (Baseline)")
    p.add_argument("-o", "--output", default=None,
                   help="output directory (default: evals/<run1>_vs_<run2>...)")
    p.add_argument("--names", default=None, help="comma-separated column names, one per run (default: recipe names)")
    p.add_argument("--seq-len", type=int, default=None,
                   help="tokens per validation window (default: the first run's train.seq_len)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a field of every run's recipe, e.g. --set data.cache_dir=/tmp/cache")
    p.add_argument("--no-plots", action="store_true", help="write JSON and Markdown only")
    p.add_argument("--allow-other-tokenizer", action="store_true",
                   help="tokenise with data.tokenizer.path even when it is not the tokenizer the run was trained with")


def add_parser(sub: argparse._SubParsersAction) -> None:
    e = sub.add_parser("eval", help="validation loss per domain and position, bits/byte, in-context curves",
                       description="Evaluate runs side by side: loss (nats/token) and bits per byte per domain, "
                                   "loss by token position, in-context learning curves (loss and accuracy on "
                                   "answer tokens vs k examples). Writes eval.json, eval.md and PNG plots.")
    _add_common(e)
    e.add_argument("--batches", type=int, default=None,
                   help="validation micro-batches per domain (default 32; with --corpus: every window)")
    e.add_argument("--corpus", nargs="+", default=None, metavar="PATH",
                   help="evaluate on these text/JSONL/Parquet files or directories instead of the run's "
                        "validation data: every document of them, tokenised with the run's tokenizer, one "
                        "domain per path (its file or directory stem)")
    e.add_argument("--micro-batch", type=int, default=8, help="windows per micro-batch (default 8)")
    e.add_argument("--buckets", default=None, help="position bucket ends in tokens, e.g. 64,256,1024 "
                                                   "(default: powers of two from 8)")
    e.add_argument("--shots", default=None, help="numbers of in-context examples (default 0,1,2,4,8,16)")
    e.add_argument("--episodes", type=int, default=64, help="episodes per task and k (default 64)")
    e.add_argument("--tasks", default=None, help="comma-separated in-context tasks: kv_recall,pattern,word_case,"
                                                 "complete (default: all)")
    e.add_argument("--seed", type=int, default=0, help="seed of the in-context episodes")
    e.set_defaults(func=run_eval)

    a = sub.add_parser("analyze", help="attention sink, routing and logit lens per (layer, visit)",
                       description="Mechanism analysis side by side: attention mass on the first token, top "
                                   "positions, entropy and content mass per (layer, visit, head); expert load and "
                                   "routing divergence between visits; logit-lens loss after every visit. Writes "
                                   "analysis.json, analysis.md and PNG plots.")
    _add_common(a)
    a.add_argument("--batches", type=int, default=4, help="validation micro-batches per domain (default 4)")
    a.add_argument("--micro-batch", type=int, default=4, help="windows per micro-batch (default 4)")
    a.add_argument("--domains", default=None, help="comma-separated validation domains (default: all)")
    a.add_argument("--top", type=int, default=3, help="how many highest-mass positions to report (default 3)")
    a.set_defaults(func=run_analyze)

    g = sub.add_parser("generate", help="decode text with the per-visit KV cache and print tokens/s",
                       description="Greedy and/or sampled decoding from a run or export with the per-visit KV "
                                   "cache. Prints the continuation and tokens/s (batch 1, prefill included).")
    g.add_argument("run", metavar="RUN", help="run directory, checkpoint or export directory")
    g.add_argument("--prompt", required=True, help="prompt text (the model sees end-of-text + prompt)")
    g.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate at most (default 64)")
    g.add_argument("--mode", choices=("greedy", "sampled", "both"), default="both", help="decoding (default both)")
    g.add_argument("--temperature", type=float, default=0.8, help="sampling temperature (default 0.8)")
    g.add_argument("--top-p", type=float, default=0.95, help="nucleus sampling mass (default 0.95)")
    g.add_argument("--seed", type=int, default=0, help="sampling seed")
    g.add_argument("--no-stop", action="store_true", help="do not stop at end-of-text")
    g.add_argument("--json", action="store_true", help="print JSON instead of text")
    g.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a recipe field")
    g.add_argument("--allow-other-tokenizer", action="store_true",
                   help="tokenise with data.tokenizer.path even when it is not the tokenizer the run was trained with")
    g.set_defaults(func=run_generate)


# ---------------------------------------------------------------------------------------------


def _positive(**values) -> None:
    for name, v in values.items():
        if v is not None and v <= 0:
            raise ConfigError(f"`--{name.replace('_', '-')}` ({v}) must be > 0: pass a positive number")


def _csv(text: str | None) -> list[str] | None:
    return None if text is None else [x.strip() for x in text.split(",") if x.strip()]


def _load(args):

    runs = load_runs(args.runs, args.set, _csv(args.names), args.allow_other_tokenizer)
    if getattr(args, "corpus", None):

        for r in runs:
            r.cfg, r.eval_split = corpus_config(r.cfg, args.corpus), "train"
    return runs


def _out_dir(args, runs) -> Path:

    if args.output:
        return Path(args.output)
    return Path("evals") / "_vs_".join(safe_name(r.name) for r in runs)


def _finish(result, rows, out: Path, stem: str, plot, no_plots: bool) -> None:

    if not no_plots:
        result["figures"] = plot(result, out)
    jpath, mpath = write_report(result, rows, out, stem)
    names = [r["name"] for r in result["runs"]]
    print(to_markdown(rows, names))
    print(f"\nwrote {jpath}, {mpath}" + ("" if no_plots else f" and {len(result['figures'])} PNGs") + f" to {out}")


def run_eval(args: argparse.Namespace) -> int:

    _positive(batches=args.batches, micro_batch=args.micro_batch, episodes=args.episodes, seq_len=args.seq_len)
    batches = args.batches if args.batches is not None else (None if args.corpus else 32)
    check_task_names(tuple(_csv(args.tasks) or TASK_NAMES))  # before the (long) loss pass
    settings = EvalSettings(seq_len=args.seq_len, micro_batch_size=args.micro_batch, batches=batches,
                            buckets=parse_buckets(args.buckets), shots=parse_shots(args.shots),
                            episodes=args.episodes, tasks=tuple(_csv(args.tasks) or TASK_NAMES), seed=args.seed)
    runs = _load(args)
    result = evaluate_runs(runs, settings)
    _finish(result, eval_table(result), _out_dir(args, runs), "eval", plot_eval, args.no_plots)
    return 0


def run_analyze(args: argparse.Namespace) -> int:

    _positive(batches=args.batches, micro_batch=args.micro_batch, top=args.top, seq_len=args.seq_len)
    settings = AnalysisSettings(seq_len=args.seq_len, micro_batch_size=args.micro_batch, batches=args.batches,
                                domains=_csv(args.domains), top_m=args.top)
    runs = _load(args)
    result = analyze_runs(runs, settings)
    _finish(result, analysis_table(result), _out_dir(args, runs), "analysis", plot_analysis, args.no_plots)
    return 0


def run_generate(args: argparse.Namespace) -> int:

    if not 0 < args.top_p <= 1:
        raise ConfigError(f"`--top-p` ({args.top_p}) must be in (0, 1]")
    if args.temperature <= 0 and args.mode != "greedy":
        raise ConfigError(f"`--temperature` ({args.temperature}) must be > 0 for sampled decoding: "
                          "use --mode greedy for temperature 0")
    run = load_run(args.run, args.set, allow_other_tokenizer=args.allow_other_tokenizer)
    data = open_eval_data(run.cfg)
    ids = encode_prompt(data.tokenizer, args.prompt, data.eot_id)
    eos = None if args.no_stop else data.eot_id
    modes = ("greedy", "sampled") if args.mode == "both" else (args.mode,)
    results = []
    for mode in modes:
        temp = 0.0 if mode == "greedy" else args.temperature
        results.append(generate_text(run.model, data.tokenizer, ids, args.max_new_tokens, temp, args.top_p,
                                     args.seed, eos))
    if args.json:
        print(json.dumps([{k: v for k, v in vars(r).items()} for r in results], indent=1))
        return 0
    print(f"{run.name}: {run.model.schedule.effective_depth} visits, prompt {len(ids)} tokens "
          "(end-of-text + prompt), per-visit KV cache")
    for r in results:
        print(f"--- {r.mode}" + ("" if r.mode == "greedy" else f" (temperature {args.temperature}, top-p {args.top_p}, "
                                                                f"seed {args.seed})"))
        print(args.prompt + r.text)
        print(f"--- {r.new_tokens} new tokens in {r.seconds:.3f} s: {r.tokens_per_s:.1f} tokens/s")
    return 0
