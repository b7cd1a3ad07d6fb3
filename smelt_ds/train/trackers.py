"""Experiment trackers beside TensorBoard (the recipe's ``tracking`` section), on rank 0 only.

Every ``metrics.jsonl`` row goes to every tracker of ``tracking.trackers`` with the optimizer step
as its x-axis (:class:`smelt_ds.train.metrics.MetricsWriter` calls :meth:`Tracker.log`): its
numeric fields (``step`` itself and non-numeric values left out), under the same keys. At the
start of each invocation the resolved config (``config_to_dict``) and the three budgets
(:func:`smelt_ds.cost.budget.compute_budget`'s ``as_dict``) are logged once.

- ``wandb``: DeepSpeed's own ``deepspeed.monitor.wandb.WandbMonitor`` (``wandb.init`` +
  ``wandb.log(row, step=step)``), built here rather than by the engine, whose monitor would log
  DeepSpeed's events against global samples (W&B drops a step lower than the last one). W&B reads
  its run id, resume mode, directory, name and mode from its documented environment variables
  (``WANDB_RUN_ID``, ``WANDB_RESUME=allow``, ``WANDB_DIR``, ``WANDB_NAME``, ``WANDB_MODE``), set
  only while the monitor starts. Files: ``RUN/trackers/wandb/``; config and budgets in the run's
  config (``budget`` key).
- ``mlflow``: the ``mlflow`` client API (DeepSpeed has no MLflow monitor): one MLflow run,
  metrics with ``step=``, the config and budgets flattened into params (``model.hidden_size``,
  ``budget.train_flops_per_token``; a value longer than MLflow's limit is left to the artifact)
  and as the artifacts ``config.yaml`` / ``budget.json``.
- ``csv``: DeepSpeed's own ``deepspeed.monitor.csv_monitor.csvMonitor``: one ``<metric>.csv``
  (``step,value`` rows; ``/`` in a key becomes ``_``) per metric in ``RUN/trackers/csv/``.

A resume (``--resume`` from step S > 0) continues the same tracker runs: their ids are kept in
``RUN/trackers/ids.json``; only rows after S are logged, as for ``metrics.jsonl``. CSV files drop
their rows after S (an earlier invocation that crashed after its last checkpoint logged them).
W&B and MLflow cannot delete logged points: after such a crash, they keep the rows between the
checkpoint and the crash, and W&B ignores the resumed run's rows up to the last step it holds.
MLflow params cannot change: a resume that changes an allowed field (``train.max_steps``) keeps
the first value in params; the ``config.yaml`` artifact is the resumed config.
"""

from __future__ import annotations

import csv
import importlib
import io
import json
import os
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from smelt_ds.config.loading import config_to_dict, dump_config
from smelt_ds.config.run import RunConfig
from smelt_ds.config.tracking import MlflowSection, WandbSection
from smelt_ds.errors import ConfigError
from smelt_ds.files import write_json_atomic, write_text_atomic
from smelt_ds.mappings import updated_environ

__all__ = ["Tracker", "TRACKERS_DIR", "IDS_FILE", "INSTALL_HINTS", "FALLBACKS", "check_trackers", "start_trackers",
           "check_mlflow_server", "check_wandb_server", "check_wandb_login", "scalars", "read_ids", "WandbTracker",
           "MlflowTracker", "CsvTracker"]

#: where the trackers' files and ids live, inside the run directory
TRACKERS_DIR = "trackers"
#: tracker name -> its run id (``RUN/trackers/ids.json``)
IDS_FILE = "ids.json"
#: tracker -> (the module it needs, how to install it)
INSTALL_HINTS = {"wandb": ("wandb", "pip install 'smelt-ds[wandb]'"),
                 "mlflow": ("mlflow", "pip install 'smelt-ds[mlflow]'"),
                 "csv": ("deepspeed.monitor.csv_monitor", "pip install deepspeed")}


class Tracker(Protocol):
    """One experiment tracker: ``run_id`` (None when it has none), ``log`` a row, ``close``."""

    name: str
    run_id: str | None

    def log(self, step: int, values: dict[str, float]) -> None: ...

    def close(self) -> None: ...


