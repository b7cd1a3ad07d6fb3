"""Checkpoint integrity: digests computed while writing, damaged checkpoints named and skipped,
fsync before the marker, a full disk reported with the file and the space needed."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from smelt_ds.config.loading import config_from_dict
from smelt_ds.testing import run_distributed, scaled_timeout
from tests.markers import slow_fixture

ROOT = Path(__file__).resolve().parents[2]


def _raw(run_dir: Path, cache: Path, **train) -> dict:
    return {"name": "ck",
            "model": {"vocab_size": 512, "hidden_size": 32, "num_layers": 4, "num_heads": 4, "num_kv_heads": 2,
                      "max_seq_len": 64},
            "moe": {"num_experts": 4, "top_k": 2, "expert_ffn_size": 32}, "loop": {"position": "middle"},
            "data": {"builtin_max_bytes": 150_000, "tokenizer": {"vocab_size": 512}, "cache_dir": str(cache)},
            "train": {"seq_len": 32, "micro_batch_size": 2, "max_steps": 4, "warmup_steps": 1, "log_every": 1,
                      "eval_every": 100, "save_every": 2, "keep_last": 3, "run_dir": str(run_dir), **train},
            "eval": {"eval_batches": 1}}


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("ckpt-cache")


def _train(rank, world, raw, resume="none"):
    from smelt_ds.train.loop import train

    r = train(config_from_dict(raw), resume=resume)
    return {"losses": r.losses, "step": r.step}


def _fsync_order_worker(rank, world, raw):
    """Train with os.fsync / os.replace recorded: (event, path) in order."""
    events = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        return real_fsync(fd)

    def replace(a, b):
        events.append(("replace", str(Path(b).resolve())))
        return real_replace(a, b)

    os.fsync, os.replace = fsync, replace
    try:
        _train(rank, world, raw)
    finally:
        os.fsync, os.replace = real_fsync, real_replace
    return events


@pytest.fixture(scope="module")
@slow_fixture
def trained(tmp_path_factory, cache):
    """A 4-step run saving at steps 2 and 4, with every fsync and rename recorded."""
    tmp = tmp_path_factory.mktemp("ckpt-run")
    raw = _raw(tmp / "run", cache)
    events = run_distributed(_fsync_order_worker, 1, args=(raw,), timeout=300)[0]
    return raw, Path(raw["train"]["run_dir"]), events


def _copy_run(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst, symlinks=True)
    return dst


def test_marker_lists_every_file_with_its_digest_and_files_are_synced_first(trained):
    from smelt_ds.runs import checkpoint as ckpt

    _, run_dir, events = trained
    step4 = run_dir / "checkpoints" / "step00000004"
    meta = json.loads((step4 / ckpt.MARKER).read_text())
    on_disk = sorted(str(p.relative_to(step4)) for p in step4.rglob("*") if p.is_file() and p.name != ckpt.MARKER)
    assert sorted(meta["files"]) == on_disk
    assert "mp_rank_00_model_states.pt" in on_disk and "reference/rank00000.pt" in on_disk
    for name, want in meta["files"].items():               # digests computed while writing == read back
        assert ckpt.file_digest(step4 / name) == {"sha256": want["sha256"], "bytes": want["bytes"]}, name
    assert ckpt.verify(step4) == []
    # every file and the directory were fsynced before the marker was renamed into place
    marker_at = events.index(("replace", str((step4 / ckpt.MARKER).resolve())))
    synced = {p for e, p in events[:marker_at] if e == "fsync"}
    big = [n for n, d in meta["files"].items() if n.endswith(".pt")]
    for name in big:
        resolved = str((step4 / name).resolve())
        assert resolved in synced or resolved + ".tmp" in synced, name
    assert str(step4.resolve()) in synced


def _flip(path: Path, n: int = 64) -> None:
    data = bytearray(path.read_bytes())
    mid = len(data) // 2
    for i in range(mid, mid + n):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.distributed
def test_damaged_newest_checkpoint_is_named_kept_and_skipped(trained, tmp_path):
    from smelt_ds.errors import ConfigError
    from smelt_ds.runs import checkpoint as ckpt
    from smelt_ds.runs.export import export_checkpoint
    from smelt_ds.testing import DistributedTestError

    raw, src, _ = trained
    run_dir = _copy_run(src, tmp_path / "run")
    raw = {**raw, "train": {**raw["train"], "run_dir": str(run_dir), "max_steps": 6}}
    step4 = run_dir / "checkpoints" / "step00000004"
    model_file = step4 / "mp_rank_00_model_states.pt"
    size = model_file.stat().st_size
    _flip(model_file)                                      # 64 flipped bytes, same size
    assert model_file.stat().st_size == size
    assert ckpt.verify(step4) == [f"{model_file} has another SHA-256 than when written (damaged)"]
    damaged_bytes = model_file.read_bytes()
    # an explicit --resume of it is refused, naming the file
    with pytest.raises(DistributedTestError, match=r"--resume .*step00000004: the checkpoint is damaged \(.*"
                                                   r"mp_rank_00_model_states.pt has another SHA-256"):
        run_distributed(_train, 1, args=(raw, str(step4)), timeout=300)
    # export and eval of the run read step 2 past a damaged reference shard of step 4 (naming it, moving
    # nothing); an export of step 4 itself is refused, naming the shard and step 2
    shard = step4 / "reference" / "rank00000.pt"
    good_shard = shard.read_bytes()
    shard.write_bytes(good_shard[: len(good_shard) // 2])   # truncated
    out = export_checkpoint(run_dir, tmp_path / "export")
    assert (out / "SOURCE").read_text().strip() == str((run_dir / "checkpoints" / "step00000002").resolve())
    with pytest.raises(ConfigError, match=r"step00000004 is damaged \(.*rank00000.pt has [\d,]+ bytes, [\d,]+ when"
                                          r".*: use .*step00000002 instead"):
        export_checkpoint(step4, tmp_path / "export4")
    assert (step4 / "reference").is_dir()
    shard.write_bytes(good_shard)
    # --resume auto falls back to step 2, says so, and keeps the damaged checkpoint
    r = run_distributed(_train, 1, args=(raw, "auto"), timeout=300)[0]
    assert r["step"] == 6 and len(r["losses"]) == 4        # steps 3..6: resumed from step 2
    kept = run_dir / "checkpoints" / "damaged-step00000004"
    assert (kept / "mp_rank_00_model_states.pt").read_bytes() == damaged_bytes
    assert ckpt.latest_complete(run_dir).name == "step00000006"


def _damaged_rank1_worker(rank, world, raw):
    """Save a 2-rank ZeRO-1 checkpoint, let rank 1 damage two of its own files (64 bytes flipped in
    its optimizer partition, its client state cut in half), move every weight away from the saved
    values, then load the checkpoint as ``--resume PATH`` does; the error (or None) and whether the
    weights stayed where they were moved."""
    import torch.distributed as dist

    from smelt_ds.errors import ConfigError
    from smelt_ds.runs import checkpoint as ckpt
    from smelt_ds.train.build import build

    cfg = config_from_dict(raw)
    built = build(cfg, world)
    path = ckpt.save(built.engine, cfg.train.run_dir, 1, 64, {}, keep_last=2, layout=built.layout)
    files = json.loads((path / ckpt.MARKER).read_text())["files"]
    params = list(built.engine.module.parameters())
    with torch.no_grad():
        for p in params:
            p.add_(1.0)
    moved = [p.detach().clone() for p in params]
    if rank == 1:
        _flip(path / "zero_pp_rank_1_mp_rank_00_optim_states.pt")
        client = path / "client_rank1.pt"
        client.write_bytes(client.read_bytes()[: client.stat().st_size // 2])
    dist.barrier()
    try:
        ckpt.load(built.engine, cfg.train.run_dir, str(path), built.layout)
        error = None
    except ConfigError as e:
        error = str(e)
    return {"rank1_files": sorted(n for n, d in files.items() if d["rank"] == 1), "error": error, "path": str(path),
            "client_bytes": files["client_rank1.pt"]["bytes"],
            "weights_kept": all(torch.equal(p, m) for p, m in zip(params, moved, strict=True))}


@pytest.mark.distributed
def test_damaged_file_of_rank_1_is_refused_naming_it(tmp_path):
    """Each rank verifies the files it wrote: damage to rank 1's files (its ZeRO-1 optimizer partition,
    bytes flipped; its client state, truncated) refuses the load on both ranks, naming both files,
    before DeepSpeed loads anything (the weights stay as they were)."""
    raw = _raw(tmp_path / "run", tmp_path / "cache")
    raw["deepspeed"] = {"zero_stage": 1}
    res = run_distributed(_damaged_rank1_worker, 2, args=(raw,), timeout=240)
    path = res[0]["path"]
    assert res[0]["rank1_files"] == ["client_rank1.pt", "reference/rank00001.pt",
                                     "zero_pp_rank_1_mp_rank_00_optim_states.pt"]
    size = res[0]["client_bytes"]
    for rank, r in enumerate(res):
        assert r["error"] is not None, f"rank {rank} loaded a damaged checkpoint"
        assert r["error"].startswith(f"--resume {path}: the checkpoint is damaged ("), r["error"]
        assert f"{path}/client_rank1.pt has {size // 2:,} bytes, {size:,} when written" in r["error"], r["error"]
        assert f"{path}/zero_pp_rank_1_mp_rank_00_optim_states.pt has another SHA-256 than when written" in r["error"]
        assert r["weights_kept"], f"rank {rank}: weights changed by a refused load"


def test_checkpoint_without_digests_that_deepspeed_cannot_read_names_it(trained, tmp_path):
    """Checkpoints of older smelt-ds have no digests: a truncated model file is still named."""
    from smelt_ds.runs import checkpoint as ckpt
    from smelt_ds.testing import DistributedTestError

    raw, src, _ = trained
    run_dir = _copy_run(src, tmp_path / "run")
    raw = {**raw, "train": {**raw["train"], "run_dir": str(run_dir), "max_steps": 6}}
    step4 = run_dir / "checkpoints" / "step00000004"
    meta = json.loads((step4 / ckpt.MARKER).read_text())
    del meta["files"]
    (step4 / ckpt.MARKER).write_text(json.dumps(meta))
    f = step4 / "mp_rank_00_model_states.pt"
    f.write_bytes(f.read_bytes()[:1000])
    with pytest.raises(DistributedTestError, match=r"DeepSpeed could not load checkpoint .*step00000004 \(.*\): it is "
                                                   r"damaged or from another recipe"):
        run_distributed(_train, 1, args=(raw, "auto"), timeout=300)


@pytest.mark.slow
def test_full_disk_names_the_file_and_leaves_no_complete_checkpoint(tmp_path, cache):
    """/dev/full answers every write with ENOSPC, as a full file system does."""
    import yaml

    from smelt_ds.runs import checkpoint as ckpt

    if not os.path.exists("/dev/full"):
        pytest.skip("/dev/full is not available on this machine")
    raw = _raw(tmp_path / "run", cache, max_steps=2)
    step2 = tmp_path / "run" / "checkpoints" / "step00000002"
    step2.mkdir(parents=True)
    (step2 / "mp_rank_00_model_states.pt").symlink_to("/dev/full")
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(raw))
    r = subprocess.run([sys.executable, "-m", "smelt_ds.train", str(recipe)], cwd=ROOT, capture_output=True,
                       text=True, timeout=scaled_timeout(300))
    assert r.returncode == 1, r.stderr[-3000:]
    assert "No space left on device writing" in r.stderr and "mp_rank_00_model_states.pt (needs about" in r.stderr
    assert "Traceback" not in r.stderr
    assert not (step2 / ckpt.MARKER).exists() and ckpt.latest_complete(tmp_path / "run") is None


def test_write_hashed_digest_equals_the_file(tmp_path):
    from smelt_ds.runs import checkpoint as ckpt

    obj = {"w": torch.arange(10_000, dtype=torch.float32), "meta": {"step": 3}}
    for zipfile in (True, False):
        path = tmp_path / f"x{zipfile}.pt"
        d = ckpt.write_hashed(obj, path, zipfile)
        assert d == ckpt.file_digest(path)
        assert torch.equal(torch.load(path, weights_only=True)["w"], obj["w"])


def test_resume_may_change_only_what_does_not_change_the_optimisation(trained):
    """`--set train.seed=...` on resume would be ignored while config.yaml said it was used. The peak
    LR may change (the resume applies it: tests/train/test_skip_resume.py), and the micro-batch with
    the global batch kept (tests/runs/test_resume_rules.py)."""
    from smelt_ds.errors import ConfigError
    from smelt_ds.train.guards import check_run_dir

    raw, run_dir, _ = trained

    def cfg(**train):
        return config_from_dict({**raw, "train": {**raw["train"], **train}})

    check_run_dir(run_dir, cfg(max_steps=10, eval_every=5, save_every=5, log_every=2, keep_last=1), "auto", 1)
    check_run_dir(run_dir, config_from_dict({**raw, "eval": {"eval_batches": 4}}), "auto", 1)
    check_run_dir(run_dir, cfg(lr=1e-4, micro_batch_size=1), "auto", 1)
    with pytest.raises(ConfigError, match=r"--resume auto: train.seed: 1234 in the run, 7 in this recipe .*a "
                                          r"resume continues the run's optimisation .*may change only train.max_steps"):
        check_run_dir(run_dir, cfg(seed=7), "auto", 1)
    for change in ({"warmup_steps": 2}, {"weight_decay": 0.01}, {"seed": 7}, {"grad_clip": 0.5}):
        with pytest.raises(ConfigError, match=rf"train.{next(iter(change))}: "):
            check_run_dir(run_dir, cfg(**change), "auto", 1)
    with pytest.raises(ConfigError, match=r"data.validation_share: "):
        check_run_dir(run_dir, config_from_dict({**raw, "data": {**raw["data"], "validation_share": 0.2}}), "auto", 1)


@pytest.mark.distributed
def test_all_checkpoints_damaged_never_restarts_from_step_zero(trained, tmp_path):
    """Every checkpoint damaged: --resume auto refuses (it used to train from step 0 over the run,
    truncating metrics.jsonl), and so do a later --resume auto and a new run there."""
    from smelt_ds.testing import DistributedTestError

    raw, src, _ = trained
    run_dir = _copy_run(src, tmp_path / "run")
    raw = {**raw, "train": {**raw["train"], "run_dir": str(run_dir), "max_steps": 6}}
    for step in (2, 4):
        _flip(run_dir / "checkpoints" / f"step{step:08d}" / "mp_rank_00_model_states.pt")
    metrics = (run_dir / "metrics.jsonl").read_text()
    with pytest.raises(DistributedTestError, match=r"no checkpoint of .* verifies \(damaged: step00000004, "
                                                   r"step00000002"):
        run_distributed(_train, 1, args=(raw, "auto"), timeout=300)
    assert (run_dir / "metrics.jsonl").read_text() == metrics
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir() if p.is_dir()) == [
        "damaged-step00000002", "damaged-step00000004"]
    with pytest.raises(DistributedTestError, match=r"holds no checkpoint that verifies, only damaged ones"):
        run_distributed(_train, 1, args=(raw, "auto"), timeout=300)
    with pytest.raises(DistributedTestError, match=r"already holds checkpoints of an earlier run \(only damaged"):
        run_distributed(_train, 1, args=(raw, "none"), timeout=300)
    assert (run_dir / "metrics.jsonl").read_text() == metrics
    from smelt_ds.errors import ConfigError
    from smelt_ds.runs.export import export_checkpoint

    with pytest.raises(ConfigError, match=r"was moved aside as damaged \(.*mp_rank_00_model_states.pt has another"):
        export_checkpoint(run_dir / "checkpoints" / "damaged-step00000004", tmp_path / "export")


def test_readers_of_a_run_take_the_newest_checkpoint_that_verifies(tmp_path, capsys):
    """eval, generate and export of a run whose newest checkpoint has one flipped byte read the newest
    one that verifies, as --resume auto does, and say so naming both (they used to refuse with a
    'stepNNNNNNNN' placeholder); they move nothing. A damaged checkpoint directory passed explicitly
    is refused naming the intact one; a run none of whose checkpoints verifies is refused naming each."""
    from smelt_ds.cli import main
    from smelt_ds.errors import ConfigError
    from smelt_ds.runs.export import export_checkpoint
    from smelt_ds.runs.load import resolve_export
    from tests.runs.fake_run import fake_run

    cfg = config_from_dict(_raw(tmp_path / "run", tmp_path / "cache"))
    run_dir = tmp_path / "run"
    states = fake_run(run_dir, cfg, steps=(2, 4))
    step2, step4 = run_dir / "checkpoints" / "step00000002", run_dir / "checkpoints" / "step00000004"
    model_file = step4 / "mp_rank_00_model_states.pt"
    _flip(model_file, 1)
    listing = sorted(str(p.relative_to(run_dir)) for p in (run_dir / "checkpoints").rglob("*"))
    export = resolve_export(run_dir)                          # what eval and generate read
    assert export == run_dir / "exports" / "step00000002"
    assert (export / "SOURCE").read_text().strip() == str(step2.resolve())
    err = capsys.readouterr().err
    assert f"checkpoint {step4} is damaged ({model_file} has another SHA-256 than when written (damaged))" in err
    assert f"using {step2} instead, the newest checkpoint of {run_dir} whose files verify" in err
    got = torch.load(export / "model.pt", weights_only=True)
    assert sorted(got) == sorted(states[2]) and all(torch.equal(got[k], v.float()) for k, v in states[2].items())
    assert not all(torch.equal(got[k], v.float()) for k, v in states[4].items())
    assert main(["export", str(run_dir), "-o", str(tmp_path / "out")]) == 0
    assert (tmp_path / "out" / "SOURCE").read_text().strip() == str(step2.resolve())
    assert f"using {step2} instead" in capsys.readouterr().err
    for read in (lambda: export_checkpoint(step4, tmp_path / "o1"), lambda: resolve_export(step4)):
        with pytest.raises(ConfigError) as e:
            read()
        assert str(e.value) == (f"checkpoint {step4} is damaged ({model_file} has another SHA-256 than when written "
                                f"(damaged)): use {step2} instead, the newest checkpoint of {run_dir} whose files "
                                f"verify (or pass the run directory {run_dir}, which takes it)")
    assert not (tmp_path / "o1").exists()
    assert sorted(str(p.relative_to(run_dir)) for p in (run_dir / "checkpoints").rglob("*")) == listing
    _flip(step2 / "mp_rank_00_model_states.pt", 1)
    with pytest.raises(ConfigError) as e:
        export_checkpoint(run_dir, tmp_path / "o2")
    assert str(e.value).startswith(f"no checkpoint of {run_dir} verifies (checkpoint {step4} is damaged ({model_file} "
                                   f"has another SHA-256 than when written (damaged)); checkpoint {step2} is damaged "
                                   f"({step2}/mp_rank_00_model_states.pt has another SHA-256"), str(e.value)
    assert str(e.value).endswith("nothing to read the weights from; restore a checkpoint from a copy, or train the "
                                 "run again")
    with pytest.raises(ConfigError, match=re.escape(f"and no other checkpoint of {run_dir} verifies: restore the "
                                                    "checkpoint from a copy")):
        export_checkpoint(step4, tmp_path / "o3")
    assert sorted(str(p.relative_to(run_dir)) for p in (run_dir / "checkpoints").rglob("*")) == listing


def _train_in_dir(rank, world, raw, run_dir, resume):
    from smelt_ds.train.loop import train

    r = train(config_from_dict(raw), resume=resume, run_dir=run_dir)
    return {"lrs": r.lrs, "step": r.step}


@pytest.mark.distributed
def test_resume_with_a_new_max_steps_runs_the_new_schedule_from_the_first_step(trained, tmp_path):
    """The checkpoint restores the old schedule's LR for the next step; the first resumed step must
    use the new schedule (cosine over the new max_steps). Also: config.yaml records --run-dir."""
    import yaml

    from smelt_ds.parallel.engine import lr_multiplier

    raw, src, _ = trained
    run_dir = _copy_run(src, tmp_path / "elsewhere")
    longer = {**raw, "train": {**raw["train"], "max_steps": 9}}
    r = run_distributed(_train_in_dir, 1, args=(longer, str(run_dir), "auto"), timeout=300)[0]
    f = lr_multiplier(config_from_dict(longer))
    lr = config_from_dict(longer).train.lr
    assert r["lrs"] == pytest.approx([lr * f(s) for s in range(4, 9)], rel=1e-12)
    old = lr_multiplier(config_from_dict(raw))
    assert abs(r["lrs"][0] - lr * old(4)) > 1e-6          # the old schedule's next LR differs
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["train"]["run_dir"] == str(run_dir)


def test_full_disk_inside_torchs_zip_writer_is_named(tmp_path, monkeypatch):
    """A write that fails mid-file surfaces from torch's zip writer as a RuntimeError ("unexpected
    pos"); the message must still say no space, the file, and the bytes needed and free."""
    import errno
    import io

    from smelt_ds.runs import checkpoint as ckpt

    class FillsUp(io.RawIOBase):
        def __init__(self):
            self.n = 0

        def writable(self):
            return True

        def write(self, b):
            self.n += len(memoryview(b))
            if self.n > 4096:
                raise OSError(errno.ENOSPC, "No space left on device")
            return len(memoryview(b))

        def fileno(self):
            raise OSError("no fd")

    monkeypatch.setattr(ckpt, "open", lambda *a, **k: FillsUp(), raising=False)
    obj = {"w": torch.zeros(100_000)}
    for zipfile in (True, False):
        with pytest.raises(ckpt.CheckpointWriteError, match=r"No space left on device writing .*x.pt \(needs about "
                                                            r"400,000 bytes; free [\d,]+\)"):
            ckpt.write_hashed(obj, tmp_path / "x.pt", zipfile)


