"""``train.reference_weights``: which checkpoints carry the reference-layout shards, on real
2-rank runs of every MoE backend (one process launch for all of them).

Each run records, on rank 0, the state of its checkpoints before and after every rename and
every directory removal under ``checkpoints/`` (the moments a crash could freeze): at each one
every complete checkpoint must verify against its ``COMPLETE`` marker (none damaged by our own
pruning) and the newest complete one must export. The cells:

- ``autoep`` EP 2, ZeRO-3 (the large recipes' layout), ``minimal``: a SIGTERM during step 3
  stops the run with a save; a resume with ``newest`` (a field a resume may change) finishes
  it. Only the final checkpoint keeps the shards; the older ones still verify and resume
  (DeepSpeed loads one), and their export names the checkpoint to export instead.
- ``deepspeed`` EP 2, ZeRO-2, ``minimal``: the same guarantees on the other expert-parallel backend.
- ``reference`` ZeRO-2 on 2 data-parallel ranks, ``minimal``: no shards before the last save; a
  crash right after the save of step 2 leaves a newest checkpoint without shards that exports
  (DeepSpeed's ``zero_to_fp32``) and resumes (a file an abandoned attempt at step 3 left in
  ``reference/`` does not enter that save's marker); a stop (``train.exit_after_steps``, the
  path of a SIGTERM) and the final save carry them, and ``zero_to_fp32``
  of that checkpoint equals its shards bit for bit (both are the fp32 master weights, copied).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
from pathlib import Path

import pytest
import torch

from smelt_ds.config.loading import config_from_dict
from smelt_ds.testing import run_distributed

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


def _raw(run_dir: Path, cache: Path, backend: str, zero: int, **train) -> dict:
    runtime: dict = {} if backend == "reference" else {"backend": backend, "ep_size": 2}
    return {"name": f"rw-{backend}",
            "model": {"vocab_size": 512, "hidden_size": 32, "num_layers": 4, "num_heads": 4, "num_kv_heads": 2,
                      "max_seq_len": 64},
            "moe": {"num_experts": 4, "top_k": 2, "expert_ffn_size": 32}, "moe_runtime": runtime,
            "loop": {"position": "middle"},
            "data": {"builtin_max_bytes": 150_000, "tokenizer": {"vocab_size": 512}, "cache_dir": str(cache)},
            "deepspeed": {"zero_stage": zero},
            "train": {"seq_len": 32, "micro_batch_size": 2, "warmup_steps": 1, "log_every": 1, "eval_every": 100,
                      "run_dir": str(run_dir), "reference_weights": "minimal", **train},
            "eval": {"eval_batches": 1}}


class _Watch:
    """On rank 0: before and after each ``os.replace`` / ``shutil.rmtree`` under ``checkpoints/``,
    every complete checkpoint verifies and the newest exports. Problems are collected, not
    raised (an exception inside a collective save would hang the other rank)."""

    def __init__(self, run_dir: Path, cfg):
        self.root, self.cfg = run_dir / "checkpoints", cfg
        self.checks, self.problems, self._busy = 0, [], False
        self._replace, self._rmtree = os.replace, shutil.rmtree

    def check(self, when: str) -> None:
        from smelt_ds.runs import checkpoint as ckpt
        from smelt_ds.runs.export import consolidated_state_dict

        if self._busy:
            return
        self._busy = True
        try:
            self.checks += 1
            complete = sorted(p for p in self.root.glob("step*") if (p / ckpt.MARKER).is_file())
            for p in complete:
                self.problems += [f"{when}: {q}" for q in ckpt.verify(p)]
            if complete:
                consolidated_state_dict(complete[-1], self.cfg)
        except Exception as e:  # noqa: BLE001 - recorded for the test's assertion
            self.problems.append(f"{when}: {type(e).__name__}: {e}")
        finally:
            self._busy = False

    def _inside(self, path) -> bool:
        return str(Path(path).resolve()).startswith(str(self.root.resolve()))

    def __enter__(self):
        def replace(a, b):
            watched = self._inside(b)
            if watched:
                self.check(f"before replace {b}")
            self._replace(a, b)
            if watched:
                self.check(f"after replace {b}")

        def rmtree(path, *a, **k):
            watched = self._inside(path)
            if watched:
                self.check(f"before rmtree {path}")
            self._rmtree(path, *a, **k)
            if watched:
                self.check(f"after rmtree {path}")

        os.replace, shutil.rmtree = replace, rmtree
        return self

    def __exit__(self, *exc):
        os.replace, shutil.rmtree = self._replace, self._rmtree


class _Crash(Exception):
    """A simulated crash right after a save: every rank stops there."""


def _train_with(rank: int, raw: dict, resume: str, after_save=None):
    """Train ``raw``; ``after_save(step)`` runs on every rank after each checkpoint save; rank 0
    watches the checkpoints (:class:`_Watch`). Returns ``(result or None after a _Crash, watch)``."""
    from smelt_ds.runs import checkpoint as ckpt
    from smelt_ds.train.loop import train

    cfg = config_from_dict(raw)
    watch = _Watch(Path(raw["train"]["run_dir"]), cfg)
    real_save = ckpt.save

    def save(engine, run_dir, step, *a, **k):
        out = real_save(engine, run_dir, step, *a, **k)
        if after_save is not None:
            after_save(step)
        return out

    ckpt.save = save
    try:
        if rank == 0:
            with watch:
                return train(cfg, resume=resume), watch
        return train(cfg, resume=resume), watch
    except _Crash:
        return None, watch
    finally:
        ckpt.save = real_save


def _export_error(ckpt_dir: Path, cfg) -> str:
    from smelt_ds.errors import ConfigError
    from smelt_ds.runs.export import consolidated_state_dict

    try:
        consolidated_state_dict(ckpt_dir, cfg)
    except ConfigError as e:
        return str(e)
    return "exported"


def _summary(run_dir: Path, cfg) -> dict:
    """Per complete checkpoint: the shards its marker lists, verify's problems, export's outcome."""
    from smelt_ds.runs import checkpoint as ckpt

    out = {}
    for p in sorted((run_dir / "checkpoints").glob("step*")):
        meta = json.loads((p / ckpt.MARKER).read_text())
        out[p.name] = {"shards": ckpt.reference_files(p), "on_disk": sorted(x.name for x in (p / "reference").glob("*"))
                       if (p / "reference").is_dir() else [], "verify": ckpt.verify(p),
                       "export": _export_error(p, cfg), "removed_by": meta.get("reference_removed_by")}
    return out


def _expert_parallel_cell(rank: int, tmp: Path, cache: Path, backend: str, zero: int) -> dict:
    """``minimal``: saves at 2, a SIGTERM-stop at 3, then a resume with ``newest`` to 6 (saves 4, 6)."""
    import torch.distributed as dist

    from smelt_ds.runs import checkpoint as ckpt
    from smelt_ds.train.build import build

    run_dir = tmp / backend
    raw = _raw(run_dir, cache, backend, zero, max_steps=6, save_every=2, keep_last=3)

    def sigterm_after_step_2(step):
        if step == 2 and rank == 0:
            os.kill(os.getpid(), signal.SIGTERM)  # the launcher's forwarded SIGTERM, during step 3

    first, w1 = _train_with(rank, raw, "none", sigterm_after_step_2)
    resumed = {**raw, "train": {**raw["train"], "reference_weights": "newest"}}
    second, w2 = _train_with(rank, resumed, "auto")
    cfg = config_from_dict(raw)
    dist.barrier()
    out = {"first": (first.step, first.stop_reason), "second_step": second.step}
    if rank == 0:
        out.update(summary=_summary(run_dir, cfg), checks=w1.checks + w2.checks, problems=w1.problems + w2.problems)
    dist.barrier()
    live = build(cfg, dist.get_world_size())  # a checkpoint without shards resumes: DeepSpeed loads it
    out["loaded_step"] = ckpt.load(live.engine, run_dir, str(run_dir / "checkpoints" / "step00000004"),
                                   live.layout)["step"]
    return out


def _reference_cell(rank: int, tmp: Path, cache: Path) -> dict:
    """``minimal`` on the reference backend at ZeRO-2: saves at 1, 2, a crash; a resume saving at 3
    and stopping at 4 (``train.exit_after_steps``, the stop path a SIGTERM takes); a resume to 5."""
    import torch.distributed as dist

    from smelt_ds.runs import checkpoint as ckpt
    from smelt_ds.runs.export import consolidated_state_dict

    run_dir = tmp / "reference"
    # minimal's own rule: without the layout-free state (which writes the shards at every save)
    raw = _raw(run_dir, cache, "reference", 2, max_steps=5, save_every=1, keep_last=3, layout_free_state=False)
    cfg = config_from_dict(raw)

    def crash_after_step_2(step):
        if step == 2:
            raise _Crash

    crashed, w1 = _train_with(rank, raw, "none", crash_after_step_2)
    dist.barrier()
    out: dict = {"crashed": crashed is None}
    if rank == 0:
        out["after_crash"] = _summary(run_dir, cfg)
        stale = run_dir / "checkpoints" / "step00000003" / "reference" / "rank00000.pt"
        stale.parent.mkdir(parents=True)              # what an abandoned attempt at step 3 would leave
        stale.write_bytes(b"not a shard")
    dist.barrier()
    stopped, w2 = _train_with(rank, {**raw, "train": {**raw["train"], "exit_after_steps": 2}}, "auto")
    dist.barrier()
    out["stopped"] = (stopped.step, stopped.stop_reason)
    if rank == 0:
        out["after_stop"] = _summary(run_dir, cfg)
    dist.barrier()
    last, w3 = _train_with(rank, raw, "auto")
    out["last_step"] = last.step
    dist.barrier()
    if rank == 0:
        watches = (w1, w2, w3)
        out.update(summary=_summary(run_dir, cfg), checks=sum(w.checks for w in watches),
                   problems=[p for w in watches for p in w.problems])
        final = run_dir / "checkpoints" / "step00000005"
        shards = consolidated_state_dict(final, cfg)
        copy = shutil.copytree(final, tmp / "no-shards" / "step00000005")
        ckpt._drop_reference(Path(copy), "test")
        out["same"] = {k: torch.equal(v, consolidated_state_dict(Path(copy), cfg)[k]) for k, v in shards.items()}
        out["same_keys"] = sorted(shards) == sorted(consolidated_state_dict(Path(copy), cfg))
    return out


def _worker(rank: int, world: int, tmp: str, cache: str) -> dict:
    tmp_p, cache_p = Path(tmp), Path(cache)
    return {"autoep": _expert_parallel_cell(rank, tmp_p, cache_p, "autoep", 3),
            "deepspeed": _expert_parallel_cell(rank, tmp_p, cache_p, "deepspeed", 2),
            "reference": _reference_cell(rank, tmp_p, cache_p)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("reference-weights")
    cache = tmp_path_factory.mktemp("reference-weights-cache")
    return run_distributed(_worker, 2, args=(str(tmp), str(cache)), timeout=600)


@pytest.mark.parametrize("backend", ["autoep", "deepspeed"])
def test_expert_parallel_keeps_the_newest_exportable_and_the_older_ones_resumable(runs, backend):
    r0 = runs[0][backend]
    assert r0["first"] == (3, "signal") and r0["second_step"] == 6
    assert r0["checks"] > 20 and r0["problems"] == []      # at every rename / removal: all verify, newest exports
    s = r0["summary"]
    assert sorted(s) == ["step00000003", "step00000004", "step00000006"]   # keep_last 3
    assert s["step00000006"]["shards"] == ["reference/rank00000.pt", "reference/rank00001.pt"]
    assert s["step00000006"]["export"] == "exported" and s["step00000006"]["verify"] == []
    for old in ("step00000003", "step00000004"):          # the SIGTERM save had them until step 4 was complete
        assert s[old]["shards"] == [] and s[old]["on_disk"] == [] and s[old]["verify"] == []
        assert s[old]["removed_by"] == ("step00000004" if old == "step00000003" else "step00000006")
        assert re.search(rf"{old} has no reference weights .*: they were removed when the newer .*: export "
                         r"\S+/checkpoints/step00000006 instead", s[old]["export"]), s[old]["export"]
    assert [r[backend]["loaded_step"] for r in runs] == [4, 4]


def test_reference_backend_writes_shards_only_at_the_last_save_and_exports_every_checkpoint(runs):
    r0 = runs[0]["reference"]
    assert r0["crashed"] and r0["stopped"] == (4, "exit_after_steps") and r0["last_step"] == 5
    crash = r0["after_crash"]
    assert sorted(crash) == ["step00000001", "step00000002"]
    for c in crash.values():                               # no shards, yet every one verifies and exports
        assert c["shards"] == [] and c["verify"] == [] and c["export"] == "exported"
    both = ["reference/rank00000.pt", "reference/rank00001.pt"]
    assert r0["after_stop"]["step00000004"]["shards"] == both   # the stop's save is the run's last
    assert r0["checks"] > 30 and r0["problems"] == []
    s = r0["summary"]
    assert sorted(s) == ["step00000003", "step00000004", "step00000005"]
    assert s["step00000005"]["shards"] == both
    for k in ("step00000003", "step00000004"):           # step 3's save removed the abandoned attempt's file
        assert s[k]["shards"] == [] and s[k]["on_disk"] == [] and s[k]["export"] == "exported", s[k]
    assert s["step00000004"]["removed_by"] == "step00000005"
    assert r0["same_keys"] and all(r0["same"].values())   # zero_to_fp32 == the shards, bit for bit


def test_which_saves_write_the_shards():
    """:func:`writes_reference` against the rule of the field's description."""
    from smelt_ds.runs.checkpoint import writes_reference

    ep = {"moe_backend": "autoep", "zero_stage": 3}
    ref2, ref0 = {"moe_backend": "reference", "zero_stage": 2}, {"moe_backend": "reference", "zero_stage": 0}
    for layout in (ep, ref2, ref0):
        for final in (False, True):
            assert writes_reference("every_save", layout, final) and writes_reference("newest", layout, final)
    assert writes_reference("minimal", ep, False) and writes_reference("minimal", ref0, False)
    assert not writes_reference("minimal", ref2, False) and writes_reference("minimal", ref2, True)
    with pytest.raises(ValueError, match="'sometimes' is not one of"):
        writes_reference("sometimes", ep, False)
