"""`smelt-ds memory RECIPE` from a recipe's defaults: the layout render-job uses, a verdict on the
recipe's own setting with the terms over and fixes that fit when re-estimated, the layout flags,
`--device-memory` units, and the exit status (0 fits, 3 does not fit, 2 bad input).

References: render-job's own plan (`plan_job`) for the layout and its memory total; the recipe
YAML read with yaml for the layout fields; the ZeRO-2 decomposition of DeepSpeed's estimator
written out by hand for the optimizer-state term; `estimate` re-run on the suggested settings."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from smelt_ds.cli import main as cli_main
from smelt_ds.launch.jobs import JobOptions, plan_job
from smelt_ds.launch.placement import MIN_HEADROOM, resolve
from smelt_ds.parallel.memory import GiB, estimate, param_counts
from smelt_ds.study.recipes import shipped_recipes

M = "recipes/m/smelt.yaml"
#: m/smelt on 1 node x 2 GPUs of 40 GiB: its ZeRO-2 without checkpointing needs about 72 GiB
TIGHT = ["--nodes", "1", "--gpus-per-node", "2", "--device-memory", "40GiB"]


def _memory(capsys, *argv: str) -> tuple[int, dict]:
    rc = cli_main(["memory", *argv, "--json"])
    out = capsys.readouterr().out
    return rc, json.loads(out) if out.strip() else {}


def _check_verdict(d: dict) -> None:
    """The verdict against the report's own configured row, recomputed here."""
    v, row, dev = d["verdict"], d["configured"], d["device_memory"]
    assert (v["option"], v["policy"], v["total"]) == (row["option"], row["policy"], row["total"])
    assert v["headroom"] == pytest.approx((dev - row["total"]) / dev)
    assert v["fits"] == ((dev - row["total"]) / dev >= MIN_HEADROOM)
    assert d["exit_status"] == (0 if v["fits"] else 3)
    # the terms add up to the total: parameters + gradients + optimizer + ZeRO-3 layer + activation peak + buffers
    assert sum(t["bytes"] for t in v["terms"]) == row["total"]
    assert [t["bytes"] for t in v["terms"]] == sorted((t["bytes"] for t in v["terms"]), reverse=True)
    acts = next(t for t in v["terms"] if t["name"] == "activations")
    assert acts["bytes"] == row["activations_peak"]


def test_every_shipped_recipe_gets_a_verdict_on_render_jobs_layout(capsys):
    for entry in shipped_recipes():
        rc, d = _memory(capsys, str(entry.path))
        plan = plan_job(entry.path, JobOptions(scheduler="slurm"))
        lay = d["layout"]
        assert (lay["name"], lay["nodes"], lay["gpus_per_node"]) == \
            (plan.layout_name, plan.nodes, plan.gpus_per_node), entry.path
        assert (d["nodes"], d["gpus_per_node"]) == (plan.nodes, plan.gpus_per_node)
        assert d["micro_batch"] == plan.config.train.micro_batch_size and lay["overrides"] == plan.train_args[1::2]
        # render-job estimates the same row on the same device memory (tiny: its CPU stand-in, in fp32)
        assert d["device_memory"] == int(plan.layout.device_memory_gib * GiB)
        assert d["configured"]["total"] == plan.memory.configured.total, entry.path
        assert d["precision"] == plan.memory.precision, entry.path
        if not lay["from_recipe"]:
            assert entry.size == "tiny" and lay["gpu"] == "cpu" and d["precision"] == "fp32"
            assert "has no `cluster.layouts`" in d["notes"][0]
        _check_verdict(d)
        assert rc == d["exit_status"]


#: settings of m/smelt that do not fit: 1 x 2 GPUs (optimizer states over; 8 nodes fit); the default 4 x 8
#: GPUs of 22.5 GiB (activations over; zero2 + looped would leave only 4.5% free: not a fix); 4 x 2 GPUs
#: of 12 GiB with looped checkpointing (only zero3+param_off with full checkpointing fits)
NOT_FITTING = [TIGHT, ["--device-memory", "22.5GiB"],
               ["--gpus-per-node", "2", "--device-memory", "12GiB",
                "--set", "train.activation_checkpointing.policy=looped"]]