def test_a_copy_of_the_runs_tokenizer_under_another_path_resumes(trained, tmp_path):
    import shutil

    import yaml

    from smelt_ds.train.guards import check_run_dir

    raw, src, _ = trained
    run_dir = _copy_run(src, tmp_path / "run")
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    shutil.copyfile(run_dir / "tokenizer.json", a)
    shutil.copyfile(run_dir / "tokenizer.json", b)
    saved = yaml.safe_load((run_dir / "config.yaml").read_text())
    saved["data"]["tokenizer"]["path"] = str(a)
    (run_dir / "config.yaml").write_text(yaml.safe_dump(saved))
    moved = {**raw, "data": {**raw["data"], "tokenizer": {**raw["data"]["tokenizer"], "path": str(b)}}}
    check_run_dir(run_dir, config_from_dict(moved), "auto", 1)   # same content: accepted


@pytest.mark.distributed
def test_lr_resync_after_a_longer_resume_under_zero3_on_two_ranks(tmp_path, cache):
    """The same as the one-rank test with ZeRO-3's optimizer wrapper and 2 ranks."""
    from smelt_ds.parallel.engine import lr_multiplier

    raw = _raw(tmp_path / "run", cache, max_steps=4, save_every=2, exit_after_steps=2)
    raw["deepspeed"] = {"zero_stage": 3}
    assert run_distributed(_train, 2, args=(raw,), timeout=300)[0]["step"] == 2
    longer = {**raw, "train": {**raw["train"], "max_steps": 7, "exit_after_steps": None}}
    r = run_distributed(_train_lrs, 2, args=(longer,), timeout=300)
    f, lr = lr_multiplier(config_from_dict(longer)), config_from_dict(longer).train.lr
    for rank in r:
        assert rank == pytest.approx([lr * f(s) for s in range(2, 7)], rel=1e-12)


