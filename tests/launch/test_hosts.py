"""Multi-node jobs on real hosts: two network/UTS/mount namespaces of this machine
(:mod:`smelt_ds.testing.hosts`), each with its own host name, IP address, ``/dev/shm`` and, where
a test asks, its own clock. Each job is rendered by ``render-job`` and started as its scheduler
would start it; each trains 1 rank per host, is stopped the way its scheduler stops it, and is
restarted with ``--resume auto``. Every logged loss must equal, bit for bit, the loss of the shared
2-rank reference run (:mod:`tests.two_ranks`, one host, ``smelt-ds train --nproc 2``) at the same
step: the hosts, the launcher and the stop change nothing of the trajectory.

- Slurm: the batch script runs on ``host0`` and ``srun`` (the bed's stand-in) starts one task per
  host; near the time limit (``SIGUSR1``) the script stops the ranks through ``srun`` and
  ``torchrun``, and requeues; the requeued start resumes.
- The deepspeed launcher with a hostfile of both hosts, through ``pdsh`` and ``ssh`` (the bed's
  stand-ins), host clocks 90 s ahead and 90 s behind the machine's: a SIGTERM to the script
  creates the STOP file, which every rank must honour although no host's clock agrees with the
  file's time; the next start resumes and is not stopped by what the first stop left.
- Kubernetes: the PyTorchJob's pod command on each host (``RANK`` = the pod's index,
  ``MASTER_ADDR`` = the master pod's name), stopped by SIGTERM to both pods, as a deletion does.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import yaml

from smelt_ds.launch.jobs import JobOptions, k8s_pod_command, plan_job, render
from smelt_ds.parallel.extension_cache import host_extension_dir
from smelt_ds.runs import checkpoint as ckpt
from smelt_ds.testing import scaled_timeout
from smelt_ds.testing.hosts import Bed, Host, bed_unavailable, multi_host_bed
from tests.two_ranks import REFERENCE_STEPS, ROOT, losses, train_env

pytestmark = [pytest.mark.slow, pytest.mark.distributed,
              pytest.mark.skipif((why := bed_unavailable(clock=True)) is not None, reason=str(why))]

#: steps each resumed start trains (train.exit_after_steps): ends every journey inside the reference
RESUMED_STEPS = 8


def test_the_bed_gives_each_host_its_own_name_address_shm_and_clock():
    """What the jobs below rely on, checked from inside each host: the names, the addresses (and
    that each host resolves both names to them), a private /dev/shm, the skewed clock, and the
    stand-in ssh and pdsh reaching the named host."""
    with multi_host_bed(2, clock_offsets_s={1: 3600}) as bed:
        seen = []
        for h in bed.hosts:
            out = h.run(["sh", "-c", "hostname; hostname -I; getent hosts host0 host1; touch /dev/shm/mine;"
                                     " ls /dev/shm; python3 -c 'import time; print(int(time.time()))'"],
                        capture_output=True, text=True, timeout=60, check=True).stdout.split("\n")
            seen.append(out)
            assert out[0] == h.name and out[1].split() == [h.ip]
            assert [line.split() for line in out[2:4]] == [["10.77.0.11", "host0"], ["10.77.0.12", "host1"]]
            assert "mine" in out[4:-2] and not Path("/dev/shm/mine").exists()
        t0, t1 = int(seen[0][-2]), int(seen[1][-2])
        assert abs((t1 - t0) - 3600) <= 5  # host1's clock runs an hour ahead (5 s: the two starts' gap)
        env = bed.env()
        r = subprocess.run(["ssh", "-o", "PasswordAuthentication=no", "host1", "hostname", "-I"], env=env,
                           capture_output=True, text=True, timeout=60)
        assert r.stdout.split() == ["10.77.0.12"], r.stderr
        r = subprocess.run(["pdsh", "-S", "-f", "1024", "-w", "host1,host0", "echo %n $(hostname); exit %n"],
                           env=env, capture_output=True, text=True, timeout=60)
        assert sorted(r.stdout.splitlines()) == ["host0: 1 host0", "host1: 0 host1"] and r.returncode == 1


_OWNER = """
import sys, time
from smelt_ds.testing.hosts import multi_host_bed
with multi_host_bed(2, root=sys.argv[1]) as bed:  # in the test's directory: a killed bed leaves its files
    print(" ".join(str(h.pid) for h in bed.hosts), flush=True)
    time.sleep(600)
