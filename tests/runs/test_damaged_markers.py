"""Damaged ``COMPLETE`` markers: ``smelt-ds checkpoint info`` says why and exits 1, ``--resume auto``
sets the checkpoint aside and continues from the previous good one, and nothing crashes.

Each malformation is fabricated from a sound marker written the way the saver writes it
(:func:`smelt_ds.runs.checkpoint._complete` over a step directory holding the files a 2-rank
ZeRO-1 layout-free save writes, :mod:`tests.runs.checkpoint_files`). A marker is damaged when it
does not read as one (JSON, keys, types, ranges, paths inside the directory, the step of the
directory's name) or does not list every file its layout needs; keys smelt-ds does not know are
kept and ignored (a newer smelt-ds may add some). The last test resumes a real 2-rank training
(the session's shared reference run) past a marker that lists no file.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from smelt_ds.cli import main
from smelt_ds.config.loading import config_from_dict, dump_config
from smelt_ds.errors import ConfigError
from smelt_ds.runs import checkpoint as ckpt
from smelt_ds.runs.reshard import plan_resume
from tests import two_ranks
from tests.runs.checkpoint_files import layout_files, writer

WORLD = 2
#: the files a 2-rank ZeRO-1 save of the reference backend with the layout-free state writes
NEEDED = layout_files(WORLD, 1)


def _save(run: Path, step: int, cfg) -> Path:
    """A complete checkpoint as :func:`smelt_ds.runs.checkpoint.save` leaves it: every file written
    through :func:`~smelt_ds.runs.checkpoint.write_hashed` by its rank, then rank 0's ``_complete``
    (the digests, the marker, the pruning)."""
    root, tag = ckpt.checkpoint_dir(run), f"step{step:08d}"
    written: list[dict[str, Any]] = [{} for _ in range(WORLD)]
    for name in NEEDED:
        (root / tag / name).parent.mkdir(parents=True, exist_ok=True)
        written[writer(name)][name] = ckpt.write_hashed({"step": step, "w": torch.ones(3) * step}, root / tag / name)
    meta = {"step": step, "tokens_seen": step * 128, **ckpt.run_layout(cfg, WORLD), "reference_weights": True,
            "layout_free": True}
    assert ckpt._complete(root, tag, [(w, None) for w in written], meta, keep_last=2, drop_reference=False) is None
    return root / tag


@pytest.fixture
def run(tmp_path):
    """``(run_dir, cfg)``: the shared tiny recipe with complete checkpoints at steps 2 and 4."""
    run = tmp_path / "run"
    cfg = config_from_dict(two_ranks.recipe_raw(run, tmp_path / "cache"))
    run.mkdir()
    dump_config(cfg, run / "config.yaml")
    _save(run, 2, cfg)
    _save(run, 4, cfg)
    return run, cfg


# -- the malformations: each turns the sound marker (a dict) into what the file holds ----------------------------

Damage = Callable[[dict[str, Any]], Any]


def _set(**values) -> Damage:
    return lambda m: {**m, **values}


def _without(*keys: str) -> Damage:
    return lambda m: {k: v for k, v in m.items() if k not in keys}


def _entry(name: str, **values) -> Damage:
    """The file entry of ``name`` with ``values`` (None: the key removed)."""
    def damage(m):
        entry = {k: v for k, v in {**m["files"][name], **values}.items() if v is not None}
        return {**m, "files": {**m["files"], name: entry}}
    return damage


def _listing(name: str, entry: Any = "copy") -> Damage:
    """``name`` added to the files, with ``client_rank0.pt``'s entry (or ``entry``)."""
    return lambda m: {**m, "files": {**m["files"], name: m["files"]["client_rank0.pt"] if entry == "copy" else entry}}


def _unlisted(*names: str) -> Damage:
    return lambda m: {**m, "files": {n: d for n, d in m["files"].items() if n not in names}}


class Raw(str):
    """The marker's bytes themselves (not JSON of a dict)."""


