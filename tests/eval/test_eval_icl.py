"""In-context tasks: construction (answers, nesting in k, documented formats) and scores against
a per-episode hand computation."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from smelt_ds.errors import ConfigError
from tests.numerics import model_chain_length, prob_tol


@pytest.fixture(scope="module")
def tasks(eval_data):
    from smelt_ds.eval.icl import build_tasks

    return {t.name: t for t in build_tasks(eval_data, seed=3)}


def test_task_set_and_errors(tasks, eval_data):
    from smelt_ds.eval.icl import build_tasks, parse_shots

    assert {"kv_recall", "pattern", "word_case", "complete_code"} <= set(tasks)
    assert {tasks[n].kind for n in ("kv_recall", "pattern")} == {"synthetic"}
    with pytest.raises(ConfigError, match="unknown task"):
        build_tasks(eval_data, ("kv_recall", "trivia"))
    assert parse_shots("4,0,1") == (0, 1, 4)
    for bad in ("x", "-1", "0,65"):
        with pytest.raises(ConfigError, match="--shots"):
            parse_shots(bad)


def test_kv_recall_answer_is_the_value_of_the_query_key(tasks, eval_data):
    t = tasks["kv_recall"]
    arrow, nl = t.arrow, t.newline
    for e in range(20):
        ep = t.episode(e, 8)
        assert ep.tokens[0] == eval_data.eot_id and ep.answer_len == 1
        body = list(ep.tokens[1:ep.answer_start])
        step = 2 + len(arrow) + len(nl)  # key, arrow, value, newline
        lines = [body[i:i + step] for i in range(0, 8 * step, step)]
        mapping = {ln[0]: ln[1 + len(arrow)] for ln in lines}
        query = body[8 * step]
        if query in mapping:
            assert mapping[query] == ep.tokens[ep.answer_start]
        # nested in k: the 4-shot episode has the same first 4 examples and the same query/answer
        small = t.episode(e, 4)
        assert small.tokens[:1 + 4 * step] == ep.tokens[:1 + 4 * step]
        assert small.tokens[-1 - len(arrow):] == ep.tokens[-1 - len(arrow):]


def test_pattern_and_text_tasks_decode_as_documented(tasks, eval_data):
    tok = eval_data.tokenizer
    p = tasks["pattern"].episode(0, 2)
    text = tok.decode(list(p.tokens[1:]))
    first, second, answer = text.split("\n")
    assert first == second == answer and len(p.tokens) == 1 + 3 * 6 + 2 and p.answer_len == 6
    w = tasks["word_case"].episode(1, 3)
    lines = tok.decode(list(w.tokens[1:])).split("\n")
    assert len(lines) == 4
    for line in lines:
        word, upper = line.split(" -> ")
        assert upper == word.upper() and word.islower()
    assert tok.decode(list(w.tokens[w.answer_start:])) == " " + lines[-1].split(" -> ")[0].upper()
    c = tasks["complete_code"].episode(2, 2)
    whole = tok.decode(list(c.tokens[1:])).split("\n")
    assert len(whole) == 3 and whole[-1] in tasks["complete_code"].lines
    assert tok.decode(list(c.tokens[c.answer_start:])).startswith(" ")
    # the concatenated pieces tokenise like the whole text (no token crosses a piece boundary)
    assert list(c.tokens[1:]) == tok.encode("\n".join(whole)).ids


def test_scores_equal_per_episode_hand_computation(tasks, random_exports, eval_data):
    from smelt_ds.eval.icl import evaluate_task
    from smelt_ds.runs.load import load_run

    model = load_run(random_exports["smelt"]).model
    for name in ("kv_recall", "word_case", "complete_code"):
        t = tasks[name]
        got = evaluate_task(model, t, (0, 1, 2), episodes=6, max_len=64, pad_id=eval_data.prepared.pad_id)
        assert got[0] is not None and (name == "complete_code" or got[2] is not None)
        for k in (0, 1, 2):
            if got[k] is None:  # too long for the 64-token context
                assert max(len(t.episode(e, k).tokens) for e in range(6)) > 65
                continue
            nats = toks = exact = 0
            for e in range(6):
                ep = t.episode(e, k)
                ids = torch.tensor([ep.tokens])
                with torch.no_grad():
                    logits = model(ids[:, :-1]).logits[0]
                a, n = ep.answer_start, ep.answer_len
                pred = logits[a - 1:a - 1 + n]
                target = ids[0, a:a + n]
                nats += float(F.cross_entropy(pred, target, reduction="sum"))
                toks += n
                exact += int(bool((pred.argmax(-1) == target).all()))
            # the evaluation batches padded episodes (other shapes, other kernels): the forward chain's
            # bound for a token mean (tests/numerics.py)
            assert got[k]["loss"] == pytest.approx(nats / toks, rel=prob_tol(model_chain_length(model, 64) + toks))
            assert got[k]["accuracy"] == exact / 6
            assert got[k]["answer_tokens"] == toks and got[k]["episodes"] == 6


def test_k_too_long_for_the_context_is_skipped(tasks, random_exports, eval_data):
    from smelt_ds.eval.icl import evaluate_task
    from smelt_ds.runs.load import load_run

    model = load_run(random_exports["smelt"]).model
    got = evaluate_task(model, tasks["pattern"], (1, 16), episodes=2, max_len=64, pad_id=eval_data.prepared.pad_id)
    assert got[16] is None and 0 <= got[1]["accuracy"] <= 1
