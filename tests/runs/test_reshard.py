"""A run stopped at one layout and resumed at another continues on the uninterrupted run's trajectory.

Run A (the module fixture): the tiny SMELT on 2 gloo ranks, AutoEP EP 2, ZeRO-3, 10 optimizer
steps of a 4-sample global batch (micro-batch 1), a checkpoint every 2 steps. Each case copies a
checkpoint of A (or of an earlier case) into its own run directory, as if the run had stopped
there, and resumes it with ``--resume auto`` at another layout through ``smelt-ds train --nproc N``
(the deepspeed launcher). Its losses at the resumed steps and its final weights (the final
checkpoint's reference-layout shards) must equal A's.

Tolerance: the new layout computes the same sums in another order (one rank sums the micro-batches
two ranks all-reduce, per-expert vs grouped matmuls, ZeRO-3's partitioned vs whole reductions).
Each optimizer step's loss and update is a chain of reductions of length ``N_STEP``
(:func:`tests.numerics.lm_chain_length` over the step's tokens), and step ``s`` carries the chains
of all steps before it: losses relative, and weights element-wise relative to the tensor's
largest, within Higham & Mary's probabilistic bound over ``s * N_STEP`` (:func:`tests.numerics.prob_tol`:
2.7e-4 at step 10). Measured: 4e-8 (losses), 2e-7 (weights). Each of these fails on a mutant of
:mod:`smelt_ds.runs.reshard` (moments left at zero, the data position reset, an expert's moments
given to another expert): see the module's commit message.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from smelt_ds.config.loading import load_config
from smelt_ds.errors import ConfigError
from smelt_ds.runs import checkpoint as ckpt
from smelt_ds.runs.reference_weights import merge_reference_shards
from smelt_ds.runs.reshard import plan_resume
from smelt_ds.testing import scaled_timeout
from tests import two_ranks
from tests.numerics import lm_chain_length, prob_tol
from tests.runs.checkpoint_files import layout_files, writer

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

STEPS, GLOBAL = 10, 4


def _raw(run_dir: Path, cache: Path, backend: str, ep: int, zero: int, **train) -> dict:
    raw = two_ranks.recipe_raw(run_dir, cache)
    raw["train"].update({"micro_batch_size": 1, "gradient_accumulation_steps": 2, "max_steps": STEPS,
                         "save_every": 2, "keep_last": 5, **train})
    raw["deepspeed"] = {"zero_stage": zero}
    raw["moe_runtime"] = {"backend": backend, **({"ep_size": ep} if backend != "reference" else {})}
    if backend == "deepspeed":  # dropless, as the other backends: the same function, so the same trajectory
        raw["moe_runtime"]["drop_tokens"] = False
    return raw


def _write(path: Path, raw: dict) -> Path:
    path.write_text(yaml.safe_dump(raw))
    return path


def _train(recipe: Path, nproc: int, *extra: str) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "smelt_ds.cli", "train", str(recipe), "--nproc", str(nproc), *extra],
                          cwd=two_ranks.ROOT, env=two_ranks.train_env(), capture_output=True, text=True,
                          timeout=scaled_timeout(300))
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


def _stopped_copy(src: Path, dest: Path, step: int) -> Path:
    """``src``'s run directory as if the run had stopped after saving step ``step``."""
    shutil.copytree(src, dest)
    root = ckpt.checkpoint_dir(dest)
    for d in root.glob("step*"):
        if int(d.name[4:]) > step:
            shutil.rmtree(d)
    (root / "latest").write_text(f"step{step:08d}")
    return dest


def _weights(run_dir: Path, recipe: Path) -> dict[str, torch.Tensor]:
    final = ckpt.latest_complete(run_dir)
    assert final is not None and final.name == f"step{STEPS:08d}"
    world = json.loads((final / ckpt.MARKER).read_text())["world_size"]
    return merge_reference_shards(final, load_config(recipe), world)


class Reference:
    def __init__(self, root: Path):
        self.cache = root / "cache"
        self.run = root / "A"
        self.recipe = _write(root / "A.yaml", _raw(self.run, self.cache, "autoep", 2, 3))
        _train(self.recipe, 2)
        self.losses = two_ranks.losses(self.run)
        self.weights = _weights(self.run, self.recipe)
        self.n_step = lm_chain_length(load_config(self.recipe), tokens=GLOBAL * 32)