"""


def test_a_bed_whose_owner_is_killed_leaves_no_host_behind(tmp_path):
    """A test killed by a timeout or a cancelled CI job must not leave namespaces and their
    processes running: each host's process dies with the process that built the bed."""
    owner = subprocess.Popen([sys.executable, "-c", _OWNER, str(tmp_path / "bed")], stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(p) for p in owner.stdout.readline().split()]
        assert len(pids) == 2 and all(psutil.pid_exists(p) for p in pids)
        owner.kill()
        owner.wait(30)
        _, alive = psutil.wait_procs([psutil.Process(p) for p in pids if psutil.pid_exists(p)],
                                     timeout=scaled_timeout(10))
        assert not alive, alive
    finally:
        if owner.poll() is None:
            owner.kill()


def test_each_host_builds_deepspeeds_ops_in_its_own_directory():
    """A home directory shared by the nodes is one torch-extensions cache for all of them: an op
    built ``-march=native`` on one node type is loaded on another (SIGILL), and one node's build
    lock looks stale to the others. What a training process sets at its start
    (:func:`smelt_ds.parallel.extension_cache.use_host_extension_dir`) must give each host its own
    build directory for torch's JIT builds, and the same one on every start on that host; a user's
    ``TORCH_EXTENSIONS_DIR`` is kept."""
    probe = ("from smelt_ds.parallel.extension_cache import use_host_extension_dir; use_host_extension_dir();"
             "from torch.utils.cpp_extension import _get_build_directory as d; print(d('deepspeed_shm_comm', False))")
    with multi_host_bed(2) as bed:
        env = {k: v for k, v in os.environ.items() if k != "TORCH_EXTENSIONS_DIR"}
        dirs = [h.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=120,
                      check=True).stdout.split()[-1] for h in (*bed.hosts, bed.hosts[0])]
        assert dirs[0] != dirs[1] and dirs[2] == dirs[0], dirs
        assert [Path(d).parent.name.split("-")[0] for d in dirs] == ["host0", "host1", "host0"]
        mine = bed.hosts[1].run([sys.executable, "-c", probe], env={**env, "TORCH_EXTENSIONS_DIR": "/shared/ext"},
                                capture_output=True, text=True, timeout=120, check=True).stdout.split()[-1]
        assert mine == "/shared/ext/deepspeed_shm_comm"


# ---------------------------------------------------------------------------------------------


def _wait_step(proc: subprocess.Popen, run: Path, step: int, log: Path) -> None:
    deadline = time.monotonic() + scaled_timeout(300)
    while max(losses(run), default=0) < step:
        assert proc.poll() is None, f"exited {proc.returncode} before step {step}:\n{log.read_text()[-4000:]}"
        assert time.monotonic() < deadline, f"step {step} not reached in time:\n{log.read_text()[-4000:]}"
        time.sleep(0.1)


