"""Activation checkpointing of visits: every policy x both implementations reproduces the run
without checkpointing exactly (loss, aux / z losses, gradients, router statistics, aux-loss-free
bias counts), with dropout and router jitter on.

Reference: the same model, seed and batch with policy ``none``. Recompute replays the forward
with the RNG state of the forward (torch.utils.checkpoint and deepspeed.checkpointing both
restore it), so on CPU in fp32 the results are bitwise equal; the tests assert equality, not a
tolerance. A negative control (recompute *without* the RNG restore) shows that the comparison
detects different dropout / jitter / experts.
"""

from __future__ import annotations

import pytest
import torch

from smelt_ds.config.loading import config_from_dict
from smelt_ds.cost.activation_checkpointing import checkpointed_visits
from smelt_ds.errors import ConfigError
from smelt_ds.model import SmeltLM
from smelt_ds.model.router import TopKRouter
from smelt_ds.parallel.engine import check_activation_checkpointing, configure_activation_checkpointing
from smelt_ds.testing import run_distributed
from smelt_ds.train.objective import total_loss
from tests.markers import slow_fixture
from tests.numerics import assert_close_chain, lm_chain_length, prob_tol
from tests.threads import one_thread

POLICIES = ("full", "looped", "every_n")


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """One intra-op thread: a 2-thread pool on a busy 2-core machine spins for seconds per op."""
    with one_thread():
        yield


def _raw(policy="none", impl="torch", **ac):
    return {"name": "ckpt", "model": {"vocab_size": 64, "hidden_size": 32, "num_layers": 4, "num_heads": 4,
                                      "num_kv_heads": 2, "max_seq_len": 32, "dropout": 0.1},
            "moe": {"num_experts": 4, "top_k": 2, "expert_ffn_size": 16, "router_jitter": 0.2,
                    "aux_loss_free_bias": True},
            "loop": {"position": "middle"},
            "train": {"seq_len": 16, "micro_batch_size": 2,
                      "activation_checkpointing": {"policy": policy, "impl": impl, "every_n": 2, **ac}}}


def _step(raw, checkpoint_fn=None):
    """One forward + backward; returns everything that must not change with checkpointing, plus
    the routing of every router call (forward and recompute) by router."""
    cfg = config_from_dict(raw)
    torch.manual_seed(0)
    model = SmeltLM(cfg.model, cfg.moe, cfg.loop).train()
    configure_activation_checkpointing(model, cfg)
    if checkpoint_fn is not None:  # same visits and frees_inputs, another function
        assert model.blocks.wrap_checkpoint_fn(lambda configured: checkpoint_fn)
    calls: dict[str, list[torch.Tensor]] = {}
    for name, m in model.named_modules():
        if isinstance(m, TopKRouter) and name.startswith("layers."):
            m.register_forward_hook(lambda mod, inp, out, n=name: calls.setdefault(n, []).append(out[2].clone()))
    ids = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(1))
    torch.manual_seed(5)  # dropout / jitter stream
    out = model(ids[:, :-1], labels=ids[:, 1:])
    loss = total_loss(out, cfg.train)
    loss.backward()
    return {"loss": loss.detach(), "aux": out.aux_loss.detach(), "z": out.z_loss.detach(),
            "grads": {n: p.grad.clone() for n, p in model.named_parameters()},
            "stats": model.recorder.router_stats(),
            "tokens": [m.tokens_per_expert.clone() for m in model.modules() if isinstance(m, TopKRouter)],
            "calls": calls, "plan": model.schedule.plan, "ckpt": checkpointed_visits(cfg, model.schedule)}


def _assert_same(got, ref, what):
    assert torch.equal(got["loss"], ref["loss"]), what
    assert torch.equal(got["aux"], ref["aux"]) and torch.equal(got["z"], ref["z"]), what
    for n, g in ref["grads"].items():
        assert torch.equal(got["grads"][n], g), f"{what}: {n}"
    assert got["stats"] == ref["stats"], what
    assert all(torch.equal(a, b) for a, b in zip(got["tokens"], ref["tokens"], strict=True)), what


def _assert_recompute_routes(got, what):
    """Router calls per layer = its visits + its checkpointed visits (recompute); each recompute
    chose the experts its forward chose."""
    for layer in range(4):
        visits = [v for v in got["plan"] if v.layer == layer]
        calls = got["calls"][f"layers.{layer}.mlp.gate"]
        n_ckpt = sum(v in got["ckpt"] for v in visits)
        assert len(calls) == len(visits) + n_ckpt, what
        fwd, recompute = calls[:len(visits)], calls[len(visits):]
        ckpt_fwd = [c for v, c in zip(visits, fwd, strict=True) if v in got["ckpt"]]
        # backward runs the visits in reverse order
        for a, b in zip(reversed(ckpt_fwd), recompute, strict=True):
            assert torch.equal(a, b), what


