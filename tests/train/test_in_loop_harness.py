"""In-loop lm-evaluation-harness evaluation (``eval.harness_tasks`` every ``eval.harness_interval``
steps, :mod:`smelt_ds.train.in_loop_harness`), on real processes.

The reference for every number is :func:`smelt_ds.eval.harness.evaluate_model` on the export
(``smelt-ds export``) of the checkpoint of the same step, tokenised with the export's
``tokenizer.json``: the in-loop metrics must equal it. They are expected bit-equal, not only
close: the export's ``model.pt`` is the same merged reference-layout fp32 state dict that the
in-loop evaluation gathers from the live engine at that step (``merge_shards``), the model is the
same reference-backend SmeltLM in fp32 on CPU with one thread, and lm-eval is seeded identically.

The task is a tiny loglikelihood task (6 documents, local JSONL) written in ``tmp_path``; its
``perplexity`` (a float of the summed log-likelihoods) tells models apart, ``acc`` (greedy
continuation) is checked equal too.
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from smelt_ds.config.loading import config_from_dict
from smelt_ds.errors import ConfigError
from smelt_ds.testing import run_distributed
from tests.eval.eval_test_utils import tiny_raw

TASK = "smelt_inloop_tiny"
DOCS = [("The cat sat on the", " mat"), ("def add(a, b):\n    return a", " + b"),
        ("Once upon a time there was a", " king"), ("for i in range(10):\n    print(", "i)"),
        ("The sun rises in the", " east"), ("import numpy as", " np")]
PPL = f"harness/{TASK}/perplexity"
ACC = f"harness/{TASK}/acc"


@pytest.fixture(autouse=True)
def _isolated(monkeypatch, tmp_path):
    """One thread; datasets' cache in tmp_path and offline (here and in spawned ranks)."""
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf-datasets"))
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import datasets.config

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", Path(tmp_path / "hf-datasets"))
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("harness-eval-cache")


def write_task(root: Path) -> Path:
    """A loglikelihood task YAML + its JSONL (6 documents) in ``root/tasks``; returns the directory."""
    d = root / "tasks"
    d.mkdir(parents=True)
    (d / "docs.jsonl").write_text("".join(json.dumps({"context": c, "target": t}) + "\n" for c, t in DOCS))
    spec = {"task": TASK, "dataset_path": "json", "dataset_kwargs": {"data_files": {"test": str(d / "docs.jsonl")}},
            "test_split": "test", "output_type": "loglikelihood", "doc_to_text": "{{context}}",
            "doc_to_target": "{{target}}",
            "metric_list": [{"metric": "perplexity", "aggregation": "perplexity", "higher_is_better": False},
                            {"metric": "acc", "aggregation": "mean", "higher_is_better": True}],
            "metadata": {"version": 1.0}}
    (d / f"{TASK}.yaml").write_text(yaml.safe_dump(spec, sort_keys=False))
    return d


def _raw(tmp: Path, cache: Path, tasks: Path | None, max_steps: int, **sections) -> dict:
    raw = tiny_raw(cache, tmp / "run", **sections)
    raw["train"].update(max_steps=max_steps, warmup_steps=1, log_every=1, eval_every=max_steps, save_every=2,
                        keep_last=max_steps, micro_batch_size=2)
    raw["eval"] = {"eval_batches": 1}
    if tasks is not None:
        raw["eval"].update(harness_tasks=[TASK], harness_interval=2, harness_include_path=str(tasks),
                           harness_batch_size=4)
    return raw


def _train_export(rank: int, world: int, raw: dict, steps: list[int], out: str, plain: dict | None = None) -> dict:
    """Train ``raw``, export the checkpoints of ``steps`` to ``out/step<N>`` (rank 0); then train
    ``plain`` (the same run without in-loop evaluation) when given. Returns both runs' losses."""
    import torch.distributed as dist

    from smelt_ds.runs.export import export_checkpoint
    from smelt_ds.train.loop import train

    result = train(config_from_dict(raw))
    dist.barrier()
    if rank == 0:
        for s in steps:
            export_checkpoint(result.run_dir / "checkpoints" / f"step{s:08d}", Path(out) / f"step{s}")
    dist.barrier()
    plain_losses = train(config_from_dict(plain)).losses if plain is not None else None
    return {"losses": result.losses, "plain_losses": plain_losses}


