"""`smelt-ds render-job` refuses what a job would silently ignore or mangle, exit 2 and no file written:
an option of another scheduler (the table ``SCHEDULER_OPTIONS`` next to the parser), a
``--node-selector`` key given twice, and Kubernetes keys, values and counts that break Kubernetes'
rules, each message naming the option, what is wrong and the fix; a positive-integer refusal offers a
sensible value of that option."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from smelt_ds import cli
from smelt_ds.launch import cli as render_cli
from smelt_ds.launch.jobs import SCHEDULERS, JobOptions

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "recipes/tiny/smelt.yaml")


def _refused(tmp_path: Path, capsys, args: list[str]) -> str:
    """Run render-job on the tiny recipe writing to ``tmp_path/job``; assert exit 2 and that nothing
    was written; the error message."""
    out = tmp_path / "job"
    capsys.readouterr()
    assert cli.main(["render-job", TINY, "--no-data-check", *args, "-o", str(out)]) == 2
    assert not out.exists()
    return capsys.readouterr().err


# -- options of another scheduler ---------------------------------------------------------------

@pytest.mark.parametrize("scheduler,given,owner", [
    ("slurm", ["--toleration", "nvidia.com/gpu:NoSchedule"], "k8s"),  # the user's command
    ("slurm", ["--gang", "volcano"], "k8s"),
    ("slurm", ["--rdma-resource", "rdma/hca=1"], "k8s"),
    ("slurm", ["--backoff-limit", "7"], "k8s"),
    ("slurm", ["--image", "foo:1"], "k8s"),
    ("slurm", ["--ipc-lock"], "k8s"),
    ("k8s", ["--cpu-bind", "cores"], "slurm"),
    ("k8s", ["--time", "1:00:00"], "slurm"),
    ("k8s", ["--time", "2-00:00:00"], "slurm"),  # the default's value, given: still an option k8s ignores
    ("deepspeed", ["--startup-time", "600"], "slurm"),
    ("k8s", ["--hostfile", "hosts"], "deepspeed"),
    ("k8s", ["--master-port", "29501"], "deepspeed or slurm"),
    ("deepspeed", ["--numa-binding", "node"], "slurm or k8s"),
    ("deepspeed", ["--job-name", "x"], "slurm or k8s"),
])
def test_an_option_of_another_scheduler_is_refused_naming_it_and_its_scheduler(tmp_path, capsys, scheduler, given,
                                                                               owner):
    err = _refused(tmp_path, capsys, ["--scheduler", scheduler, "--nodes", "1", "--gpus-per-node", "1", *given])
    names = {"deepspeed": "deepspeed launcher", "slurm": "Slurm", "k8s": "Kubernetes"}
    assert f"--scheduler {scheduler} ({names[scheduler]}) does not use 1 option(s) given; nothing written" in err
    owned = " and ".join(names[s] for s in owner.split(" or "))
    assert f"  {given[0]}: a {owned} option (--scheduler {owner}): drop it, or pass --scheduler {owner}" in err


def test_every_option_of_another_scheduler_is_named_at_once(tmp_path, capsys):
    err = _refused(tmp_path, capsys, ["--scheduler", "slurm", "--nodes", "4", "--gpus-per-node", "1", "--toleration",
                                      "nvidia.com/gpu:NoSchedule", "--gang", "volcano", "--time", "3:00:00"])
    assert "does not use 2 option(s) given" in err
    assert [line.split(":")[0].strip() for line in err.splitlines()[1:]] == ["--toleration", "--gang"]


def _parse(argv: list[str]) -> argparse.Namespace:
    return cli.build_parser(["render-job"]).parse_args(["render-job", TINY, *argv])


@pytest.mark.parametrize("scheduler", SCHEDULERS)
def test_options_left_at_their_defaults_are_never_refused_and_keep_jobs_defaults(scheduler):
    args = _parse(["--scheduler", scheduler])
    assert render_cli.unused_options(args) == []
    assert render_cli.options_from_args(args) == JobOptions(scheduler=scheduler)  # the library's defaults


@pytest.mark.parametrize("scheduler,given", [
    ("slurm", ["--master-port", "29501", "--numa-binding", "node", "--job-name", "j", "--shutdown-timeout", "200"]),
    ("deepspeed", ["--master-port", "29501"]),
    ("k8s", ["--numa-binding", "socket", "--job-name", "j", "--shutdown-timeout", "200"]),
    ("slurm", ["--workdir", ".", "--env", "A=1", "--run-dir", "runs/x", "--set", "train.max_steps=3"]),
])
def test_options_shared_by_the_scheduler_are_accepted_and_reach_the_job(scheduler, given):
    args = _parse(["--scheduler", scheduler, *given])
    assert render_cli.unused_options(args) == []
    o = render_cli.options_from_args(args)
    flags = dict(zip(given[::2], given[1::2], strict=True))
    assert o.master_port == (int(flags["--master-port"]) if "--master-port" in flags else None)
    assert o.numa_binding == flags.get("--numa-binding") and o.job_name == flags.get("--job-name")
    assert o.shutdown_s == int(flags.get("--shutdown-timeout", JobOptions.shutdown_s))


def test_the_table_covers_every_option_of_the_schedulers_help_groups():
    """An option the help lists under one scheduler's group belongs to that scheduler in the table, and
    every option in the table defaults to None (given or not is told apart)."""
    parser = cli.build_parser(["render-job"])
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    p = sub.choices["render-job"]
    groups = {"deepspeed launcher": "deepspeed", "Slurm": "slurm", "Kubernetes": "k8s"}
    seen = 0
    for g in p._action_groups:
        if g.title in groups:
            for a in g._group_actions:
                assert groups[g.title] in render_cli.SCHEDULER_OPTIONS[a.option_strings[-1]], a.option_strings
                seen += 1
    assert seen >= 27
    assert all(p._option_string_actions[f].default is None for f in render_cli.SCHEDULER_OPTIONS)


# -- Kubernetes keys, values and counts ---------------------------------------------------------

K8S = ["--scheduler", "k8s"]


@pytest.mark.parametrize("given,want", [
    (["--node-selector", "a=1", "--node-selector", "a=2"], "--node-selector a is given twice (a=1 and a=2)"),
    (["--rdma-resource", "rdma/hca=0"], "--rdma-resource 'rdma/hca=0': the COUNT '0' must be a positive integer"),
    (["--rdma-resource", "rdma/hca=-1"], "the COUNT '-1' must be a positive integer"),
    (["--rdma-resource", "rdma/hca=one"], "the COUNT 'one' must be a positive integer"),
    (["--node-selector", "nvidia.com/gpu.product=NVIDIA H100"],
     "--node-selector 'nvidia.com/gpu.product=NVIDIA H100': the label value 'NVIDIA H100' may not contain a space "
     "(a Kubernetes label value: at most 63 characters: alphanumerics, '-', '_', '.', starting and ending with an "
     "alphanumeric, or empty), e.g. --node-selector nvidia.com/gpu.product=NVIDIA-H100-80GB-HBM3"),
    (["--node-selector", "pool=" + "g" * 64], "the label value '" + "g" * 64 + "' has 64 characters, more than 63"),
    (["--node-selector", "pool=gpu-"], "the label value 'gpu-' must start and end with a letter or digit"),
    (["--node-selector", "bad key!=1"], "the key 'bad key!' is not a Kubernetes label key: its name 'bad key!' "
                                        "may not contain a space or '!'"),
    (["--toleration", "bad key!:NoSchedule"],
     "--toleration 'bad key!:NoSchedule': the key 'bad key!' is not a Kubernetes label key: its name 'bad key!' "
     "may not contain a space or '!' (a key is [PREFIX/]NAME"),
    (["--toleration", "Nvidia.com/gpu:NoSchedule"], "its prefix 'Nvidia.com' is not a DNS subdomain"),
    (["--toleration", "nvidia.com/gpu=:NoSchedule"],
     "--toleration 'nvidia.com/gpu=:NoSchedule': the value after '=' is empty: write nvidia.com/gpu:NoSchedule to "
     "tolerate the taint whatever its value (operator Exists), or give the value, nvidia.com/gpu=VALUE:NoSchedule"),
    (["--toleration", "dedicated=a b:NoExecute"], "the value 'a b' may not contain a space (a taint value"),
])
def test_kubernetes_keys_values_and_counts_are_refused_saying_what_is_wrong(tmp_path, capsys, given, want):
    err = _refused(tmp_path, capsys, [*K8S, *given])
    assert want in err
    assert "write KEY=VALUE" not in err and "EFFECT NoSchedule" not in err  # the form was right


def test_rules_accept_what_kubernetes_accepts(tmp_path, capsys):
    """Keys and values at the rules' limits render: a 63-character value, an empty label value, a
    prefixed key, a value with '-', '_', '.' inside."""
    out = tmp_path / "job.yaml"
    assert cli.main(["render-job", TINY, "--no-data-check", *K8S, "--node-selector", "a.b-c/d_e.f=" + "v" * 63,
                     "--node-selector", "empty=", "--toleration", "dedicated=a_b.c-d:NoExecute",
                     "--rdma-resource", "rdma/hca=12", "-o", str(out)]) == 0, capsys.readouterr().err
    assert f'"a.b-c/d_e.f": "{"v" * 63}", "empty": ""' in out.read_text()


# -- positive integers: the example is a sensible value -----------------------------------------

@pytest.mark.parametrize("given,want", [
    (["--scheduler", "slurm", "--startup-time", "-100"],
     "`--startup-time` (-100) must be a positive integer (seconds), e.g. --startup-time 600"),
    (["--scheduler", "slurm", "--signal-lead", "0"],
     "`--signal-lead` (0) must be a positive integer (seconds), e.g. --signal-lead 600"),
    (["--scheduler", "k8s", "--cpus-per-gpu", "0"], "`--cpus-per-gpu` (0) must be a positive integer (CPU cores), "
                                                    "e.g. --cpus-per-gpu 8"),
    (["--scheduler", "k8s", "--memory-per-gpu", "0"], "`--memory-per-gpu` (0) must be a positive integer (GiB), "
                                                      "e.g. --memory-per-gpu 64"),
])
def test_a_positive_integer_refusal_offers_a_sensible_value(tmp_path, capsys, given, want):
    assert want in _refused(tmp_path, capsys, given)
