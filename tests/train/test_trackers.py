"""Experiment trackers (smelt_ds.train.trackers) read back from their own files.

One 2-rank training with W&B (offline), MLflow (a file store) and DeepSpeed's CSV monitor stops
after 2 of 4 steps (``train.exit_after_steps``) and resumes with ``--resume auto``. Every
``metrics.jsonl`` row must then be in each tracker once, at its step, with the same value (exact:
W&B stores a value as JSON text, MLflow and the CSV file as the float's repr, all of which read
back to the same float64); the config and budgets are in W&B's run config and MLflow's params and
artifacts; the resume continues the same W&B and MLflow runs; only rank 0 logs. W&B's offline
``.wandb`` file is read with wandb's own protobuf ``Record`` messages: the file is a LevelDB log
(``:W&B`` header, 32 KiB blocks, 7-byte record headers whose CRC32 is seeded with the record type,
as wandb's earlier Python ``datastore.py`` wrote and read it); every record's CRC is checked.
"""

from __future__ import annotations

import csv
import io
import json
import os
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import pytest
import yaml

from smelt_ds.config.loading import config_from_dict, config_to_dict
from smelt_ds.cost.budget import compute_budget
from smelt_ds.errors import ConfigError
from smelt_ds.testing import run_distributed, scaled_timeout

pytest.importorskip("wandb")
pytest.importorskip("mlflow")

TRACKED = ["wandb", "mlflow", "csv"]


def _raw(tmp: Path, cache: Path) -> dict:
    return {"name": "t",
            "model": {"vocab_size": 512, "hidden_size": 32, "num_layers": 4, "num_heads": 4, "num_kv_heads": 2,
                      "max_seq_len": 64},
            "moe": {"num_experts": 4, "top_k": 2, "expert_ffn_size": 32},
            "data": {"builtin_max_bytes": 150_000, "tokenizer": {"vocab_size": 512}, "cache_dir": str(cache)},
            "train": {"seq_len": 32, "micro_batch_size": 2, "max_steps": 4, "warmup_steps": 2, "log_every": 1,
                      "eval_every": 2, "save_every": 2, "exit_after_steps": 2, "run_dir": str(tmp / "run")},
            "eval": {"eval_batches": 2},
            "tracking": {"trackers": TRACKED, "wandb": {"mode": "offline", "project": "p"},
                         "mlflow": {"tracking_uri": f"file:{tmp / 'mlruns'}", "experiment": "e"}}}


def _worker(rank, world, raw, resume, probe_missing):
    """Train ``raw``; with ``probe_missing`` first try it with wandb not importable (the
    one-process path's check) and report the error and whether the run directory appeared."""
    from smelt_ds.train.loop import train

    os.environ["MLFLOW_ALLOW_FILE_STORE"] = "true"  # MLflow 3 refuses a file store without it
    probe = None
    if probe_missing:
        saved = sys.modules.get("wandb")
        sys.modules["wandb"] = None  # type: ignore[assignment]  # `import wandb` raises ImportError
        try:
            train(config_from_dict(raw), resume=resume)
        except ConfigError as e:
            probe = {"error": str(e), "run_dir_exists": Path(raw["train"]["run_dir"]).exists()}
        finally:
            if saved is None:
                del sys.modules["wandb"]
            else:
                sys.modules["wandb"] = saved
        # a tracker that cannot start (W&B online without a login, a store that refuses the run) is
        # found after the run directory was made and the config written: that new run leaves nothing
        from smelt_ds.train import trackers

        def refuse(*a, **k):  # the first tracker of the list: no other one has started files of its own
            raise ConfigError("tracking: wandb cannot start here")

        real, trackers._STARTERS["wandb"] = trackers._STARTERS["wandb"], refuse
        try:
            train(config_from_dict(raw), resume=resume)
        except ConfigError as e:
            probe["start_error"] = str(e)
            probe["run_dir_after_start_error"] = Path(raw["train"]["run_dir"]).exists()
        finally:
            trackers._STARTERS["wandb"] = real
    r = train(config_from_dict(raw), resume=resume)
    return {"step": r.step, "probe": probe}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tracked")
    raw = _raw(tmp, tmp_path_factory.getbasetemp() / "tiny-data-cache")  # shared with test_profiler.py
    first = run_distributed(_worker, 2, args=(raw, "none", True), timeout=300)
    run_dir = Path(raw["train"]["run_dir"])
    ids_first = json.loads((run_dir / "trackers" / "ids.json").read_text())
    # an invocation that crashed after its checkpoint at step 2 would have logged step 3 already
    with (run_dir / "trackers" / "csv" / "loss.csv").open("a") as f:
        csv.writer(f).writerow([3, 999.0])
    second = run_distributed(_worker, 2, args=(raw, "auto", False), timeout=300)
    assert [r["step"] for r in first] == [2, 2] and [r["step"] for r in second] == [4, 4]
    return {"raw": raw, "tmp": tmp, "run_dir": run_dir, "first": first, "ids_first": ids_first}


