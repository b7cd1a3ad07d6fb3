"""Control collectives under NCCL's device map, emulated on CPU, and the static rule that keeps them
in their one home (``smelt_ds.parallel.control``).

NCCL serves CUDA tensors only: ``init_process_group("nccl")`` maps ``cuda`` to NCCL and nothing to
``cpu``. ``init_process_group("cuda:gloo")`` on two CPU processes has the same device map (gloo
serving ``cuda`` only), so every collective on a CPU tensor over the default group raises "No
backend type associated with device type cpu" here as it does on a GPU cluster (the first
assertion of the worker shows the emulation is real). Every control path of training then runs
on those two ranks and must give the values computed here by hand.

On main before the control group (2e90da3) the worker fails at its first control path
(``stop.agree``: the all-reduce of a CPU tensor on the default group), and the static rule lists
stop.py, metrics.py, step_guard.py, validation.py, distributed.py, watchdog.py, checkpoint.py and
loop.py.
"""

from __future__ import annotations

import ast
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from smelt_ds.testing import run_distributed

pytestmark = pytest.mark.distributed

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "smelt_ds"
HOME = PACKAGE / "parallel" / "control.py"


class _Engine:
    """A validation engine on the CPU whose ``lm_loss`` is the batch's first token id (rank-dependent
    batches give rank-dependent sums)."""

    device = torch.device("cpu")

    def __call__(self, input_ids, labels):
        return SimpleNamespace(lm_loss=input_ids[0, 0].double())

    def eval(self):
        pass

    def train(self):
        pass


def _batch(value: float, label_tokens: int):
    labels = torch.full((1, 4), -100)
    labels[0, :label_tokens] = 1
    return SimpleNamespace(input_ids=torch.full((1, 4), value), labels=labels)


def _control_worker(rank: int, world: int) -> dict:
    import torch.distributed as dist

    from smelt_ds.parallel.distributed import on_rank0, sync_flag
    from smelt_ds.train.metrics import MicroStats
    from smelt_ds.train.stop import agree
    from smelt_ds.train.validation import evaluate
    from smelt_ds.train.watchdog import gather_peers

    out: dict = {}
    try:  # the emulation is NCCL's device map: no CPU backend on the default group
        dist.all_reduce(torch.zeros(1))
        out["cpu_on_default"] = "served"
    except RuntimeError as e:
        out["cpu_on_default"] = str(e)
    # the paths whose signatures predate the control group first (on 2e90da3 each fails here)
    out["sync_flag"] = sync_flag(rank == 1)
    out["on_rank0"] = on_rank0(rank, lambda: {"from": 0})
    out["peers"] = gather_peers()
    domains = {"code": [_batch(2.0 + rank, 3)], "text": [_batch(0.5, 2 + rank)]}
    out["val"] = evaluate(_Engine(), SimpleNamespace(validation=lambda n: domains),
                          SimpleNamespace(eval=SimpleNamespace(eval_batches=1)))
    # the step's control exchange: stop reasons (rank 1 saw the stop file) and the micro-batch sums
    micro = MicroStats()
    for v in (1.0 + rank, 2.0 + rank):
        micro.add(SimpleNamespace(lm_loss=torch.tensor(v - 0.5), aux_loss=torch.tensor(0.25), z_loss=None),
                  torch.tensor(v))
    reason, totals = agree("stop_file" if rank == 1 else None, micro.local())
    out["agree"] = (reason, totals, micro.means(totals))
    from smelt_ds.parallel import control

    out["gathered"] = control.gather_objects(rank * 10)
    out["broadcast"] = control.broadcast_object(f"rank {rank}", src=1)
    control.barrier()
    return out


def test_every_control_collective_runs_on_a_group_without_a_cpu_backend():
    """``cuda:gloo`` (NCCL's device map) on 2 CPU ranks: stop agreement and the step's sums, the stop
    flag, rank 0's result, the peers, object gather/broadcast, barrier and validation sums."""
    res = run_distributed(_control_worker, 2, backend="cuda:gloo", init_deepspeed=False, timeout=120)
    for rank, r in enumerate(res):
        assert "No backend type associated with device type cpu" in r["cpu_on_default"]
        reason, totals, means = r["agree"]
        # rank 0 losses 1, 2; rank 1 losses 2, 3: finite sum 8, none non-finite, 4 micro-batches
        assert reason == "stop_file"
        assert totals == [8.0, 0.0, 4.0, 8.0, 6.0, 1.0, 0.0]
        assert means == {"loss": 2.0, "lm_loss": 1.5, "aux_loss": 0.25}  # z_loss absent: left out
        assert r["sync_flag"] is True
        assert r["on_rank0"] == ({"from": 0} if rank == 0 else None)
        assert r["peers"] == [res[0]["peers"][0], res[1]["peers"][1]]  # (host, pid, start time) of each rank
        assert res[0]["peers"][0].pid != res[1]["peers"][1].pid
        assert r["gathered"] == [0, 10]
        assert r["broadcast"] == "rank 1"
        # code: 3 tokens at 2.0 (rank 0) + 3 at 3.0 (rank 1) = 15 / 6; text: 2 + 3 tokens at 0.5
        assert r["val"] == {"code": 2.5, "text": 0.5, "all": 1.5}


