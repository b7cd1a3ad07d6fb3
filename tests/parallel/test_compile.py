"""``train.compile``: compiled training equals eager training, and a looped layer compiles once.

References: the same model run eagerly on the same batches (plain PyTorch AdamW in one process,
or the DeepSpeed engine on 2 gloo ranks). Tolerances (``tests/numerics.py``): ``aot_eager``'s
decompositions and inductor's fused C++ kernels compute the same sums in other orders, so both get
the bound of a chain of reductions: the gradients of step ``s`` (1-based) element-wise within
``2 n u`` of the tensor's largest, ``n = s * N_STEP`` (each step's forward and backward adds its
reductions to the weights the next one starts from; N_STEP = 3520 for this model: 4.2e-4 at step
1, 1.3e-3 at step 3), losses relative within Higham & Mary's probabilistic bound over the same
chain (1.2e-4 at step 3). A gradient scaled by 1.0005 fails at step 1. Compilation counts come
from ``torch._dynamo.utils.counters`` (:func:`smelt_ds.parallel.compile.compile_counters`): they
must not grow with steps or visits.
"""

from __future__ import annotations

import copy

import pytest
import torch

from smelt_ds.config.loading import config_from_dict
from smelt_ds.errors import ConfigError
from smelt_ds.model import SmeltLM
from smelt_ds.parallel.compile import compile_counters, compile_layers
from smelt_ds.parallel.engine import configure_activation_checkpointing
from smelt_ds.testing import run_distributed
from smelt_ds.train.objective import total_loss
from tests.numerics import assert_close_chain, lm_chain_length, prob_tol

SEQ, MICRO, STEPS = 16, 2, 3


def _raw(compile="none", backend="inductor", position="middle", repeats=2, **extra):
    raw = {"name": "c", "model": {"vocab_size": 64, "hidden_size": 32, "num_layers": 4, "num_heads": 4,
                                  "num_kv_heads": 2, "max_seq_len": 32, "first_k_dense": 1},
           "moe": {"num_experts": 4, "top_k": 2, "expert_ffn_size": 16},
           "loop": {"position": position, "repeats": repeats},
           "train": {"seq_len": SEQ, "micro_batch_size": MICRO, "lr": 1e-2, "warmup_steps": 1, "max_steps": 10,
                     "compile": compile, "compile_backend": backend}}
    if position == "none":
        raw["loop"] = {"position": "none"}
    for k, v in extra.items():
        raw[k] = {**raw.get(k, {}), **v}
    return raw


N_STEP = lm_chain_length(config_from_dict(_raw()), tokens=MICRO * SEQ * 2 * 2)  # micro-batch x 2 visits x 2 ranks


def _batch(step: int, rank: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    w = torch.randint(0, 64, (MICRO, SEQ + 1), generator=g)
    return w[:, :-1], w[:, 1:]


def _train(model: SmeltLM, cfg, steps: int = STEPS, counts: list | None = None):
    """``steps`` AdamW steps on fixed batches; per step the loss and every parameter gradient."""
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.train.lr)
    losses, grads = [], []
    for step in range(steps):
        x, y = _batch(step)
        loss = total_loss(model(x, labels=y), cfg.train)
        loss.backward()
        losses.append(float(loss.detach()))
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
        opt.step()
        opt.zero_grad(set_to_none=True)
        if counts is not None:
            counts.append(compile_counters())
    return losses, grads


def _pair(raw_eager, backend):
    """An eager model and its compiled copy (same initial weights)."""
    cfg = config_from_dict(raw_eager)
    torch.manual_seed(0)
    eager = SmeltLM(cfg.model, cfg.moe, cfg.loop)
    compiled = copy.deepcopy(eager)
    ccfg = config_from_dict({**raw_eager, "train": {**raw_eager["train"], "compile": "layers",
                                                    "compile_backend": backend}})
    assert compile_layers(compiled, ccfg) == cfg.model.num_layers
    return cfg, eager, ccfg, compiled


