"""The lm-evaluation-harness model (:mod:`smelt_ds.eval.harness`) against a direct computation
with :class:`smelt_ds.model.SmeltLM`.

Tiny task files of each output type (multiple choice, loglikelihood, rolling loglikelihood,
generate_until: YAML + JSONL in a temporary directory) run through ``lm_eval.simple_evaluate``
(:func:`evaluate_model` / :func:`run_harness`) on a random-weight SMELT export. The reference
(:func:`_ref_loglik`, :func:`_ref_rolling`, :func:`_ref_generate`) is written from the harness's
documented conventions, not from our code: it encodes with the tokenizer, runs
``model.forward`` on one unpadded row per request, takes ``log_softmax`` in float32 and sums the
continuation tokens' log-probabilities with ``math.fsum``; generation is ``model.generate`` on one
row. For equality (``==``, not approximately) the harness runs with ``batch_size=1``, so both do
the same arithmetic on the same ``(1, S)`` input; aggregates are recomputed with the harness's
formulas (mean; ``exp(-sum ll / sum words)``). Right padding with batches of 4 is checked
separately, within 1e-5 (see :func:`test_right_padding_changes_nothing_but_rounding`).
"""

from __future__ import annotations

import json
import math
import re

import pytest
import torch
import torch.nn.functional as F
import yaml
from lm_eval.api.instance import Instance

from smelt_ds.config.loop import loop_with_repeats
from smelt_ds.config.schedule import build_schedule
from smelt_ds.errors import ConfigError
from smelt_ds.eval.harness import SmeltHarnessLM, evaluate_model, run_harness
from smelt_ds.eval.harness_report import harness_records, metric_table, own_lengths
from smelt_ds.runs.load import load_run
from tests.numerics import BF16_U, chain_tol, model_chain_length, prob_tol

MAX_GEN = 6
STOPS = ["\n", "."]

MC_DOCS = [  # target_delimiter "": the space is part of the choice, or the question's trailing space
    {"question": "The cat sat on the", "choices": [" mat", " sky", " river"], "gold": 0},
    {"question": "def add(a, b):\n    return ", "choices": ["a + b", "None"], "gold": 0},
    {"question": "Once upon a", "choices": [" time", " tree", " hill", " stone"], "gold": 2},
    {"question": "for i in range(", "choices": ["10):", "x]"], "gold": 1},
]
LL_DOCS = [
    {"context": "The cat ", "target": "sat"},  # trailing space: moved into the continuation
    {"context": "import numpy as", "target": " np"},
    {"context": "She opened the door and", "target": " walked into the garden"},
    {"context": "x = [1, 2,", "target": " 3]"},
]
ROLL_DOCS = [
    {"text": "A short line."},
    {"text": "The river ran past the old mill, and the children ran after it all the way to the sea."},
    {"text": "def mean(xs):\n    total = 0\n    for x in xs:\n        total += x\n    return total / len(xs)\n"},
    {"text": " ".join(["the quick brown fox jumps over the lazy dog"] * 4)},
]
GEN_PROMPTS = ["The old man said", "def square(x):\n    return", "Once upon a time", "It was a dark and"]


def _yaml(root, name: str, output_type: str, rows: list[dict], **cfg) -> None:
    data = root / f"{name}.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    conf = {"task": name, "dataset_path": "json",
            "dataset_kwargs": {"data_files": {"test": str(data)}, "cache_dir": str(root / "hf-cache")},
            "test_split": "test", "output_type": output_type, **cfg}
    (root / f"{name}.yaml").write_text(yaml.safe_dump(conf, sort_keys=False))


