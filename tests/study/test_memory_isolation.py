"""The CUDA memory measurement runs each checkpointing policy in a process of its own (issue 45,
item 5): the allocator's peak of a later policy must not include an earlier one's leftovers.

No GPU here: the measurement function is replaced by :func:`_fake_measure`, which reports the
process it ran in; the orchestration (``memory_profile.measure`` with ``device="cuda"``) is the
real one. The fake is a module-level function, so that a spawned process can import it by name.
"""

from __future__ import annotations

import os

import pytest

from smelt_ds.config.loading import config_from_dict
from smelt_ds.errors import ConfigError
from smelt_ds.study import memory_profile
from smelt_ds.study.memory_profile import Measurement

#: measurements made by this process so far (a fresh process starts at 0)
_CALLS = 0


def _fake_measure(cfg, policy: str, steps: int) -> Measurement:
    """A stand-in for ``_measure_cuda``: ``params`` = its process id, ``grads`` = its parent's,
    ``optimizer`` = how many measurements this process has made (this one included),
    ``peak_allocated`` = ``steps``, ``predicted_activations`` = ``cfg.train.seq_len``."""
    global _CALLS
    _CALLS += 1
    return Measurement(policy, "fake", None, os.getpid(), os.getppid(), _CALLS, steps, cfg.train.seq_len, 0)


def _failing_measure(cfg, policy: str, steps: int) -> Measurement:
    """Raises for policy ``full``; the process dies without an answer for ``looped``."""
    if policy == "full":
        raise ConfigError("no room for policy full")
    if policy == "looped":
        os._exit(3)
    return _fake_measure(cfg, policy, steps)


def _cfg():
    return config_from_dict({"model": {"vocab_size": 64, "hidden_size": 32, "num_layers": 2, "num_heads": 4,
                                       "max_seq_len": 32},
                             "moe": {"num_experts": 4, "top_k": 2, "expert_ffn_size": 16},
                             "train": {"seq_len": 24}})


@pytest.mark.slow
def test_each_cuda_policy_is_measured_in_a_fresh_process(monkeypatch):
    monkeypatch.setattr(memory_profile, "_measure_cuda", _fake_measure)
    policies = ["none", "full", "looped"]
    got = memory_profile.measure(_cfg(), policies, steps=3, device="cuda")
    assert [m.policy for m in got] == policies  # in the order asked for
    pids = [m.params for m in got]
    assert len(set(pids)) == len(policies) and os.getpid() not in pids  # one new process each
    assert all(m.grads == os.getpid() for m in got)  # children of this process
    assert all(m.optimizer == 1 for m in got)  # nothing measured before in any of them
    assert all(m.peak_allocated == 3 and m.predicted_activations == 24 for m in got)  # arguments passed on
    assert _CALLS == 0  # and none in this process


@pytest.mark.slow
def test_a_failed_measurement_is_raised_with_its_policy():
    with pytest.raises(ConfigError, match="no room for policy full"):
        memory_profile._measure_each_in_own_process(_failing_measure, _cfg(), ["full"], 1)
    with pytest.raises(RuntimeError, match="policy 'looped' died in its process"):
        memory_profile._measure_each_in_own_process(_failing_measure, _cfg(), ["looped"], 1)


def test_cpu_measurement_stays_in_this_process(monkeypatch):
    """CPU numbers (saved tensors, storage bytes) do not depend on earlier allocations: measured
    here, without a process per policy."""
    calls = []
    monkeypatch.setattr(memory_profile, "_measure_cpu", lambda cfg, p, steps: calls.append((p, os.getpid())))
    monkeypatch.setattr(memory_profile, "_measure_each_in_own_process",
                        lambda *a: pytest.fail("CPU measurement spawned processes"))
    memory_profile.measure(_cfg(), ["none", "full"], steps=1, device="cpu")
    assert calls == [("none", os.getpid()), ("full", os.getpid())]