def _expected(run_dir: Path) -> dict[int, dict[str, float]]:
    """step -> the numeric fields of metrics.jsonl's rows at that step (train and val rows merged)."""
    out: dict[int, dict[str, float]] = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        step = row.pop("step")
        assert not set(row) & set(out.get(step, {})), f"step {step} logged twice in metrics.jsonl"
        out.setdefault(step, {}).update({k: v for k, v in row.items() if isinstance(v, (int, float))})
    return out


@pytest.mark.slow
@pytest.mark.distributed
def test_metrics_jsonl_holds_every_step_once(run):
    expected = _expected(run["run_dir"])
    assert sorted(expected) == [1, 2, 3, 4]
    assert all("loss" in expected[s] for s in expected) and "val/all" in expected[2] and "val/all" in expected[4]


# ---------------------------------------------------------------------------------------------
# W&B
# ---------------------------------------------------------------------------------------------


def _wandb_records(path: Path):
    """The protobuf Records of a ``.wandb`` transaction log (see the module docstring)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, block = path.read_bytes(), 32768
    assert data[:4] == b":W&B"
    pos, buf = 7, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # the rest of a block too short for a header is padding
            pos += left
            continue
        crc, n, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if (crc, n, kind) == (0, 0, 0):
            pos += left
            continue
        payload = data[pos + 7:pos + 7 + n]
        assert zlib.crc32(payload, zlib.crc32(bytes([kind]))) == crc, f"{path}: bad record at byte {pos}"
        pos += 7 + n
        buf = payload if kind in (1, 2) else buf + payload  # 1 full, 2 first, 3 middle, 4 last
        if kind in (1, 4):
            rec = pb.Record()
            rec.ParseFromString(buf)
            yield rec


def _key(item) -> str:
    """A history or config item's key: ``key``, or its one-part ``nested_key`` (we log flat keys)."""
    assert bool(item.key) != bool(item.nested_key) and len(item.nested_key) <= 1, item
    return item.key or item.nested_key[0]


def _wandb_runs(run_dir: Path) -> list[dict]:
    """Per offline run directory (in time order): its run id, history rows, and config."""
    out = []
    for d in sorted((run_dir / "trackers" / "wandb").glob("offline-run-*")):
        files = list(d.glob("run-*.wandb"))
        assert len(files) == 1, files
        history, config, run_ids = [], {}, set()
        for rec in _wandb_records(files[0]):
            kind = rec.WhichOneof("record_type")
            if kind == "history":
                history.append({_key(i): json.loads(i.value_json) for i in rec.history.item})
            elif kind == "run":
                run_ids.add(rec.run.run_id)
                config.update({_key(u): json.loads(u.value_json) for u in rec.run.config.update})
            elif kind == "config":
                config.update({_key(u): json.loads(u.value_json) for u in rec.config.update})
        out.append({"file": files[0].name, "run_ids": run_ids, "history": history, "config": config})
    return out


@pytest.mark.slow
@pytest.mark.distributed
def test_wandb_offline_history_equals_metrics_jsonl_and_resume_continues_the_run(run):
    runs = _wandb_runs(run["run_dir"])
    run_id = run["ids_first"]["wandb"]
    assert len(runs) == 2  # one per invocation: rank 1 never started a W&B run
    assert json.loads((run["run_dir"] / "trackers" / "ids.json").read_text())["wandb"] == run_id
    for r in runs:
        assert r["file"] == f"run-{run_id}.wandb" and r["run_ids"] == {run_id}
    rows = [h for r in runs for h in r["history"]]
    steps = [h["_step"] for h in rows]
    assert steps == [1, 2, 3, 4]  # each step once, the resumed invocation's from step 3
    assert [h["_step"] for h in runs[1]["history"]] == [3, 4]
    expected = _expected(run["run_dir"])
    for h in rows:
        assert {k: v for k, v in h.items() if not k.startswith("_")} == expected[h["_step"]]


@pytest.mark.slow
@pytest.mark.distributed
def test_wandb_config_holds_the_resolved_config_and_budgets(run):
    saved = yaml.safe_load((run["run_dir"] / "config.yaml").read_text())
    cfg = config_from_dict(saved)
    budget = compute_budget(cfg, cfg.train.seq_len).as_dict()
    for r in _wandb_runs(run["run_dir"]):
        config = {k: v for k, v in r["config"].items() if k != "_wandb"}
        assert config == {**config_to_dict(cfg), "budget": budget}