def write_tasks(root, gen_answers: list[str]) -> None:
    """The four tiny tasks t_mc, t_ll, t_roll, t_gen (and the group t_all) in ``root``."""
    root.mkdir(parents=True, exist_ok=True)
    _yaml(root, "t_mc", "multiple_choice", MC_DOCS, doc_to_text="{{question}}", doc_to_choice="choices",
          doc_to_target="gold", target_delimiter="", metric_list=[{"metric": "acc"}, {"metric": "acc_norm"}])
    _yaml(root, "t_ll", "loglikelihood", LL_DOCS, doc_to_text="{{context}}", doc_to_target="{{target}}",
          target_delimiter="", metric_list=[{"metric": "perplexity"}, {"metric": "acc"}])
    _yaml(root, "t_roll", "loglikelihood_rolling", ROLL_DOCS, doc_to_text="", doc_to_target="{{text}}",
          metric_list=[{"metric": "word_perplexity"}, {"metric": "byte_perplexity"}, {"metric": "bits_per_byte"}])
    _yaml(root, "t_gen", "generate_until",
          [{"prompt": p, "answer": a} for p, a in zip(GEN_PROMPTS, gen_answers, strict=True)],
          doc_to_text="{{prompt}}", doc_to_target="{{answer}}",
          generation_kwargs={"until": STOPS, "max_gen_toks": MAX_GEN, "do_sample": False},
          metric_list=[{"metric": "exact_match", "aggregation": "mean", "higher_is_better": True}])
    (root / "t_all.yaml").write_text(yaml.safe_dump({"group": "t_all", "task": ["t_mc", "t_ll"],
                                                     "aggregate_metric_list": [
        {"metric": "acc", "aggregation": "mean", "weight_by_size": True}]}))


# ---------------------------------------------------------------------------------------------
# the reference: one unpadded row per request through model.forward / model.generate
# ---------------------------------------------------------------------------------------------


def _enc(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False).ids


def _split(tok, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """The harness's split for a causal LM: trailing whitespace of the context moves into the
    continuation; the continuation is the whole encoding after the context's tokens."""
    n = len(context) - len(context.rstrip())
    if n:
        context, continuation = context[:-n], context[-n:] + continuation
    whole, ctx = _enc(tok, context + continuation), _enc(tok, context)
    return ctx, whole[len(ctx):]


@torch.no_grad()
def _ref_scores(model, inp: list[int], cont: list[int]) -> tuple[float, bool]:
    """Log-likelihood of the last len(cont) positions of one row ``inp`` (fsum of float32 log-probs)."""
    lp = F.log_softmax(model(torch.tensor([inp])).logits[0].float(), dim=-1)
    pos = range(len(inp) - len(cont), len(inp))
    pairs = list(zip(pos, cont, strict=True))
    return math.fsum(lp[p, t].item() for p, t in pairs), all(int(lp[p].argmax()) == t for p, t in pairs)


def _ref_loglik(model, tok, eot: int, context: str, continuation: str) -> tuple[float, bool]:
    """The request read as a document start: [eot] + context + continuation (an empty context: [eot])."""
    ctx, cont = ([], _enc(tok, continuation)) if context == "" else _split(tok, context, continuation)
    return _ref_scores(model, ([eot] + ctx + cont)[:-1], cont)


def _ref_rolling(model, tok, eot: int, text: str, L: int) -> float:
    """Disjoint windows of at most L predicted tokens, each input L tokens long (the first starts
    with end-of-text): the rolling-window convention of lm-eval's LM.loglikelihood_rolling."""
    t = _enc(tok, text)
    m = min(L, len(t))
    total = 0.0 + _ref_scores(model, [eot] + t[: m - 1], t[:m])[0]
    p = m
    while p < len(t):
        m = min(len(t) - p, L)
        end = p + m
        total += _ref_scores(model, t[end - L - 1: end - 1], t[p:end])[0]
        p = end
    return total


def _ref_generate(model, tok, eot: int, prompt: str, max_len: int, temperature: float = 0.0, top_p: float = 1.0,
                  generator=None) -> str:
    ids = ([eot] + _enc(tok, prompt))[-(max_len - MAX_GEN):]  # a document start, as smelt-ds generate prompts
    out = model.generate(torch.tensor([ids]), MAX_GEN, temperature=temperature, top_p=top_p, eos_token_id=eot,
                         generator=generator)[0, len(ids):].tolist()
    if eot in out:
        out = out[: out.index(eot)]
    text = tok.decode(out)
    for s in STOPS + [tok.decode([eot], skip_special_tokens=False)]:
        text = text.split(s)[0]
    return text


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    """No downloads: the hub and ``datasets`` offline (``datasets`` read the variable at import)."""
    import datasets

    for var in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE"):
        monkeypatch.setenv(var, "1")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)