@pytest.fixture(scope="module")
def ref(tmp_path_factory) -> Reference:
    return Reference(tmp_path_factory.mktemp("reshard"))


def _resume(ref: Reference, src: Path, at: int, dest: Path, nproc: int, backend: str, ep: int, zero: int,
            *extra: str) -> tuple[Path, subprocess.CompletedProcess]:
    run = _stopped_copy(src, dest, at)
    recipe = _write(dest.with_suffix(".yaml"), _raw(run, ref.cache, backend, ep, zero))
    return recipe, _train(recipe, nproc, "--resume", "auto", *extra)


def _assert_on_trajectory(ref: Reference, run: Path, recipe: Path, first: int) -> None:
    got = two_ranks.losses(run)
    assert sorted(got) == list(range(1, STEPS + 1))
    worst = max(abs(got[s] - ref.losses[s]) / abs(ref.losses[s]) for s in range(first, STEPS + 1))
    print(f"{run}: largest relative loss difference over steps {first}-{STEPS}: {worst:.2e}")
    for s in range(first, STEPS + 1):
        tol = prob_tol(s * ref.n_step)
        assert abs(got[s] - ref.losses[s]) <= tol * abs(ref.losses[s]), (s, got[s], ref.losses[s], tol)
    mine = _weights(run, recipe)
    assert mine.keys() == ref.weights.keys()
    tol = prob_tol(STEPS * ref.n_step)
    rel = max(float((mine[k] - w).abs().max()) / (float(w.abs().max()) or 1.0) for k, w in ref.weights.items())
    print(f"{run}: largest weight difference relative to its tensor's largest: {rel:.2e}")
    for k, want in ref.weights.items():
        if want.is_floating_point():
            scale = float(want.abs().max()) or 1.0
            assert float((mine[k] - want).abs().max()) <= tol * scale, (k, tol)
        else:
            assert torch.equal(mine[k], want), k


@pytest.fixture(scope="module")
def one_rank(ref, tmp_path_factory):
    """A's step 4 (AutoEP EP 2, ZeRO-3, 2 ranks) resumed on 1 rank, reference backend, ZeRO-0."""
    dest = tmp_path_factory.mktemp("one") / "run"
    recipe, proc = _resume(ref, ref.run, 4, dest, 1, "reference", 1, 0)
    return dest, recipe, proc


def test_autoep_zero3_on_2_ranks_to_reference_zero0_on_1_rank(ref, one_rank):
    run, recipe, proc = one_rank
    assert ("resuming step00000004 at another layout (ranks 2 -> 1; ZeRO stage 3 -> 0; MoE backend autoep -> "
            "reference; EP size 2 -> 1)") in proc.stderr
    assert "micro-batch 1 x accumulation 2 -> 4 (the run's global batch of 4 samples kept)" in proc.stderr
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    change = [r for r in rows if "layout_change" in r]
    assert len(change) == 1 and change[0]["step"] == 4
    assert change[0]["layout_change"]["from"] == {"world_size": 2, "zero_stage": 3, "moe_backend": "autoep",
                                                  "ep_size": 2}
    assert change[0]["layout_change"]["to"] == {"world_size": 1, "zero_stage": 0, "moe_backend": "reference",
                                                "ep_size": 1}
    _assert_on_trajectory(ref, run, recipe, 5)


def test_one_rank_to_autoep_ep2_zero2_on_2_ranks(ref, one_rank, tmp_path):
    recipe, _ = _resume(ref, one_rank[0], 6, tmp_path / "run", 2, "autoep", 2, 2)
    _assert_on_trajectory(ref, tmp_path / "run", recipe, 7)


def test_deepspeed_moe_zero2_then_autoep_zero3_a_backend_switch(ref, one_rank, tmp_path):
    """From the 1-rank checkpoint at step 6: DeepSpeed-MoE EP 2 ZeRO-2 for 2 steps, then that
    checkpoint (written by DeepSpeed-MoE) resumed on AutoEP EP 2 at ZeRO-3."""
    run = tmp_path / "run"
    _resume(ref, one_rank[0], 6, run, 2, "deepspeed", 2, 2, "--set", "train.exit_after_steps=2")
    assert json.loads((ckpt.latest_complete(run) / ckpt.MARKER).read_text())["moe_backend"] == "deepspeed"
    recipe = _write(tmp_path / "autoep.yaml", _raw(run, ref.cache, "autoep", 2, 3))
    proc = _train(recipe, 2, "--resume", "auto")
    assert "MoE backend deepspeed -> autoep" in proc.stderr
    _assert_on_trajectory(ref, run, recipe, 7)


