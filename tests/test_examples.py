"""Every command example in README.md's code blocks and in the help texts of `smelt-ds` (each
sub-command's description, epilog, argument and group help) is checked, so that an example cannot
go stale:

(a) it parses with :func:`smelt_ds.cli.build_parser` (``python -m smelt_ds.train`` with the
    per-rank parser, ``deepspeed ... --module smelt_ds.train`` with DeepSpeed's launcher parser
    too, ``smelt-ds lm-eval ...`` with lm-eval's own), after the placeholders of
    :data:`PLACEHOLDERS` (``RECIPE``, ``RUN``, ...) are replaced by concrete values;
(b) for the commands that take a recipe (:data:`VALIDATED`), the recipe with its ``--set``
    overrides loads and validates (:func:`smelt_ds.config.run.load_config`; a sweep is planned);
    every ``--set KEY=VALUE`` fragment of a help text validates on every shipped tiny recipe;
(c) it falls in exactly one class:

    * ``run``: cheap (:func:`_cheap`): run in this process through :func:`smelt_ds.cli.main` in a
      temporary working directory (inputs point at the checkout, outputs land in the temporary
      directory), exit status 0;
    * ``help``: ``--help`` exits 0;
    * ``reference``: a help text naming a command or module (`smelt-ds match`, `python -m
      smelt_ds.train`): the command or module must exist;
    * ``expensive``: training, evaluating a trained run, the harness: listed in :data:`EXPENSIVE`
      with the existing test that runs that path end to end (which must exist).

An example in none of them fails, saying what to add.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import pytest

from smelt_ds import cli
from smelt_ds.config.run import apply_overrides, config_from_dict, load_config
from smelt_ds.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
TINY_RECIPES = sorted((ROOT / "recipes" / "tiny").glob("*.yaml"))

#: documented placeholders of the examples -> the concrete value the checks use
PLACEHOLDERS = {"RECIPE": "recipes/tiny/smelt.yaml", "RUN": "runs/tiny-smelt", "RUN_DIR": "runs/tiny-smelt",
                "EXPORT": "exported/tiny-smelt", "TASKS": "smelt_offline", "TASKS_DIR": "tasks/", "DIR": "tasks/",
                "OUT": "out/", "N": "2"}
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
VALIDATED = {("train",), ("sweep",), ("render-job",), ("memory",), ("budget",), ("data", "prepare")}

#: examples that train, evaluate a trained run or run the harness: example -> the test that runs
#: that path end to end ("tests/<file>.py::<test>"). Keys are the example's words (comments and
#: line continuations removed, shell quotes resolved) joined by one space.
_LOOP, _EVAL, _HARNESS = "tests/train/test_loop.py", "tests/eval/test_eval_cli.py", "tests/eval/test_harness_cli.py"
_E2E_SWEEP = "tests/study/test_scaling_e2e.py::test_tiny_real_sweep_then_fit"
_RUN_EXPORT_INIT = f"{_LOOP}::test_run_directory_summary_export_and_init_from"
EXPENSIVE = {
    # README: the main job, training, launcher, resume, export
    "smelt-ds train recipes/tiny/smelt.yaml": "tests/train/test_golden_losses.py::test_fresh_run_matches_golden_losses",
    "smelt-ds train RECIPE [--set train.max_steps=200 ...]": _RUN_EXPORT_INIT,
    "smelt-ds train recipes/tiny/smelt.yaml --set tracking.trackers=[wandb,csv] --set tracking.wandb.mode=offline":
        "tests/train/test_trackers.py::test_wandb_offline_history_equals_metrics_jsonl_and_resume_continues_the_run",
    "smelt-ds train recipes/tiny/smelt.yaml --set profile.enabled=true --set profile.start_step=100 "
    "--set profile.ranks=[0,1] --nproc 2":
        "tests/train/test_profiler.py::test_trace_holds_one_range_per_visit_and_moe_stage_per_profiled_step",
    "smelt-ds train RECIPE --nproc 2": f"{_LOOP}::test_deepspeed_launcher_two_ranks",
    "deepspeed --num_gpus 8 --module smelt_ds.train RECIPE": f"{_LOOP}::test_deepspeed_launcher_two_ranks",
    "smelt-ds train RECIPE --resume auto": f"{_LOOP}::test_resume_equals_uninterrupted_zero2",
    "smelt-ds export runs/tiny-smelt -o exported/tiny-smelt": _RUN_EXPORT_INIT,
    "smelt-ds export runs/tiny-smelt --format hf -o hf/tiny-smelt":
        "tests/interop/test_export.py::test_looped_model_exports_as_smelt_with_its_code",
    "smelt-ds train RECIPE --set train.init_from=exported/tiny-smelt --run-dir runs/from-export": _RUN_EXPORT_INIT,
    "smelt-ds train recipes/tiny/smelt.yaml --set train.compile=layers":
        "tests/parallel/test_compile.py::test_compiled_layers_train_like_eager",
    "smelt-ds train recipes/tiny/smelt.yaml --set train.compile=layers --set train.compile_backend=aot_eager":
        "tests/parallel/test_compile.py::test_compiled_layers_train_like_eager",
    "smelt-ds memory recipes/tiny/smelt.yaml --measure --seq-len 32 --micro-batch 2":
        "tests/cost/test_memory.py::test_cli_table_json_and_errors",
    # README: evaluation, harness, HumanEval, test-time loop count
    "smelt-ds train recipes/tiny/baseline.yaml --set train.max_steps=300 --run-dir /tmp/runs/baseline": _RUN_EXPORT_INIT,
    "smelt-ds train recipes/tiny/smelt.yaml --set train.max_steps=300 --run-dir /tmp/runs/smelt": _RUN_EXPORT_INIT,
    "smelt-ds eval /tmp/runs/baseline /tmp/runs/smelt -o evals/tiny": f"{_EVAL}::test_eval_table_files_and_ranges",
    "smelt-ds plot /tmp/runs/baseline /tmp/runs/smelt --labels Baseline,SMELT -o docs/figures/tiny_smelt_vs_baseline.png":
        "tests/eval/test_curves.py::test_plots_a_real_run",
    "smelt-ds analyze /tmp/runs/baseline /tmp/runs/smelt -o evals/tiny": f"{_EVAL}::test_analyze_files_and_ranges",
    "smelt-ds generate /tmp/runs/smelt --prompt def main( --max-new-tokens 48":
        f"{_EVAL}::test_generate_greedy_matches_full_recompute",
    "smelt-ds eval build-tasks tasks/": "tests/eval/test_offline_tasks.py::test_cli",
    "smelt-ds eval runs/tiny-baseline runs/tiny-smelt --harness smelt_offline --include-path tasks/ "
    "--num-fewshot 0,1,2,4,8,16 -o evals/harness": f"{_HARNESS}::test_eval_harness_two_runs_two_k",
    "smelt-ds lm-eval run --model smelt-ds --model_args pretrained=runs/tiny-smelt --tasks smelt_offline "
    "--include_path tasks/ --num_fewshot 0 --output_path evals/lm-eval": f"{_HARNESS}::test_lm_eval_command_line_in_a_subprocess",
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
    # README: Hugging Face
    "smelt-ds export runs/tiny-baseline --format hf -o hf/tiny-baseline":
        "tests/interop/test_export.py::test_baseline_exports_as_a_transformers_architecture",
    "smelt-ds import-hf hf/tiny-baseline -o recipes/continue.yaml":
        "tests/interop/test_import_hf.py::test_imported_recipe_trains_from_the_checkpoint",
    # README: sweeps and scaling fits
    "smelt-ds sweep recipes/sweeps/micro.yaml": _E2E_SWEEP,
    "smelt-ds scaling fit runs/sweeps/micro -o docs/scaling-micro": _E2E_SWEEP,
    "smelt-ds sweep recipes/sweeps/micro.yaml --steps-scale 0.05": _E2E_SWEEP,
    # README: data
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
    # help texts
    "smelt-ds export runs/tiny-smelt -o exports/tiny-smelt": _RUN_EXPORT_INIT,
    "smelt-ds eval build-tasks OUT": "tests/eval/test_offline_tasks.py::test_cli",
    "smelt-ds lm-eval run --model smelt-ds --model_args pretrained=RUN --tasks TASKS --include_path DIR":
        f"{_HARNESS}::test_lm_eval_command_line_in_a_subprocess",
    "smelt-ds lm-eval run --model smelt-ds --model_args pretrained=RUN --batch_size 8 --tasks smelt_offline "
    "--include_path TASKS_DIR --output_path OUT": f"{_HARNESS}::test_lm_eval_command_line_in_a_subprocess",
    "smelt-ds eval RUN --harness smelt_offline --include-path OUT": f"{_HARNESS}::test_eval_harness_two_runs_two_k",
    "smelt-ds plot runs/tiny-baseline runs/tiny-smelt -o plots/tiny.png": "tests/eval/test_curves.py::test_plots_a_real_run",
    "smelt-ds import-hf ./Qwen3-30B-A3B -o recipes/qwen3-30b-a3b.yaml":
        "tests/interop/test_import_hf.py::test_round_trip_through_a_transformers_architecture",
}


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
    """The commands of one shell line (split at && || | ;), comments removed, each shlex-joined."""
    out, cur = [], []
    for tok in shlex.split(command, comments=True):
        if tok in _SEPARATORS:
            out.append(cur)
            cur = []
        else:
            cur.append(tok)
    out.append(cur)
    return [shlex.join(seg) for seg in out if seg]


def readme_examples() -> list[Example]:
    """Every command of README.md's shell code blocks (```bash, ```sh or unlabelled) that starts
    with one of the prefixes; continuation lines joined."""
    examples, lang, pending, start = [], None, "", 0
    for n, line in enumerate(README.read_text().splitlines(), 1):
        if line.startswith("```"):
            lang = line[3:].strip() if lang is None else None
            continue
        if lang not in ("bash", "sh", "shell", "console", ""):
            continue
        if not pending:
            start = n
        pending += line
        if pending.endswith("\\"):
            pending = pending[:-1] + " "
            continue
        for seg in _segments(pending):
            if _PREFIX.match(seg):
                examples.append(Example(f"README.md:{start}", seg))
        pending = ""
    return examples


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
        for name, value in vars(p).items():
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
    return readme_examples() + ex


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
        from lm_eval._cli import HarnessCLI

        harness = HarnessCLI()
        rest = list(ns.lm_eval_args)
        if rest[0] not in harness._subparsers.choices:  # lm-eval's legacy form: `run` implied
            rest.insert(0, "run")
        _parse(rest, harness._parser.parse_args, what + " (lm-eval's parser)")
    return ns


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
        elif cmd.path == ("data", "prepare") and ns.recipe is None:
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
    if p in (("budget",), ("match",), ("render-job",), ("config", "show"), ("config", "validate")) or (
            p == ("memory",) and "--measure" not in a):
        return a
    if p in (("recipes", "table"), ("config", "reference")):  # it would rewrite a page of docs/: print it instead
        return a if {"-o", "--output"} & set(a) else [*a, "-o", "-"]
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


def run_cheap(cmd: Command, argv: list[str], tmp: Path, monkeypatch) -> str:
    """(c) run: the example through smelt_ds.cli.main in ``tmp``; returns its output. Exit status 0."""
    argv = _localize(argv, len(cmd.path), tmp)
    monkeypatch.chdir(tmp)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = cli.main(argv)
    assert rc == 0, (f"{cmd.example.where}: `{cmd.example.text}` exits {rc} (run as `smelt-ds {shlex.join(argv)}` "
                     f"in a temporary directory):\n{err.getvalue()[-2000:]}")
    # an output the checkout ships under the same path (README: "recipes/tiny/smelt.yaml was written
    # by" smelt-ds match) is reproduced, apart from its `#` header lines (they name the command)
    for prev, tok in zip(argv, argv[1:]):
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


def check(ex: Example, tmp: Path, monkeypatch, tree=None) -> str:
    """Check one example; returns its class (run, help, reference, expensive). Raises
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
    if cmd.path in VALIDATED:
        validate(cmd, ns, tmp)
    argv = _cheap(cmd)
    key = _key(ex)
    if argv is not None:
        assert key not in EXPENSIVE, f"{ex.where}: `{ex.text}` runs here cheaply: remove it from EXPENSIVE"
        run_cheap(cmd, argv, tmp, monkeypatch)
        return "run"
    if key not in EXPENSIVE:
        raise AssertionError(
            f"{ex.where}: the example `{ex.text}` is not classified. If it runs in about a second without training "
            "or a trained run (reads recipes, writes under -o), let _cheap() in tests/test_examples.py return its "
            f"arguments; else add {key!r}: \"tests/<file>.py::<test>\" to EXPENSIVE, naming the existing test that "
            "runs this path end to end.")
    assert _pointer_exists(EXPENSIVE[key]), f"{ex.where}: EXPENSIVE[{key!r}] = {EXPENSIVE[key]!r} names no test"
    return "expensive"