def _export_metrics(export: Path, tasks: Path) -> dict[str, float]:
    """The reference: ``evaluate_model`` on the export, with the export's own tokenizer."""
    from tokenizers import Tokenizer

    from smelt_ds.eval.harness import evaluate_model
    from smelt_ds.runs.export import load_exported
    from smelt_ds.train.in_loop_harness import harness_metrics

    cfg = config_from_dict(yaml.safe_load((export / "config.yaml").read_text()))
    tok = Tokenizer.from_file(str(export / "tokenizer.json"))
    results = evaluate_model(load_exported(export), tok, tok.token_to_id(cfg.data.tokenizer.eot_token), [TASK],
                             include_path=str(tasks), num_fewshot=0, limit=None, batch_size=4)
    return harness_metrics(results)


def _rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def _harness_rows(run_dir: Path) -> list[dict]:
    return [r for r in _rows(run_dir) if any(k.startswith("harness/") for k in r)]


def _logged(row: dict) -> dict[str, float]:
    return {k: v for k, v in row.items() if k.startswith("harness/") and k != "harness/seconds"}


def _check_against_exports(run_dir: Path, out: Path, tasks: Path, steps: list[int]) -> list[dict[str, float]]:
    rows = _harness_rows(run_dir)
    assert [r["step"] for r in rows] == steps  # at the interval steps only
    tokens = {r["step"]: r["tokens"] for r in _rows(run_dir) if "loss" in r}
    logged = []
    for row, s in zip(rows, steps, strict=True):
        assert row["tokens"] == tokens[s]
        assert row["harness/seconds"] > 0
        got, want = _logged(row), _export_metrics(out / f"step{s}", tasks)
        assert PPL in want and ACC in want
        assert got == want, (s, got, want)
        logged.append(got)
    return logged


@pytest.mark.distributed
def test_one_process_reference_zero0_equals_export(tmp_path, cache):
    """(1) One process, reference backend, ZeRO-0: metrics at steps 2 and 4 of 5 only, equal to
    ``evaluate_model`` on the exports of steps 2 and 4; TensorBoard holds the same scalars."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tasks = write_task(tmp_path)
    raw = _raw(tmp_path, cache, tasks, max_steps=5)
    run_distributed(_train_export, 1, args=(raw, [2, 4], str(tmp_path / "exports")), timeout=600)
    run_dir = tmp_path / "run"
    logged = _check_against_exports(run_dir, tmp_path / "exports", tasks, [2, 4])
    assert logged[0][PPL] != logged[1][PPL]  # the weights of each step, not one model twice
    acc = EventAccumulator(str(run_dir / "tb"))
    acc.Reload()
    for tag in (PPL, ACC, "harness/seconds"):
        events = acc.Scalars(tag)
        assert [e.step for e in events] == [2, 4]
        want = [r[tag] for r in _harness_rows(run_dir)]
        assert [e.value for e in events] == pytest.approx(want, rel=1e-6)  # TensorBoard stores float32


def _untouched_worker(rank: int, world: int, raw: dict) -> dict:
    """The engine's model, mode, gradients and the RNG states around one in-loop evaluation."""
    from smelt_ds.model import SmeltLM
    from smelt_ds.train.build import build
    from smelt_ds.train.data import build_data
    from smelt_ds.train.in_loop_harness import run_harness_eval

    cfg = config_from_dict(raw)
    data = build_data(cfg, rank, world)
    built = build(cfg, world)
    engine = built.engine
    engine.train()
    before = {k: v.detach().clone() for k, v in engine.module.state_dict().items()}
    random.seed(5)
    np.random.seed(6)
    torch.manual_seed(7)
    rng = (random.getstate(), np.random.get_state()[1].copy(), torch.get_rng_state().clone())
    metrics = run_harness_eval(engine, cfg, data.prepared, 3, 96)
    after_rng = (random.getstate(), np.random.get_state()[1].copy(), torch.get_rng_state().clone())
    SmeltLM(cfg.model, cfg.moe, cfg.loop)  # what the evaluation builds: it draws from torch's RNG
    return {"metrics": metrics, "training": engine.module.training,
            "changed": [k for k, v in engine.module.state_dict().items() if not torch.equal(v, before[k])],
            "grads": [n for n, p in engine.module.named_parameters() if p.grad is not None],
            "requires_grad": all(p.requires_grad for p in engine.module.parameters()),
            "rng_same": (rng[0] == after_rng[0] and np.array_equal(rng[1], after_rng[1])
                         and torch.equal(rng[2], after_rng[2])),
            "rng_moved_by_model": not torch.equal(after_rng[2], torch.get_rng_state())}