# ---------------------------------------------------------------------------------------------
# MLflow
# ---------------------------------------------------------------------------------------------


def _mlflow(run, monkeypatch):
    from mlflow import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    return MlflowClient(run["raw"]["tracking"]["mlflow"]["tracking_uri"])


@pytest.mark.slow
@pytest.mark.distributed
def test_mlflow_metric_history_equals_metrics_jsonl_and_resume_continues_the_run(run, monkeypatch):
    client = _mlflow(run, monkeypatch)
    exp = client.get_experiment_by_name("e")
    runs = client.search_runs([exp.experiment_id])
    assert [r.info.run_id for r in runs] == [run["ids_first"]["mlflow"]]  # one run, both invocations, rank 0
    run_id = runs[0].info.run_id
    assert runs[0].info.status == "FINISHED"
    expected = _expected(run["run_dir"])
    keys = {k for values in expected.values() for k in values}
    assert set(runs[0].data.metrics) == keys
    for key in keys:
        history = sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))
        assert history == [(s, expected[s][key]) for s in sorted(expected) if key in expected[s]], key


@pytest.mark.slow
@pytest.mark.distributed
def test_mlflow_params_and_artifacts_hold_the_config_and_budgets(run, monkeypatch):
    client = _mlflow(run, monkeypatch)
    run_id = run["ids_first"]["mlflow"]
    saved_text = (run["run_dir"] / "config.yaml").read_text()
    cfg = config_from_dict(yaml.safe_load(saved_text))
    budget = compute_budget(cfg, cfg.train.seq_len).as_dict()
    params = client.get_run(run_id).data.params
    assert params["model.hidden_size"] == "32" and params["train.max_steps"] == "4"
    assert params["loop.position"] == "middle"
    assert {k: params[f"budget.{k}"] for k in budget} == {
        k: v if isinstance(v, str) else json.dumps(v) for k, v in budget.items()}
    where = Path(client.download_artifacts(run_id, "", str(run["tmp"] / "artifacts")))
    assert (where / "config.yaml").read_text() == saved_text
    assert json.loads((where / "budget.json").read_text()) == budget


# ---------------------------------------------------------------------------------------------
# DeepSpeed's CSV monitor
# ---------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.distributed
def test_csv_files_equal_metrics_jsonl_after_a_resume(run):
    expected = _expected(run["run_dir"])
    keys = {k for values in expected.values() for k in values}
    folder = run["run_dir"] / "trackers" / "csv"
    assert {p.stem for p in folder.glob("*.csv")} == {k.replace("/", "_") for k in keys}
    for key in keys:
        rows = list(csv.reader(io.StringIO((folder / f"{key.replace('/', '_')}.csv").read_text())))
        assert rows[0] == ["step", key.split("/")[-1]]  # one header: the resumed monitor wrote none
        got = [(int(s), float(v)) for s, v in rows[1:]]
        # the row a crashed invocation left at step 3 (999.0) is gone, the resumed one is there
        assert got == [(s, expected[s][key]) for s in sorted(expected) if key in expected[s]], key


# ---------------------------------------------------------------------------------------------
# refusals before training
# ---------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.distributed
def test_missing_tracker_is_refused_in_the_one_process_path_before_the_run_directory(run):
    for rank in (0, 1):  # every rank raises rank 0's error: none waits in a collective
        probe = run["first"][rank]["probe"]
        assert "pip install 'smelt-ds[wandb]'" in probe["error"] and "`tracking.trackers`" in probe["error"]
        assert not probe["run_dir_exists"]
        # a tracker failing to start after config.yaml was written: the refused new run leaves no directory
        assert "wandb cannot start here" in probe["start_error"]
        if rank == 0:  # rank 0 removes it (rank 1 may look before it has)
            assert not probe["run_dir_after_start_error"]


@pytest.mark.parametrize("tracker", ["wandb", "mlflow"])
def test_missing_tracker_is_refused_before_the_launcher(tmp_path, monkeypatch, capsys, tracker):
    from smelt_ds.cli import main

    monkeypatch.setitem(sys.modules, tracker, None)  # `import <tracker>` raises ImportError
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump({"name": "t", "tracking": {"trackers": [tracker]}}))
    rc = main(["train", str(recipe), "--run-dir", str(tmp_path / "run"), "--nproc", "2"])
    err = capsys.readouterr().err
    assert rc == 2
    assert f"pip install 'smelt-ds[{tracker}]'" in err and "launching" not in err
    assert not (tmp_path / "run").exists()