DAMAGES: list[tuple[str, Damage, str]] = [
    ("not-json", lambda m: Raw("garbage"), "not JSON (JSONDecodeError"),
    ("truncated", lambda m: Raw(json.dumps(m)[:200]), "not JSON (JSONDecodeError"),
    ("empty-file", lambda m: Raw(""), "not JSON (JSONDecodeError"),
    ("not-utf8", lambda m: b"\xff\xfe{\"step\": 4}", "not JSON (UnicodeDecodeError"),
    ("json-array", lambda m: [m], "not a checkpoint marker (JSON an array"),
    ("json-string", lambda m: "step00000004", "not a checkpoint marker (JSON a string"),
    ("json-null", lambda m: None, "not a checkpoint marker (JSON null"),
    ("json-number", lambda m: 4, "not a checkpoint marker (JSON a number"),
    ("only-step", lambda m: {"step": 4}, "no 'world_size' (the saver always writes it)"),
    *[(f"no-{key}", _without(key), f"no {key!r} (the saver always writes it)")
      for key in ("step", "tokens_seen", "world_size", "zero_stage", "moe_backend", "ep_size")],
    ("step-string", _set(step="4"), "step: Input should be a valid integer (got '4')"),
    ("step-float", _set(step=4.0), "step: Input should be a valid integer (got 4.0)"),
    ("step-bool", _set(step=True), "step: Input should be a valid integer (got True)"),
    ("step-negative", _set(step=-4), "step: Input should be greater than or equal to 0 (got -4)"),
    ("step-not-the-directorys", _set(step=6), "step 6 in a directory named step00000004 (the saver names it "
                                              "step00000006)"),
    ("tokens-negative", _set(tokens_seen=-1), "tokens_seen: Input should be greater than or equal to 0"),
    ("world-string", _set(world_size="2"), "world_size: Input should be a valid integer (got '2')"),
    ("world-zero", _set(world_size=0), "world_size: Input should be greater than or equal to 1"),
    ("zero-null", _set(zero_stage=None), "zero_stage: Input should be a valid integer (got None)"),
    ("zero-4", _set(zero_stage=4), "zero_stage: Input should be less than or equal to 3 (got 4)"),
    ("backend-number", _set(moe_backend=3), "moe_backend: Input should be a valid string (got 3)"),
    ("backend-unknown", _set(moe_backend="tutel"), "moe_backend: 'tutel' is not a MoE backend (reference, "
                                                   "deepspeed, autoep)"),
    ("ep-list", _set(ep_size=[1]), "ep_size: Input should be a valid integer (got [1])"),
    ("ep-zero", _set(ep_size=0), "ep_size: Input should be greater than or equal to 1"),
    ("ep-on-reference", _set(ep_size=2), "ep_size 2 with moe_backend 'reference'"),
    ("ep-not-dividing", _set(moe_backend="deepspeed", ep_size=4), "ep_size 4 does not divide world_size 2"),
    ("layout-free-string", _set(layout_free="yes"), "layout_free: Input should be a valid boolean (got 'yes')"),
    ("reference-number", _set(reference_weights=1), "reference_weights: Input should be a valid boolean"),
    ("batch-half", _without("global_batch_samples"), "micro_batch_size and global_batch_samples come together"),
    ("batch-unformable", _set(global_batch_samples=5), "global_batch_samples 5 is not micro_batch_size 2 x "
                                                       "accumulation x world_size 2"),
    ("batch-string", _set(global_batch_samples="4"), "global_batch_samples: Input should be a valid integer"),
    ("files-array", _set(files=[]), "files: Input should be a valid dictionary (got [])"),
    ("files-string", _set(files="x"), "files: Input should be a valid dictionary (got 'x')"),
    *[(f"path-{i}", _listing(name), f"files: names {name!r}, a path outside the checkpoint directory")
      for i, name in enumerate(["../x", "/etc/passwd", "reference/../../x", "./client_rank0.pt", "", "a//b"])],
    ("lists-the-marker", _listing(ckpt.MARKER), "files: lists the marker COMPLETE itself"),
    ("entry-array", _listing("extra.pt", []), "files.extra.pt: Input should be a valid dictionary"),
    ("bytes-string", _entry("client_rank0.pt", bytes="12"), "files.client_rank0.pt.bytes: Input should be a valid "
                                                            "integer (got '12')"),
    ("bytes-negative", _entry("client_rank0.pt", bytes=-1), "files.client_rank0.pt.bytes: Input should be greater "
                                                            "than or equal to 0"),
    ("bytes-float", _entry("client_rank0.pt", bytes=1.5), "files.client_rank0.pt.bytes: Input should be a valid "
                                                          "integer"),
    ("bytes-missing", _entry("client_rank0.pt", bytes=None), "no 'files.client_rank0.pt.bytes'"),
    ("sha-number", _entry("client_rank0.pt", sha256=5), "files.client_rank0.pt.sha256: Input should be a valid "
                                                        "string (got 5)"),
    ("sha-short", _entry("client_rank0.pt", sha256="abc"), "files.client_rank0.pt.sha256: String should match "
                                                           "pattern"),
    ("sha-missing", _entry("client_rank0.pt", sha256=None), "no 'files.client_rank0.pt.sha256'"),
    ("rank-string", _entry("client_rank0.pt", rank="0"), "files.client_rank0.pt.rank: Input should be a valid "
                                                         "integer (got '0')"),
    ("rank-negative", _entry("client_rank0.pt", rank=-1), "files.client_rank0.pt.rank: Input should be greater "
                                                          "than or equal to 0"),
    ("rank-beyond-world", _entry("client_rank1.pt", rank=2), "'client_rank1.pt' written by rank 2, but world_size "
                                                             "is 2"),
    ("world-huge", lambda m: _without("micro_batch_size", "global_batch_samples")({**m, "world_size": 10**9}),
     f"needs: the files of 1000000000 ranks ({len(NEEDED)} files in all)"),
    ("expert-grid-huge", lambda m: _listing("layer_99999_expert_99999_mp_rank_00_model_states.pt")(
        {**m, "moe_backend": "deepspeed"}), "the expert files of 100000 MoE layers x 100000 experts (1 listed)"),
    ("files-empty", _set(files={}), f"it does not list {len(NEEDED)} file(s) its layout (2 rank(s), ZeRO-1, "
                                    "reference, EP 1) needs: client_rank0.pt (rank 0's client state); "
                                    "client_rank1.pt (rank 1's client state); mp_rank_00_model_states.pt"),
    *[(f"unlisted-{name}", _unlisted(name), f"it does not list 1 file(s) its layout (2 rank(s), ZeRO-1, reference, "
                                            f"EP 1) needs: {name}")
      for name in NEEDED],
    ("layout-free-without-shards", _unlisted("reference/rank00000.pt", "reference/rank00001.pt"),
     "needs: reference/rank00000.pt (rank 0's reference shard, the layout-free state the marker claims); "
     "reference/rank00001.pt (rank 1's reference shard, the layout-free state the marker claims)"),
]


