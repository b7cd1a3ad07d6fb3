"""`smelt-ds render-job` and the launcher templates: rendered Slurm scripts pass `bash -n`,
Kubernetes manifests parse with the required fields, hostfiles give the master and world size,
bad input is refused, and the requeue path works with fake Slurm tools. The jobs train on two hosts
in tests/launch/test_hosts.py."""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from smelt_ds.cli import main as cli_main
from smelt_ds.errors import ConfigError
from smelt_ds.launch.jobs import JobOptions, expand_nodelist, parse_hostfile, plan_job, render, summary
from smelt_ds.launch.jobs import main as launch_main
from smelt_ds.study.recipes import shipped_recipes

ROOT = Path(__file__).resolve().parents[2]
CLUSTER = [(e.path, layout) for e in shipped_recipes() if e.size != "tiny" for layout in ("h100", "h200")]


def _id(case):
    path, layout = case
    return f"{path.parent.name}/{path.stem}-{layout}"


def _plan(recipe, scheduler, **kw):
    return plan_job(recipe, JobOptions(scheduler=scheduler, **kw))


def _bash_n(text: str, tmp_path: Path, name: str) -> None:
    f = tmp_path / name
    f.write_text(text)
    r = subprocess.run(["bash", "-n", str(f)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


# ---------------------------------------------------------------------------------------------
# rendering every recipe
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", CLUSTER, ids=_id)
def test_rendered_slurm_and_k8s_jobs(case, tmp_path):
    path, layout = case
    plan = _plan(path, "slurm", layout=layout, partition="gpu", env=["NCCL_SOCKET_IFNAME=ib0"])
    lay = plan.layout
    text = render(plan)
    _bash_n(text, tmp_path, "job.sbatch")
    assert "{{" not in text
    assert f"#SBATCH --nodes={lay.nodes}\n" in text and f"#SBATCH --gpus-per-node={lay.gpus_per_node}\n" in text
    assert "#SBATCH --requeue\n" in text and "#SBATCH --partition=gpu\n" in text
    assert "--resume auto" in text and "export NCCL_SOCKET_IFNAME=ib0\n" in text
    assert f"SMELT_RECIPE=recipes/{path.parent.name}/{path.name}\n" in text
    assert f"SMELT_PYTHON=${{SMELT_PYTHON:-{shlex.quote(sys.executable)}}}\n" in text  # the rendering interpreter
    if layout == "h200":  # the layout's overrides reach smelt_ds.train
        assert "--set train.micro_batch_size=" in text

    plan = _plan(path, "k8s", layout=layout, image="registry.example.org/smelt-ds:1.0")
    recipe_map, job = yaml.safe_load_all(render(plan))
    assert job["apiVersion"] == "kubeflow.org/v1" and job["kind"] == "PyTorchJob"
    assert recipe_map["kind"] == "ConfigMap" and recipe_map["data"]["recipe.yaml"].count(f"name: {plan.config.name}\n")
    specs = job["spec"]["pytorchReplicaSpecs"]
    assert specs["Master"]["replicas"] == 1 and ("Worker" in specs) == (lay.nodes > 1)
    assert sum(s["replicas"] for s in specs.values()) == lay.nodes  # one pod per node
    for role in specs:
        assert specs[role]["restartPolicy"] == "ExitCode"  # a bad configuration (exit 2) never restarts
        pod = specs[role]["template"]["spec"]
        (c,) = pod["containers"]
        assert c["name"] == "pytorch" and c["image"] == "registry.example.org/smelt-ds:1.0"
        assert c["command"] == ["bash", "-c"]
        assert f"--nnodes={lay.nodes} --nproc-per-node={lay.gpus_per_node}" in c["args"][0]
        assert "--resume auto" in c["args"][0] and '"${SMELT_RECIPE:-/etc/smelt-ds/recipe.yaml}"' in c["args"][0]
        assert c["resources"]["limits"]["nvidia.com/gpu"] == lay.gpus_per_node
        env = {e["name"]: e["value"] for e in c["env"]}
        assert env["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"] == "300"
        assert pod["terminationGracePeriodSeconds"] > 300
        shm = next(v for v in pod["volumes"] if v["name"] == "dshm")
        assert shm["emptyDir"]["medium"] == "Memory"
        assert {"name": "dshm", "mountPath": "/dev/shm"} in c["volumeMounts"]


def test_single_node_k8s_job_has_no_workers():
    _, job = yaml.safe_load_all(render(_plan(ROOT / "recipes/s/smelt.yaml", "k8s")))
    assert set(job["spec"]["pytorchReplicaSpecs"]) == {"Master"}
    assert job["spec"]["pytorchReplicaSpecs"]["Master"]["replicas"] == 1


# ---------------------------------------------------------------------------------------------
# hostfiles and node lists
# ---------------------------------------------------------------------------------------------

HOSTFILE = """# two nodes of a cluster, fully qualified
gpu-node-001.cluster.example.org slots=8
gpu-node-002.cluster.example.org   slots=8   # second

gpu-node-003.cluster.example.org slots=4
"""


def test_hostfile_gives_master_and_world_size(tmp_path):
    from deepspeed.launcher.runner import _parse_hostfile

    hosts = parse_hostfile(HOSTFILE)
    ds = _parse_hostfile(HOSTFILE.splitlines())  # DeepSpeed's own parser agrees
    assert [(h.name, h.slots) for h in hosts] == list(ds.items())
    hf = tmp_path / "hostfile"
    hf.write_text(HOSTFILE)
    plan = _plan(ROOT / "recipes/m/smelt.yaml", "deepspeed", hostfile=str(hf), nodes=2, gpus_per_node=8)
    assert plan.master_addr == "gpu-node-001.cluster.example.org" and plan.world_size == 16
    text = render(plan)
    _bash_n(text, tmp_path, "run.sh")
    assert "SMELT_MASTER_ADDR=gpu-node-001.cluster.example.org\n" in text
    assert f"SMELT_HOSTFILE={hf.resolve()}\n" in text and "SMELT_NNODES=2\n" in text
    # three nodes need 8 slots on the third host
    with pytest.raises(ConfigError, match="gpu-node-003.cluster.example.org has 4 slots"):
        _plan(ROOT / "recipes/m/smelt.yaml", "deepspeed", hostfile=str(hf), nodes=3, gpus_per_node=8)
    plan = _plan(ROOT / "recipes/tiny/smelt.yaml", "deepspeed", hostfile=str(hf), nodes=3, gpus_per_node=4)
    assert plan.world_size == 12 and plan.master_addr == "gpu-node-001.cluster.example.org"
    # a single node needs no hostfile; several do
    assert _plan(ROOT / "recipes/s/smelt.yaml", "deepspeed").master_addr == "127.0.0.1"
    with pytest.raises(ConfigError, match="needs --hostfile"):
        _plan(ROOT / "recipes/m/smelt.yaml", "deepspeed")


@pytest.mark.parametrize("text,match", [
    ("node1 slots=8\nnode1 slots=8\n", "listed twice"),
    ("node1 8\n", "line 1.*HOSTNAME slots=N"),
    ("# nothing\n\n", "no hosts"),
])
def test_bad_hostfiles(text, match):
    with pytest.raises(ConfigError, match=match):
        parse_hostfile(text)


def test_slurm_nodelists_expand_like_scontrol(capsys):
    assert expand_nodelist("gpu[001-003,010],login-1") == ["gpu001", "gpu002", "gpu003", "gpu010", "login-1"]
    assert expand_nodelist("r[1-2]n[08-09]") == ["r1n08", "r1n09", "r2n08", "r2n09"]
    assert expand_nodelist("node7.cluster.example.org") == ["node7.cluster.example.org"]
    for bad in ("gpu[3-1]", "gpu[1-2", ""):
        with pytest.raises(ConfigError):
            expand_nodelist(bad)
    assert launch_main(["hostfile", "gpu[01-02]", "--slots", "8"]) == 0
    assert capsys.readouterr().out == "gpu01 slots=8\ngpu02 slots=8\n"
    assert parse_hostfile("gpu01 slots=8\ngpu02 slots=8\n")[0].name == "gpu01"


# ---------------------------------------------------------------------------------------------
# bad input
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kw,match", [
    (dict(scheduler="pbs"), r"--scheduler 'pbs' is unknown: use one of deepspeed, slurm, k8s"),
    (dict(scheduler="slurm", nodes=512), r"4096 GPUs is more than the layout needs.*2048 micro-batches"),
    (dict(scheduler="slurm", gpus_per_node=16), r"--gpus-per-node.*\(16\) is more GPUs than a node of layout 'h100'"),
    (dict(scheduler="slurm", nodes=1, gpus_per_node=4),
     r"`moe_runtime.ep_size` \(8\) does not divide the world size.*= 4\)"),
    # 24 GPUs: 2048 sequences do not split; 16 and 32 ranks (2 or 4 nodes of 8) do
    (dict(scheduler="slurm", nodes=3), r"train.global_batch_tokens.*: run on 16 or 32 ranks .* or set "
                                       r"train.global_batch_tokens to 8,355,840 or 8,454,144 on 24 rank"),
    (dict(scheduler="slurm", job_name="Smelt_XL"), r"--job-name 'Smelt_XL': use lowercase letters"),
    (dict(scheduler="slurm", nodes=0), r"`--nodes` \(0\) must be a positive integer"),
    (dict(scheduler="slurm", layout="b200"), r"--layout 'b200'"),
    (dict(scheduler="slurm", time="two days"), r"--time 'two days'"),
    (dict(scheduler="slurm", time="00:05:00"), r"--time '00:05:00' \(300 s\) must be longer than --signal-lead "
                                               r"\(600 s\)"),
    (dict(scheduler="slurm", workdir="/nonexistent/smelt-ds"), r"--workdir '/nonexistent/smelt-ds'.*is not a "
                                                               r"directory here"),
    (dict(scheduler="slurm", master_port=80), r"--master-port \(80\) must be a port number from 1024"),
    (dict(scheduler="k8s", workdir="relwd"), r"--workdir 'relwd': a pod's working directory is an absolute path"),
    (dict(scheduler="slurm", env=["1BAD=x"]), r"--env '1BAD=x'"),
    (dict(scheduler="slurm", shutdown_s=900), r"--shutdown-timeout \(900 s\) must be shorter"),
    (dict(scheduler="k8s", image="my image"), r"--image"),
])
def test_bad_input_is_a_clear_error(kw, match):
    with pytest.raises(ConfigError, match=match):
        render(_plan(ROOT / "recipes/xl/smelt.yaml", **kw))