@pytest.mark.parametrize("argv", NOT_FITTING, ids=["1x2-40GiB", "4x8-22.5GiB", "4x2-12GiB-looped"])
def test_a_layout_that_does_not_fit_names_the_terms_over_and_fixes_that_fit(capsys, argv):
    rc, d = _memory(capsys, M, *argv)
    v = d["verdict"]
    assert rc == 3 and not v["fits"]
    _check_verdict(d)
    dev = d["device_memory"]
    assert v["over_by"] == d["configured"]["total"] - int(dev * (1 - MIN_HEADROOM)) > 0
    # `over` is the fewest largest terms that together reach the excess
    sizes = {t["name"]: t["bytes"] for t in v["terms"]}
    assert [t["name"] for t in v["terms"]][:len(v["over"])] == v["over"]
    assert sum(sizes[n] for n in v["over"]) >= v["over_by"] > sum(sizes[n] for n in v["over"][:-1])
    # every fix fits when re-estimated from the recipe with its --set overrides and flags
    sets = [argv[i + 1] for i, a in enumerate(argv) if a == "--set"]
    assert v["fixes"]
    for f in v["fixes"]:
        fixed = resolve(M, overrides=sets + f["overrides"]).config
        nodes = int(f["flags"][1]) if f["flags"] else d["nodes"]
        assert f["flags"] in ([], ["--nodes", str(nodes)])
        row = estimate(fixed, nodes, d["gpus_per_node"], dev).configured
        assert (row.option, row.policy, row.total) == (f["option"], f["policy"], f["total"]), f
        assert row.headroom >= MIN_HEADROOM, f


def test_the_terms_over_and_the_fewest_nodes_that_fit(capsys):
    _, d = _memory(capsys, M, *TIGHT)
    v = d["verdict"]
    sizes = {t["name"]: t["bytes"] for t in v["terms"]}
    # the largest term: ZeRO-2 optimizer states (fp32 master + Adam moments, 12 B/param) of the dense part
    # over 2 GPUs and of half the experts (ep_size 2) over their expert-data-parallel group of 1 GPU
    cfg = resolve(M).config
    c = param_counts(cfg)
    assert v["over"][0] == "optimizer states"
    assert abs(sizes["optimizer states"] - (12 * c.dense / 2 + 12 * c.expert / 2)) <= 2
    # the node count is the smallest that fits: no smaller one the global batch splits over does
    t = cfg.train
    micro_batches = t.global_batch_tokens // (t.micro_batch_size * t.seq_len)
    n = next(int(f["flags"][1]) for f in v["fixes"] if f["flags"])
    smaller = [k for k in range(1, n) if micro_batches % (2 * k) == 0]
    assert n > 1 and smaller
    assert all(estimate(cfg, k, 2, 40 * GiB).configured.headroom < MIN_HEADROOM for k in smaller)
    # activations alone exceed 22.5 GiB less 10%: no node count helps, and the text says so
    _, d = _memory(capsys, M, "--device-memory", "22.5GiB")
    assert d["verdict"]["nodes_searched"] and not any(f["flags"] for f in d["verdict"]["fixes"])
    assert cli_main(["memory", M, "--device-memory", "22.5GiB"]) == 3
    assert "more nodes do not bring the recipe's own setting under" in capsys.readouterr().out


def test_terms_add_up_to_the_total_where_deepspeeds_estimate_rounds(capsys):
    """ZeRO-2 on 7 GPUs: 6P/7 + 12P/7 truncated apart differ from DeepSpeed's int(18P/7) by a byte."""
    _, d = _memory(capsys, "recipes/tiny/smelt.yaml", "--gpus-per-node", "7", "--precision", "bf16",
                   "--set", "deepspeed.zero_stage=2")
    r = d["configured"]
    assert r["model_states"] != r["params"] + r["grads"] + r["optimizer"] + r["zero3_gathered"]
    _check_verdict(d)


def test_the_verdict_text_and_exit_status(capsys):
    assert cli_main(["memory", M, *TIGHT]) == 3
    out = capsys.readouterr().out
    assert re.search(r"verdict: DOES NOT FIT: the recipe's own setting, zero2 \+ checkpointing none, needs "
                     r"[\d.]+ GiB of 40.00 GiB per GPU, [\d.]+ GiB over the 36.00 GiB", out)
    assert re.search(r"^  over: optimizer states [\d.]+ GiB \(\d+% of the total\): ZeRO", out, re.M)
    assert "fits instead: " in out and "(--nodes " in out and "exit status 3" in out
    assert cli_main(["memory", M]) == 0
    assert re.search(r"verdict: FITS: .* per GPU, \+\d+\.\d% headroom", capsys.readouterr().out)