def _damage(ck: Path, damage: Damage) -> None:
    got = damage(json.loads((ck / ckpt.MARKER).read_text()))
    data = got.encode() if isinstance(got, Raw) else got if isinstance(got, bytes) else json.dumps(got).encode()
    (ck / ckpt.MARKER).write_bytes(data)


def test_the_fabricated_checkpoints_are_sound(run, capsys):
    """The reference of every case below: the same checkpoints, undamaged, are complete and
    layout-free, and ``--resume auto`` takes the newest."""
    run_dir, cfg = run
    step4 = ckpt.checkpoint_dir(run_dir) / "step00000004"
    assert sorted(ckpt.read_marker(step4)["files"]) == NEEDED
    for flags in ([], ["--verify"]):
        assert main(["checkpoint", "info", str(step4), *flags]) == 0
        out = capsys.readouterr().out
        assert "complete      yes" in out and "layout-free   yes: resumes at any layout below" in out, out
        assert "     1 rank(s): reference (ZeRO 0-3)" in out, out
    _, plan = plan_resume(cfg, run_dir, "auto", 1)
    assert plan is not None and plan.checkpoint == step4
    assert ckpt.choose(run_dir, "auto") == step4


@pytest.mark.parametrize("verify", [False, True], ids=["info", "info-verify"])
@pytest.mark.parametrize("name, damage, why", DAMAGES, ids=[d[0] for d in DAMAGES])
def test_checkpoint_info_says_why_a_marker_is_damaged_and_exits_1(run, capsys, name, damage, why, verify):
    run_dir, _ = run
    step4 = ckpt.checkpoint_dir(run_dir) / "step00000004"
    _damage(step4, damage)
    assert main(["checkpoint", "info", str(step4), *(["--verify"] if verify else [])]) == 1
    out = capsys.readouterr().out
    assert f"complete      marker present, but damaged: {step4 / ckpt.MARKER} is damaged: " in out, out
    assert why in out, out
    assert "to use this one, restore it from a copy" in out, out
    assert "layout-free   yes" not in out and " rank(s): reference" not in out, out