@pytest.fixture(scope="module")
def setup(tmp_path_factory, random_exports, eval_data):
    """The SMELT export's model, its tokenizer, and the tasks; t_gen's first answer is the
    reference greedy generation (so exact_match is not trivially 0), the others never match."""
    model = load_run(random_exports["smelt"]).model
    tok, eot = eval_data.tokenizer, eval_data.eot_id
    L = model.model_cfg.max_seq_len
    greedy = [_ref_generate(model, tok, eot, p, L) for p in GEN_PROMPTS]
    root = tmp_path_factory.mktemp("harness-tasks")
    write_tasks(root, [greedy[0], "zzz", "zzz", greedy[3] + "!"])
    return {"model": model, "tok": tok, "eot": eot, "root": str(root), "greedy": greedy}


def _eval(setup, tasks, **kw):
    kw.setdefault("batch_size", 1)
    return evaluate_model(setup["model"], setup["tok"], setup["eot"], tasks, include_path=setup["root"],
                          log_samples=True, **kw)


# ---------------------------------------------------------------------------------------------
# each output type equals the direct computation
# ---------------------------------------------------------------------------------------------


def test_multiple_choice_equals_hand_computation(setup):
    m, tok, eot = setup["model"], setup["tok"], setup["eot"]
    res = _eval(setup, ["t_mc"])
    samples = sorted(res["samples"]["t_mc"], key=lambda s: s["doc_id"])
    accs, norms = [], []
    for doc, s in zip(MC_DOCS, samples, strict=True):
        ref = [_ref_loglik(m, tok, eot, doc["question"], c) for c in doc["choices"]]
        assert [tuple(r[0]) for r in s["resps"]] == ref  # per-request (log-likelihood, is_greedy), exactly
        lls = [r[0] for r in ref]
        accs.append(1.0 if lls.index(max(lls)) == doc["gold"] else 0.0)
        normed = [ll / len(c) for ll, c in zip(lls, doc["choices"], strict=True)]
        norms.append(1.0 if normed.index(max(normed)) == doc["gold"] else 0.0)
        assert (s["acc"], s["acc_norm"]) == (accs[-1], norms[-1])
    out = res["results"]["t_mc"]
    assert out["acc,none"] == sum(accs) / len(accs) and out["acc_norm,none"] == sum(norms) / len(norms)
    assert metric_table(res)["t_mc"]["acc"]["value"] == out["acc,none"]


def test_loglikelihood_task_equals_hand_computation(setup):
    m, tok, eot = setup["model"], setup["tok"], setup["eot"]
    res = _eval(setup, ["t_ll"])
    samples = sorted(res["samples"]["t_ll"], key=lambda s: s["doc_id"])
    ref = [_ref_loglik(m, tok, eot, d["context"], d["target"]) for d in LL_DOCS]
    assert [tuple(s["resps"][0][0]) for s in samples] == ref
    lls = [r[0] for r in ref]
    out = res["results"]["t_ll"]
    assert out["perplexity,none"] == math.exp(-sum(lls) / len(lls))
    assert out["acc,none"] == sum(float(r[1]) for r in ref) / len(ref)


