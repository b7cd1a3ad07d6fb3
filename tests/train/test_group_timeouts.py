"""Every process group carries ``train.watchdog``'s timeouts: the default group, DeepSpeed's
data-parallel group and AutoEP's expert-parallel and expert-data-parallel groups, and the control
group, on every backend of each.

DeepSpeed makes its groups with ``new_group`` and no ``timeout=``, which takes the backend's default
(NCCL 10 min, gloo 30 min) whatever the default group was given; yet those groups carry the
gradient reduction, the expert all-to-all and the gradient norm. A probe inside a real 2-rank
AutoEP (EP 2) ZeRO-3 training reads every group's backends after each step, straight from
``torch.distributed``'s registry (not through smelt-ds' own helpers): ``init_timeout_s`` while the
watchdog's start-up steps run, ``collective_timeout_s`` after. On main before the fix (2e90da3) only
the default group's backends carried the configured values.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from smelt_ds.config.loading import config_from_dict
from smelt_ds.testing import run_distributed
from tests.train.test_loop import _raw

pytestmark = pytest.mark.distributed

INIT_S, STEADY_S = 77.0, 123.0


def _timeouts() -> dict[str, list[float]]:
    """``{group name: [timeout seconds of each backend]}`` for every group this rank is in, and the
    names of DeepSpeed's data-parallel / expert groups among them."""
    import torch
    import torch.distributed as dist
    from deepspeed.utils import groups

    world = dist.distributed_c10d._world
    out = {}
    for pg in world.pg_map:
        name = world.pg_names[pg]
        out[name] = [pg._get_backend(d).options._timeout.total_seconds() for d in pg._device_types]
    named = {"data_parallel": groups._get_data_parallel_group()}
    named.update({f"expert {k}": g for k, g in groups._get_expert_parallel_group_dict().items()})
    named.update({f"expert_data {k}": g for k, g in groups._get_expert_data_parallel_group_dict().items()})
    out["_deepspeed"] = sorted(f"{k}={world.pg_names[g]}" for k, g in named.items())
    del torch
    return out


def _probe_worker(rank: int, world: int, raw: dict) -> list[dict]:
    from smelt_ds.train import loop

    seen = []
    real_after = loop._after_step

    def after_step(model, cfg):  # inside the step, after engine.step: the groups as the step used them
        seen.append(_timeouts())
        return real_after(model, cfg)

    loop._after_step = after_step
    loop.train(config_from_dict(raw))
    return seen


def test_every_group_carries_the_configured_timeouts(tmp_path: Path, tmp_path_factory):
    cache = tmp_path_factory.mktemp("timeouts-cache")
    raw = _raw(tmp_path, cache, moe_runtime={"backend": "autoep", "ep_size": 2}, deepspeed={"zero_stage": 3},
               train={"max_steps": 3, "save_every": 3, "eval_every": 3,
                      "watchdog": {"startup_steps": 1, "init_timeout_s": INIT_S, "collective_timeout_s": STEADY_S}})
    per_rank = run_distributed(_probe_worker, 2, args=(raw,), timeout=300)
    for seen in per_rank:
        assert len(seen) == 3  # one probe per step
        deepspeed_groups = seen[0].pop("_deepspeed")
        # DeepSpeed's data-parallel group and AutoEP's expert / expert-data groups exist and are probed
        assert any(g.startswith("data_parallel=") for g in deepspeed_groups)
        assert any(g.startswith("expert ") for g in deepspeed_groups)
        assert any(g.startswith("expert_data ") for g in deepspeed_groups)
        assert len(seen[0]) >= 4, seen[0]  # default + data-parallel + expert + expert-data (at least)
        # step 1 runs under the start-up timeout; the watchdog switches every group after it
        assert seen[0] == {name: [INIT_S] * len(b) for name, b in seen[0].items()}, seen[0]
        for probe in seen[1:]:
            probe.pop("_deepspeed")
            assert probe == {name: [STEADY_S] * len(b) for name, b in probe.items()}, probe