@pytest.mark.parametrize("name, damage, why", DAMAGES, ids=[d[0] for d in DAMAGES])
def test_resume_auto_sets_a_damaged_marker_aside_and_takes_the_previous_checkpoint(run, capsys, name, damage, why):
    """The resume's plan (before the engine is built) and its choice of checkpoint (after) both take
    step 2; the damaged step 4 is moved aside, kept, with a message saying why."""
    run_dir, cfg = run
    root = ckpt.checkpoint_dir(run_dir)
    _damage(root / "step00000004", damage)
    _, plan = plan_resume(cfg, run_dir, "auto", 1)  # another layout: planned from the checkpoint it will load
    assert plan is not None and plan.checkpoint == root / "step00000002"
    assert ckpt.choose(run_dir, "auto") == root / "step00000002"
    err = capsys.readouterr().err
    assert f"checkpoint {root / 'step00000004'} is damaged ({root / 'step00000004' / ckpt.MARKER} is damaged: " in err
    assert why in err, err
    assert f"moved to {root / 'damaged-step00000004'} (kept, not deleted)" in err, err
    assert (root / "damaged-step00000004" / ckpt.MARKER).is_file()


def test_info_of_a_run_directory_reports_the_checkpoint_resume_auto_loads(run, capsys):
    """A run directory means the checkpoint ``--resume auto`` loads: with step 4's marker emptied,
    step 2 (complete, exit 0), naming step 4 as set aside and why; step 4 itself, given explicitly,
    is still reported damaged (exit 1). The reference is resume's own choice, made afterwards."""
    run_dir, _ = run
    root = ckpt.checkpoint_dir(run_dir)
    step2, step4 = root / "step00000002", root / "step00000004"
    _damage(step4, lambda m: Raw(""))
    assert main(["checkpoint", "info", str(run_dir)]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"checkpoint    {step2} (the one --resume auto loads)\n"), out
    assert (f"set aside     step00000004, newer, is damaged: {step4 / ckpt.MARKER} is damaged: not JSON "
            "(JSONDecodeError") in out and "--resume auto moves it to checkpoints/damaged-step00000004 and loads " \
        "step00000002" in out, out
    assert "complete      yes" in out and "step          2 (256 tokens seen)" in out, out
    assert main(["checkpoint", "info", str(step4)]) == 1
    assert f"checkpoint    {step4}\n" in capsys.readouterr().out
    assert ckpt.choose(run_dir, "auto") == step2  # what resume then loads