@pytest.fixture(scope="module")
def reference():
    return _step(_raw("none"))


@pytest.mark.parametrize("policy", POLICIES)
def test_torch_impl_reproduces_no_checkpointing(policy, reference):
    got = _step(_raw(policy, "torch"))
    assert got["ckpt"] and len(got["ckpt"]) < 6 or policy == "full"
    _assert_same(got, reference, f"torch {policy}")
    _assert_recompute_routes(got, f"torch {policy}")


def test_gradient_of_aux_and_z_loss_is_present(reference):
    """The router weights' gradient depends on the aux / z losses (so 'same gradients' above also
    covers the losses' gradient through checkpointed visits)."""
    raw = _raw("none")
    raw["train"].update(aux_loss_coef=0.0, z_loss_coef=0.0)
    without = _step(raw)
    router = "layers.1.mlp.gate.weight"
    assert not torch.allclose(without["grads"][router], reference["grads"][router], atol=1e-7)


def test_negative_control_recompute_without_rng_restore_differs(reference):
    """Without restoring the RNG state, recompute draws new dropout masks and jitter: the gradients
    (and here the experts chosen on recompute) differ, so the equalities above are not vacuous."""
    import torch.utils.checkpoint as tuc

    got = _step(_raw("full"), lambda fn, x: tuc.checkpoint(fn, x, use_reentrant=False, preserve_rng_state=False,
                                                           determinism_check="none"))
    assert torch.equal(got["loss"], reference["loss"])  # the forward itself is unchanged
    assert any(not torch.equal(got["grads"][n], g) for n, g in reference["grads"].items())


def test_deepspeed_only_options_rejected_for_torch_impl():
    for key in ("partition_activations", "cpu_checkpointing", "contiguous_memory_optimization"):
        with pytest.raises(ConfigError, match=rf"train\.activation_checkpointing\.{key}.*impl"):
            check_activation_checkpointing(config_from_dict(_raw("full", "torch", **{key: True})))
    with pytest.raises(ConfigError, match="partition_activations"):
        check_activation_checkpointing(config_from_dict(_raw("full", "deepspeed",
                                                             contiguous_memory_optimization=True)))


# ---------------------------------------------------------------------------------------------
# deepspeed.checkpointing (needs torch.distributed: a world of one) and the DeepSpeed engine
# ---------------------------------------------------------------------------------------------

# NOT coverage of cpu_checkpointing on a CPU accelerator: configure_activation_checkpointing drops
# the option there (one-time UserWarning), so that entry re-runs the plain case on CPU and tests the
# option only on CUDA; test_cpu_checkpointing_is_dropped_on_a_cpu_accelerator pins which happened.
DS_VARIANTS = [("deepspeed", {}), ("deepspeed", {"partition_activations": True}),
               ("deepspeed", {"partition_activations": True, "contiguous_memory_optimization": True}),
               ("deepspeed", {"cpu_checkpointing": True}), ("reentrant", {})]


def _ds_worker(rank, world):
    import warnings

    import deepspeed
    from deepspeed.accelerator import get_accelerator
    from deepspeed.runtime.activation_checkpointing import checkpointing as ds_ckpt

    out = {"ref": _step(_raw("none")), "cases": {}}
    cpu_ckpt = {"accelerator": get_accelerator().device_name(), "passed_on": [], "warnings": []}
    for policy in POLICIES:
        for impl, opts in DS_VARIANTS:
            fn = deepspeed.checkpointing.checkpoint if impl == "reentrant" else None
            key = (policy, impl, tuple(sorted(opts)))
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                out["cases"][key] = _step(_raw(policy, "deepspeed", **opts), checkpoint_fn=fn)
            cpu_ckpt["warnings"] += [str(w.message) for w in caught if "cpu_checkpointing" in str(w.message)]
            if opts.get("cpu_checkpointing"):
                cpu_ckpt["passed_on"].append(ds_ckpt.CPU_CHECKPOINT)  # what deepspeed.checkpointing runs with
    out["cpu_ckpt"] = cpu_ckpt
    # input injection re-adds the block input, which partition_activations empties in place
    inj = {**_raw("none"), "loop": {"position": "middle", "input_injection": "add"}}
    out["inj_ref"] = _step(inj)
    inj_ckpt = {**_raw("looped", "deepspeed", partition_activations=True), "loop": inj["loop"]}
    out["inj"] = _step(inj_ckpt)
    out["engine"] = _engine_losses()
    return out