def test_context_continuation_split_at_the_token_boundary(setup):
    m, tok, eot = setup["model"], setup["tok"], setup["eot"]
    lm = SmeltHarnessLM.from_model(m, tok, eot, batch_size=1)
    ctx, cont = lm._encode_pair("The cat ", "sat")
    assert ctx == [eot] + _enc(tok, "The cat") and ctx + cont == [eot] + _enc(tok, "The cat sat")
    assert tok.decode(cont) == " sat"  # the space belongs to the continuation's first token
    reqs = [Instance("loglikelihood", {}, ("The cat ", "sat"), 0), Instance("loglikelihood", {}, ("", "The cat"), 1)]
    got = lm.loglikelihood(reqs, disable_tqdm=True)
    assert got[0] == _ref_scores(m, (ctx + cont)[:-1], cont)
    # an empty context is conditioned on end-of-text (the harness's prefix token)
    assert got[1] == _ref_scores(m, [eot] + _enc(tok, "The cat")[:-1], _enc(tok, "The cat"))


def test_is_greedy_for_the_greedy_continuation(setup):
    m, tok, eot = setup["model"], setup["tok"], setup["eot"]
    lm = SmeltHarnessLM.from_model(m, tok, eot)
    ctx = _enc(tok, "The river ran past the")
    greedy = m.generate(torch.tensor([ctx]), 4)[0, len(ctx):].tolist()
    other = greedy[:-1] + [(greedy[-1] + 1) % tok.get_vocab_size()]
    (ll_g, is_g), (ll_o, is_o) = lm._loglikelihood_tokens([(None, ctx, greedy), (None, ctx, other)], disable_tqdm=True)
    assert is_g is True and is_o is False
    assert (ll_g, is_g) == _ref_scores(m, (ctx + greedy)[:-1], greedy) and ll_g > ll_o


def test_continuation_longer_than_max_length_is_scored_in_pieces(setup):
    """Each piece of at most L tokens is read after the L tokens before it; the pieces' sums add up."""
    m, tok, eot = setup["model"], setup["tok"], setup["eot"]
    L = 16
    lm = SmeltHarnessLM.from_model(m, tok, eot, batch_size=1, max_length=L)
    ctx, cont = _enc(tok, "def mean(xs):"), _enc(tok, ROLL_DOCS[2]["text"][14:])
    assert len(cont) > 2 * L
    full, total, greedy = ctx + cont, 0.0, True
    for start in range(len(ctx), len(full), L):
        piece = full[start:start + L]
        ll, g = _ref_scores(m, full[:start + len(piece)][-(L + 1):][:-1], piece)
        total, greedy = total + ll, greedy and g
    short = _ref_scores(m, (ctx + cont[:5])[:-1], cont[:5])
    assert lm._loglikelihood_tokens([(None, ctx, cont), (None, ctx, cont[:5])], disable_tqdm=True) == [
        (total, greedy), short]


def test_rolling_loglikelihood_equals_hand_windows(setup):
    m, tok, eot = setup["model"], setup["tok"], setup["eot"]
    L = 16
    assert max(len(_enc(tok, d["text"])) for d in ROLL_DOCS) > 2 * L  # several windows, a partial last one
    lm = SmeltHarnessLM.from_model(m, tok, eot, batch_size=1, max_length=L)
    res = run_harness(lm, ["t_roll"], setup["root"], log_samples=True)
    samples = sorted(res["samples"]["t_roll"], key=lambda s: s["doc_id"])
    lls = [_ref_rolling(m, tok, eot, d["text"], L) for d in ROLL_DOCS]
    assert [s["resps"][0][0] for s in samples] == lls
    words = [len(re.split(r"\s+", d["text"])) for d in ROLL_DOCS]
    nbytes = [len(d["text"].encode("utf-8")) for d in ROLL_DOCS]
    out = res["results"]["t_roll"]
    assert out["word_perplexity,none"] == math.exp(-sum(lls) / sum(words))
    assert out["byte_perplexity,none"] == math.exp(-sum(lls) / sum(nbytes))
    assert out["bits_per_byte,none"] == -(sum(lls) / sum(nbytes)) / math.log(2)