def test_info_names_a_marker_directory_and_gives_the_fix_for_a_missing_file(run, capsys):
    """A ``COMPLETE`` that is a directory is said to be one (not "a save that did not finish"); a
    listed file that is missing comes with the fix the other damages give, and resume agrees."""
    run_dir, _ = run
    root = ckpt.checkpoint_dir(run_dir)
    step2, step4 = root / "step00000002", root / "step00000004"
    (step4 / "client_rank0.pt").unlink()
    for flags in ([], ["--verify"]):
        assert main(["checkpoint", "info", str(step4), *flags]) == 1
        out = capsys.readouterr().out
        assert (f"damaged: {step4 / 'client_rank0.pt'} is missing: --resume auto sets this checkpoint aside "
                "(checkpoints/damaged-<tag>) and continues from the previous one that verifies; to use this one, "
                "restore the file(s) from a copy") in out, out
        assert "resumable at  nowhere: damaged; --resume auto moves it to checkpoints/damaged-<tag> and continues " \
            "from step00000002" in out, out
    assert main(["checkpoint", "info", str(run_dir)]) == 0
    assert f"checkpoint    {step2} (the one --resume auto loads)" in capsys.readouterr().out
    assert ckpt.choose(run_dir, "auto") == step2
    (step2 / ckpt.MARKER).unlink()
    (step2 / ckpt.MARKER).mkdir()
    assert main(["checkpoint", "info", str(step2)]) == 1
    out = capsys.readouterr().out
    assert (f"complete      no: {step2 / ckpt.MARKER} is a directory, not a marker file (a save writes its COMPLETE "
            "marker as a JSON file, last): --resume auto skips this checkpoint") in out, out
    assert "a save that did not finish" not in out


def test_an_explicit_resume_of_a_damaged_marker_is_refused_naming_why(run):
    run_dir, _ = run
    step4 = ckpt.checkpoint_dir(run_dir) / "step00000004"
    _damage(step4, _unlisted("client_rank1.pt"))
    with pytest.raises(ConfigError, match=rf"--resume {step4}: the checkpoint is damaged \(.*does not list 1 file\(s\) "
                                        r"its layout .* needs: client_rank1.pt \(rank 1's client state\)"):
        ckpt.choose(run_dir, str(step4))


def test_keys_a_newer_smelt_ds_may_add_are_not_damage(run, capsys):
    """Unknown keys, in the marker and in a file's entry, are kept and ignored."""
    run_dir, _ = run
    step4 = ckpt.checkpoint_dir(run_dir) / "step00000004"
    _damage(step4, lambda m: _entry("client_rank0.pt", compressed=False)({**m, "written_by": "smelt-ds 9"}))
    assert ckpt.marker_damage(step4) == []
    assert main(["checkpoint", "info", str(step4), "--verify"]) == 0
    assert "layout-free   yes" in capsys.readouterr().out
    assert ckpt.choose(run_dir, "auto") == step4


