"""The top-level command table (smelt_ds/cli.py): every package's commands, once, each with help."""

from __future__ import annotations

import argparse

import pytest

from smelt_ds import cli


def _commands_of(module) -> list[str]:
    parser = argparse.ArgumentParser()
    module.add_parser(parser.add_subparsers())
    (action,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return list(action.choices)


def test_each_package_owns_its_commands_and_no_command_is_registered_twice():
    per_package = {name: _commands_of(module) for name, module in cli.COMMANDS.items()}
    assert per_package == {"cost": ["budget", "match"], "data": ["data"], "train": ["train", "export"],
                           "eval": ["eval", "analyze", "generate", "lm-eval"], "curves": ["plot"],
                           "interop": ["import-hf"],
                           "study": ["memory", "recipes", "sweep", "scaling"], "launch": ["render-job"]}
    every = [c for cmds in per_package.values() for c in cmds]
    assert len(every) == len(set(every))
    (action,) = [a for a in cli.build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    assert list(action.choices) == every  # the order `smelt-ds --help` lists them


@pytest.mark.parametrize("command", ["budget", "match", "data", "train", "export", "eval", "analyze", "generate",
                                     "plot", "import-hf", "memory", "recipes", "sweep", "scaling", "render-job"])
def test_every_command_has_help(command, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main([command, "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: smelt-ds {command}") and len(out.splitlines()) > 3


def test_importing_the_cli_does_not_import_deepspeed():
    """Analytic commands (budget, memory estimates, render-job) start without DeepSpeed."""
    import subprocess
    import sys

    code = "import sys, smelt_ds.cli; print('deepspeed' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