def test_generate_until_equals_model_generate(setup):
    res = _eval(setup, ["t_gen"])
    samples = sorted(res["samples"]["t_gen"], key=lambda s: s["doc_id"])
    got = [s["filtered_resps"][0] for s in samples]
    assert got == setup["greedy"]
    assert all(not any(x in g for x in STOPS) for g in got)  # cut at the first stop string
    answers = [s["target"] for s in samples]
    exact = sum(g == a for g, a in zip(got, answers, strict=True)) / len(got)
    assert res["results"]["t_gen"]["exact_match,none"] == exact
    assert res["results"]["t_gen"]["exact_match,none"] == 0.25  # the one answer built from the greedy decode
    # equal-length contexts share one generate call: batch 4 gives the same strings
    res4 = _eval(setup, ["t_gen"], batch_size=4)
    assert [s["filtered_resps"][0] for s in sorted(res4["samples"]["t_gen"], key=lambda s: s["doc_id"])] == got


def test_generation_options(setup):
    """Sampling with a seed equals model.generate with a generator of that seed; a context
    longer than max_length - max_gen_toks is left-truncated; unusable options are refused."""
    m, tok, eot = setup["model"], setup["tok"], setup["eot"]
    kw = {"until": STOPS, "max_gen_toks": MAX_GEN, "do_sample": True, "temperature": 0.9, "top_p": 0.9}
    req = [Instance("generate_until", {}, ("The old man said", kw), 0)]
    lm = SmeltHarnessLM.from_model(m, tok, eot, seed=7)
    got = lm.generate_until(req, disable_tqdm=True)
    ref = _ref_generate(m, tok, eot, "The old man said", m.model_cfg.max_seq_len, 0.9, 0.9,
                        torch.Generator().manual_seed(7))
    assert got == [ref] and lm.generate_until(req, disable_tqdm=True) == got
    long = " ".join(f"word{i}" for i in range(60))
    assert len(_enc(tok, long)) > m.model_cfg.max_seq_len
    greedy = {"until": STOPS, "max_gen_toks": MAX_GEN}
    assert lm.generate_until([Instance("generate_until", {}, (long, greedy), 0)], disable_tqdm=True) == [
        _ref_generate(m, tok, eot, long, m.model_cfg.max_seq_len)]
    with pytest.raises(ConfigError, match="max_gen_toks"):
        lm.generate_until([Instance("generate_until", {}, ("x", {"max_gen_toks": 64}), 0)], disable_tqdm=True)
    with pytest.raises(ConfigError, match="num_beams"):
        lm.generate_until([Instance("generate_until", {}, ("x", {**kw, "num_beams": 2}), 0)], disable_tqdm=True)


def test_right_padding_changes_nothing_but_rounding(setup):
    """Batch 4 (right-padded rows of different lengths) vs batch 1: not bit-equal: the padded batch
    is a different matmul shape (other BLAS blocking) and each expert sees another number of rows,
    so float32 rounding differs; the causal mask keeps padding out. Bound (tests/numerics.py): each
    logit within 2 n u of the largest, n the forward's reduction lengths, so each log-probability
    within twice that, times the continuation's tokens (a leaked pad moves it by > 1e-2)."""
    m, tok, eot = setup["model"], setup["tok"], setup["eot"]
    reqs = [Instance("loglikelihood", {}, (d["question"], c), i)
            for i, (d, c) in enumerate((d, c) for d in MC_DOCS for c in d["choices"])]
    reqs += [Instance("loglikelihood", {}, (d["context"], d["target"]), 100 + i) for i, d in enumerate(LL_DOCS)]
    assert len({len(_enc(tok, r.args[0] + r.args[1])) for r in reqs}) > 3  # rows of different lengths: padding
    one = SmeltHarnessLM.from_model(m, tok, eot, batch_size=1).loglikelihood(reqs, disable_tqdm=True)
    four = SmeltHarnessLM.from_model(m, tok, eot, batch_size=4).loglikelihood(reqs, disable_tqdm=True)
    assert [g for _, g in one] == [g for _, g in four]
    with torch.no_grad():
        logit_max = max(float(m(torch.tensor([_enc(tok, r.args[0] + r.args[1])])).logits.abs().max()) for r in reqs)
    per_token = 2 * chain_tol(model_chain_length(m, m.model_cfg.max_seq_len)) * logit_max
    for r, (a, _), (b, _) in zip(reqs, one, four, strict=True):
        assert abs(a - b) <= per_token * len(_enc(tok, r.args[1])), r.args
    assert one == [_ref_loglik(m, tok, eot, *r.args) for r in reqs]