def _assert_close(ref, got):
    (l0, g0), (l1, g1) = ref, got
    assert l1 == pytest.approx(l0, rel=prob_tol(len(l0) * N_STEP))
    for step, (a, b) in enumerate(zip(g0, g1, strict=True)):
        assert a.keys() == b.keys()
        for n in a:
            assert_close_chain(b[n], a[n], (step + 1) * N_STEP, msg=f"step {step} grad {n}")


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.slow
def test_compiled_layers_train_like_eager(backend):
    cfg, eager, ccfg, compiled = _pair(_raw(), backend)
    ref = _train(eager, cfg)
    counts: list = []
    got = _train(compiled, ccfg, counts=counts)
    _assert_close(ref, got)
    # one graph for the dense layer 0, one for the MoE layers 1-3 (layers 1, 2 visited twice), one
    # for the output head
    assert [c["unique_graphs"] for c in counts] == [3, 3, 3]
    assert counts[-1]["graph_breaks"] == 0
    # the recorder saw every visit, keyed by (layer, visit), as in eager
    assert sorted(compiled.recorder.routes) == sorted(eager.recorder.routes)
    for v, r in eager.recorder.routes.items():
        torch.testing.assert_close(compiled.recorder.routes[v].topk_idx_TK, r.topk_idx_TK, rtol=0, atol=0)


@pytest.mark.parametrize("plan", [dict(position="none"), dict(position="middle", repeats=2),
                                  dict(position="middle", repeats=3), dict(position="uniform", repeats=2)])
@pytest.mark.slow
def test_compilations_do_not_depend_on_visits(plan):
    """Baseline (4 visits), SMELT with 6 and 8 visits, uniform looping (8): the same three graphs
    (dense layer, MoE layer, output head)."""
    cfg, _, ccfg, compiled = _pair(_raw(**plan), "aot_eager")
    counts: list = []
    _train(compiled, ccfg, counts=counts)
    assert len(compiled.schedule.plan) >= 4
    assert [c["unique_graphs"] for c in counts] == [3, 3, 3]
    with torch.no_grad():  # validation: one no-grad graph per layer kind and the head, reused too
        compiled(_batch(0)[0])
        compiled(_batch(1)[0])
    assert compile_counters()["unique_graphs"] == 6


@pytest.mark.parametrize("impl", ["torch", "deepspeed"])
@pytest.mark.slow
def test_compiled_layers_under_activation_checkpointing(impl):
    """The recompute runs the compiled code: gradients equal eager checkpointed training."""
    extra = {"train": {**_raw()["train"], "activation_checkpointing": {"policy": "looped", "impl": impl}}}
    if impl == "deepspeed":  # deepspeed.checkpointing needs torch.distributed (a world of one)
        return _checkpoint_deepspeed_world_of_one(_raw(**extra))
    cfg, eager, ccfg, compiled = _pair(_raw(**extra), "aot_eager")
    configure_activation_checkpointing(eager, cfg)
    configure_activation_checkpointing(compiled, ccfg)
    counts: list = []
    _assert_close(_train(eager, cfg), _train(compiled, ccfg, counts=counts))
    # the recompute (count_tokens False) reuses the forward's graph: without the expert bias the
    # flag is never read, so still one graph per layer kind (and the head)
    assert [c["unique_graphs"] for c in counts] == [3, 3, 3]


def _checkpoint_deepspeed_world_of_one(raw):
    ref, got, counts = run_distributed(_ds_ckpt_rank, world_size=1, args=(raw,))[0]
    _assert_close(ref, got)
    assert [c["unique_graphs"] for c in counts] == [3, 3, 3]


def _ds_ckpt_rank(rank, world, raw):
    cfg, eager, ccfg, compiled = _pair(raw, "aot_eager")
    configure_activation_checkpointing(eager, cfg)
    configure_activation_checkpointing(compiled, ccfg)
    ref = _train(eager, cfg)
    counts: list = []
    got = _train(compiled, ccfg, counts=counts)
    return ref, got, counts