def scalars(row: dict[str, Any]) -> dict[str, float]:
    """The numeric fields of a ``metrics.jsonl`` row, ``step`` and booleans left out."""
    return {k: v for k, v in row.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "step"}


# ---------------------------------------------------------------------------------------------
# checks before training
# ---------------------------------------------------------------------------------------------


def check_trackers(cfg: RunConfig) -> list[str]:
    """Check, before training starts, that each tracker of ``tracking.trackers`` can start.
    Returns the trackers whose server did not answer when ``tracking.on_unreachable`` is
    ``fallback`` (a warning is printed; :func:`start_trackers` then falls back for them).

    Raises ConfigError for a tracker whose package cannot be imported (naming ``pip install
    'smelt-ds[wandb]'`` / ``[mlflow]``), an MLflow tracking URI whose store MLflow's client refuses
    (see :func:`mlflow_client`), and, with ``on_unreachable: error``, an MLflow server
    (:func:`check_mlflow_server`) or W&B server in online mode (:func:`check_wandb_server`) that
    does not answer."""
    for name in cfg.tracking.trackers:
        module, hint = INSTALL_HINTS[name]
        try:
            importlib.import_module(module)
        except ImportError as e:
            raise ConfigError(f"`tracking.trackers` ({cfg.tracking.trackers}) lists {name!r}, whose package `{module}` "
                              f"cannot be imported ({e}): install it ({hint}), or remove {name!r} from "
                              "tracking.trackers") from None
    probes: list[tuple[str, Callable[[], None]]] = []
    if "mlflow" in cfg.tracking.trackers:
        mlflow_client(cfg.tracking.mlflow)
        probes.append(("mlflow", lambda: check_mlflow_server(cfg.tracking.mlflow)))
    if "wandb" in cfg.tracking.trackers:
        probes.append(("wandb", lambda: check_wandb_server(cfg.tracking.wandb)))
    unreachable: list[str] = []
    for tracker, probe in probes:
        try:
            probe()
        except ConfigError as e:
            if cfg.tracking.on_unreachable != "fallback":
                raise
            what = FALLBACKS[tracker]
            print(f"tracking: warning: {e}; tracking.on_unreachable is 'fallback': {what}", file=sys.stderr)
            unreachable.append(tracker)
    return unreachable


#: what ``tracking.on_unreachable: fallback`` does for a tracker whose server does not answer
FALLBACKS = {"wandb": "W&B logs offline into RUN/trackers/wandb (upload later with `wandb sync`)",
             "mlflow": "MLflow is left out of this run (metrics.jsonl and TensorBoard hold every metric)"}


#: seconds a tracker's server has to answer before training starts (MLflow's own client retries 7
#: times with exponential backoff and a 120 s timeout each: many minutes of silence; W&B's init
#: waits 90 s)
MLFLOW_PROBE_TIMEOUT_S = 10.0
#: the W&B server when WANDB_BASE_URL is unset (W&B's own default)
WANDB_DEFAULT_URL = "https://api.wandb.ai"


def _unreachable(url: str, timeout_s: float, accept: tuple[int, ...] | None = None) -> str | None:
    """None when ``url`` answers within ``timeout_s`` seconds with a status below 500, or with one
    of ``accept`` when given; else what failed (name resolution, refused connection, timeout, a
    5xx: a proxy or gateway in front of a stopped server, or a status not accepted)."""
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=timeout_s):
            return None
    except urllib.error.HTTPError as e:
        if (e.code in accept) if accept is not None else e.code < 500:
            return None
        if e.code < 500:
            return f"HTTP {e.code} {e.reason}: something answered, but not the tracking server's health check"
        return f"HTTP {e.code} {e.reason}: a proxy or gateway answered, not the server"
    except (urllib.error.URLError, OSError) as e:
        why = getattr(e, "reason", e)
        return why if isinstance(why, str) else f"{type(why).__name__}: {why}"


