"""Faults in real training ranks (issue: survive the cluster): non-finite steps skipped on every
rank together, a dead rank and a hung rank ending a 2-rank job within their bounds with the cause
named (a stop under each launcher, and a launcher's death: tests/launch/test_launcher_stops.py).
Faults are injected with
:mod:`smelt_ds.testing.faults` (in the ranks) or signals (from outside)."""

from __future__ import annotations

import json
import math
import os
import pickle
import re
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml

from smelt_ds.config.train import StepGuard
from smelt_ds.testing import run_distributed, scaled_timeout
from smelt_ds.testing.faults import check_ledger, fault_env, read_ledger
from smelt_ds.train.metrics import MicroStats
from smelt_ds.train.step_guard import StepGuardState
from smelt_ds.train.stop import REASONS

ROOT = Path(__file__).resolve().parents[2]


# ---------------------------------------------------------------------------------------------
# the step guard's verdicts, by hand
# ---------------------------------------------------------------------------------------------


def test_step_guard_skips_non_finite_steps_and_spikes_against_the_median():
    g = StepGuardState(StepGuard(max_consecutive_skips=2, loss_spike_factor=2.0, loss_spike_window=10))
    assert g.decide(3.0, 0, 2, 1.0).skip is None and g.history[-1] == 1.5  # mean over micro-batches
    assert g.decide(3.0, 1, 2, 1.0).skip == "non-finite loss"               # one of two micro-batches
    assert g.decide(3.0, 0, 2, math.inf).skip == "non-finite gradient norm"
    assert g.exhausted() and g.skipped == 2
    for x in range(2, 11):                          # history 1.5, 2 .. 10: median 5.5
        assert g.decide(float(x), 0, 1, 1.0).skip is None
    assert not g.exhausted() and statistics.median(g.history) == 5.5
    assert g.decide(11.0, 0, 1, 1.0).skip is None   # 11 = 2 x 5.5: not above
    saved = g.state_dict()
    spike = g.decide(13.5, 0, 1, 1.0).skip          # median of the last 10 (2 .. 10, 11) is 6.5: 13.5 > 13
    assert spike is not None and spike.startswith("loss spike (13.5000 > 2 x the median 6.5000")
    again = StepGuardState(g.cfg)
    again.load_state_dict(saved)                    # a resumed run decides the same
    assert again.decide(13.5, 0, 1, 1.0).skip == spike and again.consecutive == g.consecutive == 1


def test_spike_rule_waits_for_ten_kept_steps():
    g = StepGuardState(StepGuard(loss_spike_factor=1.5))
    for _ in range(9):
        g.decide(1.0, 0, 1, 1.0)
    assert g.decide(100.0, 0, 1, 1.0).skip is None  # 9 kept steps: no rule yet (this one is kept)
    assert g.decide(100.0, 0, 1, 1.0).skip is not None


# ---------------------------------------------------------------------------------------------
# a skipped update changes nothing, on every optimizer DeepSpeed builds
# ---------------------------------------------------------------------------------------------

#: (backend, ZeRO stage, precision): torch AdamW, FP16_UnfusedOptimizer, DeepSpeedZeroOptimizer, Stage3
SKIP_CASES = [("reference", 0, "fp32"), ("reference", 0, "bf16"), ("reference", 2, "fp32"), ("autoep", 3, "fp32")]