@pytest.mark.slow
def test_aux_loss_free_bias_counts_tokens_once_per_visit_compiled():
    """The router's in-place token counts (a buffer mutated inside the compiled graph) equal eager."""
    raw = _raw(moe={"num_experts": 4, "top_k": 2, "expert_ffn_size": 16, "aux_loss_free_bias": True})
    cfg, eager, ccfg, compiled = _pair(raw, "aot_eager")
    x, y = _batch(0)
    for m, c in ((eager, cfg), (compiled, ccfg)):
        total_loss(m(x, labels=y), c.train).backward()
    for le, lc in zip(eager.layers[1:], compiled.layers[1:], strict=True):
        torch.testing.assert_close(lc.mlp.gate.tokens_per_expert, le.mlp.gate.tokens_per_expert, rtol=0, atol=0)
    # layers 1 and 2 are visited twice: 2 visits * T tokens * K copies
    assert float(compiled.layers[1].mlp.gate.tokens_per_expert.sum()) == 2 * MICRO * SEQ * 2


# --------------------------------------------------------------------------------------------
# the DeepSpeed engine, 2 gloo ranks
# --------------------------------------------------------------------------------------------


def _engine_rank(rank, world, raw, steps):
    import torch.distributed as dist

    from smelt_ds.config.loading import config_from_dict
    from smelt_ds.train.build import build

    torch._dynamo.utils.counters.clear()
    cfg = config_from_dict(raw)
    built = build(cfg, world)
    engine = built.engine
    losses, counts = [], []
    for step in range(steps):
        x, y = _batch(step, rank)
        loss = total_loss(engine(x, labels=y), cfg.train)
        engine.backward(loss)
        engine.step()
        t = loss.detach().clone()
        dist.all_reduce(t)
        losses.append(float(t) / world)
        counts.append(compile_counters())
    reasons = [r.splitlines()[0] + " " + r for r in torch._dynamo.utils.counters["graph_break"]]
    return losses, counts, reasons


def _eager_then_compiled_rank(rank, world, eager_raw, compiled_raw, steps):
    """The eager run, then the compiled one, in the same 2 processes (one start-up instead of two)."""
    return _engine_rank(rank, world, eager_raw, steps), _engine_rank(rank, world, compiled_raw, steps)


@pytest.mark.distributed
@pytest.mark.parametrize("mode,zero_stage,extra,backend", [
    ("layers", 3, {}, "aot_eager"),
    ("layers", 3, {"moe_runtime": {"backend": "autoep", "ep_size": 2}}, "aot_eager"),
    ("layers", 2, {"moe_runtime": {"backend": "deepspeed", "ep_size": 2}}, "aot_eager"),
    ("model", 2, {}, "inductor"),
])
def test_two_rank_compiled_matches_eager(mode, zero_stage, extra, backend):
    """2 ranks: ``layers`` at ZeRO-3 with the reference MoE and with AutoEP EP 2, at ZeRO-2 with
    DeepSpeed-MoE EP 2 (the backends' MoE layers eager, the attention half compiled), ``model``
    (DeepSpeed's engine.compile) at ZeRO-2; losses equal eager training, no recompilation after
    step 1, graph breaks only at ZeRO-3's parameter hooks. The graphs and their breaks are
    dynamo's, the same for every compiler backend: the ``layers`` cases compile with ``aot_eager``
    (inductor's C++ kernels take 10-20 s per case on 2 cores and add nothing a single-process
    inductor test above does not check), ``model`` with inductor."""
    base = _raw(deepspeed={"zero_stage": zero_stage}, **extra)
    comp = {**base, "train": {**base["train"], "compile": mode, "compile_backend": backend}}
    runs = run_distributed(_eager_then_compiled_rank, args=(base, comp, STEPS))
    eager_losses = runs[0][0][0]
    for rank in range(2):
        assert runs[rank][0][1] == [{"unique_graphs": 0, "graph_breaks": 0}] * STEPS  # the eager run compiled nothing
        losses, counts, reasons = runs[rank][1]
        assert losses == pytest.approx(eager_losses, rel=prob_tol(STEPS * N_STEP))
        graphs = [c["unique_graphs"] for c in counts]
        assert graphs[0] > 0 and graphs == [graphs[0]] * STEPS, graphs  # compiled in step 1 only
        breaks = [c["graph_breaks"] for c in counts]
        assert breaks == [breaks[0]] * STEPS
        if zero_stage == 3:  # the graph breaks only where DeepSpeed's ZeRO-3 hooks gather parameters
            assert breaks[0] > 0 and all(_deepspeed_break(r) for r in reasons), reasons
        else:
            assert breaks[0] == 0, reasons


