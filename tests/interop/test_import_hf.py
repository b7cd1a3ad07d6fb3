"""``smelt-ds import-hf``: smelt -> HF -> smelt is the identity on every tensor, for the
transformers architectures and the smelt format; the recipe trains from the imported weights."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from smelt_ds.cli import main
from smelt_ds.config.loading import load_config
from smelt_ds.errors import ConfigError
from smelt_ds.interop.hf_export import export_hf
from smelt_ds.interop.import_hf import RECIPE_HEADER, import_hf
from smelt_ds.model import SmeltLM
from smelt_ds.runs.export import export_checkpoint, load_initial_weights
from smelt_ds.runs.load import resolve_export
from smelt_ds.testing import scaled_timeout


def _cli(*argv) -> int:
    return main([str(a) for a in argv])


def _expert_sums(state: dict[str, torch.Tensor]) -> dict[tuple[str, int], str]:
    """SHA-256 of (gate, up, down) of expert e of every MoE layer."""
    out = {}
    for name, gu in state.items():
        if name.endswith("mlp.experts.gate_up_proj"):
            down = state[name.replace("gate_up_proj", "down_proj")]
            F = down.shape[-1]
            for e in range(gu.shape[0]):
                h = hashlib.sha256()
                for t in (gu[e, :F], gu[e, F:], down[e]):
                    h.update(t.contiguous().numpy().tobytes())
                out[(name, e)] = h.hexdigest()
    return out


def _assert_identity(src: Path, weights: Path) -> None:
    a = torch.load(src / "model.pt", weights_only=True)
    b = torch.load(weights / "model.pt", weights_only=True)
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
    assert _expert_sums(a) == _expert_sums(b) and len(_expert_sums(a)) > 0


BASELINES = {
    "qwen3_moe": {"model": {"num_layers": 6, "qk_norm": True, "first_k_dense": 1, "dense_ffn_size": 48},
                  "loop": {"position": "none"}, "moe": {"norm_topk_prob": False}},
    "mixtral": {"model": {"num_layers": 6, "tie_embeddings": True}, "loop": {"position": "none"}},
}


@pytest.mark.parametrize("arch", sorted(BASELINES))
def test_round_trip_through_a_transformers_architecture(make_export, tmp_path, arch, capsys):
    src = make_export(f"rt-{arch}", **BASELINES[arch])
    hf = export_hf(src, tmp_path / "hf")
    assert hf.model_type == arch
    recipe = tmp_path / "recipe.yaml"
    assert _cli("import-hf", hf.out, "-o", recipe, "--name", f"imported-{arch}") == 0
    weights = tmp_path / "recipe-weights"
    assert str(weights) in capsys.readouterr().out
    _assert_identity(src, weights)
    assert recipe.read_text().startswith(RECIPE_HEADER)
    cfg = load_config(recipe)
    source_cfg = load_config(src / "config.yaml")
    arch_fields = ["vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "resolved_head_dim",
                   "max_seq_len", "rope_theta", "norm_eps", "tie_embeddings", "qk_norm", "first_k_dense"]
    assert {f: getattr(cfg.model, f) for f in arch_fields} == {f: getattr(source_cfg.model, f) for f in arch_fields}
    if cfg.model.first_k_dense:
        assert cfg.model.dense_ffn_size == source_cfg.model.dense_ffn_size
    assert cfg.moe.model_dump(include={"num_experts", "top_k", "expert_ffn_size", "norm_topk_prob", "score_func"}) \
        == source_cfg.moe.model_dump(include={"num_experts", "top_k", "expert_ffn_size", "norm_topk_prob",
                                              "score_func"})
    assert cfg.train.init_from == str(weights.resolve())
    model = SmeltLM(cfg.model, cfg.moe, cfg.loop)
    load_initial_weights(model, cfg.train.init_from)  # what train.init_from does


def test_round_trip_of_a_looped_model_through_the_smelt_format(make_export, tmp_path):
    src = make_export("rt-smelt", loop={"position": "asymmetric"}, model={"num_layers": 6},
                      moe={"shared_expert_ffn_size": 16, "score_func": "sigmoid", "aux_loss_free_bias": True})
    hf = export_hf(src, tmp_path / "hf")
    assert hf.model_type == "smelt"
    recipe, weights = import_hf(hf.out, tmp_path / "r.yaml")
    _assert_identity(src, weights)
    cfg, source_cfg = load_config(recipe), load_config(src / "config.yaml")
    assert cfg.schedule.plan == source_cfg.schedule.plan


@pytest.mark.slow
def test_imported_recipe_trains_from_the_checkpoint(make_export, interop_cache, tmp_path):
    src = make_export("rt-train", **BASELINES["qwen3_moe"])
    hf = export_hf(src, tmp_path / "hf")
    recipe, weights = import_hf(hf.out, tmp_path / "cont.yaml")
    run = tmp_path / "run"
    sets = ["train.max_steps=2", "train.warmup_steps=1", "train.seq_len=32", "train.lr=1e-9",
            "train.micro_batch_size=2", "train.eval_every=2", "train.save_every=2", "eval.eval_batches=1",
            "data.builtin_max_bytes=150000",
            f"data.cache_dir={interop_cache}", f"train.run_dir={run}"]
    # in a subprocess, as a user runs it: a training in the test process would leave its process group
    # (and its TCP store's port) behind for the tests after it
    done = subprocess.run([sys.executable, "-m", "smelt_ds.cli", "train", str(recipe),
                           *[a for s in sets for a in ("--set", s)]], capture_output=True, text=True,
                          timeout=scaled_timeout(300))
    assert done.returncode == 0, done.stderr[-3000:]
    assert (run / "checkpoints" / "step00000002" / "COMPLETE").is_file()
    # train.lr 1e-9: two AdamW steps move no weight by more than ~2e-9, so the trained run holds the
    # imported weights (a fresh init, or a dropped tensor, would differ by ~0.2); atol 1e-6 covers that
    # and the fp32 rounding of each step's w (u |w| <= 8e-8 for |w| <= 1.3)
    after = torch.load(export_checkpoint(run, tmp_path / "after") / "model.pt", weights_only=True)
    before = torch.load(src / "model.pt", weights_only=True)
    assert sorted(after) == sorted(before)
    for k in before:
        torch.testing.assert_close(after[k], before[k], atol=1e-6, rtol=0, msg=k)


# ---------------------------------------------------------------------------------------------
# bad input
# ---------------------------------------------------------------------------------------------


def test_bad_checkpoints_and_targets_are_refused(make_export, tmp_path):
    with pytest.raises(ConfigError, match="missing"):
        import_hf(tmp_path / "missing", tmp_path / "r.yaml")
    src = make_export("rt-bad", **BASELINES["mixtral"])
    hf = export_hf(src, tmp_path / "hf").out
    olmoe = tmp_path / "olmoe"
    olmoe.mkdir()
    cfg = json.loads((hf / "config.json").read_text())
    (olmoe / "config.json").write_text(json.dumps({**cfg, "model_type": "olmoe"}))
    with pytest.raises(ConfigError, match="olmoe"):
        import_hf(olmoe, tmp_path / "r.yaml")
    mine = tmp_path / "mine.yaml"
    mine.write_text("name: mine\n")
    with pytest.raises(ConfigError, match="not written by import-hf"):
        import_hf(hf, mine)
    assert yaml.safe_load(mine.read_text()) == {"name": "mine"}
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "data.bin").write_bytes(b"x")
    with pytest.raises(ConfigError, match="holds other files"):
        import_hf(hf, tmp_path / "r2.yaml", busy)
    no_tok = tmp_path / "no-tok"
    no_tok.mkdir()
    for p in hf.iterdir():
        if p.name not in ("tokenizer.json", "tokenizer_config.json"):
            (no_tok / p.name).write_bytes(p.read_bytes())
    with pytest.raises(ConfigError, match="tokenizer.json"):
        import_hf(no_tok, tmp_path / "r3.yaml")
    bad_json = tmp_path / "bad-json"
    bad_json.mkdir()
    for p in hf.iterdir():
        (bad_json / p.name).write_bytes(p.read_bytes())
    (bad_json / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="config.json is not readable JSON"):
        import_hf(bad_json, tmp_path / "r4.yaml")
    with pytest.raises(ConfigError, match="Hugging Face model directory.*import-hf"):
        resolve_export(hf)  # what eval, generate and export read


def test_an_export_missing_a_buffer_or_a_parameter_is_refused_naming_them(make_export, tmp_path):
    """A model.pt without the aux-loss-free router bias (a persistent buffer the recipe uses) used to
    load with the bias left at its initial zeros, in eval, generate and train.init_from, without a
    word; now a missing buffer or parameter is refused naming it, the file and the fix. An export of a
    run without the bias still starts a recipe with it at zero (as a new run starts)."""
    import shutil

    from smelt_ds.runs.export import load_exported, save_weights

    src = make_export("bias-gone", moe={"score_func": "sigmoid", "aux_loss_free_bias": True})
    state = torch.load(src / "model.pt", weights_only=True)
    bias = "layers.1.mlp.gate.expert_bias"
    state[bias] = torch.linspace(-1, 1, state[bias].numel())     # a learned bias, not the initial zeros
    save_weights(state, src)
    assert torch.equal(load_exported(src).state_dict()[bias], state[bias])
    part = tmp_path / "partial"
    shutil.copytree(src, part)
    param = "layers.2.self_attn.q_proj.weight"
    assert param in state
    save_weights({k: v for k, v in state.items() if k not in (bias, param)}, part)  # digest re-written: it verifies
    with pytest.raises(ConfigError) as e:
        load_exported(part)
    assert str(e.value) == (f"{part / 'model.pt'} does not fit the recipe in {part / 'config.yaml'} (missing 2: "
                            f"{bias}, {param}): the export is partial or config.yaml was edited; export the "
                            f"checkpoint again (`smelt-ds export RUN_DIR -o {part}`)")
    save_weights({k: v for k, v in state.items() if k != bias}, part)           # the buffer alone
    with pytest.raises(ConfigError, match=rf"\(missing 1: {bias}\): the export is partial"):
        load_exported(part)
    save_weights({k: v for k, v in state.items() if k not in (bias, param)}, part)
    cfg = load_config(src / "config.yaml")
    with pytest.raises(ConfigError) as e:
        load_initial_weights(SmeltLM(cfg.model, cfg.moe, cfg.loop), part)
    assert str(e.value).startswith(f"`train.init_from`: {part / 'model.pt'} does not fit this recipe's model "
                                   f"(missing 2: {bias}, {param}): ")
    extra = tmp_path / "extra"
    shutil.copytree(src, extra)
    save_weights({**state, "layers.9.self_attn.q_proj.weight": state[param]}, extra)
    with pytest.raises(ConfigError, match=r"\(unexpected 1: layers\.9\.self_attn\.q_proj\.weight\)"):
        load_exported(extra)
    no_bias = make_export("no-bias", moe={"score_func": "sigmoid"})       # a run without the bias
    model = SmeltLM(cfg.model, cfg.moe, cfg.loop)
    with torch.no_grad():
        model.layers[1].mlp.gate.expert_bias.fill_(3.0)
    load_initial_weights(model, no_bias)
    own = torch.load(no_bias / "model.pt", weights_only=True)
    got = model.state_dict()
    assert torch.equal(got[bias], torch.full_like(got[bias], 3.0))  # left as the new run initialised it
    assert all(torch.equal(got[k], v) for k, v in own.items())


def test_smelt_format_config_the_recipe_cannot_express_is_refused(make_export, tmp_path):
    hf = export_hf(make_export("rt-smelt-bad"), tmp_path / "hf").out
    for key, value, match in (("hidden_act", "gelu", "hidden_act"),
                              ("rope_parameters", {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4},
                               "rope_parameters"),
                              ("visit_plan", [[0, 0], [1, 0], [2, 0], [3, 0]], "visit_plan")):
        bad = tmp_path / f"bad-{key}"
        bad.mkdir()
        for p in hf.iterdir():
            (bad / p.name).write_bytes(p.read_bytes())
        config = json.loads((bad / "config.json").read_text())
        config[key] = value
        (bad / "config.json").write_text(json.dumps(config))
        with pytest.raises(ConfigError, match=match):
            import_hf(bad, tmp_path / f"r-{key}.yaml")
        assert not (tmp_path / f"r-{key}.yaml").exists() and not (tmp_path / f"r-{key}-weights").exists()


def test_default_recipe_name_is_the_file_stem(make_export, tmp_path):
    hf = export_hf(make_export("rt-name", **BASELINES["mixtral"]), tmp_path / "hf").out
    recipe, weights = import_hf(hf, tmp_path / "continue.yaml")
    assert load_config(recipe).name == "continue" and weights == (tmp_path / "continue-weights").resolve()
