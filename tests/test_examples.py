"""Every command example in the shell blocks of README.md and of the manual (docs/**/*.md) and in
the help texts of `smelt-ds` (each sub-command's description, epilog, argument and group help) is
checked, so that an example cannot go stale. A page's ```bash / ```sh / ```shell block is commands,
one per line (continuations joined, split at && || | ;); a ```console block's commands are its
`$ ` lines; an unlabelled block holding a command fails (label it).

A `smelt-ds` command (also ``python -m smelt_ds...``, ``deepspeed ... --module smelt_ds.train``):

(a) parses with :func:`smelt_ds.cli.build_parser` (``python -m smelt_ds.train`` with the
    per-rank parser, ``deepspeed ... --module smelt_ds.train`` with DeepSpeed's launcher parser
    too, ``smelt-ds lm-eval ...`` with lm-eval's own), after the placeholders of
    :data:`PLACEHOLDERS` (``RECIPE``, ``RUN``, ...) are replaced by concrete values;
(b) for the commands that take a recipe (:data:`VALIDATED`), the recipe with its ``--set``
    overrides loads and validates (:func:`smelt_ds.config.loading.load_config`; a sweep is planned);
    every ``--set KEY=VALUE`` fragment of a help text validates on every shipped tiny recipe;
(c) falls in exactly one class:

    * ``run``: cheap (:func:`_cheap`): run in this process through :func:`smelt_ds.cli.main` in a
      temporary working directory (inputs point at the checkout, outputs land in the temporary
      directory), exit status 0;
    * ``help``: ``--help`` exits 0;
    * ``reference``: a help text naming a command or module (`smelt-ds match`, `python -m
      smelt_ds.train`): the command or module must exist;
    * ``expensive``: training, evaluating a trained run, the harness: listed in :data:`EXPENSIVE`
      with the existing test that runs that path end to end (which must exist);
    * ``cluster``: it reads inputs the checkout lacks, on the reader's cluster or machine, each
      listed in :data:`CLUSTER_INPUTS` with the reason: parsed, its recipe validated through a
      stand-in (:data:`STAND_INS`: docs/cluster.md's recipe), and run instead when it is cheap and
      every such input has a stand-in.

An example in none of them fails, saying what to add. A command of another program is checked by
:func:`check_other`: a script of the checkout must exist, ``pip install`` must name existing extras
and versions that agree with constraints.txt, ``pytest -m`` registered markers, ``lm_eval`` must
parse with lm-eval's parser, and any other program must be listed in :data:`OTHER_PROGRAMS` with
the reason it is not run here.
"""

from __future__ import annotations

import argparse
import configparser
import contextlib
import fnmatch
import functools
import http.server
import importlib.util
import io
import itertools
import os
import re
import shlex
import threading
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from smelt_ds import cli
from smelt_ds.config.loading import apply_overrides, config_from_dict, load_config
from smelt_ds.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
#: the pages whose command examples are checked: the front page and the manual
DOC_PAGES = [README, *sorted((ROOT / "docs").rglob("*.md"))]
TINY_RECIPES = sorted((ROOT / "recipes" / "tiny").glob("*.yaml"))

#: documented placeholders of the examples -> the concrete value the checks use
PLACEHOLDERS = {"RECIPE": "recipes/tiny/smelt.yaml", "RUN": "runs/tiny-smelt", "RUN_DIR": "runs/tiny-smelt",
                "EXPORT": "exported/tiny-smelt", "TASKS": "smelt_offline", "TASKS_DIR": "tasks/", "DIR": "tasks/",
                "OUT": "out/", "N": "2", "NEW_RUN": "runs/from-export"}
#: placeholders whose value depends on the command: (command, placeholder) -> value
PLACEHOLDERS_FOR = {
    # `smelt-ds memory RECIPE --nodes 4 --gpus-per-node 8 --seq-len 4096`: a recipe of that size
    ("memory", "RECIPE"): "recipes/m/smelt.yaml",
}
#: input files an example names that the checkout does not hold under that name: option -> {value: file}
INPUT_FILES = {"--hostfile": {"hostfile": "launchers/deepspeed/hostfile.example"}}
#: options whose value is an output path (kept relative: it lands in the temporary directory)
OUTPUT_OPTIONS = {"-o", "--output", "--output-dir", "--output_path"}
#: commands whose recipe (or sweep) and --set overrides are loaded and validated
VALIDATED = {("train",), ("sweep",), ("render-job",), ("memory",), ("budget",), ("data", "prepare"),
             ("data", "tokenize")}

