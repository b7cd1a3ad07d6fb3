"""Jobs a cluster admin can run: the Kubernetes options (placement, RDMA, gang scheduling, restart
policy) render manifests that validate; a bad configuration (a rank's exit 2) is never restarted,
by the Slurm script (real torchrun and ranks behind a stand-in srun) or by a pod; a Slurm time limit
too short for one start is refused; CPU and NUMA binding are settable; the fix offered for an
``ep_size`` that does not divide the world size is itself accepted."""

from __future__ import annotations

import os
import re
import socket
import subprocess
from pathlib import Path

import pytest
import yaml

from smelt_ds import cli
from smelt_ds.config import cli as config_cli
from smelt_ds.config.reference import reference_markdown
from smelt_ds.errors import ConfigError
from smelt_ds.launch import jobs
from smelt_ds.launch.jobs import JobOptions, plan_job, render
from smelt_ds.testing import scaled_timeout
from tests.launch.test_k8s import validate_manifest

ROOT = Path(__file__).resolve().parents[2]
M = ROOT / "recipes/m/smelt.yaml"


def _tools(tmp_path: Path, **scripts: str) -> dict[str, str]:
    """Write ``scripts`` (name -> bash text) to ``tmp_path/bin``; the environment that finds them first
    on PATH, without this machine's Slurm and requeue-limit variables."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    for name, body in scripts.items():
        (bindir / name).write_text(body)
        (bindir / name).chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SMELT_MAX_", "SLURM_"))}
    return {**env, "PATH": f"{bindir}:{os.environ['PATH']}", "FAKE_LOG": str(tmp_path / "fake.log")}


def _k8s(**kw) -> tuple[dict, dict]:
    """The PyTorchJob of the M recipe rendered with ``kw``, validated (tests/launch/test_k8s.py), and
    its Master pod spec."""
    _, job = validate_manifest(render(plan_job(M, JobOptions(scheduler="k8s", **kw))))
    return job, job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]


# ---------------------------------------------------------------------------------------------
# Kubernetes
# ---------------------------------------------------------------------------------------------


def test_k8s_defaults_restart_little_and_never_on_exit_codes_below_128():
    job, pod = _k8s()
    assert job["spec"]["runPolicy"]["backoffLimit"] == 3
    assert {r["restartPolicy"] for r in job["spec"]["pytorchReplicaSpecs"].values()} == {"ExitCode"}
    for absent in ("schedulerName", "nodeSelector", "tolerations", "affinity"):
        assert absent not in pod
    assert "securityContext" not in pod["containers"][0] and "schedulingPolicy" not in job["spec"]["runPolicy"]


def test_k8s_admin_options_render_a_manifest_that_validates(tmp_path):
    aff = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
        {"matchExpressions": [{"key": "topology.kubernetes.io/zone", "operator": "In", "values": ["z1"]}]}]}}}
    (tmp_path / "aff.yaml").write_text(yaml.safe_dump({"affinity": aff}))
    job, pod = _k8s(gang="volcano", gang_queue="research", node_selector=["nvidia.com/gpu.product=H100-SXM"],
                    tolerations=["nvidia.com/gpu:NoSchedule", "dedicated=training:NoExecute", "spot"],
                    affinity=str(tmp_path / "aff.yaml"), rdma_resources=["rdma/hca=2"], backoff_limit=5,
                    restart_policy="OnFailure")
    run = job["spec"]["runPolicy"]
    assert run["backoffLimit"] == 5
    assert run["schedulingPolicy"] == {"minAvailable": 4, "queue": "research"}  # the M recipe's 4 pods
    assert {r["restartPolicy"] for r in job["spec"]["pytorchReplicaSpecs"].values()} == {"OnFailure"}
    assert job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"] == pod  # every pod alike
    assert pod["schedulerName"] == "volcano"
    assert pod["nodeSelector"] == {"nvidia.com/gpu.product": "H100-SXM"}
    assert pod["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"},
                                  {"key": "dedicated", "operator": "Equal", "value": "training",
                                   "effect": "NoExecute"},
                                  {"key": "spot", "operator": "Exists"}]
    assert pod["affinity"] == aff
    (c,) = pod["containers"]
    assert c["securityContext"] == {"capabilities": {"add": ["IPC_LOCK"]}}
    assert c["resources"]["limits"] == {"nvidia.com/gpu": 8, "rdma/hca": 2}
    assert {k: v for k, v in c["resources"]["requests"].items() if k not in ("cpu", "memory")} == \
        {"nvidia.com/gpu": 8, "rdma/hca": 2}
    _, pod = _k8s(gang="scheduler-plugins", ipc_lock=True)
    assert pod["schedulerName"] == "scheduler-plugins-scheduler"
    assert pod["containers"][0]["securityContext"] == {"capabilities": {"add": ["IPC_LOCK"]}}


@pytest.mark.parametrize("kw,match", [
    (dict(tolerations=["gpu:NoSchedul"]), r"--toleration 'gpu:NoSchedul': write KEY\[=VALUE\]\[:EFFECT\]"),
    (dict(node_selector=["pool"]), r"--node-selector 'pool': write KEY=VALUE"),
    (dict(rdma_resources=["rdma/hca=0"]), r"--rdma-resource 'rdma/hca=0': the COUNT '0' must be a positive integer"),
    (dict(rdma_resources=["hca=1"]), r"--rdma-resource hca=\.\.\.: name a device plugin's resource DOMAIN/NAME"),
    # a repeated key: one value per key in nodeSelector and in resources, the second would replace the first
    (dict(node_selector=["pool=gpu", "pool=cpu"]), r"--node-selector pool is given twice \(pool=gpu and pool=cpu\)"),
    (dict(rdma_resources=["rdma/hca=1", "rdma/hca=2"]),
     r"--rdma-resource rdma/hca is given twice \(rdma/hca=1 and rdma/hca=2\)"),
    (dict(gang="kueue"), r"--gang 'kueue': use one of volcano, scheduler-plugins"),
    (dict(gang_queue="q"), r"--gang-queue 'q' names a Volcano queue: add --gang volcano"),
    (dict(restart_policy="Always"), r"--restart-policy 'Always': use ExitCode"),
    (dict(backoff_limit=-1), r"`--backoff-limit` \(-1\) must be 0"),
    (dict(affinity="/nonexistent/aff.yaml"), r"--affinity '/nonexistent/aff.yaml': cannot read it"),
])
def test_bad_k8s_admin_options_are_refused_naming_the_form(kw, match):
    with pytest.raises(ConfigError, match=match):
        render(plan_job(M, JobOptions(scheduler="k8s", **kw)))


FAKE_TORCHRUN = """#!/bin/bash
# stands in for `python -m torch.distributed.run`: its ranks wrote FAKE_RANKS, it reports a failure as 1
mkdir -p "$SMELT_EXIT_STATUS_DIR"
i=0; for s in $FAKE_RANKS; do echo "$s" > "$SMELT_EXIT_STATUS_DIR/rank$i"; i=$((i + 1)); done
exit "$FAKE_RC"
"""


@pytest.mark.parametrize("ranks,torchrun_rc,policy,statuses", [
    ("2 75", 1, "ExitCode", [2, 2, 2]),         # bad configuration: permanent (1-127) every time
    ("75 75", 1, "ExitCode", [129, 129, 1]),    # retryable (128 + 1) twice (--backoff-limit 2), then permanent
    ("3 0", 1, "ExitCode", [3, 3, 3]),          # non-finite steps: permanent
    ("0 0", 0, "ExitCode", [0, 0, 0]),
    ("2 2", 1, "OnFailure", [2, 2, 2]),
    ("75 75", 1, "OnFailure", [1, 1, 1]),       # torchrun's status; runPolicy.backoffLimit caps
])
def test_k8s_pod_exits_so_that_the_restart_policy_never_restarts_a_bad_configuration(tmp_path, ranks, torchrun_rc,
                                                                                     policy, statuses):
    env = {**_tools(tmp_path, python=FAKE_TORCHRUN), "FAKE_RANKS": ranks, "FAKE_RC": str(torchrun_rc),
           "TMPDIR": str(tmp_path), "RANK": "0", "MASTER_ADDR": "m", "MASTER_PORT": "1"}
    plan = plan_job(M, JobOptions(scheduler="k8s", backoff_limit=2, restart_policy=policy, workdir=str(tmp_path)))
    _, job = yaml.safe_load_all(render(plan))
    cmd = job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]["args"][0]
    got = [subprocess.run(["bash", "-c", cmd], env=env, capture_output=True, text=True, timeout=60).returncode
           for _ in statuses]  # three starts of the same pod
    assert got == statuses


# ---------------------------------------------------------------------------------------------
# Slurm
# ---------------------------------------------------------------------------------------------

STANDIN_SRUN = """#!/bin/bash
# one task on this machine, as node 0 (srun's options skipped)
echo "srun $*" >> "$FAKE_LOG"
while [[ "$1" == -* ]]; do shift; done
SLURM_NODEID=0 exec "$@"
"""
FAKE_SCONTROL = """#!/bin/bash
if [[ "$1" == show ]]; then echo 127.0.0.1; else echo "scontrol $*" >> "$FAKE_LOG"; fi
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_slurm_job_whose_rank_finds_a_bad_configuration_exits_2_and_does_not_requeue(tmp_path):
    """Real torchrun and a real rank: the recipe is broken after the job was rendered (as when it is
    edited before the job starts); the rank exits 2, torchrun reports 1, the script exits 2 and
    never calls `scontrol requeue`."""
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"base: {ROOT / 'recipes/tiny/smelt.yaml'}\n")
    job = tmp_path / "job.sbatch"
    job.write_text(render(plan_job(recipe, JobOptions(scheduler="slurm", workdir=str(tmp_path), nodes=1,
                                                      gpus_per_node=1, log_dir=str(tmp_path / "logs"),
                                                      run_dir=str(tmp_path / "run")))))
    recipe.write_text(f"base: {ROOT / 'recipes/tiny/smelt.yaml'}\ntrain:\n  max_steps: -5\n")
    env = {**_tools(tmp_path, srun=STANDIN_SRUN, scontrol=FAKE_SCONTROL), "SLURM_JOB_NODELIST": "localhost",
           "SLURM_JOB_ID": "778", "SLURM_RESTART_COUNT": "0", "SMELT_MASTER_ADDR": "127.0.0.1",
           "SMELT_MASTER_PORT": str(_free_port())}
    r = subprocess.run(["bash", str(job)], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=scaled_timeout(300))
    out = r.stdout + r.stderr
    lines = (tmp_path / "fake.log").read_text().splitlines()
    assert any(line.startswith("srun ") for line in lines), out
    assert "train.max_steps" in out  # the rank's own error, naming the field
    assert "smelt-ds: srun exited 1; rank(s) rank0 exited 2" in out  # torchrun's 1, the rank's 2
    assert "not requeueing" in out
    assert r.returncode == 2, out
    assert not any(line.startswith("scontrol requeue") for line in lines), out
    assert not (tmp_path / "run" / "exit_status" / "778.0").exists()  # read, then removed