def _skip_worker(rank: int, world: int) -> list[dict]:
    """Per case: run A trains batches 0, 1 (NaN loss on rank 1: skipped), 2; run B (fresh, same seed)
    trains batches 0 and 2. Returns this rank's reference-layout weights after each of A's steps and
    after B's last, and the engines' skipped-step counts and LR schedule positions."""
    from smelt_ds.runs.reference_weights import gather_reference_shard
    from smelt_ds.train import loop
    from smelt_ds.train.build import build
    from smelt_ds.train.data import Batch
    from smelt_ds.train.metrics import MicroStats
    from tests.train.test_train_step import MICRO, SEQ, _cfg, shard

    out = []
    real_loss = loop.total_loss
    for backend, stage, precision in SKIP_CASES:
        cfg = _cfg(backend, stage, train={"precision": precision, "lr": 0.01, "warmup_steps": 0})
        runs = {}
        for name, batches in (("A", [0, 1, 2]), ("B", [0, 2])):
            built = build(cfg, world)
            fit = SimpleNamespace(built=built, cfg=cfg, accum=1, micro=MicroStats(), step=0, tokens_seen=0,
                                  tokens_per_step=MICRO * SEQ * world, guard=StepGuardState(cfg.train.step_guard),
                                  skipped_since_log=0, writer=SimpleNamespace(write=lambda *a, **k: None),
                                  console=SimpleNamespace(line=lambda *a, **k: None), device=built.engine.device,
                                  stops=None, stop_reason=None)
            weights = []
            for b in batches:
                ids = shard(rank, b, world, 3)  # 3 distinct global batches
                fit.data = SimpleNamespace(train=SimpleNamespace(
                    next_batch=lambda ids=ids: Batch(ids[:, :-1], ids[:, 1:], torch.arange(MICRO))))
                poison = name == "A" and b == 1 and rank == 1
                loop.total_loss = (lambda o, t: real_loss(o, t) * float("nan")) if poison else real_loss
                try:
                    loop._train_step(fit)
                finally:
                    loop.total_loss = real_loss
                weights.append({k: v.clone() for k, v in gather_reference_shard(built.engine, backend).items()
                                if isinstance(v, torch.Tensor)})
            runs[name] = {"weights": weights, "skipped": built.engine.skipped_steps,
                          "epoch": built.scheduler.last_epoch, "verdict": fit.verdict.skip}
        out.append(runs)
    return out


@pytest.mark.slow
@pytest.mark.distributed
def test_a_skipped_update_leaves_weights_moments_and_schedule_as_they_were():
    """2 ranks, a NaN loss on rank 1 only at the second step: both ranks skip it, their weights after
    it equal those before it bit for bit, and the next step lands exactly where a run that never saw
    the bad batch lands (so the Adam moments, the step count and the LR schedule did not move):
    exact equality, the same operations on the same values."""
    res = run_distributed(_skip_worker, world_size=2, timeout=300)
    for i, case in enumerate(SKIP_CASES):
        for rank in range(2):
            a, b = res[rank][i]["A"], res[rank][i]["B"]
            assert a["skipped"] == 1 and b["skipped"] == 0, (case, rank)
            assert a["epoch"] == b["epoch"], (case, rank, a["epoch"], b["epoch"])
            for k, w in a["weights"][0].items():
                assert torch.equal(a["weights"][1][k], w), f"{case} rank {rank}: {k} moved on the skipped step"
                assert not torch.equal(a["weights"][2][k], w) or k.endswith("expert_bias"), (case, k)
                assert torch.equal(a["weights"][2][k], b["weights"][1][k]), (
                    f"{case} rank {rank}: {k} after the skip and one step differs from a run without the bad batch")


# ---------------------------------------------------------------------------------------------
# real 2-rank runs through `smelt-ds train --nproc 2`
# ---------------------------------------------------------------------------------------------


def _recipe(tmp_path: Path, **train) -> Path:
    raw = {"name": "faults",
           "model": {"vocab_size": 512, "hidden_size": 32, "num_layers": 4, "num_heads": 4, "num_kv_heads": 2,
                     "max_seq_len": 64},
           "moe": {"num_experts": 4, "top_k": 2, "expert_ffn_size": 32},
           "data": {"builtin_max_bytes": 150_000, "tokenizer": {"vocab_size": 512},
                    "cache_dir": str(tmp_path / "cache")},
           "train": {"seq_len": 32, "micro_batch_size": 2, "max_steps": 10, "warmup_steps": 2, "log_every": 1,
                     "eval_every": 1000, "save_every": 2, "keep_last": 10, "run_dir": str(tmp_path / "run"), **train},
           "eval": {"eval_batches": 2}}
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def _train(tmp_path: Path, recipe: Path, faults: list[str], *sets: str, timeout: float = 240, resume: str = "none"):
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **fault_env(faults)}
    cmd = [sys.executable, "-m", "smelt_ds.cli", "train", str(recipe), "--nproc", "2", "--resume", resume]
    for s in sets:
        cmd += ["--set", s]
    t0 = time.monotonic()
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=scaled_timeout(timeout))
    return p, time.monotonic() - t0


def _rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _reference(ckpt: Path) -> dict:
    out = {}
    for r in sorted(ckpt.glob("reference/rank*.pt")):
        shard = torch.load(r)
        for part in ("dense", "experts"):
            out.update({f"{r.name}/{part}/{k}": v for k, v in shard[part].items() if isinstance(v, torch.Tensor)})
    assert out, f"no reference weights in {ckpt}"
    return out


