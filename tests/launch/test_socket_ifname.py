"""gloo's interface in every rendered job: when ``NCCL_SOCKET_IFNAME`` names this node's interfaces
and ``GLOO_SOCKET_IFNAME`` is unset, the Slurm script, the deepspeed script and the Kubernetes pod
command give the ranks ``GLOO_SOCKET_IFNAME`` = the same interfaces (the control group and the
in-loop harness are gloo groups); ``preflight`` names the interface and warns when this host has
no such interface. Each job runs with stand-ins for srun, deepspeed and python that record the
environment the ranks would get. ``lo`` is an interface of every Linux host."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import yaml

from smelt_ds.cli import main as cli_main
from smelt_ds.launch.jobs import JobOptions, plan_job, render

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "recipes/m/smelt.yaml"
TINY = str(ROOT / "recipes" / "tiny" / "smelt.yaml")

RECORD = """#!/bin/bash
echo "GLOO=${GLOO_SOCKET_IFNAME-unset} NCCL=${NCCL_SOCKET_IFNAME-unset}" >> "$FAKE_LOG"
[[ -n "${DS_ENV_FILE:-}" ]] && cp "$DS_ENV_FILE" "$FAKE_LOG.env"
exit 0
"""
SCONTROL = """#!/bin/bash
if [[ "$1" == show ]]; then printf 'node-a\\nnode-b\\n'; fi
"""


def _job_env(tmp_path: Path, scheduler: str, env: list[str], outside: dict[str, str]) -> tuple[str, list[str]]:
    """Render ``scheduler``'s job with ``--env env`` and run it (``outside``: the environment it
    starts in): the line the stand-in launcher recorded, and what a deepspeed job ships to the
    other hosts (its DS_ENV_FILE)."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    launcher = {"slurm": "srun", "deepspeed": "deepspeed", "k8s": "python"}[scheduler]
    for name, body in ((launcher, RECORD), ("scontrol", SCONTROL)):
        (bindir / name).write_text(body)
        (bindir / name).chmod(0o755)
    kw = {"k8s": {}, "slurm": {"log_dir": str(tmp_path / "logs")}, "deepspeed": {"workdir": str(ROOT)}}[scheduler]
    plan = plan_job(RECIPE, JobOptions(scheduler=scheduler, layout="h200", nodes=1, env=env,
                                       run_dir=None if scheduler == "k8s" else str(tmp_path / "run"), **kw))
    text = render(plan)
    if scheduler == "k8s":
        _, job = yaml.safe_load_all(text)
        container = job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]
        cmd = ["bash", "-c", container["args"][0]]
        outside = {**outside, **{e["name"]: e["value"] for e in container["env"]}}  # the pod's environment
    else:
        (tmp_path / "job").write_text(text)
        cmd = ["bash", str(tmp_path / "job")]
    log = tmp_path / "fake.log"
    base = {k: v for k, v in os.environ.items() if not k.endswith("_SOCKET_IFNAME")}
    r = subprocess.run(cmd, env={**base, "PATH": f"{bindir}:{os.environ['PATH']}", "FAKE_LOG": str(log),
                                 "SLURM_JOB_NODELIST": "node-[a-b]", "SLURM_JOB_ID": "777", "RANK": "0",
                                 "MASTER_ADDR": "m", "MASTER_PORT": "23456", **outside},
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    shipped = Path(f"{log}.env").read_text().splitlines() if Path(f"{log}.env").exists() else []
    return log.read_text().splitlines()[-1], shipped


@pytest.mark.parametrize("scheduler", ["slurm", "deepspeed", "k8s"])
@pytest.mark.parametrize("where", ["--env", "outside"])
def test_every_job_gives_gloo_the_interface_nccl_was_given(scheduler, where, tmp_path):
    env, outside = (["NCCL_SOCKET_IFNAME=lo"], {}) if where == "--env" else ([], {"NCCL_SOCKET_IFNAME": "lo"})
    if scheduler == "k8s" and where == "outside":
        outside = {"NCCL_SOCKET_IFNAME": "=lo"}  # set in the image; NCCL's exact-match form
    line, shipped = _job_env(tmp_path, scheduler, env, outside)
    assert line.startswith("GLOO=lo ")
    if scheduler == "deepspeed":  # the launcher's other hosts get it through the DS_ENV_FILE
        assert "GLOO_SOCKET_IFNAME=lo" in shipped


@pytest.mark.parametrize(("env", "expected"), [
    (["NCCL_SOCKET_IFNAME=lo", "GLOO_SOCKET_IFNAME=eth9"], "GLOO=eth9 NCCL=lo"),   # the user's own wins
    (["NCCL_SOCKET_IFNAME=^docker0,lo"], "GLOO=unset NCCL=^docker0,lo"),           # an exclusion names none
    (["NCCL_SOCKET_IFNAME=nosuch7"], "GLOO=unset NCCL=nosuch7"),                   # not an interface of the node
])
def test_gloo_is_left_alone_when_nccl_names_no_interface_or_gloo_is_set(env, expected, tmp_path):
    assert _job_env(tmp_path, "k8s", env, {})[0] == expected


def test_the_python_rule_is_the_jobs_rule():
    from smelt_ds.launch.jobs import gloo_ifname

    have = ["lo", "eth0", "ib0"]
    assert [gloo_ifname(v, have) for v in ("eth0", "=eth0", "eth0,ib0", "^lo", "ib", "eth0,nosuch", "")] == \
        ["eth0", "eth0", "eth0,ib0", None, None, None, None]


def _network_row(capsys, *env: str) -> tuple[str, str]:
    argv = [x for e in env for x in ("--env", e)]
    cli_main(["preflight", TINY, "--nodes", "1", "--gpus-per-node", "1", *argv])
    line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("  network"))
    return line[16:22].strip(), line[22:]


def test_preflight_names_the_interface_and_warns_about_one_this_host_lacks(capsys, monkeypatch):
    import psutil

    for name in ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME"):
        monkeypatch.delenv(name, raising=False)
    here = sorted(psutil.net_if_addrs())
    assert _network_row(capsys, "NCCL_SOCKET_IFNAME=lo") == (
        "OK", "gloo on lo (the job sets GLOO_SOCKET_IFNAME to NCCL_SOCKET_IFNAME's interface); NCCL on lo")
    status, detail = _network_row(capsys, "NCCL_SOCKET_IFNAME=lo", "GLOO_SOCKET_IFNAME=nosuch7")
    assert status == "WARN" and detail.startswith("GLOO_SOCKET_IFNAME='nosuch7': no interface nosuch7 on this "
                                                  "host (") and f"has {', '.join(here)})" in detail
    status, detail = _network_row(capsys, "NCCL_SOCKET_IFNAME=^docker0")
    assert status == "WARN" and "NCCL_SOCKET_IFNAME='^docker0' names no interface of this host" in detail
    status, detail = _network_row(capsys, "NCCL_SOCKET_IFNAME=lo,nosuch7")  # the one missing is named
    assert status == "WARN" and "NCCL_SOCKET_IFNAME='lo,nosuch7' names nosuch7, not an interface of this host" in detail
    cli_main(["preflight", TINY, "--nodes", "1", "--gpus-per-node", "1", "--env", "NCCL_SOCKET_IFNAME=lo,nosuch7"])
    last = capsys.readouterr().out.splitlines()[-1]
    assert last.startswith("no check failed; ") and "(network" in last and "every check passed" not in last