def check_fragment(where: str, fragment: str) -> None:
    """A `--set KEY=VALUE` of a help text validates on every shipped tiny recipe."""
    for recipe in TINY_RECIPES:
        try:
            load_config(recipe, [fragment])
        except ConfigError as e:
            raise AssertionError(f"{where}: `--set {fragment}` fails on {recipe.relative_to(ROOT)}: {e}") from None


# ---------------------------------------------------------------------------------------------
# the tests
# ---------------------------------------------------------------------------------------------

EXAMPLES = all_examples()
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


def test_examples_are_found_in_the_readme_and_in_help_texts():
    texts = {e.text for e in EXAMPLES}
    # a continued line, a `&&` chain and a comment of README.md, an epilog and a backtick span of --help
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


@pytest.mark.parametrize("where,fragment", FRAGMENTS, ids=[f"{w}:{f}" for w, f in FRAGMENTS])
def test_set_fragment_of_a_help_text_validates_on_the_tiny_recipes(where, fragment):
    check_fragment(where, fragment)


def test_expensive_examples_exist_and_point_at_existing_tests():
    keys = {_key(e) for e in EXAMPLES}
    stale = sorted(set(EXPENSIVE) - keys)
    assert not stale, f"EXPENSIVE lists examples that are no longer written anywhere: remove {stale}"
    missing = {k: v for k, v in EXPENSIVE.items() if not _pointer_exists(v)}
    assert not missing, f"EXPENSIVE points at tests that do not exist: {missing}"


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