def _damage(shard: Path) -> None:
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one byte changed, same size
    shard.write_bytes(bytes(data))


def test_data_parallel_2_to_4_with_ep_2_past_damaged_newest_checkpoints(ref, tmp_path):
    """A's run stopped after step 6, whose reference shard of rank 1 has one byte changed: the 4-rank
    resume sets step 6 aside (as a resume at the same layout does) and continues from step 4 at the
    new layout, for 2 steps. Then its own step 6 (4 ranks) is damaged too: the next 4-rank resume,
    at that checkpoint's layout, falls back to step 4 at A's layout and converts it, to step 10."""
    run = _stopped_copy(ref.run, tmp_path / "run", 6)
    _damage(ckpt.checkpoint_dir(run) / "step00000006" / "reference" / "rank00001.pt")
    recipe = _write(tmp_path / "run.yaml", _raw(run, ref.cache, "autoep", 2, 3))
    proc = _train(recipe, 4, "--resume", "auto", "--set", "train.exit_after_steps=2")
    assert "step00000006 is damaged" in proc.stderr and "has another SHA-256 than when written" in proc.stderr
    assert "resuming step00000004 at another layout (ranks 2 -> 4" in proc.stderr
    assert "accumulation 2 -> 1" in proc.stderr
    assert (ckpt.checkpoint_dir(run) / "damaged-step00000006" / "reference" / "rank00001.pt").is_file()
    newest = ckpt.latest_complete(run)
    assert newest.name == "step00000006" and json.loads((newest / ckpt.MARKER).read_text())["world_size"] == 4
    _damage(newest / "reference" / "rank00003.pt")
    proc = _train(recipe, 4, "--resume", "auto")
    assert "resuming step00000004 at another layout (ranks 2 -> 4" in proc.stderr
    # the recipe's accumulation (A's, on 2 ranks) is replaced at the 4-rank layout, and the console says so
    assert "train.gradient_accumulation_steps: the recipe's 2 -> 1 on 4 rank(s)" in proc.stderr
    _assert_on_trajectory(ref, run, recipe, 5)


def test_aux_loss_free_bias_survives_a_resume_at_another_layout(ref, tmp_path):
    """The reference backend with the aux-loss-free router bias (the only backend that has it) on
    2 ranks at ZeRO-1, stopped at step 4 and resumed on 1 rank at ZeRO-3: the same losses, and the
    same biases (moved from zero by the updates before and after the resume)."""
    a_run = tmp_path / "A"
    extra = {"moe": {"num_experts": 4, "top_k": 2, "expert_ffn_size": 32, "aux_loss_free_bias": True}}
    a = _write(tmp_path / "A.yaml", {**_raw(a_run, ref.cache, "reference", 1, 1), **extra})
    _train(a, 2)
    b_run = _stopped_copy(a_run, tmp_path / "B", 4)
    b = _write(tmp_path / "B.yaml", {**_raw(b_run, ref.cache, "reference", 1, 3), **extra})
    _train(b, 1, "--resume", "auto")
    want, got = two_ranks.losses(a_run), two_ranks.losses(b_run)
    print(f"{b_run}: largest relative loss difference over steps 5-{STEPS}: "
          f"{max(abs(got[s] - want[s]) / abs(want[s]) for s in range(5, STEPS + 1)):.2e}")
    for s in range(5, STEPS + 1):
        assert abs(got[s] - want[s]) <= prob_tol(s * ref.n_step) * abs(want[s]), s
    wa, wb = _weights(a_run, a), _weights(b_run, b)
    biases = [k for k in wa if k.endswith("expert_bias")]
    assert biases and all(float(wa[k].abs().max()) > 0 for k in biases)
    for k in biases:  # sign updates of a fixed rate: equal unless a count differed
        assert torch.equal(wa[k], wb[k]), k