@pytest.mark.distributed
def test_evaluation_leaves_the_training_model_and_rng_alone(tmp_path, cache):
    """The engine stays in train mode with the same weights, no gradients, the same RNG states
    (python, numpy, torch), although building the evaluated copy draws from torch's RNG and
    lm-eval reseeds every generator."""
    tasks = write_task(tmp_path)
    out = run_distributed(_untouched_worker, 1, args=(_raw(tmp_path, cache, tasks, max_steps=3),), timeout=400)[0]
    assert out["training"] is True
    assert out["changed"] == [] and out["grads"] == [] and out["requires_grad"]
    assert out["rng_moved_by_model"] and out["rng_same"]
    assert math.isfinite(out["metrics"][PPL]) and out["metrics"][PPL] > 1
    assert out["metrics"]["harness/seconds"] > 0


def _two_rank_case(tmp_path: Path, cache: Path, runtime: dict, zero: int) -> tuple[dict, list[dict]]:
    tasks = write_task(tmp_path)
    sections = {"moe_runtime": runtime, "deepspeed": {"zero_stage": zero}, "model": {"dropout": 0.1}}
    raw = _raw(tmp_path, cache, tasks, max_steps=3, **sections)
    plain = _raw(tmp_path / "plain", cache, None, max_steps=3, **sections)
    ranks = run_distributed(_train_export, 2, args=(raw, [2], str(tmp_path / "exports"), plain), timeout=900)
    _check_against_exports(tmp_path / "run", tmp_path / "exports", tasks, [2])
    assert not (tmp_path / "plain" / "run" / "metrics.jsonl").read_text().count("harness/")
    return ranks[0], ranks


@pytest.mark.distributed
def test_two_ranks_autoep_ep2_zero3_equals_export_and_keeps_losses(tmp_path, cache):
    """(2) 2 ranks, AutoEP with ``ep_size`` 2 at ZeRO-3 (each rank holds half the experts and a
    partition of every tensor): the metrics of step 2 equal ``evaluate_model`` on the export of
    step 2, and every training loss (dropout 0.1, so the steps after the evaluation draw from the
    RNG) equals that of the same run without in-loop evaluation."""
    r0, ranks = _two_rank_case(tmp_path, cache, {"backend": "autoep", "ep_size": 2}, zero=3)
    for r in ranks:
        assert len(r["losses"]) == 3
        assert r["losses"] == r["plain_losses"]


@pytest.mark.distributed
def test_two_ranks_deepspeed_moe_ep2_equals_export(tmp_path, cache):
    """(3) 2 ranks, DeepSpeed-MoE with ``ep_size`` 2 (ZeRO-2, dropless): step 2's metrics equal
    ``evaluate_model`` on the export of step 2; losses equal the run without in-loop evaluation."""
    r0, ranks = _two_rank_case(tmp_path, cache, {"backend": "deepspeed", "ep_size": 2, "drop_tokens": False}, zero=2)
    assert r0["losses"] == r0["plain_losses"]


# ----------------------------------------------------------------------------------------------
# (4) configuration errors, at load time
# ----------------------------------------------------------------------------------------------


def _cfg(tmp_path: Path, **ev):
    raw = tiny_raw(tmp_path / "cache", tmp_path / "run")
    raw["eval"] = {"eval_batches": 1, **ev}
    return config_from_dict(raw)


def test_interval_without_tasks_is_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"`eval.harness_tasks` \(\[\]\) is empty but `eval.harness_interval` "
                                          r"\(5\) is set: name the tasks"):
        _cfg(tmp_path, harness_interval=5)


def test_tasks_without_interval_are_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"`eval.harness_interval` \(None\) is required with `eval.harness_tasks` "
                                          r"\(\['lambada_local'\]\): set eval.harness_interval"):
        _cfg(tmp_path, harness_tasks=["lambada_local"])


