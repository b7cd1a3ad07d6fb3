"""Every tensor that enters a model in evaluation is on the model's device (issue 45): ``eval``'s
per-domain / per-position loss and in-context curves, ``analyze`` (attention sink, routing, logit
lens), the test-time loop table, ``generate``, HumanEval sampling and its canonical-solution loss,
the lm-evaluation-harness model (loglikelihood, greedy and sampled ``generate_until``) and the
in-loop harness of training.

A CPU-only machine has no second device, so the model is put on an emulated one
(:mod:`tests.fake_device`): its parameters say ``meta`` (what ``device_of`` answers) while their
values stay on the CPU, and every operation that mixes one of them with a CPU tensor raises
"Expected all tensors to be on the same device", as CUDA does. A path that feeds the model a CPU
batch therefore fails here exactly as it fails on a GPU; one that moves its inputs with
``to_device(device_of(model), ...)`` computes with the CPU's arithmetic, so its numbers must equal
those of the same model on the CPU (``==``). ``torch.Generator(device="meta")`` does not exist:
sampling draws from a generator on the model's device only for CUDA
(:func:`smelt_ds.eval.device.sampling_generator`). The CUDA path itself runs in bench/gpu_check.py.
"""

from __future__ import annotations

import json
from dataclasses import asdict

import pytest
import torch

from smelt_ds.parallel.device import device_of, to_device
from tests.eval.test_harness import _yaml
from tests.fake_device import FAKE, OnFake, fake_device, on_fake_device

QUIET = {"log": lambda *a, **k: None}


def _same(a, b) -> bool:
    """Equal, NaN equal to NaN (the JSON texts of both; floats written exactly)."""
    return json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)


@pytest.fixture
def pair(random_exports):
    """The random-weight SMELT export loaded twice: ``(cpu, fake)``; the second is put on the fake
    device inside the test."""
    from smelt_ds.runs.load import load_run

    return load_run(random_exports["smelt"]), load_run(random_exports["smelt"])


def _place(run) -> None:
    on_fake_device(run.model)
    assert device_of(run.model) == FAKE
    assert all(isinstance(p, OnFake) for p in run.model.parameters())


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    """No downloads (the harness's tasks are local JSON files)."""
    import datasets

    for var in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE"):
        monkeypatch.setenv(var, "1")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)


# ---------------------------------------------------------------------------------------------
# the emulation is sound: a CPU batch is refused, a moved one computes the CPU's numbers
# ---------------------------------------------------------------------------------------------


def test_the_fake_device_refuses_a_cpu_batch_and_computes_a_moved_one_exactly(pair, eval_data):
    cpu, fake = pair
    ids = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = cpu.model(ids).logits
        with fake_device() as mode:
            _place(fake)
            with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
                fake.model(ids)
            assert mode.mixed == ["embedding"]
            (moved,) = to_device(device_of(fake.model), ids)
            assert moved.device == FAKE and mode.moves == 1
            got = fake.model(moved).logits
            assert got.device == FAKE
            with pytest.raises(TypeError, match="numpy"):
                got.numpy()
            assert torch.equal(got.cpu(), want)
    with pytest.raises(RuntimeError, match="not an accelerator"):
        torch.Generator(device=FAKE)  # why sampling_generator keeps a non-CUDA model's generator on the CPU


def test_sampling_generator_is_on_the_cpu_unless_the_model_is_on_cuda():
    from smelt_ds.eval.device import sampling_generator

    for dev in ("cpu", FAKE):
        g = sampling_generator(dev, 7)
        assert g.device == torch.device("cpu") and g.initial_seed() == 7
    if torch.cuda.is_available():
        assert sampling_generator("cuda", 7).device.type == "cuda"


# ---------------------------------------------------------------------------------------------
# smelt-ds eval, analyze and the test-time loop table (smelt_ds.eval.suite, looptime)
# ---------------------------------------------------------------------------------------------


