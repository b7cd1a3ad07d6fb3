"""``bench/checkpoint_cost.py`` at its smallest setting: the reference backend on 1 rank, one save
with and one without the shards, in a subprocess.

Checked against what is computed here: the parameter count of a plain :class:`SmeltLM` of the
recipe; the shards' bytes against 4 bytes per element of its state dict plus a bounded archive
overhead per tensor; the with/without byte difference equal to the shards' bytes; the printed
table parsed back against the JSON's arithmetic.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("deepspeed")

from smelt_ds.config.loading import load_config  # noqa: E402
from smelt_ds.model import SmeltLM  # noqa: E402
from smelt_ds.testing.distributed import scaled_timeout  # noqa: E402

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "checkpoint_cost.py"
RECIPE = "recipes/tiny/smelt.yaml"
TINY = ["model.vocab_size=64", "model.hidden_size=32", "model.num_heads=4", "model.num_kv_heads=2",
        "model.max_seq_len=32", "moe.num_experts=4", "moe.top_k=2", "moe.expert_ffn_size=16", "train.seq_len=16",
        "train.micro_batch_size=2"]
# torch.save's zip archive, per tensor: a local header (30 B + name) and a central-directory entry
# (46 B + name) for its storage record, alignment of the data to 64 B, and its pickle entry (well
# under 200 B); names here are under 60 characters: 512 B per tensor bounds it. Plus the archive's
# fixed records (data.pkl header, version, byteorder, end of directory): 4 KiB.
PER_TENSOR, FIXED = 512, 4096


def test_bench_reports_the_shards_bytes_and_both_save_times(tmp_path):
    out = tmp_path / "result.json"
    sets = [a for kv in TINY for a in ("--set", kv)]
    proc = subprocess.run([sys.executable, str(SCRIPT), "--recipe", RECIPE, "--backends", "reference", "--repeats",
                           "1", *sets, "--json", str(out)], cwd=ROOT, capture_output=True, text=True,
                          timeout=scaled_timeout(300))
    assert proc.returncode == 0, proc.stderr[-4000:]
    [row] = json.loads(out.read_text())
    cfg = load_config(ROOT / RECIPE, TINY)
    model = SmeltLM(cfg.model, cfg.moe, cfg.loop)
    state = model.state_dict()
    assert row["params"] == sum(p.numel() for p in model.parameters())
    payload = 4 * sum(t.numel() for t in state.values())
    assert payload <= row["shard_bytes"] <= payload + PER_TENSOR * len(state) + FIXED
    assert row["bytes_with"] - row["bytes_without"] == row["shard_bytes"]
    assert row["bytes_without"] == row["deepspeed_bytes"] + row["client_bytes"]
    assert row["seconds_with"] > 0 and row["seconds_without"] > 0
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("reference "))
    fields = line.split()
    assert int(fields[4]) == row["params"] and int(fields[5]) == row["deepspeed_bytes"]
    assert int(fields[7]) == row["shard_bytes"]
    assert float(fields[9]) == pytest.approx(row["bytes_with"] / row["bytes_without"], abs=5e-4)  # printed %.3f
    assert float(fields[12]) == pytest.approx(row["seconds_with"] / row["seconds_without"], abs=5e-3)  # %.2f
