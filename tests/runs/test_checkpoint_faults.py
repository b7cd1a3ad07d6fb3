"""Checkpoint writes that fail (a full disk, a permission error, a failing device, on one rank
only): the run stops with one clear error naming the file and the cause, no partial checkpoint
gets a marker, the older complete checkpoints stay, and ``--resume auto`` continues from the
newest of them to the same weights as a run that never failed. Faults from
:mod:`smelt_ds.testing.faults`."""

from __future__ import annotations

import builtins
import errno
from pathlib import Path

import pytest
import torch

from smelt_ds.runs import checkpoint as ckpt
from smelt_ds.testing import faults
from tests import two_ranks


def _failing_open(spec: str):
    return faults._failing_open(faults._Injector(faults.parse_faults(spec), 0), builtins.open)


@pytest.mark.parametrize("name, message", [
    ("EACCES", r"EACCES: Permission denied writing {path}: make the run directory writable by this user or point "
               r"train.run_dir elsewhere; the previous complete checkpoint is untouched and --resume auto continues "
               r"from it$"),
    ("EROFS", r"EROFS: Read-only file system writing {path}: the file system is read-only: remount it read-write"),
    ("EIO", r"EIO: Input/output error writing {path}: check the device and the file system"),
    ("EDQUOT", r"EDQUOT: Disk quota exceeded writing {path} \(needs about 40,000 bytes; free [\d,]+\): free space, "
               r"raise the quota"),
    ("ENOSPC", r"ENOSPC: No space left on device writing {path} \(needs about 40,000 bytes; free [\d,]+\): free "
               r"space or point train.run_dir elsewhere"),
])
def test_every_write_error_names_the_file_the_errno_and_the_fix(tmp_path, monkeypatch, name, message):
    """Only ENOSPC/EDQUOT used to become a CheckpointWriteError: a permission error or a failing
    device escaped as a bare OSError (from open, or inside torch's zip writer as a RuntimeError)."""
    step = tmp_path / "run" / "checkpoints" / "step00000002"
    step.mkdir(parents=True)
    path = step / "x.pt"
    monkeypatch.setattr(ckpt, "open", _failing_open(f"save_error:rank=0:step=2:errno={name}"), raising=False)
    with pytest.raises(ckpt.CheckpointWriteError, match=message.format(path=str(path).replace(".", r"\."))):
        ckpt.write_hashed({"w": torch.zeros(10_000)}, path)


class _Engine:
    """Stands in for a DeepSpeed engine: one model file per save, written through write_hashed."""

    def save_checkpoint(self, save_dir, tag, client_state, save_latest=True):
        (Path(save_dir) / tag).mkdir(parents=True, exist_ok=True)
        ckpt.write_hashed({"w": torch.ones(8) * client_state["step"]}, Path(save_dir) / tag / "model.pt")


def _save(run_dir: Path, step: int) -> Path:
    return ckpt.save(_Engine(), run_dir, step, step * 10, {}, keep_last=2, reference=False)


def _complete(run_dir: Path) -> list[str]:
    return sorted(p.name for p in ckpt.checkpoint_dir(run_dir).glob("step*") if (p / ckpt.MARKER).is_file())