FAKE_SRUN_RANKS = """#!/bin/bash
echo "srun $*" >> "$FAKE_LOG"
mkdir -p "$SMELT_EXIT_STATUS_DIR"
i=0; for s in $FAKE_RANKS; do echo "$s" > "$SMELT_EXIT_STATUS_DIR/rank$i"; i=$((i + 1)); done
exit 1
"""


@pytest.mark.parametrize("ranks,rc,requeue", [("75 2", 2, False), ("3 75", 3, False), ("75 75", 1, True),
                                              ("", 1, True)])
def test_slurm_job_reads_the_ranks_statuses_behind_torchruns_1(tmp_path, ranks, rc, requeue):
    env = {**_tools(tmp_path, srun=FAKE_SRUN_RANKS, scontrol=FAKE_SCONTROL), "FAKE_RANKS": ranks,
           "SLURM_JOB_NODELIST": "node-a", "SLURM_JOB_ID": "779", "SLURM_RESTART_COUNT": "0"}
    job = tmp_path / "job.sbatch"
    job.write_text(render(plan_job(M, JobOptions(scheduler="slurm", log_dir=str(tmp_path / "logs"),
                                                 run_dir=str(tmp_path / "run")))))
    r = subprocess.run(["bash", str(job)], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == rc, r.stderr
    assert ("scontrol requeue 779" in (tmp_path / "fake.log").read_text().splitlines()) == requeue, r.stderr


@pytest.mark.parametrize("kw,time,ok", [
    ({}, "11", False),                       # the issue's --time 11: 660 s < 600 + 300 + 600
    ({}, "24:59", False),
    ({}, "25", True),                        # exactly 1500 s
    ({"startup_s": 60, "shutdown_s": 60, "signal_lead_s": 120}, "4", True),  # 240 s
    ({"startup_s": 60, "shutdown_s": 60, "signal_lead_s": 120}, "3:59", False),
])
def test_slurm_time_limit_too_short_for_one_start_is_refused(kw, time, ok):
    opts = JobOptions(scheduler="slurm", time=time, **kw)
    assert jobs.slurm_min_time(opts) == opts.startup_s + opts.shutdown_s + opts.signal_lead_s
    if ok:
        render(plan_job(M, opts))
        return
    floor = jobs.slurm_min_time(opts)
    with pytest.raises(ConfigError, match=rf"--time '{time}' \(\d+ s\) is shorter than one start needs, {floor} s "
                                          r"= --startup-time.*give --time \d+:\d\d:00 or more"):
        render(plan_job(M, opts))


def test_slurm_time_limit_suggested_is_accepted():
    opts = JobOptions(scheduler="slurm", time="11")
    with pytest.raises(ConfigError) as e:
        render(plan_job(M, opts))
    suggested = re.search(r"give --time (\S+) or more", str(e.value)).group(1)
    assert suggested == "0:25:00"
    render(plan_job(M, JobOptions(scheduler="slurm", time=suggested)))


FAKE_PYTHON_ARGV = """#!/bin/bash
printf '%s\\n' "$@" > "$FAKE_LOG"
"""


def test_slurm_cpu_and_numa_binding_are_settable(tmp_path):
    text = render(plan_job(M, JobOptions(scheduler="slurm", cpu_bind="ldoms", numa_binding="node",
                                         log_dir=str(tmp_path / "logs"))))
    (srun,) = [line for line in text.splitlines() if line.startswith("srun ")]
    assert "--cpu-bind=ldoms " in srun
    assert "--cpu-bind=none" in render(plan_job(M, JobOptions(scheduler="slurm")))  # the default
    (tmp_path / "job").write_text(text)
    env = {**_tools(tmp_path, python=FAKE_PYTHON_ARGV), "SMELT_PYTHON": "python", "SLURM_JOB_NODELIST": "node-a",
           "SLURM_JOB_ID": "7", "SLURM_NODEID": "0",
           "SMELT_MASTER_ADDR": "node-a", "SMELT_MASTER_PORT": "20007"}
    r = subprocess.run(["bash", str(tmp_path / "job"), "--per-node"], env=env, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    argv = (tmp_path / "fake.log").read_text().splitlines()
    assert argv[:4] == ["-m", "torch.distributed.run", "--nnodes=4", "--nproc-per-node=8"]
    assert "--numa-binding=node" in argv[:argv.index("smelt_ds.train")]  # torchrun's option, not training's
    _, job = yaml.safe_load_all(render(plan_job(M, JobOptions(scheduler="k8s", numa_binding="socket"))))
    cmd = job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]["args"][0]
    assert "--nproc-per-node=8 --numa-binding=socket " in cmd
    for kw, match in ((dict(cpu_bind="map cpu"), r"--cpu-bind 'map cpu' is not an srun --cpu-bind value"),
                      (dict(numa_binding="numa"), r"--numa-binding 'numa': torchrun's modes are node, socket"),
                      (dict(startup_s=0), r"`--startup-time` \(0\) must be a positive integer")):
        with pytest.raises(ConfigError, match=match):
            render(plan_job(M, JobOptions(scheduler="slurm", **kw)))


# ---------------------------------------------------------------------------------------------
# messages whose fix must itself be accepted
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("recipe,sets,nodes,gpus", [
    ("recipes/m/smelt.yaml", ["moe_runtime.ep_size=7"], None, None),  # the case: no world size splits
    ("recipes/xl/smelt.yaml", [], 1, 4),                              # ep_size 8 on 4 GPUs
    ("recipes/xl/smelt.yaml", [], 3, 3),
])
def test_the_fix_offered_for_an_ep_size_that_does_not_divide_the_world_is_accepted(recipe, sets, nodes, gpus):
    with pytest.raises(ConfigError, match=r"does not divide the world size") as e:
        plan_job(ROOT / recipe, JobOptions(scheduler="slurm", overrides=sets, nodes=nodes, gpus_per_node=gpus))
    msg = str(e.value)
    tried = 0
    for n, g in re.findall(r"--nodes (\d+) --gpus-per-node (\d+)", msg):
        plan = plan_job(ROOT / recipe, JobOptions(scheduler="slurm", overrides=sets, nodes=int(n),
                                                  gpus_per_node=int(g)))
        assert plan.world_size % plan.ep_size == 0
        tried += 1
    m = re.search(r"set moe_runtime.ep_size to ([\d or]+) \(", msg)
    for ep in (m.group(1).split(" or ") if m else []):
        plan_job(ROOT / recipe, JobOptions(scheduler="slurm", overrides=[*sets, f"moe_runtime.ep_size={ep}"],
                                           nodes=nodes, gpus_per_node=gpus))
        tried += 1
    assert tried, msg  # some fix is offered, and each one offered is accepted


def test_config_reference_prints_and_writes_only_with_o(tmp_path, monkeypatch, capsys):
    page = tmp_path / "docs" / "configuration.md"
    monkeypatch.setattr(config_cli, "REFERENCE_PAGE", page)  # an installed checkout's page
    assert cli.main(["config", "reference"]) == 0
    assert capsys.readouterr().out == reference_markdown()
    assert not page.exists()  # nothing written without -o
    assert cli.main(["config", "reference", "--check"]) == 1  # --check still reads the checkout's page
    assert f"run `smelt-ds config reference -o {page}`" in capsys.readouterr().err
    assert cli.main(["config", "reference", "-o", str(page)]) == 0 and page.read_text() == reference_markdown()
    assert cli.main(["config", "reference", "--check"]) == 0


def test_every_new_option_reaches_render_job(tmp_path, capsys):
    """The command line passes each option on (a dry run shows the rendered values)."""
    aff = tmp_path / "aff.yaml"
    aff.write_text("podAntiAffinity: {}\n")
    args = ["render-job", str(M), "--scheduler", "k8s", "--no-data-check", "--gang", "volcano", "--gang-queue", "q1",
            "--node-selector", "pool=gpu", "--toleration", "gpu:NoSchedule", "--affinity", str(aff),
            "--rdma-resource", "rdma/hca=1", "--restart-policy", "OnFailure", "--backoff-limit", "0",
            "--numa-binding", "node", "--force", "-o", str(tmp_path / "job.yaml")]
    assert cli.main(args) == 0, capsys.readouterr().err
    _, job = yaml.safe_load_all((tmp_path / "job.yaml").read_text())
    pod = job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]
    assert job["spec"]["runPolicy"] == {"backoffLimit": 0, "cleanPodPolicy": "None",
                                        "schedulingPolicy": {"minAvailable": 4, "queue": "q1"}}
    assert (pod["nodeSelector"], pod["tolerations"][0]["key"], pod["affinity"]) == \
        ({"pool": "gpu"}, "gpu", {"podAntiAffinity": {}})
    assert "--numa-binding=node" in pod["containers"][0]["args"][0]
    args = ["render-job", str(M), "--scheduler", "slurm", "--no-data-check", "--force", "--time", "2:00:00",
            "--startup-time", "900", "--cpu-bind", "cores", "-o", str(tmp_path / "job.sbatch"),
            "--log-dir", str(tmp_path / "logs")]
    assert cli.main(args) == 0, capsys.readouterr().err
    assert "--cpu-bind=cores " in (tmp_path / "job.sbatch").read_text()
    assert cli.main(args[:-4] + ["--time", "29", "-o", str(tmp_path / "short.sbatch")]) == 2
    assert "= --startup-time (900 s" in capsys.readouterr().err



def test_zero3_memory_of_expert_groups_spanning_nodes_is_estimated():
    """ep_size 2 on 2 nodes x 1 GPU (a fix the ep_size message can offer): each expert-parallel group
    spans both nodes; ZeRO-3 per GPU = the largest module gathered (4 B a parameter) + 18 B x dense / 2
    GPUs + 18 B x (experts / 2) / 1 GPU of its expert-data-parallel group (a fraction of a GPU per node
    used to truncate to 0 GPUs: ZeroDivisionError)."""
    from smelt_ds.config.loading import load_config
    from smelt_ds.parallel import memory

    cfg = load_config(ROOT / "recipes/tiny/smelt.yaml", ["moe_runtime.backend=autoep", "moe_runtime.ep_size=2",
                                                         "deepspeed.zero_stage=3"])
    c = memory.param_counts(cfg)
    ms = memory.model_states(c, 2, 1, 3, precision="bf16", ep_size=2)
    assert abs(ms.gpu - (4 * c.largest_module + 18 * c.dense / 2 + 18 * (c.expert / 2) / 1)) <= 2