# ---------------------------------------------------------------------------------------------
# test-time loop count
# ---------------------------------------------------------------------------------------------


def test_trained_repeat_count_equals_the_normal_path(setup):
    m, tok, eot = setup["model"], setup["tok"], setup["eot"]
    plain = _eval(setup, ["t_mc", "t_gen"])
    lm = SmeltHarnessLM.from_model(m, tok, eot, batch_size=1, loop_repeats=2)  # tiny SMELT trains R=2
    looped = run_harness(lm, ["t_mc", "t_gen"], setup["root"], log_samples=True)
    for task in ("t_mc", "t_gen"):
        a = sorted(plain["samples"][task], key=lambda s: s["doc_id"])
        b = sorted(looped["samples"][task], key=lambda s: s["doc_id"])
        assert [s["resps"] for s in a] == [s["resps"] for s in b]
    assert plain["results"] == looped["results"]
    assert looped["config"]["visit_plan"] == [0, 1, 2, 1, 2, 3] and looped["config"]["loop_repeats"] == 2


@pytest.mark.parametrize("repeats,exit_after", [(1, None), (3, None), (None, 1)])
def test_other_repeat_counts_run_their_plan(setup, repeats, exit_after):
    m, tok, eot = setup["model"], setup["tok"], setup["eot"]
    trained = m.schedule.layers()
    loop = loop_with_repeats(m.loop_cfg, m.model_cfg.num_layers, repeats, exit_after)
    plan = build_schedule(loop, m.model_cfg.num_layers).layers()
    assert plan != trained
    seen = []

    def hook(module, args, kwargs):  # the plan and the KV cache of every forward the harness runs
        seen.append((module.schedule.layers(), kwargs.get("kv_cache")))

    lm = SmeltHarnessLM.from_model(m, tok, eot, batch_size=1, loop_repeats=repeats, exit_after=exit_after)
    assert lm.visit_plan == plan and lm.get_model_info()["visits"] == len(plan)
    handle = m.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        ll = lm.loglikelihood([Instance("loglikelihood", {}, ("The cat sat on the", " mat"), 0)], disable_tqdm=True)
        text = lm.generate_until([Instance("generate_until", {}, (GEN_PROMPTS[0], {"until": STOPS,
                                                                                     "max_gen_toks": MAX_GEN}), 0)],
                                 disable_tqdm=True)
    finally:
        handle.remove()
    assert seen and all(p == plan for p, _ in seen)
    caches = [c for _, c in seen if c is not None]
    assert caches and all(len(c.slots) == len(plan) for c in caches)  # one KV slot per visit of the new plan
    assert sorted({v.visit for v in caches[0].slots if v.layer == 1}) == list(range(plan.count(1)))
    assert m.schedule.layers() == trained  # the caller's model runs its own plan again
    old = m.set_loop(loop)
    try:  # the reference: the same weights with the new plan set by hand
        assert ll[0] == _ref_loglik(m, tok, eot, "The cat sat on the", " mat")
        assert text[0] == _ref_generate(m, tok, eot, GEN_PROMPTS[0], m.model_cfg.max_seq_len)
    finally:
        m.set_loop(old)


def test_baseline_refuses_a_loop_count(random_exports, eval_data):
    base = load_run(random_exports["baseline"]).model
    with pytest.raises(ConfigError, match="no loop range"):
        SmeltHarnessLM.from_model(base, eval_data.tokenizer, eval_data.eot_id, loop_repeats=2)


# ---------------------------------------------------------------------------------------------
# lengths, records, reproducibility, options
# ---------------------------------------------------------------------------------------------