def test_a_failed_save_keeps_the_complete_checkpoints_and_marks_nothing(tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    _save(run_dir, 2)
    _save(run_dir, 4)
    monkeypatch.setattr(ckpt, "open", _failing_open("save_error:rank=0:step=6:errno=EIO"), raising=False)
    step6 = ckpt.checkpoint_dir(run_dir) / "step00000006"
    with pytest.raises(ckpt.CheckpointWriteError, match=rf"^could not write checkpoint {step6}: EIO: Input/output "
                                                        rf"error writing {step6}/model\.pt: "):
        _save(run_dir, 6)
    assert _complete(run_dir) == ["step00000002", "step00000004"]     # keep_last=2: both kept
    assert not (step6 / ckpt.MARKER).exists()
    assert ckpt.latest_complete(run_dir).name == "step00000004"
    assert (ckpt.checkpoint_dir(run_dir) / "latest").read_text() == "step00000004"
    monkeypatch.undo()
    _save(run_dir, 6)                                                   # the next save prunes as usual
    assert _complete(run_dir) == ["step00000004", "step00000006"]


def test_a_marker_that_cannot_be_written_leaves_no_checkpoint(tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    _save(run_dir, 2)
    _save(run_dir, 4)

    def full(ckpt_dir, meta):
        raise OSError(errno.ENOSPC, "No space left on device", str(ckpt_dir / "COMPLETE.tmp"))

    monkeypatch.setattr(ckpt, "_write_marker", full)
    with pytest.raises(ckpt.CheckpointWriteError, match=r"could not complete checkpoint .*step00000006: ENOSPC: No "
                                                        r"space left on device writing .*step00000006/COMPLETE\.tmp"):
        _save(run_dir, 6)
    assert _complete(run_dir) == ["step00000002", "step00000004"]
    assert not (ckpt.checkpoint_dir(run_dir) / "step00000006").exists()


# -- two real ranks through `smelt-ds train --nproc 2` -----------------------------------------------------------


def _weights(ckpt_dir: Path) -> dict[str, torch.Tensor]:
    out = {}
    for shard in sorted((ckpt_dir / "reference").glob("rank*.pt")):
        out.update({f"{shard.name}:{k}": v for k, v in _tensors(torch.load(shard, weights_only=False)).items()})
    return out


def _tensors(obj, prefix: str = "") -> dict[str, torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return {prefix: obj}
    if isinstance(obj, dict):
        return {k: v for key, val in obj.items() for k, v in _tensors(val, f"{prefix}/{key}").items()}
    if isinstance(obj, (list, tuple)):
        return {k: v for i, val in enumerate(obj) for k, v in _tensors(val, f"{prefix}/{i}").items()}
    return {}


@pytest.mark.slow
@pytest.mark.distributed
def test_a_save_failing_on_one_rank_stops_the_run_and_resume_auto_finishes_it(two_rank_reference, tmp_path):
    """Rank 1 alone hits ENOSPC writing its optimizer partition of step 6 (inside DeepSpeed's save,
    before DeepSpeed's closing barrier; ZeRO-1: each rank writes its own): both ranks stop with
    exit status 1 and one message naming the file and the cause; steps 2 and 4 stay complete
    (keep_last=2), step 6 gets no marker; ``--resume auto`` continues from step 4 to the same losses
    and bit-identical weights as the shared uninterrupted run (:mod:`tests.two_ranks`)."""
    ref = two_rank_reference
    run_dir = tmp_path / "run"
    recipe = two_ranks.write_recipe(tmp_path / "recipe.yaml", run_dir, ref.cache)

    failed = two_ranks.cli_train(recipe, "--set", "train.exit_after_steps=8",
                                 env=faults.fault_env(["save_error:rank=1:step=6"]))
    assert failed.returncode == 1, failed.stderr[-4000:]
    step6 = ckpt.checkpoint_dir(run_dir) / "step00000006"
    assert (f"rank 1 could not write checkpoint {step6}: ENOSPC: No space left on device writing {step6}/"
            "zero_pp_rank_1_mp_rank_00_optim_states.pt (needs about") in failed.stderr, failed.stderr[-4000:]
    assert "the previous complete checkpoint is untouched and --resume auto continues from it" in failed.stderr
    assert ckpt.latest_complete(run_dir).name == "step00000004"
    assert (ckpt.checkpoint_dir(run_dir) / "latest").read_text() == "step00000004"  # DeepSpeed's pointer too
    assert (ckpt.checkpoint_dir(run_dir) / "step00000002" / ckpt.MARKER).is_file()   # keep_last=2: both kept
    assert not (step6 / ckpt.MARKER).exists()
    assert max(two_ranks.losses(run_dir)) == 6                          # it trained step 6, then stopped

    last = two_ranks.REFERENCE_STEPS
    resumed = two_ranks.cli_train(recipe, "--resume", "auto", "--set", f"train.exit_after_steps={last - 4}")
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert two_ranks.losses(run_dir) == ref.losses and sorted(ref.losses) == list(range(1, last + 1))
    final, ref_final = ckpt.latest_complete(run_dir), ckpt.latest_complete(ref.run_dir)
    assert final.name == ref_final.name == f"step{last:08d}"
    mine, theirs = _weights(final), _weights(ref_final)
    assert mine and mine.keys() == theirs.keys()
    assert all(torch.equal(mine[k], theirs[k]) for k in mine), "resumed weights differ from the uninterrupted run"
