"""Profiling inside training (smelt_ds.train.profiler, smelt_ds.model.ranges).

One 2-rank training (4 steps, 2 micro-batches per step) profiles rank 1 only, steps 2-3 after one
warm-up step. The Chrome trace torch.profiler wrote is read back: per profiled step (the range
``optimizer step S``) it must hold the visit plan's ``layer L visit V`` ranges in plan order once
per micro-batch (``cfg.schedule.plan``, the reference), and ``moe route`` / ``moe dispatch`` /
``moe experts`` / ``moe combine`` once per MoE visit, nested in that visit and in stage order. The
first layer is dense (``model.first_k_dense: 1``), so MoE ranges and visit ranges differ in
number. The memory snapshot asked for is skipped on CPU with one message, on rank 1 only. Cost
of the ranges when off: ``bench/profile_overhead.py`` (a bench, not a timed test).
"""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest
import torch

from smelt_ds.config.loading import config_from_dict
from smelt_ds.errors import ConfigError
from smelt_ds.model import SmeltLM
from smelt_ds.model.ranges import set_ranges
from smelt_ds.testing import run_distributed
from smelt_ds.train.profiler import check_profile

STAGES = ["moe route", "moe dispatch", "moe experts", "moe combine"]
ACCUM = 2


def _raw(tmp: Path, cache: Path) -> dict:
    return {"name": "t",
            "model": {"vocab_size": 512, "hidden_size": 32, "num_layers": 4, "num_heads": 4, "num_kv_heads": 2,
                      "max_seq_len": 64, "first_k_dense": 1, "dense_ffn_size": 48},
            "moe": {"num_experts": 4, "top_k": 2, "expert_ffn_size": 32},
            "data": {"builtin_max_bytes": 150_000, "tokenizer": {"vocab_size": 512}, "cache_dir": str(cache)},
            "train": {"seq_len": 32, "micro_batch_size": 2, "gradient_accumulation_steps": ACCUM, "max_steps": 4,
                      "warmup_steps": 2, "log_every": 1, "eval_every": 4, "save_every": 4,
                      "run_dir": str(tmp / "run")},
            "eval": {"eval_batches": 1},
            "profile": {"enabled": True, "start_step": 2, "active_steps": 2, "warmup_steps": 1, "ranks": [1],
                        "memory_snapshot": True}}


def _worker(rank, world, raw):
    from smelt_ds.train.loop import train

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        train(config_from_dict(raw))
    return err.getvalue()


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("profiled")
    raw = _raw(tmp, tmp_path_factory.getbasetemp() / "tiny-data-cache")  # shared with test_trackers.py
    stderr = run_distributed(_worker, 2, args=(raw,), timeout=300)
    return {"cfg": config_from_dict(raw), "run_dir": Path(raw["train"]["run_dir"]), "stderr": stderr}


def _ranges(trace: Path) -> list[dict]:
    events = json.loads(trace.read_text())["traceEvents"]
    return sorted((e for e in events if e.get("ph") == "X" and e.get("cat") == "user_annotation"),
                  key=lambda e: e["ts"])


def _inside(outer: dict, events: list[dict], name) -> list[dict]:
    end = outer["ts"] + outer["dur"]
    return [e for e in events if name(e["name"]) and outer["ts"] <= e["ts"] and e["ts"] + e["dur"] <= end]


@pytest.mark.slow
@pytest.mark.distributed
def test_trace_is_written_for_the_chosen_rank_only(run):
    window = run["run_dir"] / "profile" / "steps2-3"
    files = sorted(p.name for p in window.iterdir())
    assert len(files) == 1 and files[0].startswith("rank1.") and files[0].endswith(".pt.trace.json"), files
    assert sorted(p.name for p in (run["run_dir"] / "profile").iterdir()) == ["steps2-3"]


@pytest.mark.slow
@pytest.mark.distributed
def test_trace_holds_one_range_per_visit_and_moe_stage_per_profiled_step(run):
    cfg = run["cfg"]
    plan = [(v.layer, v.visit) for v in cfg.schedule.plan]
    moe_layers = set(range(cfg.model.first_k_dense, cfg.model.num_layers))
    (trace,) = (run["run_dir"] / "profile" / "steps2-3").glob("rank1.*.pt.trace.json")
    events = _ranges(trace)
    steps = [e for e in events if e["name"].startswith("optimizer step ")]
    assert [e["name"] for e in steps] == ["optimizer step 2", "optimizer step 3"]  # warm-up step 1 not kept
    for step in steps:
        visits = _inside(step, events, lambda n: n.startswith("layer "))
        assert [e["name"] for e in visits] == [f"layer {layer} visit {v}" for layer, v in plan] * ACCUM
        for visit in visits:
            layer = int(visit["name"].split()[1])
            stages = _inside(visit, events, lambda n: n.startswith("moe "))
            assert [e["name"] for e in stages] == (STAGES if layer in moe_layers else [])
        assert len(_inside(step, events, lambda n: n.startswith("moe "))) == 4 * ACCUM * sum(
            layer in moe_layers for layer, _ in plan)


