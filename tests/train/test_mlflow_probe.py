"""An MLflow tracking server that does not answer stops ``smelt-ds train`` at start with one
message naming the URI, within the probe's timeout, instead of MLflow's silent retries (minutes)."""

from __future__ import annotations

import http.server
import socket
import threading
import time
from pathlib import Path

import pytest

from smelt_ds.config.tracking import MlflowSection
from smelt_ds.errors import ConfigError
from smelt_ds.train.trackers import check_mlflow_server

ROOT = Path(__file__).resolve().parents[2]


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again when the block ends: nothing listens there


def test_a_refused_connection_is_named_with_the_uri_and_the_fix():
    uri = f"http://127.0.0.1:{_closed_port()}"
    with pytest.raises(ConfigError, match=rf"`tracking.mlflow.tracking_uri` \({uri}\): no MLflow server answered "
                                          r"within 10 s \(ConnectionRefusedError.*leave mlflow out of "
                                          r"tracking.trackers"):
        check_mlflow_server(MlflowSection(tracking_uri=uri))


def test_a_server_that_never_answers_ends_at_the_timeout():
    """A listening socket that accepts nothing: the request waits, and the probe gives up after
    its timeout (1 s here) rather than MLflow's retries."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(0)
        uri = f"http://127.0.0.1:{s.getsockname()[1]}"
        t0 = time.monotonic()
        with pytest.raises(ConfigError, match=r"no MLflow server answered within 1 s"):
            check_mlflow_server(MlflowSection(tracking_uri=uri), timeout_s=1.0)
        assert time.monotonic() - t0 < 30  # one timeout, not a retry schedule (generous for a loaded machine)


def _serve(code: int) -> http.server.HTTPServer:
    class Answer(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            self.send_response(code)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Answer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def test_health_200_or_authentication_is_a_server_another_answer_is_not_and_other_stores_are_not_probed(tmp_path):
    """MLflow's server answers /health with 200; 401 / 403: it is there behind authentication. A
    404 is another web server on that port (MLflow's client would then fail with a traceback); a
    503 is a gateway in front of a stopped server, behind which MLflow's client retries for
    minutes."""
    for code in (200, 401, 403):
        server = _serve(code)
        try:
            check_mlflow_server(MlflowSection(tracking_uri=f"http://127.0.0.1:{server.server_port}"))
        finally:
            server.shutdown()
    for code, why in ((404, r"HTTP 404 .*not the tracking server's health check"),
                      (503, r"HTTP 503 .*a proxy or gateway")):
        server = _serve(code)
        try:
            with pytest.raises(ConfigError, match=rf"no MLflow server answered within 10 s \({why}"):
                check_mlflow_server(MlflowSection(tracking_uri=f"http://127.0.0.1:{server.server_port}"))
        finally:
            server.shutdown()
    check_mlflow_server(MlflowSection(tracking_uri=f"file:{tmp_path / 'mlruns'}"))


def test_train_refuses_before_the_run_directory_exists(tmp_path, capsys):
    """The journey of the issue: ``smelt-ds train`` with an unreachable server exits 2 at once,
    naming the URI, and leaves no run directory."""
    from smelt_ds.cli import main

    uri = f"http://127.0.0.1:{_closed_port()}"
    run = tmp_path / "run"
    assert main(["train", str(ROOT / "recipes" / "tiny" / "smelt.yaml"), "--run-dir", str(run),
                 "--set", "tracking.trackers=[mlflow]", "--set", f"tracking.mlflow.tracking_uri={uri}"]) == 2
    assert f"`tracking.mlflow.tracking_uri` ({uri}): no MLflow server answered" in capsys.readouterr().err
    assert not run.exists()


def test_wandb_online_with_a_server_that_never_answers_is_refused_at_the_timeout(monkeypatch):
    """W&B in online mode against a W&B server (WANDB_BASE_URL) that accepts and never answers:
    refused after the probe's timeout, naming the server and offline mode; offline mode and
    disabled are not probed (W&B writes files only)."""
    from smelt_ds.config.tracking import WandbSection
    from smelt_ds.train.trackers import check_wandb_server

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(0)
        url = f"http://127.0.0.1:{s.getsockname()[1]}"
        monkeypatch.setenv("WANDB_BASE_URL", url)
        monkeypatch.delenv("WANDB_MODE", raising=False)
        t0 = time.monotonic()
        with pytest.raises(ConfigError, match=rf"`tracking.wandb.mode` \('online'\): the W&B server {url} did not "
                                              r"answer within 1 s .*tracking.wandb.mode=offline"):
            check_wandb_server(WandbSection(), timeout_s=1.0)
        assert time.monotonic() - t0 < 30
        check_wandb_server(WandbSection(mode="offline"), timeout_s=1.0)  # returns at once: no request
        monkeypatch.setenv("WANDB_MODE", "disabled")
        check_wandb_server(WandbSection(), timeout_s=1.0)
    server = _serve(401)  # a W&B server that wants a key: it is there
    try:
        monkeypatch.setenv("WANDB_BASE_URL", f"http://127.0.0.1:{server.server_address[1]}")
        monkeypatch.setenv("WANDB_API_KEY", "k" * 40)
        check_wandb_server(WandbSection(mode="online"), timeout_s=5.0)
    finally:
        server.shutdown()


def test_wandb_online_without_an_api_key_is_refused_before_the_queue(tmp_path, monkeypatch):
    """A reachable W&B server but no key (no WANDB_API_KEY, no netrc entry for its host): refused
    naming the host and `wandb login`, instead of W&B refusing the run after the queue; the
    netrc entry `wandb login` writes, or WANDB_API_KEY, is enough."""
    from smelt_ds.config.tracking import WandbSection
    from smelt_ds.train.trackers import check_wandb_server

    server = _serve(200)
    try:
        monkeypatch.setenv("WANDB_BASE_URL", f"http://127.0.0.1:{server.server_address[1]}")
        monkeypatch.delenv("WANDB_API_KEY", raising=False)
        monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))
        with pytest.raises(ConfigError, match=r"no W&B API key for 127\.0\.0\.1 .*run `wandb login`"):
            check_wandb_server(WandbSection(mode="online"), timeout_s=5.0)
        (tmp_path / "netrc").write_text("machine 127.0.0.1\n  login user\n  password " + "k" * 40 + "\n")
        (tmp_path / "netrc").chmod(0o600)
        check_wandb_server(WandbSection(mode="online"), timeout_s=5.0)  # what `wandb login` wrote
        (tmp_path / "netrc").unlink()
        monkeypatch.setenv("WANDB_API_KEY", "k" * 40)
        check_wandb_server(WandbSection(mode="online"), timeout_s=5.0)
    finally:
        server.shutdown()
