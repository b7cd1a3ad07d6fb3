"""HumanEval (smelt_ds.eval.humaneval): pass@k against its closed form, the harness's token split,
the canonical-solution loss against a direct forward, generation against an uncached greedy loop,
the execution path with canonical solutions, the refusal, and the two-run report."""

from __future__ import annotations

import argparse
import json
import math

import pytest
import torch

from smelt_ds.errors import ConfigError
from smelt_ds.eval import humaneval as he
from tests.numerics import chain_tol, model_chain_length

WRONG = "    return None\n"


@pytest.fixture(scope="module")
def problems():
    return he.load_problems(3)


@pytest.fixture
def smelt(random_exports):
    from smelt_ds.runs.load import load_run

    return load_run(random_exports["smelt"])


def _direct_logprobs(model, ids: list[int]):
    """``(S - 1,)`` float64 log p(ids[t] | ids[:t]) for t >= 1 from one uncached forward of ``ids[:-1]``."""
    with torch.no_grad():
        logp = model(torch.tensor([ids[:-1]])).logits[0].double().log_softmax(-1)
    return logp[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]


def _logprob_tol(model, ids: list[int]) -> float:
    """How far a mean log-probability from padded batches (the harness: other matmul shapes, fp32
    log-softmax) can be from :func:`_direct_logprobs`: each logit within 2 n u of the largest (n the
    forward's reduction lengths, tests/numerics.py), a log-probability within twice that."""
    with torch.no_grad():
        logit_max = float(model(torch.tensor([ids[:-1]])).logits.abs().max())
    return 2 * chain_tol(model_chain_length(model, len(ids)) + model.model_cfg.vocab_size) * logit_max


# ------------------------------------------------------------------------------------------ pass@k