@pytest.mark.slow
@pytest.mark.distributed
def test_non_finite_steps_are_skipped_counted_and_too_many_in_a_row_stop_with_the_last_good_state(tmp_path):
    """NaN losses injected on one rank at steps 3, 5 and 6 of a 2-rank run with at most 2 skips in a
    row: step 3 is skipped and counted (metrics row and console line with every rank's sample ids),
    5-6 are two in a row, so the run saves at step 6 and exits 3; the checkpoint at 6 holds exactly
    the weights of step 4's (the last good update)."""
    recipe = _recipe(tmp_path)
    p, _ = _train(tmp_path, recipe, ["nan:rank=1:step=3", "nan:rank=0:step=5", "nan:rank=1:step=6"],
                  "train.step_guard.max_consecutive_skips=2")
    assert p.returncode == 3, p.stderr[-3000:]
    run = tmp_path / "run"
    skips = [r for r in _rows(run) if r.get("skipped")]
    assert [r["step"] for r in skips] == [3, 5, 6]
    assert [r["skipped_total"] for r in skips] == [1, 2, 3] and skips[-1]["consecutive_skips"] == 2
    assert all(len(r["sample_ids"]) == 4 and r["skip_reason"] == "non-finite loss" for r in skips)  # 2 x 2 ranks
    assert f"samples {', '.join(map(str, skips[0]['sample_ids']))}" in p.stderr
    assert "step 3: update skipped on every rank: non-finite loss" in p.stderr
    assert "stopped at step 6 of 10 by 2 consecutive skipped steps" in p.stderr
    kept = [r["step"] for r in _rows(run) if "loss" in r and not r.get("skipped") and r.get("loss_steps")]
    assert kept == [1, 2, 4], kept                                  # skipped steps' losses are left out
    four, six = _reference(run / "checkpoints/step00000004"), _reference(run / "checkpoints/step00000006")
    assert four.keys() == six.keys() and all(torch.equal(four[k], six[k]) for k in four)
    assert not all(torch.equal(four[k], v) for k, v in _reference(run / "checkpoints/step00000002").items())


@pytest.mark.slow
@pytest.mark.distributed
def test_a_rank_that_dies_ends_the_job_promptly_naming_it(tmp_path):
    """Rank 1 dies at step 5 without a word (os._exit(137), as the OOM killer's SIGKILL): the job
    exits non-zero well within 60 s of the death, rank 0 says that its collective failed and that
    rank 1 is gone, and the newest complete checkpoint (step 4) is intact and resumes."""
    from smelt_ds.runs import checkpoint as ckpt

    recipe = _recipe(tmp_path)
    p, seconds = _train(tmp_path, recipe, ["exit:rank=1:step=5"], "train.max_steps=1000")
    assert p.returncode != 0
    assert "rank 0: a collective failed at step 5" in p.stderr, p.stderr[-3000:]
    assert "rank 1 (pid" in p.stderr and ("gone" in p.stderr or "exited" in p.stderr)
    latest = ckpt.latest_complete(tmp_path / "run")
    assert latest is not None and latest.name == "step00000004" and not ckpt.verify(latest)
    assert seconds < scaled_timeout(120)  # start-up included; the death itself is seen within seconds
    # rank 0's last collectives are on disk (gloo marks no entry as failed: the trace shows what ran):
    # among them the step's control all-reduce, so the recorder ran through the training
    entries = pickle.loads((tmp_path / "run" / "hangs" / "fr_trace_rank_0").read_bytes())["entries"]
    assert any(e["profiling_name"] == "gloo:all_reduce" and e["input_sizes"] == [[MicroStats.WIDTH + len(REASONS) - 1]]
               for e in entries), [e["profiling_name"] for e in entries[-5:]]