def _train_lrs(rank, world, raw):
    from smelt_ds.train.loop import train

    return train(config_from_dict(raw), resume="auto").lrs


def _four_rank_checkpoint(run_dir: Path, step: int, damaged_rank: int | None) -> Path:
    """A complete checkpoint as 4 ranks write one at ZeRO-0 (:mod:`tests.runs.checkpoint_files`):
    every file listed in the marker with its digest and writer; the reference shard of
    ``damaged_rank`` has one byte changed after the digest."""
    from smelt_ds.runs import checkpoint as ckpt
    from tests.runs.checkpoint_files import layout_files, writer

    d = ckpt.checkpoint_dir(run_dir) / f"step{step:08d}"
    (d / "reference").mkdir(parents=True)
    files = {}
    for name in layout_files(4, 0):
        f, r = d / name, writer(name)
        f.write_bytes(bytes(range(256)) * (r + 1))
        files[name] = {**ckpt.file_digest(f), "rank": r}
        if damaged_rank is not None and name == f"reference/rank{damaged_rank:05d}.pt":
            f.write_bytes(b"\xff" + f.read_bytes()[1:])
    (d / ckpt.MARKER).write_text(json.dumps({"step": step, "tokens_seen": 0, "world_size": 4, "zero_stage": 0,
                                             "moe_backend": "reference", "ep_size": 1, "files": files}))
    return d