def test_eval_losses_and_in_context_curves_on_the_model_device(pair):
    """``evaluate_runs``: per-domain loss, bits per byte, loss by position bucket
    (:func:`smelt_ds.eval.loss.token_losses`) and the in-context curves
    (:func:`smelt_ds.eval.icl.score_episodes`)."""
    from smelt_ds.eval.suite import EvalSettings, evaluate_runs

    cpu, fake = pair
    settings = EvalSettings(seq_len=32, micro_batch_size=2, batches=1, shots=(0, 2), episodes=2,
                            tasks=("pattern", "kv_recall"))
    want = evaluate_runs([cpu], settings, **QUIET)
    with fake_device() as mode:
        _place(fake)
        got = evaluate_runs([fake], settings, **QUIET)
    assert mode.moves > 0 and not mode.mixed
    assert _same(got["domains"], want["domains"]) and _same(got["icl"], want["icl"])
    doms = want["domains"][cpu.name]
    assert len(doms) >= 3 and all(len(v["positions"]) >= 2 and len(v["per_position"]) == 32 for v in doms.values())
    assert all(v is not None for curve in want["icl"][cpu.name].values() for v in curve.values())


def test_analysis_on_the_model_device(pair):
    """``analyze_runs``: attention sink, routing and logit lens (:class:`smelt_ds.eval.analysis.LogitLens`
    calls the embedding and the model)."""
    from smelt_ds.eval.suite import AnalysisSettings, analyze_runs

    cpu, fake = pair
    settings = AnalysisSettings(seq_len=16, micro_batch_size=2, batches=1)
    want = analyze_runs([cpu], settings, **QUIET)["analysis"][cpu.name]
    with fake_device() as mode:
        _place(fake)
        got = analyze_runs([fake], settings, **QUIET)["analysis"][fake.name]
    assert mode.moves > 0 and not mode.mixed
    assert _same(got, want)
    assert want["attention"] and want["routing"]["visits"] and len(want["logit_lens"]["depths"]) > 2


def test_loop_repeat_table_on_the_model_device(pair):
    """``loss_by_repeats``: the losses at other repeat counts and the KV-cache slots of each plan
    (a one-token forward, :func:`smelt_ds.eval.looptime._kv_slots`)."""
    from smelt_ds.eval.looptime import loss_by_repeats

    cpu, fake = pair
    kw = {"seq_len": 16, "micro_batch_size": 2, "batches": 1, **QUIET}
    want = loss_by_repeats([cpu], [1, 2], **kw)
    with fake_device() as mode:
        _place(fake)
        got = loss_by_repeats([fake], [1, 2], **kw)
    assert mode.moves > 0 and not mode.mixed
    assert _same(got, want)
    assert [r["kv_cache_slots"] for r in want["rows"]] == [r["visits"] for r in want["rows"]]


# ---------------------------------------------------------------------------------------------
# smelt-ds generate and HumanEval
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_generate_on_the_model_device(pair, eval_data, temperature):
    """``generate_text`` (``smelt-ds generate``): the prompt on the model's device; sampled
    decoding with a generator it can use."""
    from smelt_ds.eval.generation import encode_prompt, generate_text

    cpu, fake = pair
    tok = eval_data.tokenizer
    ids = encode_prompt(tok, "def main():\n    return", eval_data.eot_id)
    want = generate_text(cpu.model, tok, ids, 8, temperature=temperature, top_p=0.9, seed=3)
    with fake_device() as mode:
        _place(fake)
        got = generate_text(fake.model, tok, ids, 8, temperature=temperature, top_p=0.9, seed=3)
    assert mode.moves > 0 and not mode.mixed
    assert (got.ids, got.text, got.mode) == (want.ids, want.text, want.mode)
    assert len(want.ids) == len(ids) + 8


def test_humaneval_sampling_and_canonical_loss_on_the_model_device(pair, eval_data):
    """``generate_completions`` (greedy batches and seeded samples) and ``canonical_solution_loss``."""
    from smelt_ds.eval import humaneval as he

    cpu, fake = pair
    tok, eot = eval_data.tokenizer, eval_data.eot_id
    problems = he.load_problems(2)

    def run(model) -> tuple:
        greedy = he.generate_completions(model, tok, eot, problems, max_new_tokens=6)
        sampled = he.generate_completions(model, tok, eot, problems, samples=2, temperature=1.0, top_p=0.95,
                                          max_new_tokens=6, seed=4)
        return asdict(greedy), asdict(sampled), he.canonical_solution_loss(model, tok, eot, problems)

    want = run(cpu.model)
    with fake_device() as mode:
        _place(fake)
        got = run(fake.model)
    assert mode.moves > 0 and not mode.mixed
    assert got == want
    assert [len(t) for t in want[1]["texts"]] == [2, 2] and all(n > 0 for _, n in want[2])


# ---------------------------------------------------------------------------------------------
# the lm-evaluation-harness model and the in-loop harness
# ---------------------------------------------------------------------------------------------