@pytest.mark.slow
@pytest.mark.distributed
def test_a_hung_rank_ends_the_job_within_the_watchdog_timeout_with_every_stack_on_disk(tmp_path):
    """Rank 1 sleeps 600 s in the step-end collective of step 4: both watchdogs fire at the derived
    timeout (no ``timeout_s``: max(``min_timeout_s``, ``step_time_factor`` x the slowest step so
    far), checked against the formula with the slowest step the watchdog measured), every rank's
    Python stack is written to run/hangs/, and the job exits 124 long before the sleep ends."""
    recipe = _recipe(tmp_path)
    p, seconds = _train(tmp_path, recipe, ["sleep:rank=1:step=4:seconds=600"], "train.max_steps=1000",
                        "train.watchdog.min_timeout_s=0.01", "train.watchdog.step_time_factor=50",
                        "train.watchdog.startup_steps=2", "train.watchdog.startup_timeout_s=120", timeout=300)
    assert p.returncode == 124, p.stderr[-3000:]
    fired = re.findall(r"hang watchdog: no progress for \d+ s in step 4 \(timeout ([0-9.]+) s = max\(min_timeout_s "
                       r"0.01, step_time_factor 50 x the slowest step so far ([0-9.]+) s\)\)", p.stderr)
    assert fired, p.stderr[-2000:]
    # each rank's own slowest step (a step takes far more than 0.01 / 50 s: the factor's term decides, and 50
    # steps' time keeps a slow step under load from firing it early), both printed to 6 decimals: the
    # rounding error is at most 5e-7 + 50 x 5e-7
    for timeout_s, slowest in fired:
        assert abs(float(timeout_s) - max(0.01, 50 * float(slowest))) <= 2.6e-5, (timeout_s, slowest)
    hangs = tmp_path / "run" / "hangs"
    for r in (0, 1):
        text = (hangs / f"rank{r:05d}.txt").read_text()
        assert f"rank {r} (pid" in text and "File " in text, text[:2000]
    assert "sleep" in (hangs / "rank00001.txt").read_text() or "faults.py" in (hangs / "rank00001.txt").read_text()
    assert seconds < scaled_timeout(120)
    # rank 0 waits in step 4's control all-reduce for rank 1: its flight recorder names that collective,
    # unfinished, with the steady collective timeout (train.watchdog.collective_timeout_s, 600 s default)
    # that every group carries after the start-up steps
    trace = pickle.loads((hangs / "fr_trace_rank_0").read_bytes())
    # the step's control all-reduce rank 0 waited in: unretired while rank 1 sleeps (a loaded machine can let
    # rank 1 wake and join it before the dump, which then retires it: the entry is the same collective)
    last = [e for e in trace["entries"] if e["profiling_name"] == "gloo:all_reduce"][-1]
    assert last["timeout_ms"] == 600_000, last
    assert last["input_sizes"] == [[MicroStats.WIDTH + len(REASONS) - 1]], last  # the step's control vector
    assert any(f["name"] == "agree" for f in last["frames"]), last["frames"]



# ---------------------------------------------------------------------------------------------
# the exit status of the rank that survives a peer: two ranks started as a launcher starts them
# ---------------------------------------------------------------------------------------------


def _ranks(recipe: Path, resume: str, faults: list[str], ledger: Path, *sets: str,
           stopped: int | None = None) -> list[subprocess.CompletedProcess]:
    """``python -m smelt_ds.train RECIPE`` as rank 0 and rank 1 (what torchrun and the deepspeed
    launcher start, with RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT), each with its
    own exit status. ``stopped``: the rank a fault stops (SIGSTOP); it is killed once the other ended."""
    from tests.two_ranks import train_env

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cmd = [sys.executable, "-m", "smelt_ds.train", str(recipe), "--resume", resume]
    for x in sets:
        cmd += ["--set", x]
    procs = [subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=train_env(RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                                            MASTER_PORT=str(port), **fault_env(faults, ledger=ledger)))
             for r in range(2)]
    order = [r for r in range(2) if r != stopped] + ([stopped] if stopped is not None else [])
    out: list = [None, None]
    try:
        for r in order:
            if r == stopped:
                procs[r].kill()
            o, e = procs[r].communicate(timeout=scaled_timeout(240))
            out[r] = subprocess.CompletedProcess(procs[r].args, procs[r].returncode, o, e)
    finally:
        for q in procs:
            if q.poll() is None:
                q.kill()
                q.communicate()
    return out


def _tiny(tmp_path: Path, **train) -> Path:
    from tests.two_ranks import recipe_raw

    raw = recipe_raw(tmp_path / "run", tmp_path / "cache")
    raw["train"].update(train)
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