def _choose_worker(rank, world, run_dir):
    from smelt_ds.runs import checkpoint as ckpt

    return ckpt.choose(run_dir, "auto").name


@pytest.mark.distributed
def test_fewer_ranks_than_wrote_a_checkpoint_check_every_file(tmp_path):
    """A resume on 2 ranks of a checkpoint 4 ranks wrote: ranks 0 and 1 also check the files of
    ranks 2 and 3, so a damaged file of rank 3 sets the newest aside and the older one is loaded
    (checking only the files a rank wrote itself would take the damaged one)."""
    from smelt_ds.runs import checkpoint as ckpt

    _four_rank_checkpoint(tmp_path, 2, None)
    _four_rank_checkpoint(tmp_path, 4, damaged_rank=3)
    assert ckpt.verify(ckpt.checkpoint_dir(tmp_path) / "step00000004", 1, world_size=2) == [
        f"{ckpt.checkpoint_dir(tmp_path) / 'step00000004' / 'reference' / 'rank00003.pt'} has another SHA-256 "
        "than when written (damaged)"]
    got = run_distributed(_choose_worker, 2, args=(str(tmp_path),), init_deepspeed=False, timeout=60)
    assert got == ["step00000002", "step00000002"]
    assert (ckpt.checkpoint_dir(tmp_path) / "damaged-step00000004").is_dir()


@pytest.mark.parametrize("marker", ["garbage", "[]", '{"step": 4, "files": "x"}'], ids=["not-json", "a-list", "files"])
def test_a_damaged_marker_is_a_damaged_checkpoint_not_a_crash(tmp_path, marker, capsys):
    """A COMPLETE marker that is not a checkpoint marker: verify names it (so --resume auto sets
    the checkpoint aside like one with a damaged file) and `checkpoint info` says damaged, exit 1."""
    from smelt_ds.cli import main
    from smelt_ds.runs import checkpoint as ckpt

    d = ckpt.checkpoint_dir(tmp_path) / "step00000004"
    d.mkdir(parents=True)
    (d / ckpt.MARKER).write_text(marker)
    (problem,) = ckpt.verify(d)
    assert problem.startswith(f"{d / ckpt.MARKER} is damaged")
    assert main(["checkpoint", "info", str(d)]) == 1
    assert "complete      marker present, but damaged:" in capsys.readouterr().out