def _engine_losses():
    """DeepSpeed engine, ZeRO-2 and ZeRO-3, looped visits checkpointed by deepspeed.checkpointing:
    3 AdamW steps equal the run without checkpointing (the reentrant variant raises 'already been
    reduced' here: a looped parameter would receive its gradient in two backward calls)."""
    from smelt_ds.parallel.engine import initialize

    res = {}
    for stage in (2, 3):
        for policy in ("none", "looped"):
            raw = _raw(policy, "deepspeed")
            raw["model"]["dropout"] = 0.0
            raw["moe"].update(router_jitter=0.0, aux_loss_free_bias=False)
            raw["train"].update(lr=3e-3, warmup_steps=1, max_steps=10)
            raw["deepspeed"] = {"zero_stage": stage}
            cfg = config_from_dict(raw)
            torch.manual_seed(0)
            model = SmeltLM(cfg.model, cfg.moe, cfg.loop)
            configure_activation_checkpointing(model, cfg)
            engine, *_ = initialize(cfg, model, 1)
            losses = []
            for _ in range(3):
                # the same batch every step: the loss must fall
                ids = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(7))
                out = engine(ids[:, :-1], labels=ids[:, 1:])
                loss = total_loss(out, cfg.train)
                engine.backward(loss)
                engine.step()
                losses.append(float(loss.detach()))
            res[(stage, policy)] = losses
    return res


@pytest.fixture(scope="module")
@slow_fixture
def ds_results():
    return run_distributed(_ds_worker, world_size=1, timeout=240)[0]


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("impl,opts", DS_VARIANTS, ids=lambda v: v if isinstance(v, str) else "-".join(v) or "plain")
def test_deepspeed_impl_reproduces_no_checkpointing(ds_results, policy, impl, opts):
    """deepspeed.checkpointing (non-reentrant, as configured, with partition / contiguous / CPU
    checkpointing) and the reentrant deepspeed.checkpointing.checkpoint (which runs the forward
    without grad: the aux and z losses still get their gradient because they are outputs of the
    checkpointed function) match the reference exactly."""
    got = ds_results["cases"][(policy, impl, tuple(sorted(opts)))]
    _assert_same(got, ds_results["ref"], f"{impl} {opts} {policy}")
    _assert_recompute_routes(got, f"{impl} {opts} {policy}")


def test_cpu_checkpointing_is_dropped_on_a_cpu_accelerator(ds_results):
    """On a CPU accelerator ``cpu_checkpointing`` is not passed to deepspeed.checkpointing (its CPU
    path loses the input there) and a UserWarning says so, once per process: the
    ``cpu_checkpointing`` cases above re-run the plain case on CPU. On CUDA it is passed on."""
    c = ds_results["cpu_ckpt"]
    assert len(c["passed_on"]) == len(POLICIES)
    if c["accelerator"] == "cpu":
        assert c["passed_on"] == [False] * len(POLICIES)
        assert len(c["warnings"]) == 1 and "ignored on a CPU accelerator" in c["warnings"][0], c["warnings"]
    else:
        assert c["passed_on"] == [True] * len(POLICIES) and c["warnings"] == []


def test_partition_activations_with_input_injection(ds_results):
    """partition_activations empties a checkpoint's input in place; the block input kept for
    input injection is a copy, so the result is unchanged (without the copy the loss moves by
    1e-2: the injected tensor would be a 0-d placeholder, broadcast silently). The copy adds a
    node to the block input's gradient sum, which reorders every gradient downstream of it: they
    get the bound of another summation order (tests/numerics.py: 2 n u of each tensor's largest
    gradient, n the whole backward chain, 4.2e-4)."""
    got, ref = ds_results["inj"], ds_results["inj_ref"]
    assert torch.equal(got["loss"], ref["loss"])
    n_chain = lm_chain_length(config_from_dict(_raw()), tokens=2 * 16 * 2)  # micro-batch 2 x 16 tokens x 2 visits
    for n, g in ref["grads"].items():
        assert_close_chain(got["grads"][n], g, n_chain, msg=n)
    assert got["stats"] == ref["stats"]


def test_engine_zero2_zero3_with_deepspeed_checkpointing(ds_results):
    """3 AdamW steps with checkpointed looped visits equal the run without. DeepSpeed's gradient
    hooks may sum a looped parameter's two visits in another order: losses relative within Higham
    & Mary's probabilistic bound over 3 forward/backward chains (tests/numerics.py: 1.2e-4)."""
    res = ds_results["engine"]
    n_chain = lm_chain_length(config_from_dict(_raw()), tokens=2 * 16 * 2)
    for stage in (2, 3):
        assert res[(stage, "none")][2] < res[(stage, "none")][0]
        assert res[(stage, "looped")] == pytest.approx(res[(stage, "none")], rel=prob_tol(3 * n_chain)), f"ZeRO-{stage}"