LL_DOCS = [{"context": "The cat ", "target": "sat"}, {"context": "import numpy as", "target": " np"}]
GEN_DOCS = [{"prompt": "def add(a, b):\n    return", "answer": " a + b"}, {"prompt": "Once upon a", "answer": " x"}]


@pytest.fixture(scope="module")
def tasks(tmp_path_factory) -> str:
    """A loglikelihood task and greedy and sampled generate_until tasks (local JSON)."""
    root = tmp_path_factory.mktemp("device-tasks")
    _yaml(root, "dev_ll", "loglikelihood", LL_DOCS, doc_to_text="{{context}}", doc_to_target="{{target}}",
          target_delimiter="", metric_list=[{"metric": "perplexity"}, {"metric": "acc"}])
    gen = {"doc_to_text": "{{prompt}}", "doc_to_target": "{{answer}}",
           "metric_list": [{"metric": "exact_match", "aggregation": "mean", "higher_is_better": True}]}
    _yaml(root, "dev_greedy", "generate_until", GEN_DOCS,
          generation_kwargs={"until": ["\n"], "max_gen_toks": 5, "do_sample": False}, **gen)
    _yaml(root, "dev_sampled", "generate_until", GEN_DOCS,
          generation_kwargs={"until": ["\n"], "max_gen_toks": 5, "do_sample": True, "temperature": 1.0}, **gen)
    return str(root)


TASKS = ["dev_ll", "dev_greedy", "dev_sampled"]


def _outputs(results: dict) -> tuple:
    """The metrics and every request's model output (the generated texts, the log-likelihoods)."""
    samples = {t: [s["resps"] for s in rows] for t, rows in results["samples"].items()}
    return results["results"], samples


def test_harness_model_on_the_model_device(pair, eval_data, tasks):
    """``evaluate_model`` (``smelt-ds eval --harness``): ``continuation_logprobs`` and
    ``generate_until`` (greedy and sampled) of :class:`smelt_ds.eval.harness.SmeltHarnessLM`."""
    from smelt_ds.eval.harness import evaluate_model

    cpu, fake = pair
    kw = {"include_path": tasks, "batch_size": 2, "log_samples": True, "seed": 11}
    want = evaluate_model(cpu.model, eval_data.tokenizer, eval_data.eot_id, TASKS, **kw)
    with fake_device() as mode:
        _place(fake)
        got = evaluate_model(fake.model, eval_data.tokenizer, eval_data.eot_id, TASKS, **kw)
    assert mode.moves > 0 and not mode.mixed
    assert _outputs(got) == _outputs(want)
    assert set(want["results"]) == set(TASKS)


def test_in_loop_harness_on_the_training_device(eval_cache, eval_data, random_exports, tasks, monkeypatch):
    """``_gather_and_evaluate`` of :mod:`smelt_ds.train.in_loop_harness`: the reference model built
    on the accelerator device of the rank (``_compute_device``, here the fake device) and the
    harness run on it."""
    from smelt_ds.config.loading import config_from_dict
    from smelt_ds.runs.export import load_exported
    from smelt_ds.train import in_loop_harness as ilh
    from tests.eval.eval_test_utils import tiny_raw

    cfg = config_from_dict(tiny_raw(eval_cache, eval={"harness_tasks": TASKS, "harness_interval": 10,
                                                      "harness_include_path": tasks, "harness_batch_size": 2}))
    state = load_exported(random_exports["smelt"]).state_dict()
    monkeypatch.setattr(ilh, "gather_reference_state", lambda engine, cfg, group=None: dict(state))
    seen = []
    real = ilh.evaluate_model

    def recording(model, *args, **kwargs):
        seen.append(device_of(model))
        return real(model, *args, **kwargs)

    monkeypatch.setattr(ilh, "evaluate_model", recording)
    monkeypatch.setattr(ilh, "_compute_device", lambda: "cpu")
    want = ilh._gather_and_evaluate(None, cfg, eval_data.prepared, None)
    monkeypatch.setattr(ilh, "_compute_device", lambda: str(FAKE))
    with fake_device() as mode:
        got = ilh._gather_and_evaluate(None, cfg, eval_data.prepared, None)
    assert seen == [torch.device("cpu"), FAKE]
    assert mode.moves > 0 and not mode.mixed
    assert got == want
    assert {k.split("/")[1] for k in want} == set(TASKS)