def test_a_marker_without_digests_needs_the_files_on_disk(run):
    """Markers of smelt-ds before file digests list no files: the files its layout needs must be in
    the directory instead."""
    run_dir, _ = run
    step4 = ckpt.checkpoint_dir(run_dir) / "step00000004"
    _damage(step4, _without("files"))
    assert ckpt.marker_damage(step4) == []
    (step4 / "zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    (problem,) = ckpt.marker_damage(step4)
    assert ("has no file digests (an older smelt-ds), and its directory lacks 1 file(s) its layout (2 rank(s), "
            "ZeRO-1, reference, EP 1) needs: zero_pp_rank_1_mp_rank_00_optim_states.pt or "
            "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt (rank 1's ZeRO optimizer partition)") in problem


def test_pruning_leaves_a_damaged_older_marker_alone(run):
    """``train.reference_weights: newest`` rewrites the older markers as it prunes: a damaged one
    is left as it is (it used to end the save with an AttributeError)."""
    run_dir, cfg = run
    root = ckpt.checkpoint_dir(run_dir)
    _damage(root / "step00000002", lambda m: [m])
    before = (root / "step00000002" / ckpt.MARKER).read_bytes()
    ckpt._prune(root, keep_last=2, drop_reference=True)
    assert (root / "step00000002" / ckpt.MARKER).read_bytes() == before
    assert ckpt.reference_files(root / "step00000002") is None


@pytest.mark.parametrize("layout", [
    dict(world=1, zero=0), dict(world=2, zero=0), dict(world=2, zero=2), dict(world=2, zero=3),
    dict(world=2, zero=1, bf16=True),
    dict(world=2, zero=2, backend="deepspeed", ep=2, moe_layers=4, experts=4),
    dict(world=2, zero=0, backend="deepspeed", ep=2, moe_layers=3, experts=4),
    dict(world=1, zero=0, backend="autoep", ep=1, moe_layers=4, experts=4),
    dict(world=2, zero=2, backend="autoep", ep=2, moe_layers=3, experts=4),
    dict(world=2, zero=3, backend="autoep", ep=2), dict(world=4, zero=3, backend="autoep", ep=2),
], ids=lambda d: "-".join(f"{k}{v}" for k, v in d.items()))
def test_every_file_a_save_writes_is_one_its_layout_needs(tmp_path, layout):
    """For the file sets real saves wrote (:mod:`tests.runs.checkpoint_files`): the marker listing
    them all is sound, and one listing all but any one of them is damaged, naming that file."""
    names = layout_files(layout["world"], layout["zero"], layout.get("backend", "reference"), layout.get("ep", 1),
                         moe_layers=layout.get("moe_layers", 0), experts=layout.get("experts", 0),
                         bf16=layout.get("bf16", False))
    d = tmp_path / "step00000004"
    d.mkdir()
    entry = {"sha256": "0" * 64, "bytes": 0}
    meta = {"step": 4, "tokens_seen": 0, "world_size": layout["world"], "zero_stage": layout["zero"],
            "moe_backend": layout.get("backend", "reference"), "ep_size": layout.get("ep", 1),
            "reference_weights": True, "layout_free": True}
    ckpt._write_marker(d, {**meta, "files": {n: entry for n in names}})
    assert ckpt.marker_damage(d) == []
    for name in names:
        ckpt._write_marker(d, {**meta, "files": {n: entry for n in names if n != name}})
        (problem,) = ckpt.marker_damage(d)
        assert "it does not list 1 file(s) its layout" in problem and name in problem.split("needs: ")[1], problem


@pytest.mark.slow
@pytest.mark.distributed
def test_resume_auto_past_a_marker_that_lists_no_file_continues_from_the_previous_checkpoint(
        two_rank_reference, tmp_path):
    """The shared 2-rank run (checkpoints at steps 22 and 24) with step 24's marker rewritten to list
    no file (its files all still there): ``smelt-ds train --resume auto`` moves step 24 aside saying
    why, resumes step 22, and trains steps 23 and 24 to the uninterrupted run's losses bit for bit
    (the same layout and data order). Before, it loaded step 24 unverified and trained 25 and 26."""
    ref = two_rank_reference
    run_dir = tmp_path / "run"
    shutil.copytree(ref.run_dir, run_dir, symlinks=True)
    recipe = two_ranks.write_recipe(tmp_path / "recipe.yaml", run_dir, ref.cache)
    root = ckpt.checkpoint_dir(run_dir)
    step24 = root / f"step{two_ranks.REFERENCE_STEPS:08d}"
    meta = ckpt.read_marker(step24)
    assert sorted(meta["files"]) == NEEDED  # what this layout's real save wrote: the file sets above
    assert main(["checkpoint", "info", str(step24), "--verify"]) == 0
    ckpt._write_marker(step24, {**meta, "files": {}})
    resumed = two_ranks.cli_train(recipe, "--resume", "auto", "--set", "train.exit_after_steps=2")
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert (f"checkpoint {step24} is damaged ({step24 / ckpt.MARKER} is damaged: it does not list {len(NEEDED)} "
            "file(s) its layout (2 rank(s), ZeRO-1, reference, EP 1) needs") in resumed.stderr, resumed.stderr[-4000:]
    assert (root / f"damaged-{step24.name}" / ckpt.MARKER).is_file()
    assert two_ranks.losses(run_dir) == ref.losses