#: examples that train, evaluate a trained run or run the harness: example -> the test that runs
#: that path end to end ("tests/<file>.py::<test>"). Keys are the example's words (comments and
#: line continuations removed, shell quotes resolved) joined by one space.
_LOOP, _EVAL, _HARNESS = "tests/train/test_loop.py", "tests/eval/test_eval_cli.py", "tests/eval/test_harness_cli.py"
_BENCH = "tests/eval/test_benchmarks.py"
_E2E_SWEEP = "tests/study/test_scaling_e2e.py::test_tiny_real_sweep_then_fit"
_LADDER_FIT = "tests/study/scaling/test_replicates.py::test_the_fit_command_recomputes_the_report_from_summaries_alone"
_RUN_EXPORT_INIT = f"{_LOOP}::test_run_directory_summary_export_and_init_from"
_STOPS = "tests/launch/test_launcher_stops.py"
EXPENSIVE = {
    # a trained run's checkpoint (docs/changing_scale.md)
    "smelt-ds checkpoint info runs/tiny-smelt":
        "tests/runs/test_reshard.py::test_checkpoint_info_lists_what_the_checkpoint_holds_and_where_it_resumes",
    # the main job (README.md), training, launcher, resume, export (docs/training.md)
    "smelt-ds train recipes/tiny/smelt.yaml": "tests/train/test_golden_losses.py::test_fresh_run_matches_golden_losses",
    "smelt-ds train RECIPE [--set train.max_steps=200 ...]": _RUN_EXPORT_INIT,
    "smelt-ds train recipes/tiny/smelt.yaml --set tracking.trackers=[wandb,csv] --set tracking.wandb.mode=offline":
        "tests/train/test_trackers.py::test_wandb_offline_history_equals_metrics_jsonl_and_resume_continues_the_run",
    "smelt-ds train recipes/tiny/smelt.yaml --set profile.enabled=true --set profile.start_step=100 "
    "--set profile.ranks=[0,1] --nproc 2":
        "tests/train/test_profiler.py::test_trace_holds_one_range_per_visit_and_moe_stage_per_profiled_step",
    "smelt-ds train RECIPE --nproc 2": f"{_STOPS}::test_the_reference_run_through_the_deepspeed_launcher_wrote_its_"
                                       "run_directory",
    "deepspeed --num_gpus 8 --module smelt_ds.train RECIPE":
        f"{_STOPS}::test_deepspeed_bare_then_rendered_single_host_stop_and_resume_on_the_trajectory",
    "smelt-ds train RECIPE --resume auto": f"{_LOOP}::test_resume_equals_uninterrupted_zero2",
    "smelt-ds export runs/tiny-smelt -o exported/tiny-smelt": _RUN_EXPORT_INIT,
    "smelt-ds export runs/tiny-smelt --format hf -o hf/tiny-smelt":
        "tests/interop/test_export.py::test_looped_model_exports_as_smelt_with_its_code",
    "smelt-ds train RECIPE --set train.init_from=exported/tiny-smelt --run-dir runs/from-export": _RUN_EXPORT_INIT,
    "smelt-ds export RUN -o EXPORT": _RUN_EXPORT_INIT,
    "smelt-ds train RECIPE --set train.init_from=EXPORT --run-dir NEW_RUN": _RUN_EXPORT_INIT,
    "smelt-ds train recipes/tiny/smelt.yaml --set train.compile=layers":
        "tests/parallel/test_compile.py::test_compiled_layers_train_like_eager",
    "smelt-ds train recipes/tiny/smelt.yaml --set train.compile=layers --set train.compile_backend=aot_eager":
        "tests/parallel/test_compile.py::test_compiled_layers_train_like_eager",
    "smelt-ds memory recipes/tiny/smelt.yaml --measure --seq-len 32 --micro-batch 2":
        "tests/parallel/test_memory.py::test_cli_table_json_and_errors",
    # docs/evaluation.md: evaluation, harness, HumanEval, test-time loop count
    "smelt-ds train recipes/tiny/baseline.yaml --set train.max_steps=300 --run-dir /tmp/runs/baseline":
        _RUN_EXPORT_INIT,
    "smelt-ds train recipes/tiny/smelt.yaml --set train.max_steps=300 --run-dir /tmp/runs/smelt": _RUN_EXPORT_INIT,
    "smelt-ds eval /tmp/runs/baseline /tmp/runs/smelt -o evals/tiny": f"{_EVAL}::test_eval_table_files_and_ranges",
    "smelt-ds plot /tmp/runs/baseline /tmp/runs/smelt --labels Baseline,SMELT "
    "-o docs/figures/tiny_smelt_vs_baseline.png": "tests/eval/test_curves.py::test_plots_a_real_run",
    "smelt-ds analyze /tmp/runs/baseline /tmp/runs/smelt -o evals/tiny": f"{_EVAL}::test_analyze_files_and_ranges",
    "smelt-ds generate /tmp/runs/smelt --prompt def main( --max-new-tokens 48":
        f"{_EVAL}::test_generate_greedy_matches_full_recompute",
    "smelt-ds eval build-tasks tasks/": "tests/eval/test_offline_tasks.py::test_cli",
    "smelt-ds eval runs/tiny-baseline runs/tiny-smelt --harness smelt_offline --include-path tasks/ "
    "--num-fewshot 0,1,2,4,8,16 -o evals/harness": f"{_HARNESS}::test_eval_harness_two_runs_two_k",
    "smelt-ds lm-eval run --model smelt-ds --model_args pretrained=runs/tiny-smelt --tasks smelt_offline "
    "--include_path tasks/ --num_fewshot 0 --output_path evals/lm-eval":
        f"{_HARNESS}::test_lm_eval_command_line_in_a_subprocess",
    "smelt-ds eval runs/tiny-baseline runs/tiny-smelt --humaneval --allow-code-execution -o evals/humaneval":
        "tests/eval/test_humaneval.py::test_two_run_journey",
    "smelt-ds eval runs/tiny-baseline runs/tiny-smelt --humaneval --humaneval-loss-only -o evals/humaneval":
        f"{_HARNESS}::test_build_tasks_and_humaneval_are_dispatched",
    "smelt-ds eval runs/tiny-smelt --humaneval --allow-code-execution --samples 10 --temperature 0.8":
        "tests/eval/test_humaneval.py::test_pass_at_k_over_mixed_samples",
    "smelt-ds eval runs/tiny-baseline runs/tiny-smelt --loop-repeats 1,2,3 -o evals/loops":
        f"{_HARNESS}::test_eval_loop_repeats_without_harness_writes_a_loss_table",
    "smelt-ds eval runs/tiny-smelt --harness smelt_offline --include-path tasks/ --loop-repeats 1,2,3":
        f"{_HARNESS}::test_eval_harness_loop_repeats_and_baseline_no_loop",
    "smelt-ds generate runs/tiny-smelt --prompt def main( --loop-repeats 3":
        f"{_EVAL}::test_generate_with_a_test_time_loop_count",
    "smelt-ds eval fetch-benchmarks": f"{_BENCH}::test_fetch_rebuilds_the_same_files_atomically_and_once",
    "smelt-ds eval runs/tiny-baseline runs/tiny-smelt --harness smelt_benchmarks --num-fewshot 0,5 -o evals/benchmarks":
        f"{_BENCH}::test_eval_harness_command_on_benchmark_tasks",
    "smelt-ds eval runs/tiny-smelt --harness arc_easy_val,hellaswag_val,mbpp_bpb --samples-per-task 200":
        f"{_BENCH}::test_eval_harness_command_on_benchmark_tasks",
    # docs/huggingface.md
    "smelt-ds export runs/tiny-baseline --format hf -o hf/tiny-baseline":
        "tests/interop/test_export.py::test_baseline_exports_as_a_transformers_architecture",
    "smelt-ds import-hf hf/tiny-baseline -o recipes/continue.yaml":
        "tests/interop/test_import_hf.py::test_imported_recipe_trains_from_the_checkpoint",
    # docs/scaling.md: sweeps and scaling fits
    "smelt-ds sweep recipes/sweeps/micro.yaml": _E2E_SWEEP,
    "smelt-ds scaling fit runs/sweeps/micro -o docs/scaling-micro": _E2E_SWEEP,
    "smelt-ds sweep recipes/sweeps/micro.yaml --steps-scale 0.05": _E2E_SWEEP,
    "smelt-ds sweep recipes/sweeps/ladder.yaml": _E2E_SWEEP,
    "smelt-ds scaling fit docs/scaling-ladder/runs -o docs/scaling-ladder": _LADDER_FIT,
    "smelt-ds scaling fit runs/sweeps/ladder -o evals/ladder": _LADDER_FIT,
    # docs/results/ladder.md: the ladder's largest pair (item 3 of issue 28)
    "smelt-ds eval runs/sweeps/ladder/baseline/h80-c3.2e13 runs/sweeps/ladder/smelt/h80-c3.2e13 --harness "
    "smelt_benchmarks --num-fewshot 0,1,2,4,8 --samples-per-task 100 -o evals/ladder-h80":
        f"{_BENCH}::test_eval_harness_command_on_benchmark_tasks",
    "smelt-ds analyze runs/sweeps/ladder/baseline/h80-c3.2e13 runs/sweeps/ladder/smelt/h80-c3.2e13 --batches 16 "
    "-o evals/ladder-h80-analysis": f"{_EVAL}::test_analyze_files_and_ranges",
    "smelt-ds scaling fit runs/sweeps/ladder-gpu -o docs/scaling-ladder-gpu": _LADDER_FIT,
    # docs/data.md
    "smelt-ds data builtin /tmp/corpus": "tests/data/test_builtin.py::test_cli_prints_documents_mb_and_hash",
    "smelt-ds data tokenizer --input builtin --vocab-size 4096 -o tokenizer.json":
        "tests/data/test_tokenizer.py::test_cli_trains_then_reuses",
    "smelt-ds data prepare": "tests/data/test_prepare.py::test_builtin_prepared_matches_direct_tokenisation",
    "smelt-ds data prepare --recipe recipes/tiny/smelt.yaml --set data.validation_share=0.1":
        "tests/data/test_cli.py::test_prepare_with_a_recipe_and_set",
    "smelt-ds data prepare --source path=corpus.jsonl,domain=web,weight=2 --source "
    "path=books/,sample_by=paragraph,domain=books --vocab-size 8192 -o prepared/":
        "tests/data/test_cli.py::test_prepare_then_reuse_then_verify",
    "smelt-ds data verify prepared/": "tests/data/test_cli.py::test_prepare_then_reuse_then_verify",
    "smelt-ds data tokenize --input corpus.jsonl -o data/web_text_document --recipe recipes/tiny/smelt.yaml "
    "--workers 8": "tests/data/test_tokenize.py::test_the_recipes_tokenizer_and_a_text_input",
    # help texts
    "smelt-ds export runs/tiny-smelt -o exports/tiny-smelt": _RUN_EXPORT_INIT,
    "smelt-ds eval build-tasks OUT": "tests/eval/test_offline_tasks.py::test_cli",
    "smelt-ds lm-eval run --model smelt-ds --model_args pretrained=RUN --tasks TASKS --include_path DIR":
        f"{_HARNESS}::test_lm_eval_command_line_in_a_subprocess",
    "smelt-ds lm-eval run --model smelt-ds --model_args pretrained=RUN --batch_size 8 --tasks smelt_offline "
    "--include_path TASKS_DIR --output_path OUT": f"{_HARNESS}::test_lm_eval_command_line_in_a_subprocess",
    "smelt-ds eval RUN --harness smelt_offline --include-path OUT": f"{_HARNESS}::test_eval_harness_two_runs_two_k",
    "smelt-ds eval RUN --harness smelt_benchmarks": f"{_BENCH}::test_eval_harness_command_on_benchmark_tasks",
    "smelt-ds plot runs/tiny-baseline runs/tiny-smelt -o plots/tiny.png":
        "tests/eval/test_curves.py::test_plots_a_real_run",
    "smelt-ds import-hf ./Qwen3-30B-A3B -o recipes/qwen3-30b-a3b.yaml":
        "tests/interop/test_import_hf.py::test_round_trip_through_a_transformers_architecture",
}