def test_own_lengths_and_records(setup):
    m, tok, eot = setup["model"], setup["tok"], setup["eot"]
    tasks = ["t_mc", "t_ll", "t_roll", "t_gen"]
    lm = SmeltHarnessLM.from_model(m, tok, eot)
    lengths = own_lengths(lm, tasks, setup["root"])
    k0 = run_harness(lm, tasks, setup["root"], num_fewshot=0, log_samples=True)
    for task in tasks:
        for s in k0["samples"][task]:
            ctx, cont = s["arguments"][0][0], s["arguments"][0][1] if len(s["arguments"][0]) > 1 else ""
            own = ctx + cont if task == "t_ll" else ctx  # rolling: the whole string; mc / gen: the context
            assert lengths[(task, s["doc_id"])] == len(_enc(tok, own)), (task, s["doc_id"])
    k1 = run_harness(lm, ["t_mc"], setup["root"], num_fewshot=1, log_samples=True)
    s1 = sorted(k1["samples"]["t_mc"], key=lambda s: s["doc_id"])
    assert all(len(_enc(tok, s["arguments"][0][0])) > lengths[("t_mc", s["doc_id"])] for s in s1)  # few-shot prefix
    recs = harness_records(k1, "smelt", 1, lengths)
    acc = {r["doc_id"]: r for r in recs if r["metric"] == "acc"}
    assert {d: r["value"] for d, r in acc.items()} == {s["doc_id"]: s["acc"] for s in s1}
    assert all(r["length_tokens"] == lengths[("t_mc", d)] and r["num_fewshot"] == 1 for d, r in acc.items())
    roll = [r for r in harness_records(k0, "smelt", 0, lengths) if r["task"] == "t_roll"]
    by_doc = {s["doc_id"]: s["resps"][0][0] for s in k0["samples"]["t_roll"]}
    loss = {r["doc_id"]: r["value"] for r in roll if r["metric"] == "loss"}
    assert loss == {d: -ll / lengths[("t_roll", d)] for d, ll in by_doc.items()}  # nats/token
    nll = {r["doc_id"]: r["value"] for r in harness_records(k0, "smelt", 0, lengths) if r["metric"] == "nll"}
    assert nll == {s["doc_id"]: -s["resps"][0][0][0] for s in k0["samples"]["t_ll"]}
    # records carry the k that ran: a task whose YAML fixes num_fewshot 0 ignores a requested k
    k1["n-shot"]["t_mc"] = 0  # as the harness reports such a task
    assert {r["num_fewshot"] for r in harness_records(k1, "smelt", 1, lengths)} == {0}


def test_named_filters_keep_their_name():
    """A task with a filter_list (e.g. smelt_code_complete's ``strip``) reports ``metric,filter``
    keys and tags each sample with its filter: both keep the filter in the metric name."""
    res = {"results": {"t": {"alias": "t", "exact_match,strip": 0.5, "exact_match_stderr,strip": 0.25,
                             "acc,none": 1.0, "acc_stderr,none": "N/A"}},
           "samples": {"t": [{"doc_id": d, "filter": "strip", "metrics": ["exact_match"], "exact_match": float(d)}
                             for d in (0, 1)]}}
    assert metric_table(res) == {"t": {"exact_match,strip": {"value": 0.5, "stderr": 0.25},
                                       "acc": {"value": 1.0, "stderr": None}}}
    recs = harness_records(res, "r", 0, {("t", 0): 3, ("t", 1): 5})
    assert [(r["metric"], r["doc_id"], r["value"], r["length_tokens"]) for r in recs] == [
        ("exact_match,strip", 0, 0.0, 3), ("exact_match,strip", 1, 1.0, 5)]


def test_repeated_calls_are_reproducible(setup):
    a = _eval(setup, ["t_all"], num_fewshot=1, batch_size=4, seed=3)
    b = _eval(setup, ["t_all"], num_fewshot=1, batch_size=4, seed=3)
    assert a["results"] == b["results"] and a["groups"] == b["groups"]
    for task in ("t_mc", "t_ll"):
        assert [s["arguments"] for s in a["samples"][task]] == [s["arguments"] for s in b["samples"][task]]
        assert [s["resps"] for s in a["samples"][task]] == [s["resps"] for s in b["samples"][task]]
    assert a["n-shot"]["t_mc"] == 1
    acc = {t: a["results"][t]["acc,none"] for t in ("t_mc", "t_ll")}
    assert metric_table(a)["t_all"]["acc"]["value"] == pytest.approx(
        (acc["t_mc"] * len(MC_DOCS) + acc["t_ll"] * len(LL_DOCS)) / (len(MC_DOCS) + len(LL_DOCS)), abs=1e-12)