# --------------------------------------------------------------------------------------------
# another micro-batch size: the same samples in every optimizer step, the same trajectory
# --------------------------------------------------------------------------------------------
#
# Run M: 1 rank, the reference backend at ZeRO-1, micro-batch 4 x accumulation 1 (a 4-sample global
# batch), MB_STEPS steps, a checkpoint every 2. Its step 2 is resumed with micro-batches of 2
# (accumulation 2) on 1 rank, and of 1 (accumulation 2) on 2 ranks. Each resumed step must read M's
# samples, in M's order across the ranks' micro-batches, and continue M's losses and weights.
#
# train.aux_loss_coef is 0 here: the load-balancing loss is the one term of the objective that is
# not a mean over the step's tokens (E sum_e f_e P_e multiplies two means over one micro-batch), so
# regrouping the step's samples into other micro-batches changes it beyond rounding (docs/changing_scale.md).
# Every other term (the LM loss, the z-loss, the aux-loss-free bias counts) is a sum or an equal-weight
# mean over the step's micro-batches of the same size, which DeepSpeed averages over the accumulation
# and the ranks: the same value, summed in another order. Tolerance as above: prob_tol(s * N_STEP).

MB_STEPS = 4


def _mb_raw(run: Path, cache: Path, micro: int) -> dict:
    return _raw(run, cache, "reference", 1, 1, micro_batch_size=micro, gradient_accumulation_steps=None,
                max_steps=MB_STEPS, aux_loss_coef=0.0)


def _fit(rank: int, world: int, raw: dict, resume: str) -> dict:
    from smelt_ds.config.loading import config_from_dict
    from smelt_ds.train.loop import train

    r = train(config_from_dict(raw), resume=resume)
    return {"ids": r.sample_ids, "losses": r.losses, "step": r.step}


def _final_weights(run: Path, raw: dict) -> dict[str, torch.Tensor]:
    from smelt_ds.config.loading import config_from_dict

    final = ckpt.latest_complete(run)
    assert final is not None and final.name == f"step{MB_STEPS:08d}"
    return merge_reference_shards(final, config_from_dict(raw), ckpt.read_marker(final)["world_size"])


@pytest.fixture(scope="module")
def micro4(tmp_path_factory):
    """Run M (see above): ``(run dir, cache, its sample ids and losses per step, its final weights, N_STEP)``."""
    from smelt_ds.config.loading import config_from_dict
    from smelt_ds.testing import run_distributed

    root = tmp_path_factory.mktemp("micro4")
    raw = _mb_raw(root / "M", root / "cache", 4)
    got = run_distributed(_fit, 1, args=(raw, "none"), timeout=300)[0]
    assert got["step"] == MB_STEPS and all(len(ids) == 4 for ids in got["ids"])
    return (root / "M", root / "cache", got, _final_weights(root / "M", raw),
            lm_chain_length(config_from_dict(raw), tokens=4 * 32))