def check_mlflow_server(section: MlflowSection, timeout_s: float = MLFLOW_PROBE_TIMEOUT_S) -> None:
    """For an ``http(s)://`` tracking URI (``tracking.mlflow.tracking_uri``, else
    ``MLFLOW_TRACKING_URI``): one request to the server's ``/health`` within ``timeout_s`` seconds
    (:func:`_unreachable`): 200, or 401 / 403 (authentication in front of it). Raises ConfigError
    naming the URI, what failed and the fix, instead of the minutes MLflow's client would spend
    retrying in silence. Other stores are not probed."""
    uri = section.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or ""
    if not uri.startswith(("http://", "https://")):
        return
    # MLflow's server answers /health with 200; 401 / 403: it is there, behind authentication (the
    # client sends MLFLOW_TRACKING_USERNAME / _TOKEN); a 404 is another web server on that port
    what = _unreachable(uri.rstrip("/") + "/health", timeout_s, accept=(401, 403))
    if what is not None:
        raise ConfigError(f"`tracking.mlflow.tracking_uri` ({uri}): no MLflow server answered within {timeout_s:g} s "
                          f"({what}): start the server or fix the address (a login node may reach hosts the compute "
                          "nodes cannot), or leave mlflow out of tracking.trackers (metrics.jsonl and TensorBoard "
                          "are always written)")


def check_wandb_login(url: str, mode: str) -> None:
    """W&B online needs an API key for the server ``url``: ``WANDB_API_KEY``, or the ``~/.netrc``
    entry (``$NETRC``) that ``wandb login`` writes for the server's host, where W&B itself looks.
    Raises ConfigError naming the host and the fix; W&B would otherwise refuse the run at start
    ("log in with wandb login"), after the queue. A key given only in code (``wandb.login(key=)``)
    is not seen here."""
    import netrc
    import urllib.parse

    if os.environ.get("WANDB_API_KEY"):
        return
    host = urllib.parse.urlparse(url).hostname or url
    path = os.path.expanduser(os.environ.get("NETRC") or "~/.netrc")
    try:
        if netrc.netrc(path).authenticators(host):
            return
    except (FileNotFoundError, netrc.NetrcParseError, OSError):
        pass
    raise ConfigError(f"`tracking.wandb.mode` ({mode!r}): no W&B API key for {host} (neither WANDB_API_KEY nor an "
                      f"entry in {path}): run `wandb login` where the job runs (it writes {path}) or export "
                      "WANDB_API_KEY, or log offline with --set tracking.wandb.mode=offline")


def check_wandb_server(section: WandbSection, timeout_s: float = MLFLOW_PROBE_TIMEOUT_S) -> None:
    """For W&B in online mode (``tracking.wandb.mode``, else ``WANDB_MODE``, else online): one
    request to the W&B server (``WANDB_BASE_URL``, else :data:`WANDB_DEFAULT_URL`) within
    ``timeout_s`` seconds, then its API key (:func:`check_wandb_login`). Raises ConfigError naming
    the server, what failed and the fix (offline mode, where W&B writes files to upload later).
    Offline and disabled modes are not probed."""
    mode = section.mode or os.environ.get("WANDB_MODE") or "online"
    if mode not in ("online", "run"):
        return
    url = os.environ.get("WANDB_BASE_URL") or WANDB_DEFAULT_URL
    what = _unreachable(url, timeout_s)
    if what is None:
        check_wandb_login(url, mode)
        return
    raise ConfigError(f"`tracking.wandb.mode` ({mode!r}): the W&B server {url} did not answer within {timeout_s:g} s "
                      f"({what}): log offline with --set tracking.wandb.mode=offline (upload later with `wandb sync`), "
                      "set WANDB_BASE_URL to your W&B server, or leave wandb out of tracking.trackers")


def mlflow_client(section: MlflowSection):
    """``mlflow.MlflowClient(section.tracking_uri)``. Raises ConfigError naming
    ``tracking.mlflow.tracking_uri`` when MLflow refuses the store (MLflow 3 refuses a ``file:``
    store unless ``MLFLOW_ALLOW_FILE_STORE=true``; ``sqlite:`` needs SQLAlchemy, which
    ``mlflow-skinny`` lacks)."""
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    try:
        return MlflowClient(section.tracking_uri)
    except (MlflowException, ImportError) as e:
        uri = section.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or "MLflow's default"
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(f"`tracking.mlflow.tracking_uri` ({section.tracking_uri!r}, resolved: {uri}): MLflow cannot "
                          f"open this tracking store: {first}: point it at a tracking server (e.g. "
                          "http://host:5000), or use a local file store with MLFLOW_ALLOW_FILE_STORE=true "
                          "(e.g. --set tracking.mlflow.tracking_uri=file:./mlruns)") from None