def test_pass_at_k_matches_closed_form():
    for n in list(range(1, 21)) + [50, 200]:
        for c in sorted({0, 1, n // 3, n // 2, n - 1, n} if n > 20 else range(n + 1)):
            for k in sorted({1, 2, 5, 10, 100, n} & set(range(1, n + 1))) if n > 20 else range(1, n + 1):
                want = 1.0 - math.comb(n - c, k) / math.comb(n, k)
                assert he.pass_at_k(n, c, k) == pytest.approx(want, rel=1e-12, abs=1e-14), (n, c, k)


def test_pass_at_k_edge_cases():
    assert he.pass_at_k(10, 0, 5) == 0.0
    assert he.pass_at_k(10, 6, 5) == 1.0  # n - c = 4 < k
    assert he.pass_at_k(7, 3, 1) == pytest.approx(3 / 7, rel=1e-15)
    with pytest.raises(ConfigError, match=r"k \(11\).*n \(10\)"):
        he.pass_at_k(10, 2, 11)
    with pytest.raises(ConfigError, match=r"c \(12\)"):
        he.pass_at_k(10, 12, 1)


def test_cut_at_stop():
    assert he.cut_at_stop("    return a\n\n\ndef g():\n    pass\n") == "    return a\n\n"
    assert he.cut_at_stop("    x = 1\n# note\nif True:\n") == "    x = 1"
    assert he.cut_at_stop("    return b\nprint(1)\nclass A") == "    return b"
    assert he.cut_at_stop("    return c  # done") == "    return c  # done"


# ------------------------------------------------------------------------- canonical-solution loss


class _HarnessTokenizer:
    """lm-evaluation-harness's own ``TemplateLM._encode_pair`` over our tokenizer (the reference)."""

    def __init__(self, tokenizer):
        from lm_eval.api.model import TemplateLM

        class LM(TemplateLM):
            eot_token_id = 0

            def tok_encode(self, string, add_special_tokens=None, **kwargs):
                return list(tokenizer.encode(string).ids)

            def _loglikelihood_tokens(self, requests, **kwargs):
                raise NotImplementedError

            def loglikelihood_rolling(self, requests, disable_tqdm=False):
                raise NotImplementedError

            def generate_until(self, requests, disable_tqdm=False):
                raise NotImplementedError

        self.lm = LM()


def test_encode_pair_is_the_harness_split(eval_data):
    ref = _HarnessTokenizer(eval_data.tokenizer).lm
    pairs = [(p["prompt"], p["canonical_solution"]) for p in he.load_problems(6)]
    pairs += [("x = ", "1 + 2"), ("def f(a):\n    \n", "return a"), ("a\t \n", "b")]
    for ctx, cont in pairs:
        assert he.encode_pair(eval_data.tokenizer, ctx, cont) == ref._encode_pair(ctx, cont)
    ctx_ids, cont_ids = he.encode_pair(eval_data.tokenizer, "x = ", "1")
    assert eval_data.tokenizer.decode(cont_ids) == " 1"  # the trailing space moved to the continuation


def test_canonical_loss_equals_direct_computation(eval_data, eval_cache, problems):
    """A model whose window holds whole problems: the loss is the mean of the solution tokens'
    -log p from one forward over [eot] + context + solution."""
    from smelt_ds.config.loading import config_from_dict
    from smelt_ds.model import SmeltLM
    from tests.eval.eval_test_utils import tiny_raw

    raw = tiny_raw(eval_cache)
    raw["model"].update(max_seq_len=1024, init_std=0.2)
    cfg = config_from_dict(raw)
    torch.manual_seed(3)
    model = SmeltLM(cfg.model, cfg.moe, cfg.loop).eval()
    tok, eot = eval_data.tokenizer, eval_data.eot_id
    got = he.canonical_solution_loss(model, tok, eot, problems)
    for p, (loss, n) in zip(problems, got, strict=True):
        ctx, cont = he.encode_pair(tok, p["prompt"], p["canonical_solution"])
        lp = _direct_logprobs(model, [eot] + ctx + cont)
        assert n == len(cont) > 0
        assert loss == pytest.approx(float(-lp[-len(cont):].mean()), abs=_logprob_tol(model, [eot] + ctx + cont))
    assert len({round(lo, 6) for lo, _ in got}) == 3


def test_truncation_keeps_every_solution_token(smelt, eval_data):
    """max_seq_len 64: the prompt is left-truncated, every solution token is still scored; a solution
    that fits the window is scored with the 64 tokens before its last token as input."""
    model, tok, eot = smelt.model, eval_data.tokenizer, eval_data.eot_id
    L = model.model_cfg.max_seq_len
    probs = he.load_problems(20)
    splits = [he.encode_pair(tok, p["prompt"], p["canonical_solution"]) for p in probs]
    got = he.canonical_solution_loss(model, tok, eot, probs)
    assert [n for _, n in got] == [len(cont) for _, cont in splits]
    assert all(math.isfinite(lo) and lo > 0 for lo, _ in got)
    short = [i for i, (ctx, cont) in enumerate(splits) if len(cont) < L - 8 and len(ctx) + len(cont) > L]
    long = [i for i, (_, cont) in enumerate(splits) if len(cont) > L]
    assert short and long  # both cases are exercised
    for i in short:
        ctx, cont = splits[i]
        seq = ([eot] + ctx + cont)[-(L + 1):]
        lp = _direct_logprobs(model, seq)
        assert got[i][0] == pytest.approx(float(-lp[-len(cont):].mean()), abs=_logprob_tol(model, seq))


# ------------------------------------------------------------------------------------ generation


def test_greedy_completions_match_uncached_decoding(smelt, eval_data, problems):
    model, tok, eot = smelt.model, eval_data.tokenizer, eval_data.eot_id
    L, new = model.model_cfg.max_seq_len, 10
    probs = [*problems, {"task_id": "short", "prompt": "def f():\n"}]
    got = he.generate_completions(model, tok, eot, probs, max_new_tokens=new)
    for p, texts, n_prompt, trunc in zip(probs, got.texts, got.prompt_tokens, got.truncated, strict=True):
        full = [eot] + list(tok.encode(p["prompt"]).ids)
        ids = full[-(L - new):]
        assert (n_prompt, trunc) == (len(ids), len(full) > L - new)
        out = []
        with torch.no_grad():
            for _ in range(new):
                nxt = int(model(torch.tensor([ids + out])).logits[0, -1].argmax())
                if nxt == eot:
                    break
                out.append(nxt)
        assert texts == [he.cut_at_stop(tok.decode(out))]
    assert got.num_truncated == 3 and got.truncated[-1] is False


def test_sampling_is_seeded(smelt, eval_data, problems):
    args = (smelt.model, eval_data.tokenizer, eval_data.eot_id, problems[:2])
    a = he.generate_completions(*args, samples=3, temperature=1.0, top_p=1.0, max_new_tokens=8, seed=5)
    b = he.generate_completions(*args, samples=3, temperature=1.0, top_p=1.0, max_new_tokens=8, seed=5)
    c = he.generate_completions(*args, samples=3, temperature=1.0, top_p=1.0, max_new_tokens=8, seed=6)
    assert a.texts == b.texts and [len(t) for t in a.texts] == [3, 3]
    assert a.new_tokens != c.new_tokens or a.texts != c.texts


def test_generation_settings_are_checked(smelt, eval_data, problems):
    args = (smelt.model, eval_data.tokenizer, eval_data.eot_id, problems)
    with pytest.raises(ConfigError, match="--temperature"):
        he.generate_completions(*args, samples=2, temperature=0.0)
    with pytest.raises(ConfigError, match=r"--max-new-tokens.*\(64\)"):
        he.generate_completions(*args, max_new_tokens=64)


# ------------------------------------------------------------------------------- execution path


def test_canonical_completions_pass(smelt, eval_data, problems):
    """The execution path: canonical solutions pass every problem, a wrong one none."""
    args = (smelt.model, eval_data.tokenizer, eval_data.eot_id)
    good = he.evaluate_humaneval(*args, problems=problems, allow_code_execution=True, workers=2,
                                 completions=[[p["canonical_solution"]] for p in problems])
    bad = he.evaluate_humaneval(*args, problems=problems, allow_code_execution=True, workers=2,
                                completions=[[WRONG] for _ in problems])
    assert good["pass_at_k"] == {"pass@1": 1.0} and [r["passed"] for r in good["problems"]] == [1, 1, 1]
    assert bad["pass_at_k"] == {"pass@1": 0.0}
    assert all(r["results"][0]["status"] == "failed" for r in bad["problems"])


def test_pass_at_k_over_mixed_samples(smelt, eval_data, problems):
    probs = problems[:2]
    comps = [[p["canonical_solution"]] * 2 + [WRONG] * 3 for p in probs]
    res = he.evaluate_humaneval(smelt.model, eval_data.tokenizer, eval_data.eot_id, problems=probs, samples=5,
                                temperature=0.8, k_list=(1, 2, 5, 10), allow_code_execution=True, workers=2,
                                completions=comps)
    assert [r["passed"] for r in res["problems"]] == [2, 2]
    want = {f"pass@{k}": 1 - math.comb(3, k) / math.comb(5, k) for k in (1, 2, 5)}
    assert res["pass_at_k"].keys() == want.keys()  # pass@10 is dropped: 10 > 5 samples
    for k, v in want.items():
        assert res["pass_at_k"][k] == pytest.approx(v, rel=1e-12)


def test_refuses_without_allow_code_execution(smelt, eval_data, problems, monkeypatch):
    def never(*a, **k):
        raise AssertionError("generated before refusing")

    monkeypatch.setattr(he, "generate_completions", never)
    monkeypatch.setattr(he, "canonical_solution_loss", never)
    with pytest.raises(ConfigError, match="generated code is executed.*--allow-code-execution"):
        he.evaluate_humaneval(smelt.model, eval_data.tokenizer, eval_data.eot_id, problems=problems)


def test_loss_only_needs_no_flag(smelt, eval_data, problems):
    res = he.evaluate_humaneval(smelt.model, eval_data.tokenizer, eval_data.eot_id, problems=problems, execute=False)
    losses = he.canonical_solution_loss(smelt.model, eval_data.tokenizer, eval_data.eot_id, problems)
    tokens = sum(n for _, n in losses)
    assert res["pass_at_k"] == {} and "completions" not in res["problems"][0]
    cl = res["canonical_loss"]
    assert cl["tokens"] == tokens
    assert cl["token_weighted_nats_per_token"] == pytest.approx(sum(lo * n for lo, n in losses) / tokens, rel=1e-12)
    assert cl["per_problem_mean_nats_per_token"] == pytest.approx(sum(lo for lo, _ in losses) / 3, rel=1e-12)


# ------------------------------------------------------------------------------------ the report


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    p.add_argument("--seed", type=int, default=0)  # the eval parser's own
    he.add_humaneval_arguments(p)
    return p


def test_flags_are_checked():
    p = _parser()
    with pytest.raises(ConfigError, match="--allow-code-execution"):
        he.humaneval_settings(p.parse_args(["--humaneval"]))
    with pytest.raises(ConfigError, match="--temperature.*--samples"):
        he.humaneval_settings(p.parse_args(["--humaneval", "--allow-code-execution", "--samples", "4"]))
    with pytest.raises(ConfigError, match="--temperature"):
        he.humaneval_settings(p.parse_args(["--allow-code-execution", "--samples", "4", "--temperature", "0"]))
    with pytest.raises(ConfigError, match="--timeout"):
        he.humaneval_settings(p.parse_args(["--allow-code-execution", "--timeout", "0"]))
    st = he.humaneval_settings(p.parse_args(["--humaneval-loss-only", "--samples", "3", "--temperature", "0.8"]))
    assert (st.execute, st.samples, st.temperature, st.max_new_tokens) == (False, 3, 0.8, 128)
    assert he.humaneval_settings(p.parse_args(["--allow-code-execution"])).temperature == 0.0


def test_two_run_journey(random_exports, eval_data, tmp_path, monkeypatch):
    """Two runs -> humaneval.json with both; pass@1 = passed / samples from the per-problem results
    (problems 0 and 1 get their canonical solution, so the number is not trivially 0); the loss
    equals the direct computation; truncated prompts are counted; no flag -> refusal, no files."""
    from smelt_ds.runs.load import load_runs

    runs = load_runs([str(random_exports["baseline"]), str(random_exports["smelt"])])
    out = tmp_path / "out"
    real = he.generate_completions

    def partly_canonical(model, tokenizer, eot_id, problems, *a, **k):
        gen = real(model, tokenizer, eot_id, problems, *a, **k)
        for i in (0, 1):
            gen.texts[i] = [problems[i]["canonical_solution"]] * len(gen.texts[i])
        return gen

    with pytest.raises(ConfigError, match="--allow-code-execution"):
        he.run_humaneval(runs, _parser().parse_args(["--humaneval", "--humaneval-limit", "3"]), out)
    assert not out.exists()

    monkeypatch.setattr(he, "generate_completions", partly_canonical)
    args = _parser().parse_args(["--humaneval", "--allow-code-execution", "--humaneval-limit", "3",
                                 "--max-new-tokens", "8", "--workers", "2"])
    he.run_humaneval(runs, args, out)
    assert sorted(p.name for p in out.iterdir()) == ["humaneval.json", "humaneval.md"]
    res = json.loads((out / "humaneval.json").read_text())
    names = [r.name for r in runs]
    assert [r["name"] for r in res["runs"]] == names and set(res["results"]) == set(names)
    problems = he.load_problems(3)
    budget = 64 - 8
    n_trunc = sum(len(eval_data.tokenizer.encode(p["prompt"]).ids) + 1 > budget for p in problems)
    for run in runs:
        r = res["results"][run.name]
        rows = r["problems"]
        assert [row["task_id"] for row in rows] == ["HumanEval/0", "HumanEval/1", "HumanEval/2"]
        assert rows[0]["passed"] == rows[1]["passed"] == 1
        assert r["pass_at_k"]["pass@1"] == sum(row["passed"] for row in rows) / sum(row["samples"] for row in rows)
        assert r["pass_at_k"]["pass@1"] >= 2 / 3
        assert r["prompts_truncated"] == n_trunc
        losses = he.canonical_solution_loss(run.model, eval_data.tokenizer, eval_data.eot_id, problems)
        assert [row["loss_nats_per_token"] for row in rows] == pytest.approx([lo for lo, _ in losses], abs=1e-9)
    table = {row["run"]: row for row in res["table"]}
    b, s = (res["results"][n]["canonical_loss"]["token_weighted_nats_per_token"] for n in names)
    assert table[names[0]]["delta_loss_token_weighted"] == 0.0
    assert table[names[1]]["delta_loss_token_weighted"] == pytest.approx(s - b, abs=1e-12)
    md = (out / "humaneval.md").read_text()
    assert all(f"| {n} |" in md for n in names) and "pass@1" in md and "nats/token" in md