@pytest.mark.slow
@pytest.mark.distributed
def test_a_killed_rank_leaves_its_peer_exiting_75_and_the_ledger_shows_each_step_trained_once(tmp_path):
    """Two ranks of the tiny recipe (ZeRO-1, a checkpoint every 2 steps) through the ranks' own entry
    point. Rank 0's gradient is +inf at step 2 while its loss stays finite: the step guard skips
    step 2 on both ranks (the weights after it are those after step 1, bit for bit) and step 3
    trains. Rank 1 is SIGKILLed at the start of step 6: rank 0, the survivor, exits 75 naming
    rank 1 as gone. ``--resume auto`` continues from step 4 to 7. The ledger (append-only, one line
    per trained step and rank) shows step 5 trained twice, the one repetition the crash allows
    (trained after the newest checkpoint), and every other step once."""
    recipe = _tiny(tmp_path, max_steps=7, keep_last=10)
    ledger = tmp_path / "ledger"
    first = _ranks(recipe, "none", ["inf_grad:rank=0:step=2", "kill:rank=1:step=6"], ledger)
    assert first[1].returncode == -signal.SIGKILL, first[1].stderr[-2000:]
    assert first[0].returncode == 75, first[0].stderr[-3000:]  # the documented status, not PEER_EXIT's value
    pid = json.loads((ledger / "rank1.jsonl").read_text().splitlines()[0])["pid"]
    assert re.search(rf"rank 0: a collective failed at step 6 \(RuntimeError: .*\): a peer is lost: rank 1 \(pid "
                     rf"{pid}\) (gone|exited)", first[0].stderr), first[0].stderr[-3000:]
    # the non-finite gradient norm with a finite loss
    lines = read_ledger(ledger)
    for rank in (0, 1):
        by_step = {x["step"]: x for x in lines[rank]}
        assert by_step[2]["skipped"] == "non-finite gradient norm", by_step[2]
        assert [by_step[s]["skipped"] for s in (1, 3, 4, 5)] == [None] * 4
        assert by_step[2]["weights"] == by_step[1]["weights"], f"rank {rank}: the skipped step changed the weights"
        assert by_step[3]["weights"] != by_step[2]["weights"], f"rank {rank}: step 3 did not train"
    m = re.search(r"step 2: update skipped on every rank: non-finite gradient norm \(mean loss ([^)]+)\)",
                  first[0].stderr)
    assert m and math.isfinite(float(m.group(1))), first[0].stderr[-3000:]
    second = _ranks(recipe, "auto", [], ledger)
    assert [p.returncode for p in second] == [0, 0], second[0].stderr[-3000:]
    assert check_ledger(read_ledger(ledger), 7, checkpoints=[4]) == {"attempts": [(1, 5), (5, 7)], "retrained": [5]}


@pytest.mark.slow
@pytest.mark.distributed
def test_a_stopped_rank_fails_the_collective_at_its_timeout_and_the_peer_exits_75(tmp_path):
    """Rank 1 stops itself (SIGSTOP) at the start of step 4, after the 2 start-up steps. The hang
    watchdog allows 60 s; every group's collective timeout is 3 s after the start-up steps
    (``train.watchdog.collective_timeout_s``), so rank 0's collective fails at 3 s: it exits 75
    naming rank 1 as stopped, and its last collective in the flight recorder carries the 3 s."""
    recipe = _tiny(tmp_path, max_steps=6, keep_last=10)
    ranks = _ranks(recipe, "none", ["stop:rank=1:step=4"], tmp_path / "ledger",
                   "train.watchdog.timeout_s=60", "train.watchdog.startup_steps=2",
                   "train.watchdog.collective_timeout_s=3", stopped=1)
    assert ranks[0].returncode == 75, ranks[0].stderr[-3000:]
    assert re.search(r"rank 0: a collective failed at step 4 \(RuntimeError: .*\): a peer is lost: rank 1 \(pid "
                     r"\d+\) stopped \(SIGSTOP", ranks[0].stderr), ranks[0].stderr[-3000:]
    trace = pickle.loads((tmp_path / "run" / "hangs" / "fr_trace_rank_0").read_bytes())
    assert trace["entries"][-1]["timeout_ms"] == 3000, trace["entries"][-1]


def test_the_flight_recorder_is_on_unless_the_environment_sizes_it():
    """Training turns torch's flight recorder on (2000 entries) before its process groups exist, and
    leaves a size the user or the rendered job set, under either spelling, as it is (0 keeps it off)."""
    from smelt_ds.train.watchdog import FLIGHT_RECORDER_ENTRIES, enable_flight_recorder

    for env, want in (({}, {"TORCH_FR_BUFFER_SIZE": str(FLIGHT_RECORDER_ENTRIES)}),
                      ({"TORCH_FR_BUFFER_SIZE": "0"}, {"TORCH_FR_BUFFER_SIZE": "0"}),
                      ({"TORCH_NCCL_TRACE_BUFFER_SIZE": "64"}, {"TORCH_NCCL_TRACE_BUFFER_SIZE": "64"})):
        enable_flight_recorder(env)
        assert env == want
    assert FLIGHT_RECORDER_ENTRIES == 2000
