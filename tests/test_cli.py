"""The top-level command table (smelt_ds/cli.py): every package's commands, once, each with help;
only the chosen command's module is imported; a bare `KEY=VALUE` is named as a forgotten `--set`;
and every list-valued option of every command keeps each of its uses (or refuses a second one)."""

from __future__ import annotations

import argparse
import importlib
import json
import re
import subprocess
import sys

import pytest

from smelt_ds import cli
from smelt_ds.arguments import CommaList, Once
from tests.test_examples import parser_tree


def _registered(module: str) -> dict[str, str | None]:
    """command -> help line, as ``module.add_parser`` registers them (in its order)."""
    parser = argparse.ArgumentParser()
    importlib.import_module(module).add_parser(parser.add_subparsers())
    (action,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return {c.dest: c.help for c in action._choices_actions}


def test_each_module_registers_exactly_its_table_commands_with_the_table_help():
    modules = dict.fromkeys(m for m, _ in cli.COMMANDS.values())
    per_module = {m: _registered(m) for m in modules}
    assert {m: list(cmds) for m, cmds in per_module.items()} == {
        "smelt_ds.cost.cli": ["budget", "match"], "smelt_ds.config.cli": ["config"], "smelt_ds.data.cli": ["data"],
        "smelt_ds.train.cli": ["train"], "smelt_ds.runs.cli": ["checkpoint"],
        "smelt_ds.eval.cli": ["eval", "analyze", "generate", "lm-eval"],
        "smelt_ds.eval.curves": ["plot"], "smelt_ds.interop.cli": ["export", "import-hf"],
        "smelt_ds.study.cli": ["memory", "recipes", "scaling"], "smelt_ds.study.sweep": ["sweep"],
        "smelt_ds.launch.preflight": ["preflight"], "smelt_ds.launch.cli": ["render-job"]}
    every = [c for cmds in per_module.values() for c in cmds]
    assert len(every) == len(set(every)) and set(every) == set(cli.COMMANDS)
    for module, cmds in per_module.items():
        for command, help_line in cmds.items():
            assert cli.COMMANDS[command] == (module, help_line), command  # `smelt-ds --help` shows the module's own
    (action,) = [a for a in cli.build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    assert set(action.choices) == set(every)


def test_top_level_help_lists_the_table_in_order(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["--help"])
    assert e.value.code == 0
    listed = re.findall(r"^    (\S+)", capsys.readouterr().out, re.M)
    assert listed == list(cli.COMMANDS) == ["budget", "match", "config", "data", "train", "export", "checkpoint",
                                            "eval", "analyze", "generate", "lm-eval", "plot", "import-hf", "memory",
                                            "recipes", "sweep", "scaling", "preflight", "render-job"]


@pytest.mark.parametrize("command", ["budget", "match", "config", "data", "train", "export", "eval", "analyze",
                                     "generate", "plot", "import-hf", "memory", "recipes", "sweep", "scaling",
                                     "preflight", "render-job"])
def test_every_command_has_help(command, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main([command, "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: smelt-ds {command}") and len(out.splitlines()) > 3


#: run in one fresh process, lightest first: sys.modules only grows, so a module absent after a
#: command was not imported by it (nor by the lighter ones before it)
_IMPORTS = """
import json, sys
from smelt_ds.cli import main
HEAVY = ["torch", "deepspeed", "datasets", "lm_eval", "transformers", "scipy", "matplotlib"]
seen = {}
for argv in (["--help"], ["budget", "recipes/tiny/smelt.yaml"], ["memory", "recipes/tiny/smelt.yaml"]):
    try:
        main(argv)
    except SystemExit:
        pass
    seen[argv[0]] = [m for m in HEAVY if m in sys.modules]
print(json.dumps(seen))
"""


def test_each_command_imports_only_what_it_uses():
    """`--help` imports no heavy package; `budget` (pydantic, PyYAML) no torch either; `memory` needs
    torch (the measured profile and the model's expert implementation) but not DeepSpeed, datasets,
    lm-eval or transformers. bench/cli_startup.py prints the start-up times."""
    out = subprocess.run([sys.executable, "-c", _IMPORTS], capture_output=True, text=True, check=True).stdout
    seen = json.loads(out.splitlines()[-1])
    assert seen["--help"] == [] and seen["budget"] == []
    assert seen["memory"] == ["torch"]


# -- a bare KEY=VALUE is a forgotten --set ---------------------------------------------------------

def test_bare_override_is_named_as_a_forgotten_set(capsys):
    # where a recipe path is read (budget takes several recipes: the override is one of them)
    assert cli.main(["budget", "recipes/tiny/smelt.yaml", "train.max_steps=200"]) == 2
    assert capsys.readouterr().err.strip() == ("smelt-ds budget: error: `train.max_steps=200` looks like an override: "
                                               "write `--set train.max_steps=200`")
    # where argparse finds an argument the command does not take, for a command with --set
    with pytest.raises(SystemExit) as e:
        cli.main(["train", "recipes/tiny/smelt.yaml", "loop.ranges.0.repeats=3"])
    assert e.value.code == 2
    assert "`loop.ranges.0.repeats=3` looks like an override: write `--set loop.ranges.0.repeats=3`" in \
        capsys.readouterr().err
    # a command without --set keeps argparse's own message
    with pytest.raises(SystemExit):
        cli.main(["import-hf", "ckpt", "-o", "r.yaml", "train.max_steps=200"])
    err = capsys.readouterr().err
    assert "unrecognized arguments: train.max_steps=200" in err and "--set" not in err


# -- list-valued options keep every use -----------------------------------------------------------

_LISTY_HELP = re.compile(r"comma-separated|(?:e\.g\.|default) [\w:]+,\w")


def _list_valued(action: argparse.Action) -> bool:
    """Options a user would give twice: several values (nargs), appending, or a comma-separated list."""
    return bool(action.option_strings) and (
        action.nargs in ("+", "*") or (isinstance(action.nargs, int) and action.nargs > 1)
        or isinstance(action, (argparse._AppendAction, argparse._ExtendAction, CommaList))
        or bool(_LISTY_HELP.search(action.help or "")) or "," in str(action.metavar or "")
        or "LIST" in str(action.metavar or ""))


def _list_options() -> dict[tuple[tuple[str, ...], str], argparse.Action]:
    return {(path, a.option_strings[-1]): a for path, p in parser_tree().items() for a in p._actions
            if _list_valued(a)}


#: (command path, option) -> (first use, second use, what the command sees); None: refused
_TWICE: dict[tuple[tuple[str, ...], str], tuple[str, str, object]] = {
    **{(path, "--set"): ("a.b=1", "c.d=2", ["a.b=1", "c.d=2"]) for path in (
        ("budget",), ("config", "show"), ("config", "validate"), ("data", "tokenizer"), ("data", "prepare"),
        ("train",), ("eval",), ("eval", "build-tasks"), ("analyze",), ("generate",), ("memory",), ("sweep",),
        ("preflight",), ("render-job",), ("data", "tokenize"))},
    (("match",), "--ranges"): ("0:1:2", "1:2:3", "0:1:2,1:2:3"),
    (("data", "tokenizer"), "--input"): ("a.txt", "builtin:code", ["a.txt", "builtin:code"]),
    (("data", "prepare"), "--source"): ("path=a", "path=b", ["path=a", "path=b"]),
    (("eval",), "--names"): ("a,b", "c", "a,b,c"),
    (("eval",), "--corpus"): ("wiki.txt", "code.jsonl", ["wiki.txt", "code.jsonl"]),
    (("eval",), "--buckets"): ("64", "256", "64,256"),
    (("eval",), "--shots"): ("0,1", "4", "0,1,4"),
    (("eval",), "--tasks"): ("kv_recall", "pattern", "kv_recall,pattern"),
    (("eval",), "--harness"): ("t1", "t2,t3", "t1,t2,t3"),
    (("eval",), "--num-fewshot"): ("0", "5", "0,5"),
    (("eval",), "--loop-repeats"): ("1", "2,3", "1,2,3"),
    (("analyze",), "--names"): ("a", "b", "a,b"),
    (("analyze",), "--domains"): ("code", "text", "code,text"),
    (("plot",), "--labels"): ("a", "b", "a,b"),
    (("memory",), "--options"): ("zero1", "zero3", "zero1,zero3"),
    (("memory",), "--policies"): ("none", "full,looped", "none,full,looped"),
    (("scaling", "fit"), "--c-range"): ("1.5 2.5", "3.5 4.5", None),
    (("sweep",), "--only"): ("smelt-*", "*-h64-*", ["smelt-*", "*-h64-*"]),
    (("render-job",), "--env"): ("A=1", "B=2", ["A=1", "B=2"]),
    (("preflight",), "--env"): ("A=1", "B=2", ["A=1", "B=2"]),
    (("render-job",), "--sbatch"): ("--qos=high", "--mem=0", ["--qos=high", "--mem=0"]),
    (("data", "tokenize"), "--input"): ("a.jsonl", "shards/", ["a.jsonl", "shards/"]),  # read in this order
    # Kubernetes pod placement: several labels, taints and device resources
    (("render-job",), "--node-selector"): ("a/b=1", "c=d", ["a/b=1", "c=d"]),
    (("render-job",), "--toleration"): ("nvidia.com/gpu:NoSchedule", "spot=true:NoExecute",
                                        ["nvidia.com/gpu:NoSchedule", "spot=true:NoExecute"]),
    (("render-job",), "--rdma-resource"): ("rdma/hca=1", "nvidia.com/hostdev=2",
                                           ["rdma/hca=1", "nvidia.com/hostdev=2"]),
}


def test_every_list_valued_option_accumulates_or_refuses_a_repetition():
    """Walks every parser of smelt-ds: a list-valued option must append/extend (CommaList for one
    comma-separated string) or refuse a second use (Once); and each has a case in _TWICE below."""
    found = _list_options()
    bad = {f"{' '.join(path)} {opt}": type(a).__name__ for (path, opt), a in found.items()
           if not isinstance(a, (argparse._AppendAction, argparse._ExtendAction, CommaList, Once))}
    assert not bad, f"list-valued options that keep only their last use: {bad}"
    assert set(found) == set(_TWICE), "every list-valued option needs a case in _TWICE (and only those)"


def _required_args(p: argparse.ArgumentParser, but: str) -> list[str]:
    """Placeholder values for a parser's required arguments (positionals, required options but ``but``)."""
    out: list[str] = []
    for a in p._actions:
        if isinstance(a, (argparse._HelpAction, argparse._SubParsersAction)):
            continue
        value = a.choices[0] if a.choices else "1" if a.type in (int, float) else "X"
        if not a.option_strings and a.nargs != argparse.REMAINDER:
            out.append(str(value))
        elif a.required and but not in a.option_strings:
            out += [a.option_strings[0], str(value)]
    return out


@pytest.mark.parametrize("key", list(_TWICE), ids=lambda k: f"{' '.join(k[0])} {k[1]}")
def test_option_given_twice_keeps_both_or_is_refused(key, capsys):
    (path, opt), (first, second, want) = key, _TWICE[key]
    p = parser_tree()[path]
    argv = _required_args(p, opt) + [arg for use in (first, second)
                                     for arg in ([opt, *use.split(" ")] if " " in use else [f"{opt}={use}"])]
    if want is None:
        with pytest.raises(SystemExit):
            p.parse_args(argv)
        assert f"{opt} is given twice ({first} and {second})" in capsys.readouterr().err
        return
    ns = p.parse_args(argv)
    assert getattr(ns, p._option_string_actions[opt].dest) == want


def test_eval_corpus_takes_one_path_per_flag_and_leaves_the_runs_alone():
    """`--corpus a.jsonl RUN`: the run is not swallowed as a second corpus path (a flag with several
    values would take it and then fail with 'the following arguments are required: RUN')."""
    args = cli.build_parser(["eval"]).parse_args(["eval", "--corpus", "a.jsonl", "runs/x", "--corpus", "b.txt"])
    assert args.corpus == ["a.jsonl", "b.txt"] and args.runs == ["runs/x"]