#: inputs on the reader's cluster or machine that the checkout lacks (docs/cluster.md's walkthrough,
#: docs/data.md's token files and the files it tokenises): input (a path, or a prefix ending in "/")
#: -> why it is not here. An example naming one is parsed, and its recipe validated through its
#: stand-in (STAND_INS); it runs when it is cheap and every such input has a stand-in, else its class
#: is `cluster` (not run).
_INSPECT = "tests/data/test_token_bad_input.py::test_inspect_prints_what_the_writers_wrote"
_TOKENIZE = "tests/data/test_tokenize.py::test_megatron_round_trip_through_inspect_and_the_reader"
CLUSTER_INPUTS = {
    "/shared/": "a path on the cluster's shared filesystem (docs/cluster.md: corpora, tokenizer, environment)",
    "m-smelt-pile.yaml": "the recipe docs/cluster.md has the reader write (stand-in: its yaml block)",
    "runs/m-smelt-pile": f"the walkthrough's run on 4 nodes (the path at tiny scale: {_RUN_EXPORT_INIT})",
    "exports/m-smelt-pile": f"the export of the walkthrough's run (the path at tiny scale: {_RUN_EXPORT_INIT})",
    "corpus_text_document": f"a Megatron dataset docs/data.md writes with megatron-core's builder ({_INSPECT})",
    "corpus.npy": f"a flat token file docs/data.md writes with np.save ({_INSPECT})",
    "shards/": "the reader's own directory of JSONL files docs/data.md tokenises (a JSONL file at test scale: "
               f"{_TOKENIZE})",
    "/data/tokenizers/": "a tokenizer on the reader's machine (Llama 3's, which the checkout does not ship; a "
                         f"tokenizer.json at test scale: {_TOKENIZE})",
}


def walkthrough_recipe(tmp: Path) -> Path:
    """docs/cluster.md's recipe (its yaml block starting ``# m-smelt-pile.yaml``) written to ``tmp``,
    with its ``base:`` pointed at this checkout's M recipe."""
    page = (ROOT / "docs" / "cluster.md").read_text()
    blocks = [body for lang, _, body in fenced_blocks(page) if lang == "yaml" and body[0] == "# m-smelt-pile.yaml"]
    assert len(blocks) == 1, "docs/cluster.md: expected one yaml block starting `# m-smelt-pile.yaml`"
    raw = yaml.safe_load("\n".join(blocks[0]))
    raw["base"] = str(ROOT / "recipes" / "m" / "smelt.yaml")
    path = tmp / "m-smelt-pile.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


#: cluster inputs that have a stand-in here: input -> function writing it into a directory, returning its path
STAND_INS = {"m-smelt-pile.yaml": walkthrough_recipe}

#: commands of other programs in the pages' shell blocks: program (or `python -m MODULE`) -> why the
#: example is not run here. `pip`, `pytest`, `lm_eval` and scripts of the checkout are checked
#: (see check_other); every other program must be listed.
OTHER_PROGRAMS = {
    "sbatch": "submits a job to a Slurm cluster (the script render-job writes; tests/launch/test_jobs.py runs its "
              "per-node command on loopback)",
    "kubectl": "applies a manifest to a Kubernetes cluster (tests/launch/test_jobs.py checks the manifest)",
    "bash": "runs a job script render-job writes (tests/launch/test_jobs.py runs one with `bash -n` and on loopback)",
    "wandb": "W&B's own CLI (uploads an offline run; tests/train/test_trackers.py reads the offline files)",
    "mlflow": "MLflow's own UI server",
    "tensorboard": "TensorBoard's viewer",
    "python -m venv": "creates a virtual environment",
    "source": "shell builtin: activates an environment",
    "export": "shell builtin: sets an environment variable",
    "echo": "shell builtin",
    "truncate": "coreutils: damages a file on purpose (tests/data/test_token_bad_input.py cuts files the same way)",
}
#: folders of the checkout: `python X` / `bash X` with X under one of them must name a file that exists
_SCRIPT_FOLDERS = ("bench", "scripts", "launchers", ".ci")


# ---------------------------------------------------------------------------------------------
# finding the examples
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Example:
    """One command example: where it is written and its text (one command, as written)."""

    where: str
    text: str
    prose: bool = False  # named in a help text's prose or a backtick span there (may be a reference)


_PREFIX = re.compile(r"^(smelt-ds(?![\w:/.'-])|python -m smelt_ds\b|deepspeed .*--module smelt_ds\b)")
_SEPARATORS = {"&&", "||", "|", ";"}