@pytest.mark.slow
@pytest.mark.distributed
def test_memory_snapshot_is_skipped_on_cpu_with_a_message_on_the_profiled_rank(run):
    message = "profile.memory_snapshot: skipped: CUDA memory snapshots need a CUDA device"
    assert run["stderr"][1].count(message) == 1 and message not in run["stderr"][0]
    assert "profile: trace of steps 2-3 in" in run["stderr"][1]
    assert not list((run["run_dir"] / "profile").rglob("*.pickle"))


# ---------------------------------------------------------------------------------------------
# in one process: ranges off, on, and under torch.compile
# ---------------------------------------------------------------------------------------------


def _forward_ranges(model: SmeltLM, on: bool) -> list[str]:
    """Names of the model's ranges recorded by torch.profiler around one training forward."""
    x = torch.randint(0, model.embed_tokens.num_embeddings, (2, 8))
    set_ranges(on)
    try:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            model(x, labels=x)
    finally:
        set_ranges(False)
    return [e.name for e in prof.events() if e.name.startswith(("layer ", "moe "))]


def test_ranges_are_recorded_only_when_on(tiny_cfg):
    cfg = tiny_cfg({"loop": {"position": "middle"}})
    torch.manual_seed(0)
    model = SmeltLM(cfg.model, cfg.moe, cfg.loop).train()
    assert _forward_ranges(model, on=False) == []
    names = _forward_ranges(model, on=True)
    want = [f"layer {v.layer} visit {v.visit}" for v in cfg.schedule.plan]
    assert [n for n in names if n.startswith("layer ")] == want
    assert [n for n in names if n.startswith("moe ")] == STAGES * len(cfg.schedule.plan)


def test_ranges_do_not_change_compiled_layers(tiny_cfg):
    """train.compile: layers, ranges off then on in the same process: turning them on compiles
    nothing new (no guard on the switch), no graph breaks; the visit ranges are around the compiled
    layers, no MoE stage range inside them."""
    from smelt_ds.parallel.compile import compile_counters, compile_layers

    cfg = tiny_cfg({"train": {"compile": "layers", "compile_backend": "eager"}})
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    try:
        torch.manual_seed(0)
        model = SmeltLM(cfg.model, cfg.moe, cfg.loop).train()
        compile_layers(model, cfg)
        assert _forward_ranges(model, on=False) == []
        off = compile_counters()
        names = _forward_ranges(model, on=True)
        on = compile_counters()
    finally:
        torch._dynamo.reset()
    assert off["unique_graphs"] >= 1 and off["graph_breaks"] == 0
    assert on == off
    assert names == [f"layer {v.layer} visit {v.visit}" for v in cfg.schedule.plan]


# ---------------------------------------------------------------------------------------------
# refusals
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("profile,match", [
    ({"start_step": 2, "warmup_steps": 2}, r"`profile.warmup_steps` \(2\) must be < `profile.start_step` \(2\)"),
    ({"ranks": [0, -1]}, r"`profile.ranks` \(\[0, -1\]\) holds negative ranks \[-1\]"),
    ({"ranks": []}, r"`profile.ranks` \(\[\]\) is empty"),
    ({"ranks": [1, 1]}, r"`profile.ranks` \(\[1, 1\]\) names \[1\] more than once"),
])
def test_bad_profile_sections_are_refused_at_load_time(profile, match):
    with pytest.raises(ConfigError, match=match):
        config_from_dict({"profile": {"enabled": True, **profile}})


def test_window_and_ranks_are_checked_against_the_run():
    cfg = config_from_dict({"train": {"max_steps": 10}, "profile": {"enabled": True, "start_step": 9,
                                                                    "active_steps": 2, "ranks": [0, 2]}})
    with pytest.raises(ConfigError, match=r"`profile.start_step` \(9\) with `profile.active_steps` \(2\) records "
                                          r"steps 9-10, past `train.max_steps` \(9\)") as e:
        check_profile(cfg.profile, 9, 4)
    assert "raise train.max_steps" in str(e.value)
    check_profile(cfg.profile, 10, 3)  # the window ends at the last step, ranks 0 and 2 exist
    with pytest.raises(ConfigError, match=r"`profile.ranks` \(\[0, 2\]\) names ranks \[2\] but the run has 2"):
        check_profile(cfg.profile, 10, 2)
    check_profile(cfg.profile.model_copy(update={"enabled": False}), 1, 1)  # nothing to check when off