def test_a_recipe_name_that_is_no_kubernetes_name_gives_one_for_the_job():
    """`--set name=M_Smelt_Pile.v2` (a name training accepts) makes the job name, never an error
    about --job-name, a flag the user did not pass."""
    plan = _plan(ROOT / "recipes/m/smelt.yaml", "k8s", overrides=["name=M_Smelt_Pile.v2"])
    assert plan.job_name == "smelt-m-smelt-pile-v2" and 'name: "smelt-m-smelt-pile-v2"' in render(plan)
    long = _plan(ROOT / "recipes/m/smelt.yaml", "slurm", overrides=["name=" + "Ab." * 30]).job_name
    assert len(long) <= 52 and re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", long)


@pytest.mark.parametrize("limit,seconds", [("30", 1800), ("30:15", 1815), ("12:00:00", 43200), ("2-00", 172800),
                                           ("2-04:30", 189000), ("1-00:00:10", 86410), ("UNLIMITED", 10 ** 12),
                                           ("infinite", 10 ** 12), ("0", 10 ** 12)])
def test_slurm_time_limits_in_seconds(limit, seconds):
    """Every form sbatch --time takes (man sbatch): minutes, minutes:seconds, hours:minutes:seconds,
    days-hours, days-hours:minutes, days-hours:minutes:seconds."""
    from smelt_ds.launch.jobs import slurm_seconds

    assert slurm_seconds(limit) == seconds


def test_workdir_and_master_port_reach_the_job_as_given(tmp_path, monkeypatch, capsys):
    """A relative --workdir becomes the absolute directory it names here; --master-port is the Slurm
    job's rendezvous port (SMELT_MASTER_PORT still wins); a --workdir with a space is blamed for the
    log directory it gives, not a --log-dir the user did not pass; without -o the submit line says
    to render to a file first."""
    (tmp_path / "work").mkdir()
    monkeypatch.chdir(tmp_path)
    plan = _plan(ROOT / "recipes/tiny/smelt.yaml", "slurm", nodes=1, gpus_per_node=1, workdir="work",
                 master_port=29501)
    text = render(plan)
    assert plan.workdir == str(tmp_path / "work") and f"SMELT_WORKDIR={tmp_path / 'work'}\n" in text
    assert "MASTER_PORT=${SMELT_MASTER_PORT:-29501}" in text
    assert "port 29501" in summary(plan)
    assert "submit        render it with -o job.sbatch, then sbatch job.sbatch" in summary(plan)
    assert "submit        sbatch jobs/x.sbatch" in summary(plan, "jobs/x.sbatch")
    (tmp_path / "my work").mkdir()
    with pytest.raises(ConfigError, match=r"the default log directory \('.*my work/runs/slurm-logs', under --workdir "
                                          r".*\): #SBATCH --output cannot hold spaces; pass --log-dir"):
        render(_plan(ROOT / "recipes/tiny/smelt.yaml", "slurm", nodes=1, gpus_per_node=1, workdir="my work"))


