"""The manual pages under docs/: their commands parse, and the cluster walkthrough's recipe validates.

README.md's examples are checked in depth by tests/test_examples.py. The docs pages describe cluster
runs whose files (corpora, tokenizers, recipes of the reader's own) are not in the checkout, so here
every ``smelt-ds`` command of a page's shell blocks is parsed by the real command parser (a renamed
flag, a dropped choice or a removed command fails), and docs/cluster.md's example recipe (``base:``
on the shipped M recipe, Megatron sources, a tokenizer directory, W&B) is loaded and validated with
its ``base:`` pointed at this checkout.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import yaml

from smelt_ds import cli
from smelt_ds.config.run import load_config

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted((ROOT / "docs").glob("*.md"))
_SEPARATORS = {"&&", "||", "|", ";"}


def _blocks(text: str, langs: tuple[str, ...]) -> list[tuple[int, str]]:
    """``(first line, body)`` of every fenced block in one of ``langs``."""
    out, lang, body, start = [], None, [], 0
    for n, line in enumerate(text.splitlines(), 1):
        if line.startswith("```"):
            if lang is None:
                lang, body, start = line[3:].strip(), [], n + 1
            else:
                if lang in langs:
                    out.append((start, "\n".join(body)))
                lang = None
            continue
        if lang is not None:
            body.append(line)
    return out


def doc_commands() -> list[tuple[str, list[str]]]:
    """``(page:line, argv)`` of every ``smelt-ds`` command in the shell blocks of docs/*.md."""
    found = []
    for page in DOCS:
        for start, body in _blocks(page.read_text(), ("bash", "sh", "shell", "")):
            for k, line in enumerate(body.replace("\\\n", " ").splitlines()):
                if "smelt-ds" not in line:
                    continue
                words, seg = shlex.split(line, comments=True), []
                for w in words + [";"]:
                    if w in _SEPARATORS:
                        if seg[:1] == ["smelt-ds"]:
                            found.append((f"{page.name}:{start + k}", seg[1:]))
                        seg = []
                    else:
                        seg.append(w)
    return found


def test_docs_hold_commands():
    pages = {where.split(":")[0] for where, _ in doc_commands()}
    assert {"cluster.md"} <= pages


@pytest.mark.parametrize("where,argv", doc_commands(), ids=[w for w, _ in doc_commands()])
def test_doc_command_parses(where, argv):
    """The command line parses; ``--help``-style exits (SystemExit 0) count as parsing."""
    try:
        cli.build_parser([argv[0]]).parse_args(argv)
    except SystemExit as e:
        assert e.code == 0, f"{where}: `smelt-ds {shlex.join(argv)}` does not parse"


def test_cluster_walkthrough_recipe_validates(tmp_path):
    page = (ROOT / "docs" / "cluster.md").read_text()
    recipes = [body for _, body in _blocks(page, ("yaml",)) if body.lstrip().startswith("# m-smelt-pile.yaml")]
    assert len(recipes) == 1
    raw = yaml.safe_load(recipes[0])
    raw["base"] = str(ROOT / "recipes" / "m" / "smelt.yaml")
    path = tmp_path / "m-smelt-pile.yaml"
    path.write_text(yaml.safe_dump(raw))
    cfg = load_config(path)
    shipped = load_config(ROOT / "recipes" / "m" / "smelt.yaml")
    assert cfg.name == "m-smelt-pile"
    assert [s.kind() for s in cfg.data.sources] == ["megatron", "megatron"]
    assert cfg.tracking.trackers == ["wandb"]
    # everything but the data, tracking and name is the shipped M recipe: the walkthrough trains it
    for section in ("model", "moe", "moe_runtime", "loop", "train", "deepspeed", "cluster"):
        assert getattr(cfg, section) == getattr(shipped, section), section
    # the commands of the page name the recipe the block writes
    assert re.search(r"smelt-ds memory m-smelt-pile\.yaml", page)