# ---------------------------------------------------------------------------------------------
# start
# ---------------------------------------------------------------------------------------------


def read_ids(run_dir: Path) -> dict[str, str]:
    """The tracker run ids stored in ``run_dir/trackers/ids.json`` ({} when none)."""
    path = run_dir / TRACKERS_DIR / IDS_FILE
    return json.loads(path.read_text()) if path.is_file() else {}


def start_trackers(cfg: RunConfig, run_dir: Path, start_step: int, budget: dict[str, Any],
                   unreachable: list[str] | tuple[str, ...] = ()) -> list[Tracker]:
    """Start the trackers of ``cfg.tracking.trackers`` (call on rank 0 only) and log the resolved
    config and ``budget`` (the budgets' ``as_dict``) to each. ``start_step``: the step training
    continues from; above 0 each tracker continues its run stored in ``RUN/trackers/ids.json``
    (a tracker without a stored id starts a new run). ``unreachable``: trackers whose server did
    not answer (:func:`check_trackers` with ``on_unreachable: fallback``): W&B starts offline,
    MLflow is left out (:data:`FALLBACKS`). Writes the ids. Raises ConfigError when a tracker
    cannot start (e.g. W&B online without a login); trackers already started are closed."""
    if "wandb" in unreachable:
        wandb = cfg.tracking.wandb.model_copy(update={"mode": "offline"})
        cfg = cfg.model_copy(update={"tracking": cfg.tracking.model_copy(update={"wandb": wandb})})
    names = [t for t in cfg.tracking.trackers if not (t == "mlflow" and "mlflow" in unreachable)]
    if not names:
        return []
    root = run_dir / TRACKERS_DIR
    root.mkdir(parents=True, exist_ok=True)
    ids = read_ids(run_dir) if start_step > 0 else {}
    config = config_to_dict(cfg)
    started: list[Tracker] = []
    try:
        for name in names:
            if start_step > 0 and name not in ids and name != "csv":
                print(f"tracking: {name}: no run id in {root / IDS_FILE}: a new {name} run starts at step "
                      f"{start_step + 1}", file=sys.stderr)
            started.append(_STARTERS[name](cfg, root, ids.get(name), start_step, config, budget))
    except BaseException:
        for t in started:
            t.close()
        raise
    write_json_atomic(root / IDS_FILE, {t.name: t.run_id for t in started if t.run_id is not None})
    return started


class WandbTracker:
    """W&B through DeepSpeed's ``WandbMonitor`` (see the module docstring)."""

    name = "wandb"

    def __init__(self, cfg: RunConfig, root: Path, run_id: str | None, start_step: int, config: dict[str, Any],
                 budget: dict[str, Any]):
        import wandb
        from deepspeed.monitor.config import WandbConfig
        from deepspeed.monitor.wandb import WandbMonitor

        s = cfg.tracking.wandb
        self.run_id: str | None = run_id or uuid.uuid4().hex[:12]  # W&B ids: [a-z0-9], unique per project
        env = {"WANDB_RUN_ID": self.run_id, "WANDB_RESUME": "allow", "WANDB_DIR": str(root),
               "WANDB_NAME": s.name or cfg.name}
        if s.mode is not None:
            env["WANDB_MODE"] = s.mode
        try:
            with updated_environ(env):
                self.monitor = WandbMonitor(WandbConfig(enabled=True, project=s.project, group=s.group, team=s.entity))
        except wandb.errors.Error as e:
            raise ConfigError(f"`tracking.wandb.mode` ({s.mode!r}): W&B could not start its run: {e}: log in with "
                              "`wandb login` (or set WANDB_API_KEY), or log offline with --set "
                              "tracking.wandb.mode=offline and upload later with `wandb sync`") from None
        wandb.config.update({**config, "budget": budget}, allow_val_change=True)

    def log(self, step: int, values: dict[str, float]) -> None:
        self.monitor.log(values, step=step)

    def close(self) -> None:
        import wandb

        wandb.finish()