def test_fill_template_fills_every_field_and_refuses_a_missing_one():
    from smelt_ds.launch.jobs import fill_template

    # values go in literally (no second pass), shell braces are left alone
    assert fill_template("a={{A}} ${B} {{A}}\n", {"A": "{{B}}"}, "t.sh") == "a={{B}} ${B} {{B}}\n"
    with pytest.raises(ConfigError, match=r"template t.sh has fields \['B', 'C'\] that render-job does not fill"):
        fill_template("{{A}}{{C}}{{B}}", {"A": "1"}, "t.sh")
    with pytest.raises(ConfigError, match=r"fields \['B'\] that smelt-ds sweep does not fill"):
        fill_template("{{B}}", {}, "t.sh", by="smelt-ds sweep")


def test_a_job_rendered_outside_the_checkout_names_the_recipe_it_can_open(tmp_path, monkeypatch):
    """Rendered from a work directory with the checkout's recipe given by its absolute path, the
    Slurm job runs in that work directory, so it names the recipe absolutely (relative to the
    checkout it named a file the job could not open); a recipe inside the work directory stays
    relative to it. A Kubernetes pod runs in the image's checkout, so there the checkout's recipe
    stays relative to the checkout."""
    recipe = ROOT / "recipes" / "tiny" / "smelt.yaml"
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    for workdir in (None, str(work)):
        plan = _plan(recipe, "slurm", nodes=1, gpus_per_node=1, workdir=workdir)
        assert plan.recipe_arg == str(recipe.resolve())
        assert f"SMELT_RECIPE={shlex.quote(str(recipe.resolve()))}\n" in render(plan)
    own = work / "mine.yaml"
    own.write_text(f"base: {recipe}\n")
    assert _plan(own, "slurm", nodes=1, gpus_per_node=1).recipe_arg == "mine.yaml"
    k8s = _plan(recipe, "k8s", nodes=1, gpus_per_node=1, image="registry.example.org/smelt-ds:1.0")
    assert k8s.recipe_arg == "/etc/smelt-ds/recipe.yaml"  # the ConfigMap's copy: tests/launch/test_k8s.py


def test_cli_dry_run_and_errors(tmp_path, capsys):
    rc = cli_main(["render-job", "recipes/xl/smelt.yaml", "--scheduler", "slurm", "--layout", "h200", "--dry-run",
                   "-o", str(tmp_path / "job.sbatch"), "--no-data-check"])  # the recipe's corpora are not here
    out = capsys.readouterr().out
    assert rc == 0 and not (tmp_path / "job.sbatch").exists()  # dry run writes nothing
    assert re.search(r"checks \(smelt-ds preflight\)\n  config +OK .*\n  data +SKIP +--no-data-check", out)
    assert "world size    32 node(s) x 8 GPU(s) = 256 ranks" in out
    assert "256 ranks x micro-batch 2 x 4096 tokens x accumulation 4 = 8,388,608 tokens per step" in out
    assert "ep_size 8: 32 group(s) of 8 consecutive ranks (inside a node), 24 of 192 experts per GPU" in out
    assert re.search(r"memory/GPU +[\d.]+ GiB of 139.7 GiB .*: fits, \d+% headroom", out)
    assert '--node-rank="$SLURM_NODEID"' in out and "--set train.micro_batch_size=2" in out
    rc = cli_main(["render-job", "recipes/xl/smelt.yaml", "--scheduler", "k8s", "-o", str(tmp_path / "job.yaml")])
    assert "warning" not in capsys.readouterr().err  # a pod reads corpora/ from its volume, not from here
    assert rc == 0 and [d["kind"] for d in yaml.safe_load_all((tmp_path / "job.yaml").read_text())] == [
        "ConfigMap", "PyTorchJob"]
    capsys.readouterr()
    assert cli_main(["render-job", "recipes/xl/smelt.yaml", "--scheduler", "slurm", "--nodes", "1",
                     "--gpus-per-node", "4"]) == 2
    assert "does not divide the world size" in capsys.readouterr().err


def test_memory_verdict_warns_when_a_layout_does_not_fit(tmp_path, capsys):
    plan = _plan(ROOT / "recipes/xl/smelt.yaml", "slurm", overrides=["train.micro_batch_size=8"], nodes=32)
    assert not plan.memory.fits(0.1) and any("under the 10% headroom" in n for n in plan.notes)
    # writing such a job is refused unless --force; --dry-run still shows the verdict
    args = ["render-job", "recipes/xl/smelt.yaml", "--scheduler", "slurm", "--nodes", "1", "--gpus-per-node", "8",
            "-o", str(tmp_path / "x.sbatch"), "--no-data-check"]
    capsys.readouterr()
    assert cli_main(args) == 2 and not (tmp_path / "x.sbatch").exists()
    assert re.search(r"1 check\(s\) that training makes at start fail for this job; nothing written:\n  memory: "
                     r"zero3 \+ checkpointing none: [\d.]+ GiB per GPU on 1 x 8 GPUs of [\d.]+ GiB, -\d+% free, needs "
                     r"10%: .*--force", capsys.readouterr().err, re.S)
    # --dry-run shows the verdict and the checks, and refuses the same way
    assert cli_main(args + ["--dry-run"]) == 2 and "DOES NOT FIT" in capsys.readouterr().out
    assert cli_main(args + ["--force"]) == 0 and (tmp_path / "x.sbatch").is_file()
    assert "warning (--force): memory: zero3 + checkpointing none" in capsys.readouterr().err  # still said


# ---------------------------------------------------------------------------------------------
# the Slurm script's signal handling, with fake srun / scontrol
# ---------------------------------------------------------------------------------------------

FAKE_SRUN = """#!/bin/bash
echo "srun $*" >> "$FAKE_LOG"
trap 'echo "srun got TERM" >> "$FAKE_LOG"; exit 0' TERM
echo started >> "$FAKE_LOG"
while true; do sleep 0.05; done
"""
FAKE_SCONTROL = """#!/bin/bash
if [[ "$1" == show ]]; then printf 'node-a\\nnode-b\\n'; else echo "scontrol $*" >> "$FAKE_LOG"; fi
"""