def test_an_mlflow_store_mlflow_refuses_names_the_field(tmp_path, monkeypatch):
    from smelt_ds.config.tracking import MlflowSection
    from smelt_ds.train.trackers import mlflow_client

    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    with pytest.raises(ConfigError, match=r"`tracking.mlflow.tracking_uri` .*MLFLOW_ALLOW_FILE_STORE=true"):
        mlflow_client(MlflowSection(tracking_uri=f"file:{tmp_path / 'mlruns'}"))


def test_a_tracker_listed_twice_or_unknown_is_refused():
    with pytest.raises(ConfigError, match=r"`tracking.trackers` .*\['csv'\] more than once"):
        config_from_dict({"tracking": {"trackers": ["csv", "csv"]}})
    with pytest.raises(ConfigError, match="tracking.trackers"):
        config_from_dict({"tracking": {"trackers": ["tensorboardx"]}})


def test_a_resume_may_change_tracking_and_profile_and_a_new_run_refuses_their_files(tmp_path):
    from smelt_ds.train.guards import _check_resume_overrides, earlier_run_files

    old = config_to_dict(config_from_dict({}))
    new = config_to_dict(config_from_dict({"tracking": {"trackers": ["csv"]},
                                           "profile": {"enabled": True, "ranks": [1]}}))
    _check_resume_overrides(new, old, tmp_path, "auto")  # profiling or logging a resumed run is allowed
    (tmp_path / "trackers").mkdir()
    (tmp_path / "profile").mkdir()
    assert earlier_run_files(tmp_path) == ["trackers", "profile"]  # a new run here would mix two runs' files


def _closed_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_unreachable_trackers_refuse_the_start_or_fall_back_as_the_recipe_chose(tmp_path, monkeypatch, capsys):
    """W&B online and MLflow with servers on closed ports: `on_unreachable: error` (the default)
    refuses at the first; `fallback` warns, names both, and returns them for start_trackers."""
    from smelt_ds.train.trackers import check_trackers

    monkeypatch.setenv("WANDB_BASE_URL", f"http://127.0.0.1:{_closed_port()}")
    monkeypatch.delenv("WANDB_MODE", raising=False)
    raw = _raw(tmp_path, tmp_path / "cache")
    raw["tracking"] = {"trackers": ["wandb", "mlflow"], "wandb": {"mode": "online"},
                       "mlflow": {"tracking_uri": f"http://127.0.0.1:{_closed_port()}"}}
    with pytest.raises(ConfigError, match=r"`tracking.mlflow.tracking_uri`.*no MLflow server answered"):
        check_trackers(config_from_dict(raw))
    raw["tracking"]["on_unreachable"] = "fallback"
    assert check_trackers(config_from_dict(raw)) == ["mlflow", "wandb"]
    err = capsys.readouterr().err
    assert "tracking.on_unreachable is 'fallback': MLflow is left out of this run" in err
    assert "tracking.on_unreachable is 'fallback': W&B logs offline into RUN/trackers/wandb" in err


def test_a_run_falls_back_to_wandb_offline_and_trains_without_mlflow(tmp_path):
    """The journey: `smelt-ds train` with W&B online and MLflow whose servers do not answer, and
    `tracking.on_unreachable: fallback`: the run trains to its end, W&B writes an offline run for
    `wandb sync`, MLflow is left out (no id recorded), metrics.jsonl holds every step."""
    raw = _raw(tmp_path, tmp_path / "cache")
    raw["train"].update(max_steps=2, exit_after_steps=None, eval_every=2, save_every=2)
    raw["tracking"] = {"trackers": ["wandb", "mlflow"], "on_unreachable": "fallback",
                       "wandb": {"mode": "online", "project": "p"},
                       "mlflow": {"tracking_uri": f"http://127.0.0.1:{_closed_port()}"}}
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump(raw))
    env = {k: v for k, v in os.environ.items() if k != "WANDB_MODE"}
    env["WANDB_BASE_URL"] = f"http://127.0.0.1:{_closed_port()}"
    r = subprocess.run([sys.executable, "-m", "smelt_ds.train", str(recipe)], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=scaled_timeout(300))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "W&B logs offline into RUN/trackers/wandb" in r.stderr and "MLflow is left out of this run" in r.stderr
    run = tmp_path / "run"
    assert list((run / "trackers" / "wandb").rglob("offline-run-*"))
    assert set(json.loads((run / "trackers" / "ids.json").read_text())) == {"wandb"}
    assert [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()
            if "loss" in json.loads(line)] == [1, 2]