@pytest.mark.slow
def test_bad_options_name_the_field(setup, random_exports):
    m, tok, eot = setup["model"], setup["tok"], setup["eot"]
    for kwargs, field in (({"max_length": 65}, "max_length"), ({"batch_size": "auto"}, "batch_size"),
                          ({"batch_size": 0}, "batch_size"), ({"dtype": "float16"}, "dtype"),
                          ({"device": "tpu"}, "device"), ({"bogus": 1}, "bogus")):
        with pytest.raises(ConfigError, match=field):
            SmeltHarnessLM.from_model(m, tok, eot, **kwargs)
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="CUDA is not available"):
            SmeltHarnessLM(pretrained=str(random_exports["smelt"]), device="cuda")
        # lm-eval's command line passes cuda:0 by default: a missing cuda:i falls back (as in HFLM)
        assert SmeltHarnessLM.from_model(m, tok, eot, device="cuda:0").device == torch.device("cpu")
    with pytest.raises(ConfigError, match="unknown harness task"):
        evaluate_model(m, tok, eot, ["no_such_task"], include_path=setup["root"])
    with pytest.raises(ConfigError, match="pretrained"):
        SmeltHarnessLM()


def test_bfloat16_scores_near_float32(setup, random_exports):
    tok, eot = setup["tok"], setup["eot"]
    reqs = [Instance("loglikelihood", {}, (d["context"], d["target"]), i) for i, d in enumerate(LL_DOCS)]
    f32 = SmeltHarnessLM.from_model(setup["model"], tok, eot).loglikelihood(reqs, disable_tqdm=True)
    lm = SmeltHarnessLM.from_model(load_run(random_exports["smelt"]).model, tok, eot, dtype="bfloat16")
    bf16 = lm.loglikelihood(reqs, disable_tqdm=True)
    assert lm.get_model_info()["model_dtype"] == "bfloat16" and bf16 != f32
    # the bf16 path scores as a bf16 forward of the same requests does (the same kernels, batch 1)
    one = SmeltHarnessLM.from_model(lm.model, tok, eot, dtype="bfloat16", batch_size=1)
    assert one.loglikelihood(reqs, disable_tqdm=True) == [_ref_loglik(lm.model, tok, eot, *r.args) for r in reqs]
    # against float32: bf16 (u = 2^-8) rounds every op's output (matmuls and sums accumulate in fp32),
    # about 12 per visit and 4 in the head: Higham & Mary's bound lambda sqrt(k) u at lambda = 10 for
    # one computation, relative to the log-probabilities whose logits carry it (0.34 here)
    k = 12 * lm.model.schedule.effective_depth + 4
    assert max(abs(a - b) / abs(a) for (a, _), (b, _) in zip(f32, bf16, strict=True)) < prob_tol(k, BF16_U) / 2


def test_pretrained_export_loads_with_string_arguments(setup, random_exports):
    lm = SmeltHarnessLM.create_from_arg_string(f"pretrained={random_exports['smelt']},batch_size=2,max_length=32,"
                                               "dtype=float32,loop_repeats=3")
    assert (lm.batch_size, lm.max_length, lm.loop_repeats) == (2, 32, 3)
    info = lm.get_model_info()
    assert info["smelt_export"] == str(random_exports["smelt"]) and info["visits"] == 8
    assert info["non_embedding_params"] == setup["model"].num_non_embedding_params()
    assert lm.eot_token_id == setup["eot"] and lm.tok_encode("a b") == _enc(setup["tok"], "a b")