def _segments(command: str) -> list[str]:
    """The commands of one shell line (split at && || | ;, with or without spaces around them),
    comments removed, each shlex-joined."""
    lexer = shlex.shlex(command, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    out, cur = [], []
    for tok in lexer:
        if tok in _SEPARATORS:
            out.append(cur)
            cur = []
        else:
            cur.append(tok)
    out.append(cur)
    return [shlex.join(seg) for seg in out if seg]


#: fenced-block languages whose every line is a command, and those whose `$ `-prompted lines are
SHELL_LANGS, CONSOLE_LANGS = ("bash", "sh", "shell"), ("console",)


def fenced_blocks(text: str) -> list[tuple[str, int, list[str]]]:
    """``(language, first body line, body lines)`` of every fenced block (```` ``` ```` fences)."""
    out: list[tuple[str, int, list[str]]] = []
    lang: str | None = None
    for n, line in enumerate(text.splitlines(), 1):
        if line.startswith("```"):
            if lang is None:
                lang, start, body = line[3:].strip(), n + 1, []
            else:
                out.append((lang, start, body))
                lang = None
        elif lang is not None:
            body.append(line)
    return out


def _command_lines(lang: str, start: int, body: list[str]) -> list[tuple[int, str]]:
    """``(line number, command)`` of a shell or console block, continuation lines joined."""
    out, pending, first = [], "", 0
    for n, line in enumerate(body, start):
        if lang in CONSOLE_LANGS:
            if not pending and not line.startswith("$ "):
                continue  # output of the command above
            line = line[2:] if not pending else line
        if not pending:
            first = n
        pending += line
        if pending.endswith("\\"):
            pending = pending[:-1] + " "
            continue
        out.append((first, pending))
        pending = ""
    return out


def page_commands(page: Path) -> tuple[list[Example], list[Example]]:
    """The commands of a page's shell (```bash, ```sh, ```shell) and console (```console, `$ `
    lines) blocks, one per command of a line (split at && || | ;): those starting with a smelt-ds
    prefix (:data:`_PREFIX`), and the others (``pip``, ``sbatch``, ``python bench/x.py``, ...).
    Raises AssertionError for an unlabelled block that holds a smelt-ds command (label it)."""
    rel = page.relative_to(ROOT)
    ours, others = [], []
    for lang, start, body in fenced_blocks(page.read_text()):
        if lang == "":
            stray = [ln for ln in body if _PREFIX.match(ln.removeprefix("$ ").strip())]
            assert not stray, f"{rel}:{start}: an unlabelled code block holds the command {stray[0]!r}: label the " \
                              "block ```bash (commands) or ```console (`$ ` before each command, then its output)"
            continue
        if lang not in SHELL_LANGS + CONSOLE_LANGS:
            continue
        for n, line in _command_lines(lang, start, body):
            for seg in _segments(line):
                (ours if _PREFIX.match(seg) else others).append(Example(f"{rel}:{n}", seg))
    return ours, others


def doc_examples() -> tuple[list[Example], list[Example]]:
    """:func:`page_commands` of README.md and every page under docs/: (smelt-ds commands, others)."""
    ours, others = [], []
    for page in DOC_PAGES:
        a, b = page_commands(page)
        ours += a
        others += b
    return ours, others


def parser_tree() -> dict[tuple[str, ...], argparse.ArgumentParser]:
    """Every parser of `smelt-ds`, by command path: sub-commands, and parsers a command keeps
    beside its sub-parsers (`smelt-ds eval build-tasks`)."""
    tree: dict[tuple[str, ...], argparse.ArgumentParser] = {}

    def walk(path: tuple[str, ...], p: argparse.ArgumentParser) -> None:
        tree[path] = p
        for a in p._actions:
            if isinstance(a, argparse._SubParsersAction):
                for name, sp in a.choices.items():
                    walk(path + (name,), sp)
        for value in vars(p).values():
            if isinstance(value, argparse.ArgumentParser) and value.prog.startswith(p.prog + " "):
                walk(path + (value.prog[len(p.prog) + 1:],), value)

    walk((), cli.build_parser())
    return tree


def _help_strings(p: argparse.ArgumentParser) -> list[tuple[str, str]]:
    """(what, text) of a parser's description, epilog, group descriptions and argument help."""
    texts = [("description", p.description or ""), ("epilog", p.epilog or "")]
    texts += [(f"group {g.title!r}", g.description or "") for g in p._action_groups]
    fmt = p._get_formatter()
    for a in p._actions:
        if a.help and a.help != argparse.SUPPRESS:
            texts.append((f"argument {'/'.join(a.option_strings) or a.dest}", fmt._expand_help(a)))
        if isinstance(a, argparse._SubParsersAction):
            texts += [(f"sub-command {c.dest}", c.help or "") for c in a._choices_actions]
    return [(w, t) for w, t in texts if t]


_SPAN = re.compile(r"`([^`]+)`")
_PROSE_NAME = re.compile(r"(?<![\w/.`-])(smelt-ds|python -m smelt_ds[\w.]*)((?: [a-z][\w-]*)*)(?![\w:/.'-])")
_SET_FRAGMENT = re.compile(r"--set[ =]([\w.]+=[^\s,;)`]+)")


def help_examples() -> tuple[list[Example], list[tuple[str, str]]]:
    """Examples of every help text: backtick spans starting with a prefix, lines of a text (after
    `example:`, `examples:` or `e.g.`) starting with one, and commands named in prose; and every
    ``--set KEY=VALUE`` fragment as (where, KEY=VALUE)."""
    examples, fragments = [], []
    tree = parser_tree()

    def named(prog: str, words: str) -> str:  # the program and as many following words as name a command
        path: tuple[str, ...] = ()
        for w in words.split():
            if prog != "smelt-ds" or path + (w,) not in tree:
                break
            path += (w,)
        return " ".join((prog,) + path)

    for path, p in tree.items():
        for what, text in _help_strings(p):
            where = f"`{' '.join(('smelt-ds',) + path)} --help` {what}"
            fragments += [(where, f) for f in _SET_FRAGMENT.findall(text)]
            rest = _SPAN.sub(" ", text)
            for span in _SPAN.findall(text):
                if _PREFIX.match(span.strip()):
                    examples.append(Example(where, span.strip(), prose=True))
            for line in rest.splitlines():
                s = re.sub(r"^\s*(examples?:|e\.g\.)?\s*", "", line)
                if _PREFIX.match(s):  # a command line, up to a comment after two spaces or `#`
                    examples.append(Example(where, re.split(r"\s{2,}|\s#", s.strip())[0]))
                    continue
                for m in _PROSE_NAME.finditer(line):
                    examples.append(Example(where, named(m.group(1), m.group(2)), prose=True))
    return [e for e in examples if e.text != "smelt-ds"], fragments  # the program's bare name


def all_examples() -> list[Example]:
    ex, _ = help_examples()
    return doc_examples()[0] + ex


# ---------------------------------------------------------------------------------------------
# resolving, parsing, validating, running
# ---------------------------------------------------------------------------------------------


@dataclass
class Command:
    """An example resolved: ``args`` are what `smelt-ds` parses (placeholders replaced), ``path``
    the command path, ``module`` the module of a ``python -m`` / ``deepspeed --module`` form,
    ``launcher`` the deepspeed launcher's own arguments."""

    example: Example
    args: list[str]
    path: tuple[str, ...]
    module: str | None = None
    launcher: list[str] | None = None


_PLACEHOLDER = re.compile(r"^[A-Z][A-Z0-9]*(?:_[A-Z0-9]+)*$")


def _unbracket(tok: str) -> str:
    """`[--set` -> `--set`, `...]` -> `...`, `RUN...` -> `RUN` (optional and repeated parts of a synopsis);
    a balanced bracket is a value's own (`tracking.trackers=[wandb,csv]`) and stays."""
    if tok.startswith("[") and tok.count("[") > tok.count("]"):
        tok = tok[1:]
    if tok.endswith("]") and tok.count("]") > tok.count("["):
        tok = tok[:-1]
    return tok[:-3] if tok.endswith("...") and len(tok) > 3 else tok


def _substitute(tok: str, command: str) -> str:
    def one(word: str) -> str:
        if not _PLACEHOLDER.match(word):
            return word
        value = PLACEHOLDERS_FOR.get((command, word), PLACEHOLDERS.get(word))
        if value is None:
            raise AssertionError(f"placeholder {word!r} is not in PLACEHOLDERS of tests/test_examples.py: add it with "
                                 "a concrete value the checks can use")
        return value

    if "=" in tok and not tok.startswith("-"):
        key, _, value = tok.partition("=")
        return f"{key}={','.join(one(v) for v in value.split(','))}"
    return one(tok)


def _command_path(args: list[str], tree) -> tuple[str, ...]:
    path: tuple[str, ...] = ()
    for a in args:
        if path + (a,) not in tree:
            break
        path += (a,)
    return path


def resolve(ex: Example, tree) -> Command:
    """The example as `smelt-ds` arguments. Raises AssertionError for a form no parser is known for."""
    toks = [t for t in (_unbracket(t) for t in shlex.split(ex.text)) if t and t != "..."]
    module, launcher = None, None
    if toks[0] == "smelt-ds":
        rest = toks[1:]
    elif toks[:2] == ["python", "-m"]:
        module, rest = toks[2], toks[3:]
        rest = {"smelt_ds": rest, "smelt_ds.cli": rest, "smelt_ds.train": ["train", *rest],
                "smelt_ds.eval.harness": ["lm-eval", *rest]}.get(module, rest)
    elif toks[0] == "deepspeed" and "--module" in toks:
        i = toks.index("--module")
        module, launcher, rest = toks[i + 1], toks[1:i], ["train", *toks[i + 2:]]
        assert module == "smelt_ds.train", f"{ex.where}: `{ex.text}` launches {module}, not smelt_ds.train"
    else:
        raise AssertionError(f"{ex.where}: no parser is known for `{ex.text}`")
    path = _command_path(rest, tree)
    command = path[0] if path else ""
    head, tail = rest[:len(path)], rest[len(path):]
    return Command(ex, head + [_substitute(t, command) for t in tail], path, module, launcher)


def _parse(argv: list[str], parse, what: str) -> argparse.Namespace | None:
    """``parse(argv)`` with argparse's messages captured; None after a --help (exit 0)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            return parse(argv)
        except SystemExit as e:
            if e.code == 0:
                return None
            lines = err.getvalue().strip().splitlines() or [f"exit status {e.code}"]
            raise AssertionError(f"{what} does not parse: {lines[-1]}") from None


def parse(cmd: Command) -> argparse.Namespace | None:
    """(a): the example parses with smelt_ds.cli.build_parser (and the launcher's / lm-eval's parser)."""
    what = f"{cmd.example.where}: `{cmd.example.text}` (as `smelt-ds {shlex.join(cmd.args)}`)"
    if cmd.module is not None and cmd.module not in ("smelt_ds", "smelt_ds.cli", "smelt_ds.train",
                                                     "smelt_ds.eval.harness"):
        raise AssertionError(f"{what}: no parser is known for module {cmd.module}: add it to tests/test_examples.py")
    if cmd.module == "smelt_ds.train":  # the per-rank entry point has its own parser
        from smelt_ds.train.loop import parse_args

        _parse(cmd.args[1:], parse_args, what)
    if cmd.launcher is not None:
        from deepspeed.launcher.runner import parse_args as ds_parse_args

        _parse([*cmd.launcher, "--module", cmd.module, *cmd.args[1:]], ds_parse_args, what + " (deepspeed launcher)")
    ns = _parse(cmd.args, cli.build_parser().parse_args, what)
    if ns is not None and cmd.path == ("lm-eval",) and ns.lm_eval_args:
        parse_lm_eval(list(ns.lm_eval_args), what)
    return ns


def parse_lm_eval(args: list[str], what: str) -> None:
    """lm-eval's own command line (``smelt-ds lm-eval ARGS``, ``lm_eval ARGS``) parses with lm-eval's parser."""
    from lm_eval._cli import HarnessCLI

    harness = HarnessCLI()
    if args[0] not in harness._subparsers.choices:  # lm-eval's legacy form: `run` implied
        args = ["run", *args]
    _parse(args, harness._parser.parse_args, what + " (lm-eval's parser)")


def _in_repo(path: str) -> Path:
    p = Path(path)
    return p if p.is_absolute() else ROOT / p


def validate(cmd: Command, ns: argparse.Namespace, tmp: Path) -> None:
    """(b): the recipe(s) of a command in VALIDATED load with its --set overrides (a sweep is planned)."""
    sets = list(getattr(ns, "set", None) or [])
    try:
        if cmd.path == ("sweep",):
            from smelt_ds.study.sweep import load_sweep, plan_sweep

            plan_sweep(load_sweep(_in_repo(ns.sweep)), _in_repo(ns.sweep), output_dir=str(tmp / "sweep"),
                       overrides=sets, steps_scale=ns.steps_scale)
        elif cmd.path == ("budget",):
            for r in ns.recipes:
                load_config(_in_repo(r), sets)
        elif cmd.path in (("data", "prepare"), ("data", "tokenize")) and ns.recipe is None:
            config_from_dict(apply_overrides({}, sets))
        else:
            load_config(_in_repo(ns.recipe), sets)
    except ConfigError as e:
        raise AssertionError(f"{cmd.example.where}: `{cmd.example.text}`: its recipe does not validate: {e}") from None


def _cheap(cmd: Command) -> list[str] | None:
    """The arguments to run a cheap example with (what it does, writing nothing outside the
    working directory), or None when it is not cheap."""
    a, p = cmd.args, cmd.path
    if cmd.module is not None and cmd.module not in ("smelt_ds", "smelt_ds.cli"):
        return None
    if p in (("budget",), ("match",), ("render-job",), ("preflight",), ("config", "show"), ("config", "validate")) or (
            p == ("memory",) and "--measure" not in a):
        return a
    if p in (("recipes", "table"), ("config", "reference")):  # it would rewrite a page of docs/: print it instead
        # (--check compares with the checkout's page and writes nothing: run as written)
        return a if {"-o", "--output", "--check"} & set(a) else [*a, "-o", "-"]
    if p == ("recipes", "derive"):  # it would rewrite the checkout's recipes: compare instead
        return a if "--check" in a else [*a, "--check"]
    if p == ("sweep",) and ("--dry-run" in a or "--render" in a):
        return a
    return None


def _localize(args: list[str], skip: int, tmp: Path) -> list[str]:
    """Inputs that name files of the checkout become absolute; outputs stay relative (to ``tmp``);
    the first ``skip`` words (the command path) stay as they are."""
    out = args[:skip]
    for i, tok in enumerate(args[skip:], skip):
        prev = args[i - 1]
        if prev in OUTPUT_OPTIONS:
            if tok != "-":
                (tmp / tok).parent.mkdir(parents=True, exist_ok=True)
        elif tok in INPUT_FILES.get(prev, {}):
            tok = str(ROOT / INPUT_FILES[prev][tok])
        elif not tok.startswith("-") and not Path(tok).is_absolute() and (ROOT / tok).exists():
            tok = str(ROOT / tok)
        out.append(tok)
    return out


@functools.cache
def _answering_server() -> str:
    """The URL of a local HTTP server (a daemon thread, for the session) that answers 200."""

    class Answer(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Answer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return f"http://127.0.0.1:{server.server_address[1]}"


def run_cheap(cmd: Command, argv: list[str], tmp: Path, monkeypatch) -> str:
    """(c) run: the example through smelt_ds.cli.main in ``tmp``; returns its output. Exit status 0."""
    argv = _localize(argv, len(cmd.path), tmp)
    if cmd.path in (("render-job",), ("preflight",)):
        if "--no-data-check" not in argv:
            # the recipes name corpora the checkout does not ship (corpora/, /shared/): every other check
            # runs; tests/launch/test_preflight.py runs the data check on data that exist and that do not
            argv.append("--no-data-check")
        # the reader's W&B server (these machines reach none): a local server that answers stands in
        monkeypatch.setenv("WANDB_BASE_URL", _answering_server())
        monkeypatch.setenv("WANDB_API_KEY", "stand-in")  # and the reader's `wandb login`
    monkeypatch.chdir(tmp)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = cli.main(argv)
    assert rc == 0, (f"{cmd.example.where}: `{cmd.example.text}` exits {rc} (run as `smelt-ds {shlex.join(argv)}` "
                     f"in a temporary directory):\n{err.getvalue()[-2000:]}")
    # an output the checkout ships under the same path (docs/budgets.md: "recipes/tiny/smelt.yaml is
    # written by" smelt-ds match) is reproduced, apart from its `#` header lines (they name the command)
    for prev, tok in itertools.pairwise(argv):
        shipped = ROOT / tok
        if prev in OUTPUT_OPTIONS and tok != "-" and shipped.is_file():
            body = [line for line in (tmp / tok).read_text().splitlines() if not line.startswith("#")]
            assert body == [line for line in shipped.read_text().splitlines() if not line.startswith("#")], (
                f"{cmd.example.where}: `{cmd.example.text}` writes a {tok} that differs from the shipped one")
    return out.getvalue()


def _is_reference(cmd: Command) -> bool:
    return cmd.example.prose and len(cmd.args) == len(cmd.path) and cmd.launcher is None


def _module_exists(module: str) -> bool:
    spec = importlib.util.find_spec(module)
    if spec is None:
        return False
    return spec.submodule_search_locations is None or importlib.util.find_spec(module + ".__main__") is not None


def _key(ex: Example) -> str:
    return " ".join(shlex.split(ex.text))


def _pointer_exists(pointer: str) -> bool:
    file, _, name = pointer.partition("::")
    path = ROOT / file
    return path.is_file() and re.search(rf"^(async )?def {re.escape(name.split('[')[0])}\(", path.read_text(),
                                        re.M) is not None


def cluster_inputs(cmd: Command) -> list[str]:
    """The :data:`CLUSTER_INPUTS` an example's arguments name (a path equal to one, or under one)."""
    found: list[str] = []
    for tok in cmd.args[len(cmd.path):]:
        for name in CLUSTER_INPUTS:
            under = name if name.endswith("/") else name + "/"
            if (tok == name or tok.startswith(under)) and name not in found:
                found.append(name)
    return found


def with_stand_ins(cmd: Command, names: list[str], tmp: Path) -> Command:
    """``cmd`` with each of ``names`` replaced by its stand-in (:data:`STAND_INS`), written into ``tmp``."""
    args = list(cmd.args)
    for name in names:
        path = str(STAND_INS[name](tmp))
        args = [path if a == name else a for a in args]
    return Command(cmd.example, args, cmd.path, cmd.module, cmd.launcher)


def check(ex: Example, tmp: Path, monkeypatch, tree=None) -> str:
    """Check one example; returns its class (run, help, reference, expensive, cluster). Raises
    AssertionError naming the example, where it is written, what failed and what to do."""
    tree = tree or parser_tree()
    cmd = resolve(ex, tree)
    if _is_reference(cmd):
        if cmd.module is not None and cmd.module not in ("smelt_ds", "smelt_ds.cli"):
            assert _module_exists(cmd.module), f"{ex.where}: `{ex.text}` names module {cmd.module}, which does not run"
        return "reference"  # the command path resolved word for word in the parser tree
    ns = parse(cmd)
    if ns is None or "-h" in cmd.args or "--help" in cmd.args:
        return "help"
    elsewhere = cluster_inputs(cmd)
    if elsewhere:
        cmd = with_stand_ins(cmd, [name for name in elsewhere if name in STAND_INS], tmp)
        ns = parse(cmd)
    if cmd.path in VALIDATED:
        validate(cmd, ns, tmp)
    argv = _cheap(cmd)
    key = _key(ex)
    if elsewhere:
        assert key not in EXPENSIVE, \
            f"{ex.where}: `{ex.text}` names {elsewhere} (CLUSTER_INPUTS): remove it from EXPENSIVE"
        if argv is None or not all(name in STAND_INS for name in elsewhere):
            return "cluster"
    if argv is not None:
        assert key not in EXPENSIVE, f"{ex.where}: `{ex.text}` runs here cheaply: remove it from EXPENSIVE"
        run_cheap(cmd, argv, tmp, monkeypatch)
        return "run"
    if key not in EXPENSIVE:
        raise AssertionError(
            f"{ex.where}: the example `{ex.text}` is not classified. If it runs in about a second without training "
            "or a trained run (reads recipes, writes under -o), let _cheap() in tests/test_examples.py return its "
            f"arguments; else add {key!r}: \"tests/<file>.py::<test>\" to EXPENSIVE, naming the existing test that "
            "runs this path end to end; or, when it reads files the checkout lacks (a cluster's paths, the reader's "
            "own data), add those inputs to CLUSTER_INPUTS with the reason.")
    assert _pointer_exists(EXPENSIVE[key]), f"{ex.where}: EXPENSIVE[{key!r}] = {EXPENSIVE[key]!r} names no test"
    return "expensive"


def check_fragment(where: str, fragment: str) -> None:
    """A `--set KEY=VALUE` of a help text validates on every shipped tiny recipe."""
    for recipe in TINY_RECIPES:
        try:
            load_config(recipe, [fragment])
        except ConfigError as e:
            raise AssertionError(f"{where}: `--set {fragment}` fails on {recipe.relative_to(ROOT)}: {e}") from None


def _setup_cfg() -> configparser.ConfigParser:
    parser = configparser.ConfigParser()
    parser.read(ROOT / "setup.cfg")
    return parser


def _pins() -> dict[str, str]:
    """``{name: version}`` of constraints.txt."""
    lines = (ROOT / "constraints.txt").read_text().splitlines()
    return dict(line.split("==", 1) for line in lines if "==" in line and not line.startswith("#"))


def _check_pip(words: list[str], what: str) -> None:
    """``pip install``: the extras named exist in setup.cfg, a ``-c`` file exists, and a pinned
    ``NAME==VERSION`` (``*`` a wildcard) agrees with constraints.txt."""
    extras = set(_setup_cfg()["options.extras_require"])
    for prev, tok in zip(words, words[1:], strict=False):
        if prev == "-c":
            assert (ROOT / tok).is_file(), f"{what}: constraints file {tok} does not exist"
        elif tok.startswith(".[") and tok.endswith("]"):
            missing = set(tok[2:-1].split(",")) - extras
            assert not missing, f"{what}: setup.cfg has no extra {sorted(missing)} (extras: {sorted(extras)})"
        elif "==" in tok and not tok.startswith("-"):
            name, version = tok.split("==", 1)
            pin = _pins().get(name)
            assert pin is not None and fnmatch.fnmatch(pin, version), \
                f"{what}: {tok} differs from constraints.txt ({name}=={pin})"


def _check_pytest(words: list[str], what: str) -> None:
    """``pytest``: the markers of ``-m EXPR`` are registered in setup.cfg, ``-n`` (pytest-xdist's
    workers) is a count or ``auto``, the paths exist."""
    markers = {line.split(":")[0].strip() for line in _setup_cfg()["tool:pytest"]["markers"].splitlines() if line}
    for prev, tok in zip(["", *words], words, strict=False):
        if prev == "-m":
            unknown = set(re.findall(r"\w+", tok)) - markers - {"and", "or", "not"}
            assert not unknown, f"{what}: -m names markers {sorted(unknown)} that setup.cfg does not register"
        elif prev == "-n":
            assert tok == "auto" or tok.isdigit(), f"{what}: -n {tok} is not a number of workers or auto"
        elif tok != "pytest" and not tok.startswith("-"):
            assert (ROOT / tok.split("::")[0]).exists(), f"{what}: {tok} does not exist"


def check_other(ex: Example) -> str:
    """Check a command of another program in a page's shell block; returns its class: ``script``
    (a script of the checkout, which must exist), ``pip``, ``pytest``, ``lm-eval`` (parsed by
    lm-eval's parser) or ``other`` (a program of :data:`OTHER_PROGRAMS`)."""
    what = f"{ex.where}: `{ex.text}`"
    words = shlex.split(ex.text)
    while words and re.match(r"^[A-Za-z_]\w*=", words[0]):  # VAR=value before the command
        words = words[1:]
    if words[:1] == ["flock"]:  # flock LOCKFILE COMMAND...
        words = words[2:]
    program = words[0]
    if program in ("python", "bash") and len(words) > 1 and Path(words[1]).parts[0] in _SCRIPT_FOLDERS:
        assert (ROOT / words[1]).is_file(), f"{what}: {words[1]} does not exist"
        return "script"
    if Path(program).parts[0] in _SCRIPT_FOLDERS:  # an executable script of the checkout, run directly
        assert (ROOT / program).is_file() and os.access(ROOT / program, os.X_OK), f"{what}: {program} is not executable"
        return "script"
    if program == "python" and words[1:2] == ["-m"]:
        program = f"python -m {words[2]}"
    if program == "pip":
        _check_pip(words, what)
        return "pip"
    if program == "pytest":
        _check_pytest(words, what)
        return "pytest"
    if program == "lm_eval":
        parse_lm_eval(words[1:], what)
        return "lm-eval"
    assert program in OTHER_PROGRAMS, (
        f"{what}: `{program}` is neither a smelt-ds command nor a program tests/test_examples.py checks: add it to "
        "OTHER_PROGRAMS with the reason it is not run here")
    return "other"


# ---------------------------------------------------------------------------------------------
# the tests
# ---------------------------------------------------------------------------------------------

EXAMPLES = all_examples()
OTHERS = doc_examples()[1]
FRAGMENTS = help_examples()[1]
TREE = parser_tree()


def test_checker_catches_what_it_is_for(tmp_path, monkeypatch):
    # issue 18: `smelt-ds train --help` suggested this, which fails on every shipped tiny recipe
    bad = Example("self-test", "smelt-ds train recipes/tiny/smelt.yaml --set train.max_steps=20")
    with pytest.raises(AssertionError, match=r"`train.warmup_steps` \(50\) must be <= `train.max_steps` \(20\)"):
        check(bad, tmp_path, monkeypatch, TREE)
    with pytest.raises(AssertionError, match=r"`--set train.max_steps=20` fails on recipes/tiny/"):
        check_fragment("self-test", "train.max_steps=20")
    check_fragment("self-test", "train.max_steps=200")
    # a flag that does not exist, a scheduler that is not one, an unknown placeholder
    with pytest.raises(AssertionError, match=r"does not parse: .*unrecognized arguments: --nodez"):
        check(Example("self-test", "smelt-ds memory recipes/tiny/smelt.yaml --nodez 2"), tmp_path, monkeypatch, TREE)
    with pytest.raises(AssertionError, match=r"invalid choice: 'pbs'"):
        check(Example("self-test", "smelt-ds render-job RECIPE --scheduler pbs"), tmp_path, monkeypatch, TREE)
    with pytest.raises(AssertionError, match=r"placeholder 'CKPT' is not in PLACEHOLDERS"):
        check(Example("self-test", "smelt-ds export CKPT -o out"), tmp_path, monkeypatch, TREE)
    # a cheap example that fails when run, an expensive one nobody classified
    with pytest.raises(AssertionError, match=r"exits 2 .*--tolerance"):
        check(Example("self-test", "smelt-ds match recipes/tiny/baseline.yaml --position top --tolerance 1e-9"),
              tmp_path, monkeypatch, TREE)
    with pytest.raises(AssertionError, match=r"is not classified.*add 'smelt-ds train recipes/tiny/top.yaml': "):
        check(Example("self-test", "smelt-ds train recipes/tiny/top.yaml"), tmp_path, monkeypatch, TREE)
    # a file the checkout ships, written again by an example, must come out the same
    with pytest.raises(AssertionError, match=r"writes a recipes/tiny/smelt.yaml that differs from the shipped one"):
        check(Example("self-test", "smelt-ds match recipes/tiny/baseline.yaml --position middle --ep-size 2 "
                                   "--name other -o recipes/tiny/smelt.yaml"), tmp_path, monkeypatch, TREE)
    # a command named in prose must exist
    assert check(Example("self-test", "smelt-ds scaling fit", prose=True), tmp_path, monkeypatch, TREE) == "reference"
    with pytest.raises(AssertionError, match=r"does not parse"):
        check(Example("self-test", "smelt-ds scaling fitt", prose=True), tmp_path, monkeypatch, TREE)


def test_checker_of_cluster_inputs_and_other_programs(tmp_path, monkeypatch):
    # a cluster input with a stand-in runs when cheap, and its recipe is validated through the stand-in
    assert check(Example("self-test", "smelt-ds config show m-smelt-pile.yaml"), tmp_path, monkeypatch, TREE) == "run"
    with pytest.raises(AssertionError, match=r"`train.warmup_steps` \(2000\) must be <= `train.max_steps` \(20\)"):
        check(Example("self-test", "smelt-ds data prepare --recipe m-smelt-pile.yaml --set train.max_steps=20"),
              tmp_path, monkeypatch, TREE)
    assert check(Example("self-test", "smelt-ds data prepare --recipe m-smelt-pile.yaml"), tmp_path, monkeypatch,
                 TREE) == "cluster"
    assert check(Example("self-test", "smelt-ds export runs/m-smelt-pile -o x"), tmp_path, monkeypatch,
                 TREE) == "cluster"
    with pytest.raises(AssertionError, match=r"is not classified.*CLUSTER_INPUTS"):
        check(Example("self-test", "smelt-ds data inspect /elsewhere/corpus"), tmp_path, monkeypatch, TREE)
    # other programs: scripts exist, pip extras and pins agree with setup.cfg and constraints.txt, pytest
    # markers are registered, lm-eval parses, anything else is listed
    assert check_other(Example("self-test", "python bench/decode.py")) == "script"
    for text, problem in (("python bench/decoding.py", r"bench/decoding.py does not exist"),
                          ("pip install -e '.[dev,wandbb]' -c constraints.txt", r"no extra \['wandbb'\]"),
                          ("pip install torch==2.12.0", r"differs from constraints.txt \(torch==2\.13"),
                          ("pytest -m 'not slwo'", r"markers \['slwo'\]"),
                          ("lm_eval --model hf --taskz x", r"does not parse"),
                          ("scontrol show job 1", r"add it to OTHER_PROGRAMS")):
        with pytest.raises(AssertionError, match=problem):
            check_other(Example("self-test", text))
    # an unlabelled block holding a command is refused
    page = ROOT / "docs" / "cluster.md"
    monkeypatch.setattr(Path, "read_text", lambda self: "```\n$ smelt-ds budget recipes/tiny/smelt.yaml\n```\n")
    with pytest.raises(AssertionError, match=r"unlabelled code block holds the command"):
        page_commands(page)


def test_examples_are_found_in_the_pages_and_in_help_texts():
    texts = {e.text for e in EXAMPLES}
    pages = {e.where.split(":")[0] for e in EXAMPLES + OTHERS}
    assert {"README.md", "docs/cluster.md", "docs/training.md", "docs/data.md"} <= pages
    # a console block's `$ ` lines, split at `;`, and another program's command
    assert "smelt-ds data inspect corpus_text_document" in texts
    assert "truncate -s -1 corpus_text_document.bin" in {e.text for e in OTHERS}
    # a continued line, a `&&` chain and a comment of a page, an epilog and a backtick span of --help
    assert ("smelt-ds match recipes/tiny/baseline.yaml --position middle --ep-size 2 --name tiny-smelt --tolerance "
            "0.01 -o recipes/tiny/smelt.yaml") in texts
    assert "smelt-ds render-job recipes/m/smelt.yaml --scheduler deepspeed --hostfile hostfile -o jobs/m-smelt.sh" \
        in texts
    assert "smelt-ds export runs/tiny-smelt -o exports/tiny-smelt" in texts
    assert "deepspeed --num_gpus 8 --module smelt_ds.train RECIPE" in texts
    assert ("`smelt-ds train --help` argument --set", "train.max_steps=200") in FRAGMENTS


@pytest.mark.parametrize("ex", EXAMPLES, ids=[f"{e.where}:{e.text[:60]}" for e in EXAMPLES])
def test_example(ex, tmp_path, monkeypatch):
    check(ex, tmp_path, monkeypatch, TREE)


@pytest.mark.parametrize("ex", OTHERS, ids=[f"{e.where}:{e.text[:60]}" for e in OTHERS])
def test_other_program_example(ex):
    check_other(ex)


@pytest.mark.parametrize("where,fragment", FRAGMENTS, ids=[f"{w}:{f}" for w, f in FRAGMENTS])
def test_set_fragment_of_a_help_text_validates_on_the_tiny_recipes(where, fragment):
    check_fragment(where, fragment)


def test_expensive_examples_exist_and_point_at_existing_tests():
    keys = {_key(e) for e in EXAMPLES}
    stale = sorted(set(EXPENSIVE) - keys)
    assert not stale, f"EXPENSIVE lists examples that are no longer written anywhere: remove {stale}"
    missing = {k: v for k, v in EXPENSIVE.items() if not _pointer_exists(v)}
    assert not missing, f"EXPENSIVE points at tests that do not exist: {missing}"


def test_cluster_inputs_and_other_programs_are_all_used():
    named = {name for e in EXAMPLES if e.text.split()[0] == "smelt-ds"
             for name in cluster_inputs(resolve(e, TREE))}
    assert set(CLUSTER_INPUTS) == named, f"CLUSTER_INPUTS names inputs no example reads: {set(CLUSTER_INPUTS) - named}"
    assert set(STAND_INS) <= set(CLUSTER_INPUTS)
    programs = set()
    for e in OTHERS:
        words = [w for w in shlex.split(e.text) if not re.match(r"^[A-Za-z_]\w*=", w)]
        programs |= {words[0], " ".join(words[:3])}
    stale = set(OTHER_PROGRAMS) - programs
    assert not stale, f"OTHER_PROGRAMS lists programs no page runs: remove {stale}"
    pointers = [p for reason in CLUSTER_INPUTS.values() for p in re.findall(r"tests/\S+\.py::\w+", reason)]
    assert pointers and all(_pointer_exists(p) for p in pointers), pointers


HELP_PATHS = [p for p, parser in TREE.items() if p and parser.add_help]


@pytest.mark.parametrize("path", HELP_PATHS, ids=[" ".join(p) for p in HELP_PATHS])
def test_every_command_help_exits_zero(path, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main([*path, "--help"])
    assert e.value.code == 0
    assert capsys.readouterr().out.startswith(f"usage: smelt-ds {' '.join(path)}")


#: the commands whose every option with a default states it in its help
STATES_DEFAULTS = [("memory",), ("recipes", "table"), ("config", "reference"), ("recipes", "derive"), ("sweep",),
                   ("scaling", "fit"), ("render-job",)]


@pytest.mark.parametrize("path", STATES_DEFAULTS, ids=[" ".join(p) for p in STATES_DEFAULTS])
def test_every_option_states_its_default(path):
    quiet = (argparse._HelpAction, argparse._VersionAction, argparse._StoreTrueAction, argparse._AppendAction)
    missing = [a.option_strings[0] for a in TREE[path]._actions
               if a.option_strings and not isinstance(a, quiet) and not a.required and "default" not in (a.help or "")]
    assert not missing, f"`smelt-ds {' '.join(path)}`: the help of {missing} does not state the default"


def test_memory_flags_with_fixed_values_fail_at_parse_time_naming_the_choices(capsys):
    for flag, value, choices in (("--kv-dtype", "int4", "fp32"), ("--options", "zero2,zero4", "zero3+param_off"),
                                 ("--policies", "none,some", "every_n")):
        with pytest.raises(SystemExit) as e:
            cli.main(["memory", "recipes/tiny/smelt.yaml", flag, value])
        err = capsys.readouterr().err
        assert e.value.code == 2 and f"argument {flag}:" in err and choices in err, err
        assert "zero2," not in err.split(f"argument {flag}:")[1].split("choose from")[0]  # names only the bad one
    helps = {a.option_strings[0]: a.help for a in TREE[("memory",)]._actions if a.option_strings}
    assert "without layouts the CPU stand-in render-job uses, 8GiB" in helps["--device-memory"]