def _finish(procs: list[subprocess.Popen], log: Path) -> list[int]:
    try:
        return [p.wait(scaled_timeout(300)) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        assert all(p.returncode is not None for p in procs), log.read_text()[-4000:]


def _saved_step(run: Path, log: Path) -> int:
    latest = ckpt.latest_complete(run)
    assert latest is not None and not ckpt.verify(latest), log.read_text()[-4000:]
    return json.loads((latest / ckpt.MARKER).read_text())["step"]


def _check_trajectory(run: Path, reference: dict[int, float], stopped_at: int, end: int) -> None:
    """Steps 1..end each logged once, each loss bit-equal to the reference's; a step after the
    resume is among them."""
    got = losses(run)
    assert sorted(got) == list(range(1, end + 1)), sorted(got)
    assert stopped_at < end <= REFERENCE_STEPS
    assert got == {s: reference[s] for s in got}


def _start(host: Host, cmd: list[str], env: dict[str, str], log: Path, cwd: Path) -> subprocess.Popen:
    # the bed's hosts are one machine: they share this machine's build of DeepSpeed's ops (set as a
    # user of identical nodes would), rather than each compiling its own for a minute or two
    env = {"TORCH_EXTENSIONS_DIR": str(host_extension_dir()), **env}
    with log.open("a") as out:
        out.write(f"\n==== {host.name}: {cmd[:3]}\n")
        out.flush()
        return host.popen(cmd, env=env, cwd=cwd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def _plan(ref, scheduler: str, run: Path, **kw):
    sets = [f"train.exit_after_steps={RESUMED_STEPS}"]
    return plan_job(ref.recipe, JobOptions(scheduler=scheduler, nodes=2, gpus_per_node=1, workdir=str(ROOT),
                                           run_dir=str(run), overrides=sets, **kw))


def test_slurm_job_on_two_hosts_stops_at_the_time_limit_requeues_and_resumes_on_the_trajectory(
        two_rank_reference, tmp_path):
    """Rendered and run as a user would outside the checkout: the user's recipe (``base:`` the
    reference's) in their own directory, the job's working directory another one (the run directory
    relative to it), the batch script started from a third, the ``python`` first on ``PATH`` not
    the job's, and no SMELT_PYTHON (the job runs the interpreter render-job ran under)."""
    ref = two_rank_reference
    mine, work, elsewhere = tmp_path / "mine", tmp_path / "work", tmp_path / "elsewhere"
    for d in (mine, work, elsewhere):
        d.mkdir()
    recipe = mine / "two-hosts.yaml"
    recipe.write_text(f"base: {ref.recipe}\nname: two-hosts\n")
    plan = plan_job(recipe, JobOptions(scheduler="slurm", nodes=2, gpus_per_node=1, workdir=str(work),
                                       run_dir="runs/two-hosts", log_dir=str(tmp_path / "logs"),
                                       overrides=[f"train.exit_after_steps={RESUMED_STEPS}"]))
    assert plan.recipe_arg == str(recipe)  # outside the workdir: absolute
    run, log = work / "runs" / "two-hosts", tmp_path / "log.txt"
    job = tmp_path / "job.sbatch"
    job.write_text(render(plan))
    wrong = tmp_path / "bin"
    wrong.mkdir()
    (wrong / "python").write_text("#!/bin/sh\necho 'the python on PATH ran' >&2\nexit 97\n")
    (wrong / "python").chmod(0o755)
    with multi_host_bed(2) as bed:
        env = bed.env(train_env(SLURM_JOB_NODELIST=bed.nodelist, SLURM_JOB_ID="4242"))
        env["PATH"] = f"{wrong}:{env['PATH']}"
        env.pop("SMELT_PYTHON", None)
        batch = _start(bed.hosts[0], ["bash", str(job)], env, log, elsewhere)
        _wait_step(batch, run, 2, log)
        batch.send_signal(signal.SIGUSR1)  # --signal=B:USR1@LEAD: the time limit is near
        assert _finish([batch], log) == [0], log.read_text()[-4000:]
        assert bed.requeues() == ["4242"]
        assert "smelt-ds: 2 node(s) x 1 GPUs, master host0:" in log.read_text()
        stopped = _saved_step(run, log)
        assert stopped == max(losses(run)) < RESUMED_STEPS  # stopped by the signal, not by exit_after_steps

        env["SLURM_RESTART_COUNT"] = "1"  # the requeued start
        batch = _start(bed.hosts[0], ["bash", str(job)], env, log, elsewhere)
        assert _finish([batch], log) == [0], log.read_text()[-4000:]
        assert bed.requeues() == ["4242"]
    assert "the python on PATH ran" not in log.read_text()
    _check_trajectory(run, ref.losses, stopped, stopped + RESUMED_STEPS)


def test_deepspeed_hostfile_job_on_two_hosts_with_skewed_clocks_stops_and_resumes_on_the_trajectory(
        two_rank_reference, tmp_path):
    ref = two_rank_reference
    run, log = tmp_path / "run", tmp_path / "log.txt"
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("host0 slots=1\nhost1 slots=1\n")
    script = tmp_path / "run.sh"
    script.write_text(render(_plan(ref, "deepspeed", run, hostfile=str(hostfile))))
    with multi_host_bed(2, clock_offsets_s={0: 90, 1: -90}) as bed:
        env = bed.env(train_env())
        launcher = _start(bed.hosts[0], ["bash", str(script)], env, log, tmp_path)
        _wait_step(launcher, run, 2, log)
        launcher.send_signal(signal.SIGTERM)  # the script creates RUN/STOP; the ranks must see it
        assert _finish([launcher], log) == [128 + signal.SIGTERM], log.read_text()[-4000:]
        assert f"smelt-ds: SIGTERM: created {run}/STOP" in log.read_text()
        assert not (run / "STOP").exists()
        stopped = _saved_step(run, log)
        assert stopped == max(losses(run)) < RESUMED_STEPS

        launcher = _start(bed.hosts[0], ["bash", str(script)], env, log, tmp_path)
        assert _finish([launcher], log) == [0], log.read_text()[-4000:]
    assert "master_addr host0" in log.read_text() or "--master_addr host0" in log.read_text()
    _check_trajectory(run, ref.losses, stopped, stopped + RESUMED_STEPS)


def test_kubernetes_pods_on_two_hosts_stop_on_sigterm_and_resume_on_the_trajectory(two_rank_reference, tmp_path):
    ref = two_rank_reference
    log = tmp_path / "log.txt"
    # the pods' working directory is tmp_path: its runs volume holds the run and the data cache (the
    # reference's, linked), as render-job requires of a pod's writable paths
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "cache").symlink_to(ref.cache)
    run = tmp_path / "runs" / "k8s"
    plan = plan_job(ref.recipe, JobOptions(
        scheduler="k8s", nodes=2, gpus_per_node=1, workdir=str(tmp_path), run_dir=str(run),
        overrides=[f"data.cache_dir={tmp_path / 'runs' / 'cache'}", f"train.exit_after_steps={RESUMED_STEPS}"]))
    recipe_map = next(d for d in yaml.safe_load_all(render(plan)) if d and d.get("kind") == "ConfigMap")
    (tmp_path / "recipe.yaml").write_text(recipe_map["data"]["recipe.yaml"])
    cmd = ["bash", "-c", k8s_pod_command(plan)]

    def pods(bed: Bed) -> list[subprocess.Popen]:
        # what the PyTorchJob operator sets in each pod: its index, the master pod's name and port
        return [_start(h, cmd, bed.env(train_env(MASTER_ADDR="host0", MASTER_PORT="23456", RANK=str(h.index),
                                                  SMELT_RECIPE=str(tmp_path / "recipe.yaml"))), log, tmp_path)
                for h in bed.hosts]

    with multi_host_bed(2) as bed:
        started = pods(bed)
        _wait_step(started[0], run, 2, log)
        for p in started:
            p.send_signal(signal.SIGTERM)
        assert _finish(started, log) == [128 + signal.SIGTERM] * 2, log.read_text()[-4000:]
        stopped = _saved_step(run, log)
        assert stopped == max(losses(run)) < RESUMED_STEPS
        assert _finish(pods(bed), log) == [0, 0], log.read_text()[-4000:]
    _check_trajectory(run, ref.losses, stopped, stopped + RESUMED_STEPS)