# ---------------------------------------------------------------------------------------------
# the static rule
# ---------------------------------------------------------------------------------------------

#: collectives on tensors (NCCL serves them when the tensor is on the GPU)
TENSOR_COLLECTIVES = {"all_reduce", "all_gather", "all_gather_into_tensor", "broadcast", "reduce",
                      "reduce_scatter", "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "gather",
                      "scatter"}
#: collectives whose device torch picks from the group's backend (the GPU under NCCL)
OBJECT_COLLECTIVES = {"all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list",
                      "barrier"}
#: torch factories that put a tensor on the CPU unless given a device
FACTORIES = {"tensor", "zeros", "ones", "empty", "full", "arange", "as_tensor", "zeros_like", "ones_like"}


def _is_dist(node: ast.expr) -> bool:
    """``dist`` or ``torch.distributed``."""
    if isinstance(node, ast.Name):
        return node.id == "dist"
    return isinstance(node, ast.Attribute) and node.attr == "distributed"


def _hostless_names(fn: ast.AST) -> set[str]:
    """Names assigned in ``fn`` from a torch factory call without ``device=``."""
    names = set()
    for node in ast.walk(fn):
        if not (isinstance(node, ast.Assign) and isinstance(node.value, ast.Call)):
            continue
        f = node.value.func
        if (isinstance(f, ast.Attribute) and f.attr in FACTORIES and isinstance(f.value, ast.Name)
                and f.value.id == "torch" and not any(k.arg == "device" for k in node.value.keywords)):
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
    return names


def control_collective_violations(source: str, where: str) -> list[str]:
    """Each collective in ``source`` that belongs in the control home: an object collective or a
    barrier without an explicit ``group=``, or a tensor collective on a tensor built in the same
    function by a torch factory without ``device=`` (a CPU tensor, which NCCL does not serve)."""
    tree = ast.parse(source)
    out = []
    for fn in ast.walk(tree):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        hostless = _hostless_names(fn)
        for node in ast.walk(fn):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and _is_dist(node.func.value)):
                continue
            name = node.func.attr
            grouped = any(k.arg == "group" for k in node.keywords)
            if name in OBJECT_COLLECTIVES and not grouped:
                out.append(f"{where}:{node.lineno} {fn.name}: {name} without group=")
            elif (name in TENSOR_COLLECTIVES and node.args and isinstance(node.args[0], ast.Name)
                  and node.args[0].id in hostless):
                out.append(f"{where}:{node.lineno} {fn.name}: {name} of {node.args[0].id}, a tensor built "
                           "without a device")
    return out


def test_no_control_collective_outside_its_home():
    """Every collective on host values goes through ``smelt_ds.parallel.control``."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path != HOME:
            found += control_collective_violations(path.read_text(), str(path.relative_to(ROOT)))
    assert not found, "collectives that NCCL cannot serve, outside smelt_ds/parallel/control.py:\n" + "\n".join(found)


def test_the_static_rule_sees_each_kind_of_violation():
    """The rule's own mutants: a hostless all-reduce, an object collective and a barrier without a
    group are found; a device tensor, a grouped object collective and the home's calls are not."""
    bad = ("import torch\nimport torch.distributed as dist\n"
           "def f():\n    t = torch.tensor([1.0])\n    dist.all_reduce(t)\n"
           "def g(x):\n    dist.all_gather_object([None, None], x)\n    torch.distributed.barrier()\n")
    good = ("import torch\nimport torch.distributed as dist\n"
            "def f(dev, grp):\n    t = torch.zeros(2, device=dev)\n    dist.all_reduce(t)\n"
            "    dist.broadcast_object_list([1], src=0, group=grp)\n")
    assert [v.split(" ", 1)[1] for v in control_collective_violations(bad, "m")] == [
        "f: all_reduce of t, a tensor built without a device", "g: all_gather_object without group=",
        "g: barrier without group="]
    assert control_collective_violations(good, "m") == []


@pytest.mark.parametrize("value, error", [
    ("nonsense", "is not a torch.distributed backend"),
    ("cuda:gloo,gloo", "is not a torch.distributed backend"),
    ("tpu:gloo", "is not a torch.distributed backend"),
    ("cuda:gloo", "needs CUDA"),
    ("nccl", "needs CUDA"),
])
def test_a_bad_backend_override_is_one_clear_error(value, error):
    """``SMELT_DIST_BACKEND`` is checked before any process group: a value torch would refuse with an
    AssertionError deep in init_process_group, or one this CPU machine cannot serve, is a ConfigError
    naming the variable, the value and the fix."""
    from smelt_ds.errors import ConfigError
    from smelt_ds.parallel.distributed import BACKEND_ENV, check_backend

    if torch.cuda.is_available() and error == "needs CUDA":
        pytest.skip("this machine has CUDA")
    with pytest.raises(ConfigError, match=rf"`{BACKEND_ENV}` \('{value}'\) {error}.*unset {BACKEND_ENV}"):
        check_backend(value)
    assert check_backend("gloo") == "gloo" and check_backend("cpu:gloo") == "cpu:gloo"
