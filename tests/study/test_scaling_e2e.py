"""A very small real sweep end to end: 2 sizes x 2 token budgets x {Baseline, SMELT} trained on
the built-in corpus (tmp cache), one run interrupted and resumed, then `smelt-ds scaling fit`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from smelt_ds.config.loading import load_config
from smelt_ds.cost.budget import compute_budget
from smelt_ds.testing import run_distributed

BASE = {"name": "e2e",
        "model": {"vocab_size": 512, "hidden_size": 32, "num_layers": 3, "num_heads": 4, "num_kv_heads": 4,
                  "max_seq_len": 64},
        "moe": {"num_experts": 4, "top_k": 2, "expert_ffn_size": 24},
        "loop": {"position": "none"},
        "data": {"builtin_max_bytes": 150_000, "tokenizer": {"vocab_size": 512}},
        "train": {"seq_len": 32, "micro_batch_size": 2, "max_steps": 10, "warmup_steps": 1, "log_every": 1,
                  "eval_every": 1000, "save_every": 1000},
        "eval": {"eval_batches": 2}}


def _sweep_worker(rank, world, sweep_path, sets, limit):
    from smelt_ds.study.sweep import load_sweep, plan_sweep, run_local

    plan = plan_sweep(load_sweep(sweep_path), sweep_path, overrides=sets)
    return [(o.run.name, o.status) for o in run_local(plan, limit=limit, executor="inprocess", log=lambda s: None)]


@pytest.mark.slow
def test_tiny_real_sweep_then_fit(tmp_path):
    from smelt_ds.cli import main

    base = {**BASE, "data": {**BASE["data"], "cache_dir": str(tmp_path / "cache")}}
    (tmp_path / "base.yaml").write_text(yaml.safe_dump(base))
    out = tmp_path / "sweep"
    sweep = {"name": "e2e", "output_dir": str(out), "base": "base.yaml",
             "sizes": [{"name": "h32"}, {"name": "h48", "overrides": {"model": {"hidden_size": 48},
                                                                      "moe": {"expert_ffn_size": 36}}}],
             "budgets": [{"name": "d256", "tokens": 256}, {"name": "d512", "tokens": 512}],
             "architectures": [{"name": "baseline", "position": "none"}, {"name": "smelt", "position": "middle"}],
             "match_tolerance": 0.05}
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump(sweep))

    # 1) the first run stops after 2 of its 4 steps (as a time-boxed job would); the sweep stops there
    first = run_distributed(_sweep_worker, 1, args=(path, ["train.exit_after_steps=2"], 1), timeout=300)[0]
    assert first == [("baseline-h32-d256", "interrupted")]
    r0 = out / "baseline" / "h32-d256"
    assert not (r0 / "summary.json").exists() and (r0 / "checkpoints" / "step00000002" / "COMPLETE").is_file()
    # 2) the whole sweep: the interrupted run resumes from its checkpoint, the others train
    second = run_distributed(_sweep_worker, 1, args=(path, [], None), timeout=600)[0]
    assert [s for _, s in second] == ["done"] * 8
    steps = [json.loads(line)["step"] for line in (r0 / "metrics.jsonl").read_text().splitlines()
             if '"loss"' in line]
    assert steps == [1, 2, 3, 4]  # steps 1-2 before the stop, 3-4 after the resume: none repeated
    # 3) nothing left to do: every run is skipped
    assert [s for _, s in run_distributed(_sweep_worker, 1, args=(path, [], None), timeout=300)[0]] == ["skipped"] * 8

    # collected points equal a direct computation from each run directory
    from smelt_ds.study.scaling import collect_runs

    points, excluded = collect_runs([out])
    assert excluded == [] and len(points) == 8
    for p in points:
        cfg = load_config(Path(p.run_dir) / "config.yaml")
        b = compute_budget(cfg)
        summary = json.loads((Path(p.run_dir) / "summary.json").read_text())
        assert p.architecture == ("baseline" if cfg.loop.position == "none" else "smelt")
        assert p.N == b.non_embedding_params and p.D == cfg.train.max_steps * 64 == summary["tokens"]
        assert p.C == pytest.approx(b.train_flops_per_token * p.D, rel=1e-12)
        assert p.loss == summary["validation_loss"]["all"]
    assert {p.D for p in points} == {256, 512}

    report = tmp_path / "report"
    assert main(["scaling", "fit", str(out), "-o", str(report), "--bootstrap", "3"]) == 0
    res = json.loads((report / "scaling.json").read_text())
    assert res["baseline"] == "baseline" and set(res["architectures"]) == {"baseline", "smelt"}
    assert len(res["architectures"]["smelt"]["savings"]["saving"]) == len(res["C_grid"])
    md = (report / "report.md").read_text()
    assert "## Training FLOPs saved vs baseline" in md and "4 runs for 5 parameters" in md
    for png in ("scaling_loss_vs_flops.png", "scaling_savings.png", "scaling_paired.png"):
        assert (report / png).stat().st_size > 10_000