def _on_micro4_trajectory(micro4, raw: dict, resumed: list[dict]) -> None:
    """The resumed steps 3..MB_STEPS (``resumed``: each rank's result) read M's samples in M's order
    (rank r's micro-batch m of a step holds M's positions ``(m W + r) B ..``), and their losses
    and final weights are M's within the tolerance."""
    _, _, want, weights, n_step = micro4
    world, micro = len(resumed), raw["train"]["micro_batch_size"]
    for k in range(MB_STEPS - 2):
        order = [i for m in range(len(resumed[0]["ids"][k]) // micro) for r in range(world)
                 for i in resumed[r]["ids"][k][m * micro:(m + 1) * micro]]
        assert order == want["ids"][2 + k], (k, order, want["ids"][2 + k])
    losses = resumed[0]["losses"]
    assert len(losses) == MB_STEPS - 2 and all(r["losses"] == losses for r in resumed)
    print(f"micro-batch {micro} on {world} rank(s): largest relative loss difference "
          f"{max(abs(g - w) / abs(w) for g, w in zip(losses, want['losses'][2:], strict=True)):.2e}")
    for k, got in enumerate(losses):
        s, ref_loss = 3 + k, want["losses"][2 + k]
        assert abs(got - ref_loss) <= prob_tol(s * n_step) * abs(ref_loss), (s, got, ref_loss)
    mine = _final_weights(Path(raw["train"]["run_dir"]), raw)
    assert mine.keys() == weights.keys()
    tol = prob_tol(MB_STEPS * n_step)
    for k, w in weights.items():
        assert float((mine[k] - w).abs().max()) <= tol * (float(w.abs().max()) or 1.0), k


def _resume_micro4(micro4, dest: Path, micro: int, world: int) -> tuple[dict, list[dict], list[dict]]:
    """M's step 2 resumed in ``dest`` on ``world`` ranks with micro-batches of ``micro``: its recipe,
    each rank's result and the rows of its ``metrics.jsonl``."""
    from smelt_ds.testing import run_distributed

    run = _stopped_copy(micro4[0], dest, 2)
    raw = _mb_raw(run, micro4[1], micro)
    resumed = run_distributed(_fit, world, args=(raw, "auto"), timeout=300)
    return raw, resumed, [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_a_smaller_micro_batch_at_the_same_layout_reads_the_same_samples_per_step(micro4, tmp_path):
    """M's step 2 resumed on 1 rank with micro-batches of 2: accumulation 1 -> 2 (the global batch
    kept), DeepSpeed's own files loaded (no conversion), M's samples and trajectory."""
    raw, resumed, rows = _resume_micro4(micro4, tmp_path / "run", 2, 1)
    change = [r["micro_batch_change"] for r in rows if "micro_batch_change" in r]
    assert len(change) == 1 and change[0]["micro_batch_size"] == [4, 2] and change[0]["accumulation"] == [1, 2]
    assert change[0]["converted"] == [] and not any("layout_change" in r for r in rows)
    _on_micro4_trajectory(micro4, raw, resumed)


def test_a_micro_batch_change_at_another_layout_continues_the_trajectory(micro4, tmp_path):
    """M's step 2 (1 rank, micro-batch 4) resumed on 2 ranks with micro-batches of 1 and
    accumulation 2: converted from the layout-free state; every step's 4 samples are M's, rank 0
    reading M's positions 0 and 2, rank 1 positions 1 and 3."""
    raw, resumed, rows = _resume_micro4(micro4, tmp_path / "run", 1, 2)
    change = [r["layout_change"] for r in rows if "layout_change" in r]
    assert len(change) == 1 and change[0]["micro_batch_size"] == [4, 1] and change[0]["accumulation"] == [1, 2]
    assert change[0]["from"]["world_size"] == 1 and change[0]["to"]["world_size"] == 2
    _on_micro4_trajectory(micro4, raw, resumed)


# --------------------------------------------------------------------------------------------
# what a resume at another layout refuses (no training: a checkpoint marker is enough)
# --------------------------------------------------------------------------------------------


def _fake_checkpoint(run_dir: Path, **meta) -> Path:
    """The marker of a 2-rank ZeRO-3 AutoEP EP 2 checkpoint, listing the files that layout writes
    (:mod:`tests.runs.checkpoint_files`; not on disk: the plan reads the marker only)."""
    d = ckpt.checkpoint_dir(run_dir) / "step00000004"
    d.mkdir(parents=True)
    files = {n: {"sha256": "0" * 64, "bytes": 0, "rank": writer(n)} for n in layout_files(2, 3, "autoep", 2)}
    base = {"step": 4, "tokens_seen": 512, "world_size": 2, "zero_stage": 3, "moe_backend": "autoep", "ep_size": 2,
            "micro_batch_size": 1, "global_batch_samples": 4, "layout_free": True, "files": files}
    (d / ckpt.MARKER).write_text(json.dumps({**base, **meta}))
    return d


def _cfg(tmp_path: Path, backend="autoep", ep=2, zero=3, **train):
    return load_config(_write(tmp_path / "r.yaml", _raw(tmp_path / "run", tmp_path / "cache", backend, ep, zero,
                                                        **train)))


def test_a_world_size_that_cannot_form_the_global_batch_names_the_nearest_that_can(tmp_path):
    _fake_checkpoint(tmp_path / "run", global_batch_samples=8)
    with pytest.raises(ConfigError, match=r"6 rank\(s\) cannot form the run's global batch of 8 samples .*resume on "
                                          r"2, 4 or 8 rank\(s\) \(expert-parallel size 2\)"):
        plan_resume(_cfg(tmp_path), tmp_path / "run", "auto", 6)


def test_a_checkpoint_without_the_layout_free_state_resumes_only_at_its_layout(tmp_path):
    _fake_checkpoint(tmp_path / "run", layout_free=False)
    with pytest.raises(ConfigError, match="holds no layout-free training state.*resume it at its own layout "
                                          r"\(2 rank\(s\), ZeRO-3, autoep, EP 2\)"):
        plan_resume(_cfg(tmp_path, "reference", 1, 0), tmp_path / "run", "auto", 1)
    cfg, plan = plan_resume(_cfg(tmp_path), tmp_path / "run", "auto", 2)  # at its own layout: DeepSpeed loads it
    assert plan is None and cfg.train.gradient_accumulation_steps == 2


def test_another_micro_batch_keeps_the_global_batch_and_a_size_that_cannot_form_it_is_refused(tmp_path):
    _fake_checkpoint(tmp_path / "run")
    cfg, plan = plan_resume(_cfg(tmp_path, micro_batch_size=2, gradient_accumulation_steps=1), tmp_path / "run",
                            "auto", 2)
    assert cfg.train.gradient_accumulation_steps == 1 and plan is not None and plan.changes == {}
    assert (plan.old["micro_batch_size"], plan.new["micro_batch_size"], plan.old_accum, plan.new_accum) == (1, 2, 2, 1)
    with pytest.raises(ConfigError, match=r"2 rank\(s\) cannot form the run's global batch of 4 samples from "
                                          r"micro-batches of 4 .*on 2 rank\(s\) with train.micro_batch_size 1 or 2"):
        plan_resume(_cfg(tmp_path, micro_batch_size=4, gradient_accumulation_steps=1), tmp_path / "run", "auto", 2)


def test_an_expert_parallel_size_that_does_not_divide_the_experts_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="ep_size"):
        _cfg(tmp_path, "autoep", 3, 3)


def test_checkpoint_info_lists_what_the_checkpoint_holds_and_where_it_resumes(ref, tmp_path, capsys):
    """``smelt-ds checkpoint info`` on A: its step and layout, the batch, every file, and the layouts
    the run's recipe resumes at: 1, 2 or 4 ranks (the divisors of 4 micro-batches per step), each
    with the EP sizes that divide both the ranks and the 4 experts (DeepSpeed-MoE up to ZeRO-2). An
    incomplete checkpoint, and (``--verify``) a damaged one, exit 1."""
    from smelt_ds import cli

    assert cli.main(["checkpoint", "info", str(ref.run)]) == 0
    out = capsys.readouterr().out
    final = ckpt.latest_complete(ref.run)
    files = [p for p in final.rglob("*") if p.is_file()]
    assert f"checkpoint    {final}\n" in out and f"step          {STEPS} ({STEPS * GLOBAL * 32:,} tokens seen)" in out
    assert "layout        2 rank(s), ZeRO-3, autoep, EP 2" in out
    assert "batch         global batch 4 samples of micro-batch 1" in out
    assert f"files         {len(files)}, {sum(p.stat().st_size for p in files):,} bytes" in out
    listed = dict(line.strip().split(" rank(s): ") for line in out.splitlines() if " rank(s): " in line
                  and line.startswith("  "))
    assert listed == {
        "1": "reference (ZeRO 0-3); deepspeed EP 1 (ZeRO 0-2); autoep EP 1 (ZeRO 0-3)",
        "2": "reference (ZeRO 0-3); deepspeed EP 1 (ZeRO 0-2); deepspeed EP 2 (ZeRO 0-2); autoep EP 1 (ZeRO 0-3); "
             "autoep EP 2 (ZeRO 0-3)",
        "4": "reference (ZeRO 0-3); deepspeed EP 1 (ZeRO 0-2); deepspeed EP 2 (ZeRO 0-2); deepspeed EP 4 (ZeRO 0-2); "
             "autoep EP 1 (ZeRO 0-3); autoep EP 2 (ZeRO 0-3); autoep EP 4 (ZeRO 0-3)"}
    copy = _stopped_copy(ref.run, tmp_path / "run", STEPS)
    ck = ckpt.latest_complete(copy)
    _damage(ck / "reference" / "rank00001.pt")
    assert cli.main(["checkpoint", "info", str(copy)]) == 0
    capsys.readouterr()
    assert cli.main(["checkpoint", "info", str(ck), "--verify"]) == 1
    assert "has another SHA-256 than when written" in capsys.readouterr().out
    # the run directory: the checkpoint --resume auto loads, the damaged newer one set aside, saying why
    assert cli.main(["checkpoint", "info", str(copy), "--verify"]) == 0
    out = capsys.readouterr().out
    assert f"set aside     {ck.name}, newer, is damaged: " in out and "has another SHA-256 than when written" in out
    (ck / ckpt.MARKER).unlink()
    assert cli.main(["checkpoint", "info", str(ck)]) == 1
    assert "complete      no: no COMPLETE marker" in capsys.readouterr().out