@pytest.mark.parametrize("sig,restarts,kw,expect_requeue,rc,said", [
    (signal.SIGUSR1, "0", {}, True, 0, "requeue (1 of at most 50)"),
    (signal.SIGTERM, "0", {}, False, 143, "SIGTERM (preemption or scancel): checkpoint"),
    # the time-limit requeue is capped too: 50 by default, --max-time-requeues
    (signal.SIGUSR1, "50", {}, False, 143,
     "not requeueing: requeue limit reached (50; render-job --max-time-requeues)"),
    (signal.SIGUSR1, "2", {"max_time_requeues": 2}, False, 143,
     "not requeueing: requeue limit reached (2; render-job --max-time-requeues)"),
])
def test_slurm_script_checkpoints_on_signal_and_requeues_near_the_time_limit(tmp_path, sig, restarts, kw,
                                                                             expect_requeue, rc, said):
    bindir = tmp_path / "bin"
    bindir.mkdir()
    for name, body in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL)):
        (bindir / name).write_text(body)
        (bindir / name).chmod(0o755)
    job = tmp_path / "job.sbatch"
    job.write_text(render(_plan(ROOT / "recipes/m/smelt.yaml", "slurm", log_dir=str(tmp_path / "logs"),
                                run_dir=str(tmp_path / "run"), **kw)))
    log = tmp_path / "fake.log"
    base = {k: v for k, v in os.environ.items() if not k.startswith("SMELT_MAX_")}
    env = {**base, "PATH": f"{bindir}:{os.environ['PATH']}", "FAKE_LOG": str(log), "SLURM_RESTART_COUNT": restarts,
           "SLURM_JOB_NODELIST": "node-[a-b]", "SLURM_JOB_ID": "777", "SLURM_CPUS_ON_NODE": "32"}
    proc = subprocess.Popen(["bash", str(job)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    t0 = time.time()
    while not (log.exists() and "started" in log.read_text()):
        assert time.time() - t0 < 30 and proc.poll() is None, proc.stdout.read() if proc.poll() is not None else ""
        time.sleep(0.05)
    proc.send_signal(sig)
    out, _ = proc.communicate(timeout=30)
    lines = log.read_text().splitlines()
    assert proc.returncode == rc, out
    assert "srun got TERM" in lines
    assert ("scontrol requeue 777" in lines) == expect_requeue
    assert said in out, out
    srun = next(line for line in lines if line.startswith("srun "))
    assert "--ntasks-per-node=1" in srun and "--cpus-per-task=32" in srun
    assert "--master-addr=node-a --master-port=10777" in srun  # 10000 + 777 % 20000 and "--nnodes=4" in srun


FAKE_SRUN_EXITS = """#!/bin/bash
echo "srun $*" >> "$FAKE_LOG"
exit "$FAKE_SRUN_RC"
"""


def _run_slurm_job(tmp_path: Path, srun_rc: int, env: dict[str, str], **kw) -> tuple[int, str, list[str]]:
    """Run the rendered Slurm job with a fake srun that exits ``srun_rc`` (as when the ranks end by
    themselves) and a fake scontrol: (the job's status, its output, the fakes' log lines)."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    for name, body in (("srun", FAKE_SRUN_EXITS), ("scontrol", FAKE_SCONTROL)):
        (bindir / name).write_text(body)
        (bindir / name).chmod(0o755)
    job = tmp_path / "job.sbatch"
    job.write_text(render(_plan(ROOT / "recipes/m/smelt.yaml", "slurm", log_dir=str(tmp_path / "logs"),
                                run_dir=str(tmp_path / "run"), **kw)))
    log = tmp_path / "fake.log"
    base = {k: v for k, v in os.environ.items()
            if k not in ("SLURM_RESTART_COUNT", "SMELT_MAX_REQUEUES", "SMELT_MAX_TIME_REQUEUES")}
    r = subprocess.run(["bash", str(job)], env={**base, "PATH": f"{bindir}:{os.environ['PATH']}", "FAKE_LOG": str(log),
                                               "FAKE_SRUN_RC": str(srun_rc), "SLURM_JOB_NODELIST": "node-[a-b]",
                                               "SLURM_JOB_ID": "777", **env},
                       capture_output=True, text=True, timeout=60)
    return r.returncode, r.stdout + r.stderr, log.read_text().splitlines() if log.exists() else []


@pytest.mark.parametrize("var, value", [("SMELT_MAX_REQUEUES", "x"), ("SMELT_MAX_TIME_REQUEUES", "-1"),
                                        ("SMELT_MAX_REQUEUES", "3 4"), ("SMELT_MAX_TIME_REQUEUES", "1e3")])
def test_a_requeue_limit_exported_before_sbatch_that_is_no_number_stops_the_job_before_srun(tmp_path, var, value):
    rc, out, lines = _run_slurm_job(tmp_path, 1, {var: value})
    assert rc == 2 and lines == [], out  # neither srun nor scontrol ran
    assert f"smelt-ds: {var}={value} is not a whole number of requeues" in out


@pytest.mark.parametrize("srun_rc,requeue", [
    (1, True),     # torchrun: some rank failed (a dead peer, a hang, or an unexpected error)
    (75, True),    # a collective failed: a peer was lost
    (124, True),   # the hang watchdog fired
    (137, True),   # srun or its step killed (SIGKILL, node failure)
    (0, False),    # done
    (2, False),    # bad configuration: failing again is certain
    (3, False),    # stopped after non-finite steps: a restart would diverge again
])
def test_slurm_job_whose_ranks_fail_requeues_itself(tmp_path, srun_rc, requeue):
    rc, out, lines = _run_slurm_job(tmp_path, srun_rc, {"SLURM_RESTART_COUNT": "1"})
    assert rc == srun_rc, out
    assert any(line.startswith("srun ") for line in lines)
    assert ("scontrol requeue 777" in lines) == requeue, out
    if requeue:
        assert f"smelt-ds: srun exited {srun_rc} (a rank failed, hung or lost a peer) at restart count 1: " \
               "requeueing (2 of at most 3)" in out
    elif srun_rc:
        assert f"smelt-ds: srun exited {srun_rc} (" in out and "not requeueing" in out


@pytest.mark.parametrize("env,kw,limit", [
    ({"SLURM_RESTART_COUNT": "3", "SMELT_MAX_REQUEUES": "3"}, {}, 3),  # exported
    ({"SLURM_RESTART_COUNT": "3"}, {}, 3),                             # render-job's default
    ({"SLURM_RESTART_COUNT": "2"}, {"max_requeues": 2}, 2),            # --max-requeues 2
    ({}, {"max_requeues": 0}, 0),                                      # --max-requeues 0: never
])
def test_slurm_job_requeues_a_failure_at_most_max_requeues_times(tmp_path, env, kw, limit):
    rc, out, lines = _run_slurm_job(tmp_path, 1, env, **kw)
    assert rc == 1
    assert not any(line.startswith("scontrol requeue") for line in lines), out
    assert f"not requeueing: requeue limit reached ({limit}; render-job --max-requeues)" in out
    with pytest.raises(ConfigError, match=r"`--max-requeues` \(-1\) must be 0"):
        render(_plan(ROOT / "recipes/m/smelt.yaml", "slurm", max_requeues=-1))
    with pytest.raises(ConfigError, match=r"`--max-time-requeues` \(-1\) must be 0 \(never requeue a job at its time"):
        render(_plan(ROOT / "recipes/m/smelt.yaml", "slurm", max_time_requeues=-1))


# a tiny model's overrides, for tests that render jobs of it (tests/launch/test_hosts.py runs them on
# two hosts)
TINY_SETS = ["model.vocab_size=512", "model.hidden_size=32", "model.num_layers=4", "model.num_heads=4",
             "model.num_kv_heads=2", "model.max_seq_len=64", "moe.num_experts=4", "moe.top_k=2",
             "moe.expert_ffn_size=32", "data.builtin_max_bytes=150000", "data.tokenizer.vocab_size=512",
             "train.seq_len=32", "train.micro_batch_size=2", "train.max_steps=2", "train.warmup_steps=1",
             "train.log_every=1", "train.eval_every=100", "train.save_every=100", "eval.eval_batches=1",
             "deepspeed.zero_stage=3"]


# ---------------------------------------------------------------------------------------------
# what the deepspeed script and the Kubernetes pods execute, with fake launchers
# ---------------------------------------------------------------------------------------------

FAKE_ARGV = """#!/bin/bash
printf '%s\\n' "$0" "$@" > "$FAKE_LOG"
[[ -n "${DS_ENV_FILE:-}" ]] && cp "$DS_ENV_FILE" "$FAKE_LOG.env"
exit 0
"""


def _fake_bin(tmp_path: Path, name: str) -> dict[str, str]:
    bindir = tmp_path / "bin"
    bindir.mkdir(exist_ok=True)
    (bindir / name).write_text(FAKE_ARGV)
    (bindir / name).chmod(0o755)
    return {**os.environ, "PATH": f"{bindir}:{os.environ['PATH']}", "FAKE_LOG": str(tmp_path / "argv")}


def test_deepspeed_script_calls_the_launcher_with_hostfile_and_overrides(tmp_path):
    hf = tmp_path / "hostfile"
    hf.write_text(HOSTFILE)
    plan = _plan(ROOT / "recipes/m/smelt.yaml", "deepspeed", hostfile=str(hf), nodes=2, layout="h200",
                 overrides=["train.log_every=5", f"train.run_dir={tmp_path / 'run'}"],
                 env=["NCCL_IB_HCA=mlx5_0", "MY_FLAG=a b"], workdir=str(ROOT))
    (tmp_path / "run.sh").write_text(render(plan))
    env = {**_fake_bin(tmp_path, "deepspeed"), "OMP_NUM_THREADS": "4"}
    r = subprocess.run(["bash", str(tmp_path / "run.sh")], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    argv = (tmp_path / "argv").read_text().splitlines()[1:]
    assert argv == ["--num_nodes", "2", "--num_gpus", "8", "--master_addr", "gpu-node-001.cluster.example.org",
                    "--master_port", "29500", "--hostfile", str(hf.resolve()), "--module", "smelt_ds.train",
                    "recipes/m/smelt.yaml", "--resume", "auto", "--set", "train.micro_batch_size=4",
                    "--set", "train.log_every=5", "--set", f"train.run_dir={tmp_path / 'run'}"]
    shipped = (tmp_path / "argv.env").read_text().splitlines()  # variables the other hosts receive
    assert "OMP_NUM_THREADS=4" in shipped and "MY_FLAG=a b" in shipped
    assert f"TORCH_NCCL_DEBUG_INFO_TEMP_FILE={tmp_path / 'run'}/nccl_trace/rank_" in shipped
    assert "TORCH_NCCL_DUMP_ON_TIMEOUT=1" in shipped and "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC=600" in shipped


def test_deepspeed_script_still_ships_the_users_deepspeed_env_files(tmp_path):
    """The launcher reads KEY=VALUE lines for the other hosts from .deepspeed_env in the home and
    the working directory (DeepSpeed's runner); the script's own temporary DS_ENV_FILE must carry
    those lines too, without blank lines (the launcher splits every line on =)."""
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    (home / ".deepspeed_env").write_text("FROM_HOME=1\n\n")
    (work / ".deepspeed_env").write_text("LD_LIBRARY_PATH=/opt/nccl/lib\nFROM_WORKDIR=a=b")  # no final newline
    plan = _plan(ROOT / "recipes/tiny/smelt.yaml", "deepspeed", nodes=1, gpus_per_node=1, workdir=str(work),
                 overrides=[f"train.run_dir={tmp_path / 'run'}"])
    (tmp_path / "run.sh").write_text(render(plan))
    env = {**_fake_bin(tmp_path, "deepspeed"), "HOME": str(home), "OMP_NUM_THREADS": "4"}
    env.pop("DS_ENV_FILE", None)
    r = subprocess.run(["bash", str(tmp_path / "run.sh")], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    shipped = (tmp_path / "argv.env").read_text().splitlines()
    assert shipped[:3] == ["FROM_HOME=1", "LD_LIBRARY_PATH=/opt/nccl/lib", "FROM_WORKDIR=a=b"]
    assert "OMP_NUM_THREADS=4" in shipped and "" not in shipped


def test_jobs_without_smelt_ds_on_the_node_stop_before_the_launcher_naming_the_install(tmp_path):
    """A Slurm job whose SMELT_PYTHON cannot import smelt_ds, and a deepspeed script with no
    deepspeed on PATH, exit 2 before srun / the launcher, naming the one install sequence."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    for name, body in (("srun", FAKE_SRUN_EXITS), ("scontrol", FAKE_SCONTROL)):
        (bindir / name).write_text(body)
        (bindir / name).chmod(0o755)
    bare = bindir / "bare-python"  # a Python without site-packages: no smelt_ds
    bare.write_text(f"#!/bin/sh\nexec {sys.executable} -I -S \"$@\"\n")
    bare.chmod(0o755)
    job = tmp_path / "job.sbatch"
    job.write_text(render(_plan(ROOT / "recipes/m/smelt.yaml", "slurm", log_dir=str(tmp_path / "logs"),
                                run_dir=str(tmp_path / "run"))))
    log = tmp_path / "fake.log"
    env = {**os.environ, "PATH": f"{bindir}:{os.environ['PATH']}", "FAKE_LOG": str(log), "FAKE_SRUN_RC": "0",
           "SLURM_JOB_NODELIST": "node-a", "SLURM_JOB_ID": "777", "SMELT_PYTHON": str(bare)}
    r = subprocess.run(["bash", str(job)], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and not log.exists(), r.stderr  # srun never ran
    assert f"{bare} cannot import smelt_ds" in r.stderr and "scripts/install_gpu.sh" in r.stderr
    env.pop("SMELT_PYTHON")
    assert subprocess.run(["bash", str(job)], env=env, capture_output=True, text=True, timeout=60).returncode == 0
    assert log.read_text().startswith("srun ")  # with render-job's own interpreter the job starts

    plan = _plan(ROOT / "recipes/m/smelt.yaml", "deepspeed", workdir=str(ROOT), run_dir=str(tmp_path / "run"),
                 nodes=1, gpus_per_node=8)
    (tmp_path / "run.sh").write_text(render(plan))
    r = subprocess.run(["bash", str(tmp_path / "run.sh")], env={**os.environ, "PATH": "/usr/bin:/bin"},
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "no deepspeed launcher on PATH" in r.stderr and "install_gpu.sh" in r.stderr


FAKE_DEEPSPEED_WAITS = """#!/bin/bash
# a launcher whose ranks stop on RUN_DIR/STOP: save (FAKE_SAVE_S), then exit FAKE_RC; 99 when no
# STOP came within 20 s
printf '%s\\n' "$0" "$@" > "$FAKE_LOG"
env > "$FAKE_LOG.environ"
for (( i = 0; i < 1000; i++ )); do [[ -e "$FAKE_STOP" ]] && break; sleep 0.02; done
[[ -e "$FAKE_STOP" ]] || exit 99
echo stopping > "$FAKE_LOG.stopping"
sleep "$FAKE_SAVE_S"
echo saved > "$FAKE_LOG.saved"
exit "$FAKE_RC"
"""


@pytest.mark.parametrize("launcher_rc", [143, 1])
def test_deepspeed_script_stops_the_ranks_through_the_stop_file_on_sigterm(tmp_path, launcher_rc):
    """SIGTERM to the rendered script creates RUN_DIR/STOP; a second signal (SIGINT) during the
    ranks' save does not end the script: it waits for the launcher and exits with its status
    (143: the ranks stopped after saving; 1: a rank failed while saving)."""
    run_dir = tmp_path / "run dir"  # a space: quoted everywhere
    plan = _plan(ROOT / "recipes/s/smelt.yaml", "deepspeed", workdir=str(ROOT), run_dir=str(run_dir))
    (tmp_path / "run.sh").write_text(render(plan))
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "deepspeed").write_text(FAKE_DEEPSPEED_WAITS)
    (bindir / "deepspeed").chmod(0o755)
    log = tmp_path / "argv"
    env = {**os.environ, "PATH": f"{bindir}:{os.environ['PATH']}", "FAKE_LOG": str(log),
           "FAKE_STOP": str(run_dir / "STOP"), "FAKE_SAVE_S": "2", "FAKE_RC": str(launcher_rc)}
    env.pop("SMELT_LAUNCHER_PID", None)
    out_file = tmp_path / "out"
    with out_file.open("w") as out_f:  # a file, not a pipe: a launcher left behind cannot block the test
        # SIGINT at its default in the script: bash cannot trap a signal ignored when it starts, as it
        # is when pytest itself runs in a background job (`pytest &`)
        proc = subprocess.Popen(["bash", str(tmp_path / "run.sh")], env=env, stdout=out_f, stderr=subprocess.STDOUT,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        t0 = time.time()
        while not Path(f"{log}.environ").is_file() or not Path(f"{log}.environ").read_text().endswith("\n"):
            assert time.time() - t0 < 30 and proc.poll() is None, out_file.read_text()
            time.sleep(0.02)
        time.sleep(0.1)
        assert not (run_dir / "STOP").exists()
        proc.send_signal(signal.SIGTERM)
        # the ranks save; the script's SIGTERM handler has ended (its message is its last command: a
        # signal that reaches bash while the handler's `touch` runs is dropped, as bash does for a
        # SIGINT its foreground child survived)
        while not Path(f"{log}.stopping").is_file() or "SIGTERM: created" not in out_file.read_text():
            assert time.time() - t0 < 30 and proc.poll() is None, f"the script exited {proc.poll()}: no STOP\n" \
                + out_file.read_text()
            time.sleep(0.02)
        proc.send_signal(signal.SIGINT)  # while the ranks save
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    out = out_file.read_text()
    assert (run_dir / "STOP").is_file()
    assert proc.returncode == launcher_rc, out
    assert Path(f"{log}.saved").is_file(), "the script exited before the launcher"
    assert f"smelt-ds: SIGTERM: created {run_dir}/STOP: the ranks finish their step, save a checkpoint" in out
    assert f"smelt-ds: SIGINT: created {run_dir}/STOP" in out
    seen = dict(line.split("=", 1) for line in Path(f"{log}.environ").read_text().splitlines() if "=" in line)
    assert seen["SMELT_LAUNCHER_PID"] == str(proc.pid)
    assert not Path(seen["DS_ENV_FILE"]).exists()  # removed on exit
    argv = log.read_text().splitlines()[1:]
    assert argv[-2:] == ["--run-dir", str(run_dir)]  # the ranks use the directory the script watches


FAKE_ENV = """#!/bin/bash
env > "$FAKE_LOG.environ"
"""

#: NCCL fault handling every job sets ({run_dir}: the run directory as the job sees it)
NCCL_DEFAULTS = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3", "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
                 "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000",
                 "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": "{run_dir}/nccl_trace/rank_",
                 "TORCH_NCCL_ENABLE_MONITORING": "1", "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC": "600"}


def _rank_env(scheduler: str, tmp_path: Path, mine: dict[str, str]) -> tuple[dict[str, str], str]:
    """The environment the ranks' launcher (deepspeed, torchrun) starts with in the rendered job,
    with ``mine`` exported before the bash scripts run (Kubernetes: passed with --env), and the
    run directory the job resolved. Each scheduler resolves the run directory another way:
    --run-dir (deepspeed), train.run_dir relative to the workdir (slurm), a --set with {name} (k8s)."""
    tmp_path.mkdir()
    wd = tmp_path / "wd"
    wd.mkdir()
    bindir = tmp_path / "bin"
    bindir.mkdir()
    fake = "deepspeed" if scheduler == "deepspeed" else "python"
    (bindir / fake).write_text(FAKE_ENV)
    (bindir / fake).chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k not in NCCL_DEFAULTS}
    env.update(PATH=f"{bindir}:{os.environ['PATH']}", FAKE_LOG=str(tmp_path / "fake"))
    recipe = ROOT / "recipes/s/smelt.yaml"
    if scheduler == "deepspeed":
        plan = _plan(recipe, scheduler, workdir=str(wd), run_dir=str(tmp_path / "run"))
        run_dir = str(tmp_path / "run")
        argv = ["bash", str(tmp_path / "job")]
    elif scheduler == "slurm":
        plan = _plan(recipe, scheduler, workdir=str(wd), log_dir=str(tmp_path / "logs"))
        run_dir = f"{wd}/runs/{plan.config.name}"
        argv = ["bash", str(tmp_path / "job"), "--per-node"]
        env.update(SMELT_PYTHON="python", SLURM_JOB_NODELIST="node-a", SLURM_JOB_ID="777", SLURM_NODEID="0",
                   SMELT_MASTER_ADDR="node-a", SMELT_MASTER_PORT="20777")
    else:
        plan = _plan(recipe, scheduler, workdir=str(wd), overrides=["train.run_dir=runs/{name}-k8s"],
                     env=[f"{k}={v}" for k, v in mine.items()])
        run_dir = f"{wd}/runs/{plan.config.name}-k8s"
    assert plan.run_dir == run_dir
    text = render(plan)
    if scheduler == "k8s":
        _, job = yaml.safe_load_all(text)
        (c,) = job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"]
        names = [e["name"] for e in c["env"]]
        assert len(names) == len(set(names)), names  # --env replaces a default, no second entry
        env.update({e["name"]: str(e["value"]) for e in c["env"]}, RANK="0", MASTER_ADDR="m", MASTER_PORT="1")
        argv = ["bash", "-c", c["args"][0]]
    else:
        (tmp_path / "job").write_text(text)
        env.update(mine)
    r = subprocess.run(argv, env=env, cwd=wd, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    seen = (tmp_path / "fake.environ").read_text().splitlines()
    return dict(line.split("=", 1) for line in seen if "=" in line), run_dir


@pytest.mark.parametrize("scheduler", ["deepspeed", "slurm", "k8s"])
def test_every_job_sets_the_nccl_fault_variables_as_overridable_defaults(scheduler, tmp_path):
    seen, run_dir = _rank_env(scheduler, tmp_path / "defaults", {})
    assert {k: seen.get(k) for k in NCCL_DEFAULTS} == {k: v.format(run_dir=run_dir) for k, v in NCCL_DEFAULTS.items()}
    assert Path(run_dir, "nccl_trace").is_dir()  # the flight recorder needs the directory
    mine = {"TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC": "1200", "TORCH_NCCL_DUMP_ON_TIMEOUT": "0",
            "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": str(tmp_path / "fr dumps" / "trace_")}
    seen, run_dir = _rank_env(scheduler, tmp_path / "overridden", {**mine, "NCCL_DEBUG": "INFO"})
    assert {k: seen.get(k) for k in NCCL_DEFAULTS} == {**{k: v.format(run_dir=run_dir)
                                                          for k, v in NCCL_DEFAULTS.items()}, **mine}
    assert seen["NCCL_DEBUG"] == "INFO"  # a variable the template itself sets (default WARN)
    assert (tmp_path / "fr dumps").is_dir() and not Path(run_dir, "nccl_trace").exists()


def test_k8s_pod_command_uses_the_pod_rank_and_master_from_the_operator(tmp_path):
    _, job = yaml.safe_load_all(render(_plan(ROOT / "recipes/l/top.yaml", "k8s", layout="h200")))
    cmd = job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]["args"][0]
    env = {**_fake_bin(tmp_path, "python"), "RANK": "5", "MASTER_ADDR": "smelt-l-top-master-0", "MASTER_PORT": "23456"}
    r = subprocess.run(["bash", "-c", cmd], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    argv = (tmp_path / "argv").read_text().splitlines()[1:]
    assert argv == ["-m", "torch.distributed.run", "--nnodes=16", "--nproc-per-node=8", "--node-rank=5",
                    "--master-addr=smelt-l-top-master-0", "--master-port=23456", "-m", "smelt_ds.train",
                    "/etc/smelt-ds/recipe.yaml", "--resume", "auto"]  # the layout's override: in the ConfigMap


def test_version_matches_the_installed_package(capsys):
    from importlib.metadata import version

    from smelt_ds.cli import build_parser

    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out.strip() == f"smelt-ds {version('smelt-ds')}"


# ---------------------------------------------------------------------------------------------
# hostfile lines: accepted exactly when the deepspeed launcher accepts them
# ---------------------------------------------------------------------------------------------

HOSTFILE_LINES = [
    "host slots=8", "  host   slots=8  ", "host\tslots=8", "host\x0cslots=8", "host\u00a0slots=8",
    "gpu-node-001.cluster.example.org slots=16", "host slots=0", "host slots=08", "host slots=\u0668",
    "host slots=8 # a comment after the entry", "host slots=8 max_slots=16", "host slots=8abc", "host slots=8.5",
    "host#rack1 slots=8", "# host slots=8", "   # an indented comment", "#", "", "   \t ",
    "host slots = 8", "host slots =8", "host slots= 8", "host SLOTS=8", "host Slots=8", "host slots:8",
    "host slots=", "host slots=-1", "host slots=x8", "host 8", "host", "slots=8", "host,slots=8", "host:slots=8",
    "hostslots=8", "host slots 8", "; host slots=8",
]


def _ours_and_deepspeeds(text: str, tmp_path: Path):
    """(our hosts or None, DeepSpeed's hosts or None) for the hostfile ``text``; None = refused.
    DeepSpeed reads the file as `deepspeed --hostfile` does (runner.fetch_hostfile)."""
    from deepspeed.launcher.runner import fetch_hostfile

    hf = tmp_path / "hostfile"
    hf.write_bytes(text.encode())
    try:
        ds = list(fetch_hostfile(str(hf)).items())
    except ValueError:
        ds = None
    ours = []
    for given in (text, hf.read_text()):  # as passed, and as plan_job reads the file
        try:
            ours.append([(h.name, h.slots) for h in parse_hostfile(given, str(hf))])
        except ConfigError:
            ours.append(None)
    assert ours[0] == ours[1]
    return ours[0], ds


@pytest.mark.parametrize("line", HOSTFILE_LINES, ids=repr)
def test_hostfile_line_accepted_exactly_when_deepspeed_accepts_it(line, tmp_path):
    # alone (a comment or blank line alone is an empty hostfile: refused by both), and after a
    # good line (so only the line itself decides)
    for text in (line + "\n", f"first slots=2\n{line}\n"):
        ours, ds = _ours_and_deepspeeds(text, tmp_path)
        assert ours == ds, f"{text!r}: ours {ours}, deepspeed {ds}"
    # the decision is as expected, not only shared (guards against both parsers changing)
    accepted = line in ("host slots=8", "  host   slots=8  ", "host\tslots=8", "host\x0cslots=8",
                        "host\u00a0slots=8", "gpu-node-001.cluster.example.org slots=16", "host slots=0",
                        "host slots=08", "host slots=\u0668", "host slots=8 # a comment after the entry",
                        "host slots=8 max_slots=16", "host slots=8abc", "host slots=8.5", "host#rack1 slots=8")
    skipped = line.strip() == "" or line.strip().startswith("#")
    assert (ours is not None and len(ours) == 2) == accepted
    assert (ours == [("first", 2)]) == skipped


@pytest.mark.parametrize("text", [
    "a slots=8\na slots=4\n",                   # a host twice: refused
    "a slots=8\n\n# a again\n  a   slots=8\n",  # also when the lines differ in spacing
    "a slots=8\nA slots=8\n",                   # host names are compared as written
    "a slots=8\na.example.org slots=8\n",
    "a slots=8\r\nb slots=4\r\n",               # CRLF
    "a slots=8\rb slots=4\r",                   # CR alone ends a line too (universal newlines)
    "a slots=8\x85b slots=4\n",                 # NEL does not (one line: a, 8)
    "a slots=8\u2028b slots=4\n",
    "# only a comment\n\n",
    "",
    "\n\n\n",
])
def test_hostfile_files_parse_like_deepspeed(text, tmp_path):
    ours, ds = _ours_and_deepspeeds(text, tmp_path)
    assert ours == ds, f"{text!r}: ours {ours}, deepspeed {ds}"


def test_hostfile_with_spaces_around_equals_is_refused_naming_the_line_and_the_fix(tmp_path, capsys):
    hf = tmp_path / "hostfile"
    hf.write_text("# the cluster\ngpu-node-001 slots=8\r\ngpu-node-002 slots = 8\n")
    expected = (f"{hf} line 3: 'gpu-node-002 slots = 8' is not a deepspeed hostfile entry `HOSTNAME slots=N` "
                "(the deepspeed launcher refuses it): write `gpu-node-002 slots=8` (lower-case `slots=`, no spaces "
                "around `=`)")
    with pytest.raises(ConfigError) as e:
        _plan(ROOT / "recipes/m/smelt.yaml", "deepspeed", hostfile=str(hf), nodes=2, gpus_per_node=8)
    assert str(e.value) == expected
    capsys.readouterr()
    assert cli_main(["render-job", "recipes/m/smelt.yaml", "--scheduler", "deepspeed", "--hostfile", str(hf),
                     "--nodes", "2", "--gpus-per-node", "8", "--dry-run"]) == 2
    assert expected in capsys.readouterr().err
    with pytest.raises(ConfigError, match=r"^hostfile line 1: 'node1 8' is not a deepspeed hostfile entry .*: "
                                          r"write `node1 slots=8`$"):
        parse_hostfile("node1 8\n")
    with pytest.raises(ConfigError, match=r"^hostfile line 1: 'node1' .*: write one host per line as "
                                          r"`HOSTNAME slots=N` .*e\.g\. `gpu-node-001\.example\.org slots=8`"):
        parse_hostfile("node1\n")


def test_hostfile_duplicate_and_empty_errors_name_the_lines(tmp_path):
    with pytest.raises(ConfigError) as e:
        parse_hostfile("a slots=8\n# b\nb slots=8\n a  slots=4\n", "hf")
    assert str(e.value) == ("hf line 4: 'a  slots=4': host 'a' is listed twice (first on line 1), which the "
                            "deepspeed launcher refuses: keep one line per host")
    with pytest.raises(ConfigError, match=r"^hf lists no hosts \(only blank lines and `#` comments\): add one "
                                          r"`HOSTNAME slots=N` line per node"):
        parse_hostfile("# a slots=8\n\n", "hf")


def test_hostfile_host_with_zero_slots_parses_but_a_job_cannot_use_it(tmp_path):
    # the launcher takes `slots=0` (and with --num_gpus ignores slots), so the parser does too;
    # the plan refuses such a host only when the job places ranks on it
    assert [(h.name, h.slots) for h in parse_hostfile("a slots=8\nb slots=0\n")] == [("a", 8), ("b", 0)]
    hf = tmp_path / "hostfile"
    hf.write_text("a slots=8\nb slots=0\n")
    plan = _plan(ROOT / "recipes/s/smelt.yaml", "deepspeed", hostfile=str(hf), nodes=1, gpus_per_node=8)
    assert plan.world_size == 8 and plan.master_addr == "a"
    with pytest.raises(ConfigError, match=r"b has 0 slots, fewer than --gpus-per-node 8"):
        _plan(ROOT / "recipes/m/smelt.yaml", "deepspeed", hostfile=str(hf), nodes=2, gpus_per_node=8)


def test_scheduler_is_a_choice_refused_at_parse_time_naming_the_choices(capsys):
    with pytest.raises(SystemExit) as e:
        cli_main(["render-job", "recipes/tiny/smelt.yaml", "--scheduler", "pbs", "--dry-run"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert re.search(r"argument --scheduler: invalid choice: '?pbs'? \(choose from '?deepspeed'?, '?slurm'?, '?k8s'?\)",
                     err), err
    with pytest.raises(SystemExit):
        cli_main(["render-job", "--help"])
    assert "--scheduler {deepspeed,slurm,k8s}" in capsys.readouterr().out


def test_a_tracker_missing_here_is_refused_for_slurm_and_a_warning_for_k8s(monkeypatch, capsys):
    """A Slurm job runs the Python render-job runs under: a tracker package missing here fails at
    start, so it is refused now (naming the extra). A pod runs its image: a warning."""
    argv = ["render-job", "recipes/tiny/smelt.yaml", "--scheduler", "slurm", "--dry-run",
            "--set", "tracking.trackers=[wandb]", "--set", "tracking.wandb.mode=offline"]
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` raises ImportError, as when it is missing
    assert cli_main(argv) == 2
    err = capsys.readouterr().err
    assert "trackers: `tracking.trackers` (['wandb']) lists 'wandb'" in err and "pip install 'smelt-ds[wandb]'" in err
    k8s = [a if a != "slurm" else "k8s" for a in argv]
    assert cli_main(k8s) == 0
    err = capsys.readouterr().err
    assert "smelt-ds render-job: warning: trackers: `tracking.trackers` (['wandb'])" in err
    assert "a Kubernetes pod sees its own image" in err
    monkeypatch.delitem(sys.modules, "wandb")  # the dev extra installs it: no warning
    assert cli_main(argv) == 0 and "warning" not in capsys.readouterr().err


def test_render_job_refuses_before_the_queue_what_training_refuses_at_start(tmp_path, capsys):
    """Issue 40's cases before the queue: prepared data (after `smelt-ds data prepare --recipe`)
    whose tokenizer is larger than model.vocab_size is refused (exit 2), as training refuses it at
    start; so is a misspelled source path, naming the field and the working directory
    (--no-data-check skips the check, for data only the compute nodes see); the micro-batch passed
    through deepspeed.config is refused when the recipe is loaded."""
    from smelt_ds.config.loading import load_config
    from smelt_ds.data.prepare import prepare_from_config

    recipe = str(ROOT / "recipes" / "tiny" / "smelt.yaml")
    base = ["render-job", recipe, "--scheduler", "slurm", "--nodes", "1", "--gpus-per-node", "2", "--dry-run",
            "--workdir", str(tmp_path)]
    typo = ["--set", "data.sources=[{path: corpora/web-typo, domain: web}]"]
    assert cli_main(base + typo) == 2
    err = capsys.readouterr().err
    assert "data: `data.sources[0].path` ('corpora/web-typo'): no such file or directory" in err
    assert f"relative paths are read from the working directory {str(tmp_path)!r}" in err and "--workdir DIR" in err
    assert cli_main(base + typo + ["--no-data-check"]) == 0
    assert "warning" not in capsys.readouterr().err

    text = tmp_path / "shakespeare.txt"  # a file source, as on a cluster (built-in sources are not looked up)
    text.write_text((ROOT / "tests" / "data" / "corpora" / "tinyshakespeare-head.txt").read_text())
    sets = [s for s in TINY_SETS if not s.startswith("model.vocab_size")] + [
        f"data.cache_dir={tmp_path / 'cache'}", f"data.sources=[{{path: {text}, sample_by: paragraph}}]"]
    prepare_from_config(load_config(recipe, sets).data)          # what `smelt-ds data prepare --recipe` leaves
    args = base + [x for s in sets for x in ("--set", s)]
    assert cli_main(args + ["--set", "model.vocab_size=256"]) == 2
    assert "`model.vocab_size` (256) is smaller than the tokenizer of the prepared data (512 tokens" in \
        capsys.readouterr().err
    assert cli_main(args + ["--set", "model.vocab_size=512"]) == 0
    capsys.readouterr()
    assert cli_main(args + ["--set", "deepspeed.config.train_micro_batch_size_per_gpu=4"]) == 2
    assert "is set by the recipe field train.micro_batch_size" in capsys.readouterr().err