def _yaml_layouts(path: Path) -> dict:
    """``cluster.layouts`` as the YAML files write them (following ``base:`` to the file that sets them)."""
    raw = yaml.safe_load(path.read_text())
    while "cluster" not in raw and "base" in raw:
        path = path.parent / raw["base"]
        raw = yaml.safe_load(path.read_text())
    return raw["cluster"]["layouts"]


def test_layout_nodes_and_gpus_per_node(capsys):
    raw = _yaml_layouts(Path(M))
    rc, d = _memory(capsys, M, "--layout", "h200")
    h200 = raw["h200"]
    assert rc == 0 and d["layout"]["name"] == "h200" and d["device_memory"] == int(h200["device_memory_gib"] * GiB)
    assert [f"train.micro_batch_size={d['micro_batch']}"] == h200["overrides"]
    assert (d["nodes"], d["gpus_per_node"]) == (h200["nodes"], h200["gpus_per_node"])
    # --device-memory wins over the layout's; --nodes / --gpus-per-node over its sizes
    rc, d = _memory(capsys, M, "--layout", "h200", "--device-memory", "141GB", "--nodes", "2", "--gpus-per-node", "4")
    assert (d["device_memory"], d["nodes"], d["gpus_per_node"]) == (141 * 10 ** 9, 2, 4)
    assert d["layout"]["device_memory_from"] == "--device-memory"
    want = estimate(resolve(M, "h200").config, 2, 4, 141 * 10 ** 9).configured.total
    assert d["configured"]["total"] == want


@pytest.mark.parametrize("argv,match", [
    (["--nodes", "1", "--gpus-per-node", "3"],
     r"`moe_runtime.ep_size` \(2\) does not divide the world size \(1 node"
     r"\(s\) x 3 GPU\(s\) = 3\).* --nodes / --gpus-per-node .*--gpus-per-node 4"),
    (["--nodes", "0"], r"`--nodes` \(0\) must be a positive integer"),
    (["--gpus-per-node", "-2"], r"`--gpus-per-node` \(-2\) must be a positive integer"),
    (["--gpus-per-node", "16"], r"more GPUs than a node of layout 'h100' has"),
    (["--layout", "b200"], r"--layout 'b200'.*\['h100', 'h200'\]"),
    (["--device-memory", "80"], r"`--device-memory` \('80'\) has no unit.*79.1GiB.*139.7GiB"),
    (["--device-memory", "8e10"], r"`--device-memory` \('8e10'\) has no unit"),
    (["--device-memory", "0GiB"], r"`--device-memory` \('0GiB'\) must be a positive memory size.*79.1GiB"),
    (["--device-memory=-1GB"], r"`--device-memory` \('-1GB'\) must be a positive memory size"),
])
def test_bad_flags_exit_2_naming_the_flag_and_fix(capsys, argv, match):
    assert cli_main(["memory", M, *argv]) == 2
    assert re.search(match, capsys.readouterr().err)


@pytest.mark.parametrize("text,want", [("80GiB", 80 * 2 ** 30), ("141GB", 141 * 10 ** 9), ("0.5 TiB", 2 ** 39),
                                       ("512mib", 2 ** 29), ("2048B", 2048)])
def test_device_memory_units(capsys, text, want):
    _, d = _memory(capsys, "recipes/tiny/smelt.yaml", "--device-memory", text)
    assert d["device_memory"] == want
    assert d["verdict"]["headroom"] == pytest.approx((want - d["configured"]["total"]) / want)


def test_tiny_keeps_one_gpu_and_a_tiny_device_prints_no_nonsense_percentages(capsys):
    assert cli_main(["memory", "recipes/tiny/smelt.yaml", "--layout", "h100"]) == 2
    assert "has no `cluster.layouts`" in capsys.readouterr().err
    assert cli_main(["memory", "recipes/tiny/smelt.yaml", "--device-memory", "1KiB"]) == 3
    out = capsys.readouterr().out
    rows = [r.split("|") for r in out.splitlines() if r.startswith("| zero")]
    assert rows
    for cells in rows:
        total_mib, headroom = float(cells[11]), cells[14].strip()
        m = re.fullmatch(r"needs ([\d.e+]+)x", headroom)
        assert m, headroom  # every row needs far more than 1 KiB: a ratio, not a percentage of thousands
        # the ratio is printed to 3 significant digits (0.5% at most) and the total to 0.005 MiB of ~100 MiB
        assert float(m.group(1)) == pytest.approx(total_mib * 2 ** 20 / 1024, rel=1e-2)