def test_missing_include_path_is_refused(tmp_path):
    missing = tmp_path / "no-such-tasks"
    with pytest.raises(ConfigError, match=rf"`eval.harness_include_path` \('{missing}'\) does not exist: .*"
                                          r"smelt-ds eval build-tasks"):
        _cfg(tmp_path, harness_tasks=[TASK], harness_interval=2, harness_include_path=str(missing))
    (tmp_path / "a-file").write_text("")
    with pytest.raises(ConfigError, match=r"`eval.harness_include_path` \('.*a-file'\) is a file"):
        _cfg(tmp_path, harness_tasks=[TASK], harness_interval=2, harness_include_path=str(tmp_path / "a-file"))


def test_bad_interval_and_repeated_task_are_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"eval.harness_interval.*greater than 0"):
        _cfg(tmp_path, harness_tasks=[TASK], harness_interval=0)
    with pytest.raises(ConfigError, match=r"`eval.harness_tasks` .* names \['a'\] more than once"):
        _cfg(tmp_path, harness_tasks=["a", "a"], harness_interval=2)


def test_unknown_task_name_is_named_before_training(tmp_path):
    """A typo fails when training starts (rank 0 reads lm-eval's task index), naming the field."""
    from smelt_ds.train.in_loop_harness import check_harness_tasks

    tasks = write_task(tmp_path)
    check_harness_tasks(_cfg(tmp_path, harness_tasks=[TASK], harness_interval=2, harness_include_path=str(tasks)))
    cfg = _cfg(tmp_path, harness_tasks=[TASK + "x"], harness_interval=2, harness_include_path=str(tasks))
    with pytest.raises(ConfigError, match=rf"`eval.harness_tasks` \(\['{TASK}x'\]\): unknown harness task\(s\) "
                                          rf"\['{TASK}x'\]"):
        check_harness_tasks(cfg)


def test_harness_metrics_names_and_drops_non_numbers():
    from smelt_ds.train.in_loop_harness import harness_due, harness_metrics

    results = {"results": {"t": {"alias": "t", "acc,none": 0.5, "acc_stderr,none": "N/A", "ppl,none": float("inf"),
                                 "exact_match,strict-match": 0.25, "flag,none": True}}}
    assert harness_metrics(results) == {"harness/t/acc": 0.5, "harness/t/exact_match,strict-match": 0.25}
    cfg = config_from_dict({"eval": {"harness_tasks": ["t"], "harness_interval": 3}})
    assert [s for s in range(1, 10) if harness_due(cfg, s)] == [3, 6, 9]
    assert not any(harness_due(config_from_dict({}), s) for s in range(1, 10))


def test_merge_shards_in_memory_equals_the_state_dict_and_names_duplicates(tmp_path):
    """The in-memory merge the in-loop evaluation uses: two ranks' shards (rank 0 the dense
    tensors and experts 0-1, rank 1 experts 2-3) give back the model's state dict exactly; an
    expert claimed twice or missing is named."""
    from smelt_ds.model import SmeltLM
    from smelt_ds.runs.reference_weights import FORMAT, merge_shards

    cfg = _cfg(tmp_path)
    state = SmeltLM(cfg.model, cfg.moe, cfg.loop).state_dict()
    expert = [k for k in state if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]
    assert expert
    dense = {k: v for k, v in state.items() if k not in expert}

    def shard(rank, d, experts):
        return {"format": FORMAT, "rank": rank, "dense": d,
                "experts": {k: {e: state[k][e] for e in experts} for k in expert}}

    merged = merge_shards([shard(0, dense, [0, 1]), shard(1, {}, [2, 3])], cfg, "the live engine")
    assert merged.keys() == state.keys() and all(torch.equal(merged[k], state[k]) for k in state)
    with pytest.raises(ConfigError, match=r"the live engine rank 1: expert 1 of .* was already written"):
        merge_shards([shard(0, dense, [0, 1]), shard(1, {}, [1, 2, 3])], cfg, "the live engine")
    with pytest.raises(ConfigError, match=r"the live engine: .* has experts \[0, 1, 2\] of 0..3 \(missing \[3\]\)"):
        merge_shards([shard(0, dense, [0, 1]), shard(1, {}, [2])], cfg, "the live engine")