class MlflowTracker:
    """MLflow through its client API (see the module docstring)."""

    name = "mlflow"

    def __init__(self, cfg: RunConfig, root: Path, run_id: str | None, start_step: int, config: dict[str, Any],
                 budget: dict[str, Any]):
        s = cfg.tracking.mlflow
        self.client = mlflow_client(s)
        try:
            self._start(cfg, run_id, config, budget)
        except ConfigError:
            raise
        except Exception as e:  # MlflowException, requests errors: the server refused the run
            uri = s.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or "MLflow's default"
            raise ConfigError(f"`tracking.mlflow.tracking_uri` ({uri}): MLflow could not start the run "
                              f"({type(e).__name__}: {str(e)[:300]}): check the server and its credentials "
                              "(MLFLOW_TRACKING_USERNAME / MLFLOW_TRACKING_TOKEN), or leave mlflow out of "
                              "tracking.trackers") from None

    def _start(self, cfg: RunConfig, run_id: str | None, config: dict[str, Any], budget: dict[str, Any]) -> None:
        """Create (or resume) the MLflow run and log the config and budgets once."""
        from mlflow.entities import Param, RunStatus
        from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH

        s = cfg.tracking.mlflow
        if run_id is None:
            exp = self.client.get_experiment_by_name(s.experiment)
            exp_id = exp.experiment_id if exp is not None else self.client.create_experiment(s.experiment)
            run_id = self.client.create_run(exp_id, run_name=s.run_name or cfg.name).info.run_id
        else:
            self.client.update_run(run_id, status=RunStatus.to_string(RunStatus.RUNNING))
        self.run_id = run_id
        logged = self.client.get_run(run_id).data.params
        flat = _flatten({**config, "budget": budget})
        params = [Param(k, v) for k, v in flat.items() if k not in logged and len(v) <= MAX_PARAM_VAL_LENGTH]
        self.client.log_batch(run_id, params=params)
        self.client.log_text(run_id, dump_config(cfg), "config.yaml")
        self.client.log_dict(run_id, budget, "budget.json")

    def log(self, step: int, values: dict[str, float]) -> None:
        from mlflow.entities import Metric

        ms = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, float(v), ms, step) for k, v in values.items()])

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


def _flatten(d: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """Nested dicts as ``{"a.b": str(value)}`` (lists and scalars as JSON)."""
    out: dict[str, str] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v if isinstance(v, str) else json.dumps(v)
    return out


class CsvTracker:
    """DeepSpeed's ``csvMonitor`` in ``RUN/trackers/csv/`` (see the module docstring)."""

    name = "csv"
    run_id: str | None = None

    def __init__(self, cfg: RunConfig, root: Path, run_id: str | None, start_step: int, config: dict[str, Any],
                 budget: dict[str, Any]):
        from deepspeed.monitor.config import CSVConfig
        from deepspeed.monitor.csv_monitor import csvMonitor

        self.monitor = csvMonitor(CSVConfig(enabled=True, output_path=str(root), job_name="csv"))
        existing = sorted(Path(self.monitor.log_dir).glob("*.csv"))
        for path in existing:
            _drop_rows_after(path, start_step)
        # the monitor writes a header the first time *it* writes a file: not again into a resumed one
        self.monitor.filenames = [p.stem for p in existing]

    def log(self, step: int, values: dict[str, float]) -> None:
        self.monitor.write_events([(k, v, step) for k, v in values.items()])

    def close(self) -> None:
        return None


def _drop_rows_after(path: Path, step: int) -> None:
    """Rewrite one csvMonitor file (``step,<name>`` header, then ``step,value`` rows) without the
    rows after ``step`` (atomically)."""
    rows = list(csv.reader(path.read_text().splitlines()))
    keep = rows[:1] + [r for r in rows[1:] if r and int(r[0]) <= step]
    if len(keep) != len(rows):
        text = io.StringIO()
        csv.writer(text).writerows(keep)  # the monitor's own dialect (csv.writer's default)
        write_text_atomic(path, text.getvalue())


_STARTERS: dict[str, Callable[..., Tracker]] = {"wandb": WandbTracker, "mlflow": MlflowTracker, "csv": CsvTracker}
