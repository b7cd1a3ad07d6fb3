"""Sweep planning, run-directory bookkeeping, cluster rendering and bad sweep files."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
import yaml

from smelt_ds.config.loading import config_from_dict, load_config
from smelt_ds.cost.budget import compute_budget, match_baseline
from smelt_ds.errors import ConfigError
from smelt_ds.launch.placement import load_raw
from smelt_ds.study.sweep import (
    format_duration,
    load_sweep,
    materialize,
    plan_sweep,
    render_k8s,
    render_slurm,
    run_local,
    run_status,
)

ROOT = Path(__file__).resolve().parents[2]
SWEEPS = sorted((ROOT / "recipes" / "sweeps").glob("*.yaml"))


def _sweep(tmp: Path, **over) -> Path:
    base = yaml.safe_load((ROOT / "recipes" / "tiny" / "baseline.yaml").read_text())
    (tmp / "base.yaml").write_text(yaml.safe_dump(base))
    doc = {"name": "t", "output_dir": str(tmp / "out"), "base": "base.yaml",
           "sizes": [{"name": "h64", "overrides": {"model": {"hidden_size": 64}, "moe": {"expert_ffn_size": 48}}},
                     {"name": "h128"}],
           "budgets": [{"name": "d1", "tokens": 20480}, {"name": "c1", "flops": 1.0e11},
                       {"name": "t", "tokens_per_param": 0.01}],
           "architectures": [{"name": "baseline", "position": "none"},
                             {"name": "smelt", "position": "middle", "ep_size": 2}],
           "warmup_fraction": 0.1}
    doc.update(over)
    path = tmp / "sweep.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


@pytest.mark.parametrize("path", SWEEPS, ids=[p.name for p in SWEEPS])
def test_every_shipped_sweep_plans(path):
    plan = plan_sweep(load_sweep(path), path)
    sw = plan.sweep
    assert len(plan.runs) == len(sw.sizes) * len(sw.architectures) * sum(len(sw.seeds_of(b)) for b in sw.budgets)
    per_arch = {a.name: {(r.size, r.budget) for r in plan.runs if r.architecture == a.name} for a in sw.architectures}
    assert all(len({s for s, _ in v}) >= 3 and len({b for _, b in v}) >= 3 for v in per_arch.values())
    for r in plan.runs:
        if r.deviations:
            assert max(abs(v) for v in r.deviations.values()) <= sw.match_tolerance


def test_plan_matches_each_size_and_converts_budgets(tmp_path):
    path = _sweep(tmp_path)
    plan = plan_sweep(load_sweep(path), path)
    assert [r.name for r in plan.runs[:4]] == ["baseline-h64-d1", "smelt-h64-d1", "baseline-h128-d1", "smelt-h128-d1"]
    base128 = yaml.safe_load((tmp_path / "base.yaml").read_text())
    matched = match_baseline(base128, "middle", ep_size=2).raw
    r = next(r for r in plan.runs if r.name == "smelt-h128-d1")
    for section in ("model", "moe", "loop"):
        assert r.raw[section] == matched[section]
    # steps: tokens / (micro_batch 8 x seq_len 128); warmup 10% of steps
    assert r.steps == 20480 // 1024 and r.tokens == 20480 and r.raw["train"]["warmup_steps"] == 2
    # FLOPs budget: tokens = 1e11 / the Baseline's training FLOPs per token, same for both architectures
    fpt = compute_budget(config_from_dict(base128)).train_flops_per_token
    c1 = [x for x in plan.runs if x.budget == "c1" and x.size == "h128"]
    assert {x.steps for x in c1} == {round(1e11 / fpt / 1024)}
    assert r.train_flops_per_token == compute_budget(r.config).train_flops_per_token
    assert r.non_embedding_params == compute_budget(r.config).non_embedding_params
    # tokens per parameter: of the Baseline's non-embedding parameters
    n128 = compute_budget(config_from_dict(base128)).non_embedding_params
    assert {x.steps for x in plan.runs if x.budget == "t" and x.size == "h128"} == {round(0.01 * n128 / 1024)}


def test_materialize_writes_loadable_recipes_and_labels(tmp_path):
    path = _sweep(tmp_path)
    plan = plan_sweep(load_sweep(path), path)
    materialize(plan)
    for r in plan.runs:
        cfg = load_config(r.recipe_path)
        assert cfg == r.config
        assert cfg.train.run_dir == str(r.run_dir) and cfg.train.max_steps == r.steps
        label = json.loads((r.run_dir / "sweep_run.json").read_text())
        assert (label["architecture"], label["size"], label["budget"], label["tokens"]) == \
            (r.architecture, r.size, r.budget, r.steps * 1024)
    assert len(json.loads((plan.output_dir / "sweep_plan.json").read_text())["runs"]) == len(plan.runs)


def test_status_and_conflicting_run_directories(tmp_path):
    from smelt_ds.config.loading import dump_config
    from smelt_ds.runs import checkpoint as ckpt

    path = _sweep(tmp_path)
    plan = plan_sweep(load_sweep(path), path)
    r = plan.runs[0]
    assert run_status(r) == "new"
    (r.run_dir / "checkpoints" / "step00000002").mkdir(parents=True)
    (r.run_dir / "checkpoints" / "step00000002" / ckpt.MARKER).write_text("{}")
    assert run_status(r) == "partial"
    (r.run_dir / "summary.json").write_text(json.dumps({"steps": r.steps}))
    assert run_status(r) == "done"
    (r.run_dir / "summary.json").write_text(json.dumps({"steps": r.steps - 1}))
    assert run_status(r) == "partial"
    dump_config(r.config, r.run_dir / "config.yaml")
    materialize(plan)  # the same recipe: fine
    scaled = plan_sweep(load_sweep(path), path, steps_scale=0.5)
    with pytest.raises(ConfigError, match=r"holds a run of another recipe \(train.max_steps"):
        materialize(scaled)


@pytest.mark.parametrize("over,match", [
    ({"sizes": [{"name": "a", "recipe": "nope.yaml"}]}, r"sizes\[0\].recipe.*does not exist"),
    ({"base": None}, r"sizes\[0\].recipe.*no `base`"),
    ({"budgets": [{"name": "x", "tokens": 10, "flops": 1.0}]}, "exactly one of `tokens`"),
    ({"budgets": [{"name": "x"}]}, "exactly one of `tokens`.*got none"),
    ({"budgets": [{"name": "x", "token": 10}]},
     "unknown key `token` in `budgets\\[0\\]`: did you mean `tokens`\\?"),
    ({"architectures": [{"name": "a"}, {"name": "a", "position": "top"}]}, "duplicate names \\['a'\\]"),
    ({"sizes": [{"name": "a", "overrides": {"loop": {"position": "middle"}}}]}, "must be a Baseline"),
    ({"sizes": [{"name": "a", "overrides": {"model": {"hidden_sise": 3}}}]}, "hidden_sise"),
    ({"warmup_fraction": None}, "warmup_steps.*warmup_fraction"),
    ({"match_tolerance": 1e-6}, "matching architecture 'smelt' to size"),
])
def test_bad_sweep_files_name_the_field_and_fix(tmp_path, over, match):
    path = _sweep(tmp_path, **over)
    with pytest.raises(ConfigError, match=match):
        plan_sweep(load_sweep(path), path)


def test_only_trains_the_runs_it_names_and_a_pattern_matching_none_is_refused(tmp_path, monkeypatch):
    """``--only``: the runs matching a pattern train, in plan order; the others are neither trained
    nor reported; a pattern that matches no run is an error naming it (not a silent no-op)."""
    from smelt_ds.study import sweep as sweep_mod

    plan = plan_sweep(load_sweep(_sweep(tmp_path)), tmp_path / "sweep.yaml")
    trained = []
    monkeypatch.setattr(sweep_mod, "check_data_passes", lambda plan, prepare=False: [])
    monkeypatch.setattr(sweep_mod, "_train_subprocess",
                        lambda r, resume, nproc: (trained.append(r.name), (1, False))[1])
    outcomes = run_local(plan, only=["smelt-h128-*", "*-h64-d1"], log=lambda s: None)
    expected = [r.name for r in plan.runs if r.name.startswith("smelt-h128-") or r.name.endswith("-h64-d1")]
    assert trained == [o.run.name for o in outcomes] == expected
    assert len(expected) == 5  # smelt-h128 at 3 budgets, both architectures of h64 at d1
    with pytest.raises(ConfigError, match=r"--only 'smelt-h96-\*' matches no run .*--dry-run"):
        run_local(plan, only=["smelt-h96-*"], log=lambda s: None)
    assert len(json.loads((plan.output_dir / "sweep_plan.json").read_text())["runs"]) == 12  # the whole sweep


def test_only_selects_the_runs_of_dry_run_and_render(tmp_path, capsys, monkeypatch):
    """``--only`` with ``--dry-run`` lists only the matching runs, with ``--render`` writes only
    their jobs; a pattern that matches nothing fails there too."""
    from smelt_ds.cli import main

    path = _sweep(tmp_path)
    assert main(["sweep", str(path), "--dry-run", "--only", "smelt-h128-*"]) == 0
    out = capsys.readouterr().out
    assert "smelt-h128-d1" in out and "baseline-h128-d1" not in out and "smelt-h64-d1" not in out
    assert main(["sweep", str(path), "--render", "k8s", "--only", "*-h64-d1"]) == 2  # output_dir not on runs/
    assert f"`output_dir` ('{tmp_path / 'out'}') of a sweep rendered for Kubernetes must lie under runs/" in \
        capsys.readouterr().err
    monkeypatch.chdir(tmp_path)
    path = _sweep(tmp_path, output_dir="runs/sweeps/t")
    assert main(["sweep", str(path), "--render", "k8s", "--only", "*-h64-d1"]) == 0
    jobs = sorted(p.name for p in (tmp_path / "runs" / "sweeps" / "t" / "launch" / "k8s").rglob("*.yaml"))
    assert len(jobs) == 2 and all("h64-d1" in j for j in jobs), jobs
    assert main(["sweep", str(path), "--dry-run", "--only", "nothing"]) == 2
    assert "--only 'nothing' matches no run" in capsys.readouterr().err


def test_cli_dry_run_and_steps_scale(tmp_path, capsys):
    from smelt_ds.cli import main

    path = _sweep(tmp_path)
    assert main(["sweep", str(path), "--dry-run", "--steps-scale", "0.5"]) == 0
    out = capsys.readouterr().out
    assert f"12 runs in {tmp_path / 'out'}-x0.5" in out and "| 10 | 10,240 |" in out
    assert not (tmp_path / "out-x0.5").exists()
    assert main(["sweep", str(tmp_path / "missing.yaml")]) == 2
    assert "sweep file" in capsys.readouterr().err


def test_render_slurm_array_and_k8s_jobs(tmp_path, monkeypatch):
    from smelt_ds.study import sweep

    monkeypatch.chdir(tmp_path)  # output_dir under runs/: where a pod's runs volume is
    path = _sweep(tmp_path, launch={"max_parallel": 3, "partition": "gpu"}, output_dir="runs/sweeps/t")
    plan = plan_sweep(load_sweep(path), path)
    arrays = render_slurm(plan)
    assert [a.name for a in arrays] == ["array-1x1.sbatch"]  # CPU recipes: one process each
    text = arrays[0].read_text()
    assert "#SBATCH --array=0-11%3" in text and "#SBATCH --partition=gpu" in text
    # the array script is launchers/slurm/sweep_array.sbatch with every {{FIELD}} filled
    template = (ROOT / "launchers" / "slurm" / "sweep_array.sbatch").read_text()
    assert sweep.ARRAY_TEMPLATE.read_text() == template and "{{" not in text
    filled = re.fullmatch(re.sub(r"\\\{\\\{[A-Z0-9_]+\\\}\\\}", lambda _: "(.*?)", re.escape(template)), text, re.S)
    assert filled is not None and "t" in filled.groups() and "sweep-t" in filled.groups()
    subprocess.run(["bash", "-n", str(arrays[0])], check=True)
    scripts = sorted((plan.output_dir / "launch" / "slurm" / "runs").glob("*.sbatch"))
    assert len(scripts) == 12
    for s, r in zip(scripts, plan.runs, strict=True):
        assert s.name.startswith(f"{r.index:03d}-") and str(r.recipe_path.name) in s.read_text()
        subprocess.run(["bash", "-n", str(s)], check=True)
    (plan.runs[0].run_dir / "summary.json").write_text(json.dumps({"steps": plan.runs[0].steps}))
    jobs = render_k8s(plan)
    assert len(jobs) == 11  # the finished run gets no job
    for j, r in zip(jobs, plan.runs[1:], strict=True):
        recipe_map, doc = yaml.safe_load_all(j.read_text())
        assert doc["kind"] == "PyTorchJob"
        args = doc["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]["args"][0]
        assert args.startswith(f"test -f /workspace/smelt-ds/{r.run_dir}/summary.json && exit 0; ")
        assert "python -m torch.distributed.run " in args
        assert f"name: {r.config.name}\n" in recipe_map["data"]["recipe.yaml"]  # the run's recipe travels with it
    # a field the sweep does not fill is refused, naming the template and the field
    bad = tmp_path / "sweep_array.sbatch"
    bad.write_text(template + "# {{NOT_A_FIELD}}\n")
    monkeypatch.setattr(sweep, "ARRAY_TEMPLATE", bad)
    with pytest.raises(ConfigError, match=r"sweep_array.sbatch has fields \['NOT_A_FIELD'\] that smelt-ds sweep "
                                          r"--render slurm does not fill"):
        render_slurm(plan)


def test_cluster_sweep_smelt_equals_the_shipped_matched_recipes():
    # the sweep derives SMELT with the matcher; the shipped recipes/<size>/smelt.yaml came from the
    # same matcher (smelt-ds recipes derive): both must be the same model
    path = ROOT / "recipes" / "sweeps" / "cluster.yaml"
    plan = plan_sweep(load_sweep(path), path)
    checked = 0
    for r in plan.runs:
        shipped = ROOT / "recipes" / r.size / "smelt.yaml"
        if r.architecture == "smelt" and r.budget == "t20" and shipped.is_file():
            ref = load_raw(shipped)  # its `base:` (the size's baseline.yaml) merged
            assert {k: r.raw[k] for k in ("model", "moe", "loop")} == {k: ref[k] for k in ("model", "moe", "loop")}
            checked += 1
    assert checked == 4


# ---------------------------------------------------------------------------------------------
# time estimates (smelt-ds sweep --dry-run)
# ---------------------------------------------------------------------------------------------


def test_estimate_is_analytic_from_the_budget_then_measured_from_the_run_directories(tmp_path, capsys):
    from smelt_ds.cli import main
    from smelt_ds.study.sweep import CPU_FLOPS_PER_CORE, estimate_runs

    path = _sweep(tmp_path)
    plan = plan_sweep(load_sweep(path), path)
    by_name = {r.name: r for r in plan.runs}

    def hand_analytic(r):  # tokens x training FLOPs/token (3x forward, from the recipe) / 2 cores x 30 GFLOP/s
        tokens = r.steps * 8 * 128  # micro-batch 8 x seq_len 128, one rank
        return tokens * compute_budget(config_from_dict(r.raw)).train_flops_per_token / (2 * CPU_FLOPS_PER_CORE)

    est = estimate_runs(plan, cpu_cores=2, local_peak_tflops=0)
    for r, e in zip(plan.runs, est, strict=True):
        assert e.seconds == pytest.approx(hand_analytic(r), rel=1e-12) and e.remaining_s == e.seconds
        assert e.source == "analytic: 2 CPU core(s) x 30 GFLOP/s" and e.gpus is None

    # a finished run's summary.json measures its own speed and that of its size's other budgets
    done = by_name["baseline-h64-d1"]
    done.run_dir.mkdir(parents=True)
    (done.run_dir / "summary.json").write_text(json.dumps({"steps": done.steps, "tokens_per_s": 2048.0}))
    # an unfinished run's metrics.jsonl: the mean of its logged windows (rows without tokens/s skipped)
    part = by_name["smelt-h128-c1"]
    part.run_dir.mkdir(parents=True)
    rows = [{"step": 1, "tokens_per_s": 1000.0}, {"step": 2, "val_loss": 5.0}, {"step": 3, "tokens_per_s": 3000.0}]
    (part.run_dir / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in rows))
    est = dict(zip(by_name, estimate_runs(plan, cpu_cores=2, local_peak_tflops=0), strict=True))
    e = est["baseline-h64-d1"]
    assert e.source == "measured: summary.json of this run"
    assert e.seconds == pytest.approx(done.steps * 1024 / 2048.0) and e.remaining_s == 0  # finished
    for name in ("baseline-h64-c1", "baseline-h64-t"):
        assert est[name].source == "measured: summary.json of baseline-h64-d1"
        assert est[name].seconds == pytest.approx(by_name[name].steps * 1024 / 2048.0)
    assert est["smelt-h128-c1"].source == "measured: metrics.jsonl of this run"
    assert est["smelt-h128-c1"].seconds == pytest.approx(part.steps * 1024 / 2000.0)
    assert est["smelt-h128-d1"].source == "measured: metrics.jsonl of smelt-h128-c1"
    for name in ("smelt-h64-d1", "baseline-h128-d1"):  # other architecture or size: still analytic
        assert est[name].seconds == pytest.approx(hand_analytic(by_name[name]), rel=1e-12)

    assert main(["sweep", str(path), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "| measured: summary.json of baseline-h64-d1 |" in out and "| measured: metrics.jsonl of this run |" in out
    total = sum(x.seconds for x in est.values())
    assert f"estimated training time: {format_duration(total)} for all 12 runs one after another" in out
    assert "tokens/s measured for 6 runs, analytic for 6" in out and "30 GFLOP/s per CPU core" in out


def test_estimate_of_a_cluster_sweep_uses_the_layout_gpus_peak_and_the_stated_mfu():
    from smelt_ds.study.sweep import ASSUMED_MFU, estimate_runs

    path = ROOT / "recipes" / "sweeps" / "cluster.yaml"
    plan = plan_sweep(load_sweep(path), path)
    est = estimate_runs(plan, local_peak_tflops=0)
    r, e = plan.runs[0], est[0]  # baseline-s-t5: layout h100 = 1 node x 8 H100 SXM5 (989.4 dense bf16 TFLOP/s)
    fpt = compute_budget(load_config(ROOT / "recipes" / "s" / "baseline.yaml")).train_flops_per_token
    assert r.name == "baseline-s-t5" and e.gpus == 8
    assert e.seconds == pytest.approx(r.tokens * fpt / (8 * 989.4e12 * ASSUMED_MFU), rel=1e-12)
    assert e.source == f"analytic: layout h100, 8 x H100-SXM5-80GB at 989.4 TFLOP/s x MFU {ASSUMED_MFU:g}"
