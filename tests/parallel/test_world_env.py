"""The world a rank joins comes from its launcher's environment: torch's variables, else an MPI
launcher's (Open MPI, MVAPICH2, MPICH/Intel MPI), else a world of one; a world only partly
described is refused. Two real processes given only Open MPI's variables form a world of 2."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from smelt_ds.errors import ConfigError
from smelt_ds.parallel.distributed import find_free_port as free_port
from smelt_ds.testing.distributed import scaled_timeout

DEFAULT_MPI_PORT = 29500  # deepspeed.constants.TORCH_DISTRIBUTED_DEFAULT_PORT, its MPI discovery's port


def world_env(environ):
    from smelt_ds.parallel.distributed import world_env

    return world_env(environ)


OMPI = {"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "8", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
        "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "MASTER_ADDR": "node0", "MASTER_PORT": "29400"}


def test_open_mpi_variables_give_rank_world_and_local_rank():
    env = world_env(OMPI)
    assert env == {"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
                   "MASTER_ADDR": "node0", "MASTER_PORT": "29400"}


@pytest.mark.parametrize("names", [("MV2_COMM_WORLD_RANK", "MV2_COMM_WORLD_SIZE", "MV2_COMM_WORLD_LOCAL_RANK",
                                    "MV2_COMM_WORLD_LOCAL_SIZE"),
                                   ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS")])
def test_mvapich_and_pmi_variables(names):
    env = world_env(dict(zip(names, ("5", "6", "2", "3"), strict=True), MASTER_ADDR="n0"))
    assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"], env["LOCAL_WORLD_SIZE"]) == ("5", "6", "2", "3")
    assert env["MASTER_PORT"] == str(DEFAULT_MPI_PORT)  # DeepSpeed's MPI discovery's port


def test_an_mpi_world_of_one_needs_no_local_rank():
    """Slurm's pmi2 sets PMI_RANK and PMI_SIZE for `srun -n1`, and no local rank: one process."""
    got = world_env({"PMI_RANK": "0", "PMI_SIZE": "1"})
    assert (got["RANK"], got["WORLD_SIZE"], got["LOCAL_RANK"]) == ("0", "1", "0")
    with pytest.raises(ConfigError, match="environment is incomplete: MPI_LOCALRANKID not set"):
        world_env({"PMI_RANK": "0", "PMI_SIZE": "2", "MASTER_ADDR": "a"})


def test_torch_variables_win_over_mpi_ones():
    env = world_env({**OMPI, "RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0"})
    assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"]) == ("0", "2", "0")


def test_no_launcher_is_a_world_of_one():
    env = world_env({})
    assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"], env["MASTER_ADDR"]) == ("0", "1", "0", "127.0.0.1")
    assert 1024 <= int(env["MASTER_PORT"]) <= 65535


def test_an_mpi_world_on_one_host_needs_no_master_addr():
    env = world_env({k: v for k, v in OMPI.items() if not k.startswith("MASTER")} | {"OMPI_COMM_WORLD_SIZE": "2",
                                                                                     "OMPI_COMM_WORLD_RANK": "1"})
    assert (env["MASTER_ADDR"], env["MASTER_PORT"]) == ("127.0.0.1", str(DEFAULT_MPI_PORT))


@pytest.mark.parametrize(("environ", "match"), [
    ({"RANK": "1"}, r"`RANK` is set \('1'\) but `WORLD_SIZE` is not"),
    ({"WORLD_SIZE": "2"}, r"`WORLD_SIZE` is set \('2'\) but `RANK` is not"),
    ({"RANK": "2", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "a"}, r"rank 2 is outside a world of 2"),
    ({"RANK": "x", "WORLD_SIZE": "2"}, r"`RANK` \('x'\) must be a whole number"),
    ({"OMPI_COMM_WORLD_RANK": "1"}, r"Open MPI's environment is incomplete: OMPI_COMM_WORLD_SIZE, "
                                    r"OMPI_COMM_WORLD_LOCAL_RANK not set"),
    ({k: v for k, v in OMPI.items() if k != "MASTER_ADDR"}, r"`MASTER_ADDR` is not set for a world of 8 ranks"),
    ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "5", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "a"},
     r"local rank 5 is outside the 2 ranks of this host"),
    ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "a", "MASTER_PORT": "abc"},
     r"`MASTER_PORT` \('abc'\) must be a whole number"),
    ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "a", "MASTER_PORT": "70000"},
     r"`MASTER_PORT` \('70000'\) is no TCP port"),
])
def test_a_partly_described_world_is_refused(environ, match, monkeypatch):
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)  # no mpi4py to discover MASTER_ADDR
    with pytest.raises(ConfigError, match=match):
        world_env(environ)


def test_local_rank_is_never_the_global_rank_of_a_world_over_several_hosts():
    """A missing LOCAL_RANK is the MPI launcher's local rank, or RANK when the whole world is on
    this host; over several hosts it is refused (rank 5 of 8 is not cuda:5 of a 4-GPU node)."""
    base = {"RANK": "5", "WORLD_SIZE": "8", "MASTER_ADDR": "n0", "MASTER_PORT": "1234"}
    assert world_env({**base, "OMPI_COMM_WORLD_LOCAL_RANK": "1"})["LOCAL_RANK"] == "1"
    assert world_env({**base, "LOCAL_WORLD_SIZE": "8"})["LOCAL_RANK"] == "5"
    with pytest.raises(ConfigError, match=r"`LOCAL_RANK` is not set for rank 5 of a world of 8 .*SLURM_LOCALID"):
        world_env({**base, "LOCAL_WORLD_SIZE": "4"})


_RANK = """
import json, torch, torch.distributed as dist
from smelt_ds.parallel.distributed import init_distributed
rank, local, world = init_distributed(timeout_s=60)
t = torch.tensor([float(rank + 1)])
dist.all_reduce(t)
print("RESULT " + json.dumps([rank, local, world, t.item()]), flush=True)
dist.destroy_process_group()
"""


@pytest.mark.distributed
def test_two_processes_started_with_open_mpi_variables_form_one_world(tmp_path):
    """What ``deepspeed --launcher openmpi`` (``mpirun``) gives each process: Open MPI's variables,
    and MASTER_ADDR/PORT through ``mpirun -x`` (a ``.deepspeed_env`` line), no RANK/WORLD_SIZE.
    The all-reduce of rank+1 over 2 ranks is 1 + 2 = 3."""
    port = free_port()
    drop = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "LOCAL_SIZE", "MASTER_ADDR", "MASTER_PORT",
            "GROUP_RANK", "ROLE_RANK")
    base = {k: v for k, v in os.environ.items() if k not in drop}
    procs = []
    for rank in range(2):
        env = {**base, "OMPI_COMM_WORLD_RANK": str(rank), "OMPI_COMM_WORLD_SIZE": "2",
               "OMPI_COMM_WORLD_LOCAL_RANK": str(rank), "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}
        procs.append(subprocess.Popen([sys.executable, "-c", _RANK], env=env, cwd=tmp_path, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    results = []
    for p in procs:
        out, _ = p.communicate(timeout=scaled_timeout(300))
        assert p.returncode == 0, out[-3000:]
        results.append(json.loads(next(line for line in out.splitlines() if line.startswith("RESULT "))[7:]))
    assert sorted(results) == [[0, 0, 2, 3.0], [1, 1, 2, 3.0]]