def _deepspeed_break(reason: str) -> bool:
    """A graph break caused by DeepSpeed's ZeRO-3 module hooks: its ``torch.compiler.disable``'d
    pre-forward hook, its nvtx-wrapped post-forward hook, or dynamo rebuilding a submodule after
    such a break (\"sourceless builder\", a dynamo limitation)."""
    return any(k in reason for k in ("_pre_forward_module_hook", "instrument_w_nvtx", "sourceless builder",
                                     "_post_forward_module_hook"))


# --------------------------------------------------------------------------------------------
# what the config refuses
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("extra,field", [
    ({"moe_runtime": {"backend": "autoep", "ep_size": 2}}, "train.compile"),
    ({"deepspeed": {"zero_stage": 3}}, "train.compile"),
    ({"train": {"activation_checkpointing": {"policy": "looped", "impl": "deepspeed"}}}, "train.compile"),
])
def test_model_compile_refuses_what_it_cannot_run(extra, field):
    raw = _raw(compile="model", **extra)
    if "train" in extra:
        raw["train"] = {**_raw(compile="model")["train"], **extra["train"]}
    with pytest.raises(ConfigError) as e:
        config_from_dict(raw)
    assert field in str(e.value) and "layers" in str(e.value)  # names the alternative


def test_unknown_compile_value_names_the_choices():
    with pytest.raises(ConfigError) as e:
        config_from_dict(_raw(compile="regional"))
    assert "train.compile" in str(e.value) and "layers" in str(e.value)


def test_a_resume_may_switch_compilation_but_not_the_optimisation(tmp_path):
    from smelt_ds.config.loading import config_to_dict
    from smelt_ds.train.guards import _check_resume_overrides

    old = config_to_dict(config_from_dict(_raw()))
    new = config_to_dict(config_from_dict(_raw(compile="layers", backend="inductor")))
    _check_resume_overrides(old, new, tmp_path, "auto")  # compiled or not: the same run
    new["train"]["weight_decay"] = 0.5  # the optimisation (a peak LR may change on resume; this may not)
    with pytest.raises(ConfigError, match="train.weight_decay"):
        _check_resume_overrides(old, new, tmp_path, "auto")


def test_deepcopy_of_a_compiled_model_runs_its_own_weights():
    """The compiled functions are unbound: a copy with other weights must not run the original's."""
    cfg, _, ccfg, compiled = _pair(_raw(), "aot_eager")
    twin = copy.deepcopy(compiled)
    with torch.no_grad():
        for p in twin.parameters():
            p.mul_(1.5)
    x = _batch(0)[0]
    eager_twin = SmeltLM(cfg.model, cfg.moe, cfg.loop)
    eager_twin.load_state_dict(twin.state_dict())
    with torch.no_grad():
        assert_close_chain(twin(x).logits, eager_twin(x).logits, lm_chain_length(cfg, 0, backward=False))
        assert not torch.allclose(twin(x).logits, compiled(x).logits)


def test_a_compile_backend_without_compile_is_refused():
    """A recipe that sets a backend but compiles nothing would claim what does not run."""
    with pytest.raises(ConfigError) as e:
        config_from_dict(_raw(compile="none", backend="aot_eager"))
    assert "train.compile_backend" in str(e.value) and "train.compile: layers" in str(e.value)
    config_from_dict(_raw(compile="none", backend="inductor"))  # the default: nothing claimed
