"""Every MoE backend, end to end: train on 2 real ranks, save, export, load in one CPU process,
evaluate, generate, and start new runs on every backend from the export (``train.init_from``).

One cell per backend x ZeRO stage x expert-parallel size that the backend supports
(``deepspeed``: ZeRO 0-2; ``reference``: no expert parallelism, 2 data-parallel ranks). Each
cell checks, against the live engine that DeepSpeed itself restores from the same checkpoint
(``engine.load_checkpoint``, independent of the exported reference-layout shards):

(a) the export's logits on a fixed batch equal the live engine's (fp32, expert outputs summed in
    another order: within 2 n u of the largest logit, n the forward's reduction lengths,
    ``tests/numerics.py``);
(b) the SHA-256 of every expert's weights (gate, up and down matrices of expert ``e`` of layer
    ``l``, gathered from the rank that holds it) equals that of expert ``e`` of layer ``l`` in
    the export;
(c) ``smelt-ds eval`` and ``smelt-ds generate`` run on the export, and so do ``smelt-ds eval --harness``
    (its numbers equal a direct harness evaluation of the exported model) and ``--humaneval``;
(d) ``train.init_from`` of the export into each backend gives the exported model's loss on the
    same batch (Higham & Mary's bound over the forward chain, ``tests/numerics.py``): the first
    step of a run started from it;
(e) ``smelt-ds export --format hf`` of the run loads with ``AutoModelForCausalLM`` and its logits
    equal the live engine's (same tolerance as (a)).

(c), (d) and (e) read only the export, which (a) and (b) check in every cell: they run in the most
sharded cell of each source backend (``USER_PATH_CELLS``).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch

from smelt_ds.config.loading import config_from_dict
from smelt_ds.testing import run_distributed
from tests.numerics import assert_close_chain, model_chain_length, prob_tol

pytestmark = pytest.mark.distributed

WORLD = 2
E = 4
# (backend, ZeRO stage, expert-parallel size)
CELLS = [("reference", 0, 1), ("reference", 2, 1), ("reference", 3, 1),
         ("deepspeed", 0, 1), ("deepspeed", 0, 2), ("deepspeed", 2, 1), ("deepspeed", 2, 2),
         ("autoep", 0, 1), ("autoep", 0, 2), ("autoep", 2, 1), ("autoep", 2, 2), ("autoep", 3, 1), ("autoep", 3, 2)]
# (c) the user's commands and (d) init_from on every backend read only the export, whose layout and
# values (a, b) every cell checks against its live engine: they run from the most sharded cell of
# each source backend (a third of the matrix's time on 2 cores goes to them otherwise)
USER_PATH_CELLS = {("reference", 3, 1), ("deepspeed", 2, 2), ("autoep", 3, 2)}


def _raw(run_dir: Path, cache: Path, backend: str, zero: int, ep: int) -> dict:
    moe = {"num_experts": E, "top_k": 2, "expert_ffn_size": 32, "shared_expert_ffn_size": 16}
    runtime: dict = {}
    if backend != "reference":
        runtime.update(backend=backend, ep_size=ep)
    if backend == "deepspeed":
        runtime.update(drop_tokens=False)  # dropless, so the logits equal the reference layout's
    return {"name": f"{backend}-z{zero}-ep{ep}",
            "model": {"vocab_size": 512, "hidden_size": 32, "num_layers": 4, "num_heads": 4, "num_kv_heads": 2,
                      "max_seq_len": 64, "first_k_dense": 1, "dense_ffn_size": 48},
            "moe": moe, "moe_runtime": runtime, "loop": {"position": "middle"},
            "data": {"builtin_max_bytes": 150_000, "tokenizer": {"vocab_size": 512}, "cache_dir": str(cache)},
            "deepspeed": {"zero_stage": zero},
            "train": {"seq_len": 32, "micro_batch_size": 2, "max_steps": 2, "warmup_steps": 1, "log_every": 1,
                      "eval_every": 2, "save_every": 2, "lr": 1e-2, "run_dir": str(run_dir)},
            "eval": {"eval_batches": 1}}


def _targets(raw: dict, export: Path) -> dict[str, dict]:
    """The recipe started from ``export`` on every backend (expert-parallel size 2 where it applies)."""
    out = {}
    for backend, zero in (("reference", 3), ("deepspeed", 2), ("autoep", 3)):
        t = json.loads(json.dumps(raw))
        t["moe_runtime"] = {}
        if backend != "reference":
            t["moe_runtime"].update(backend=backend, ep_size=2)
        if backend == "deepspeed":
            t["moe_runtime"]["drop_tokens"] = False
        t["deepspeed"] = {"zero_stage": zero}
        t["train"] = {**t["train"], "init_from": str(export), "run_dir": str(export.parent / f"from-{backend}")}
        out[backend] = t
    return out


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, 512, (2, 33), generator=g)
    return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()


def _sha(*tensors: torch.Tensor) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().float().contiguous().numpy().tobytes())
    return h.hexdigest()


def _live_experts(model, backend: str) -> dict[tuple[int, int], str]:
    """``{(layer, global expert): sha256(gate, up, down)}`` of the experts this rank holds,
    read from the live modules (gathered under ZeRO-3). Expert parallelism places the experts
    in contiguous blocks: rank ``r`` of the expert-parallel group holds ``r * E/ep ..``."""
    import deepspeed
    from deepspeed.utils import groups

    out = {}
    for i, block in enumerate(model.layers):
        if not block.is_moe:
            continue
        mlp = block.mlp
        params = list(mlp.parameters())
        with deepspeed.zero.GatheredParameters(params):
            if backend == "reference":
                F = mlp.experts.down_proj.shape[-1]
                for e in range(E):
                    gu = mlp.experts.gate_up_proj[e]
                    out[(i, e)] = _sha(gu[:F], gu[F:], mlp.experts.down_proj[e])
                continue
            ep_rank = groups._get_expert_parallel_rank(f"ep_size_{mlp.ep_size}") if mlp.ep_size > 1 else 0
            if backend == "deepspeed":
                local = mlp.local_experts
                for j, ex in enumerate(local):
                    out[(i, ep_rank * len(local) + j)] = _sha(ex.gate_proj.weight, ex.up_proj.weight,
                                                              ex.down_proj.weight)
            else:
                w1, w2, w3 = mlp.experts.w1, mlp.experts.w2, mlp.experts.w3
                for j in range(w1.shape[0]):
                    out[(i, ep_rank * w1.shape[0] + j)] = _sha(w1[j], w3[j], w2[j])
    return out


def _cell_worker(rank: int, world: int, raw: dict, export: str, user_paths: bool = True) -> dict:
    import torch.distributed as dist

    from smelt_ds.runs import checkpoint as ckpt
    from smelt_ds.runs.export import export_checkpoint
    from smelt_ds.train.build import build
    from smelt_ds.train.loop import train

    cfg = config_from_dict(raw)
    result = train(cfg)
    dist.barrier()
    if rank == 0:
        export_checkpoint(result.run_dir, export)
    dist.barrier()
    ids, labels = _batch()
    live = build(cfg, world)
    assert ckpt.load(live.engine, result.run_dir, "auto", live.layout)["step"] == 2
    live.engine.eval()
    with torch.no_grad():
        logits = live.engine(ids).logits.float()
    experts = _live_experts(live.model, cfg.moe_runtime.backend)
    losses = {}
    for name, t in (_targets(raw, Path(export)).items() if user_paths else ()):
        built = build(config_from_dict(t), world)
        with torch.no_grad():
            losses[name] = float(built.engine(ids, labels=labels).lm_loss)
    return {"logits": logits, "experts": experts, "losses": losses}


def _export_experts(model) -> dict[tuple[int, int], str]:
    out = {}
    for i, block in enumerate(model.layers):
        if block.is_moe:
            F = block.mlp.experts.down_proj.shape[-1]
            for e in range(E):
                gu = block.mlp.experts.gate_up_proj[e]
                out[(i, e)] = _sha(gu[:F], gu[F:], block.mlp.experts.down_proj[e])
    return out


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("export-matrix-cache")


def _cli(*argv) -> int:
    from smelt_ds.cli import main

    return main([str(a) for a in argv])


@pytest.mark.parametrize("backend,zero,ep", CELLS, ids=[f"{b}-z{z}-ep{e}" for b, z, e in CELLS])
def test_export_eval_generate_init_from(tmp_path, cache, backend, zero, ep, capsys):
    from smelt_ds.runs.export import load_exported

    raw = _raw(tmp_path / "run", cache, backend, zero, ep)
    export = tmp_path / "export"
    user_paths = (backend, zero, ep) in USER_PATH_CELLS
    ranks = run_distributed(_cell_worker, WORLD, args=(raw, str(export), user_paths), timeout=400)
    model = load_exported(export)
    ids, labels = _batch()
    with torch.no_grad():
        out = model(ids, labels=labels)
    n = model_chain_length(model, 32)
    for r in ranks:  # (a)
        assert_close_chain(out.logits.float(), r["logits"], n)
    live = {k: v for r in ranks for k, v in r["experts"].items()}  # (b)
    assert sorted(live) == sorted(_export_experts(model))
    assert live == _export_experts(model)
    assert sorted(ranks[0]["losses"]) == (["autoep", "deepspeed", "reference"] if user_paths else [])
    for name, loss in ranks[0]["losses"].items():  # (d)
        assert loss == pytest.approx(float(out.lm_loss), rel=prob_tol(n + 64)), name
    if not user_paths:
        return
    # (e) the Hugging Face export of the run (issue 16): transformers' model equals the live engine
    from transformers import AutoModelForCausalLM

    from smelt_ds.interop.hf_export import export_hf

    hf_dir = export_hf(tmp_path / "run", tmp_path / "hf").out
    hf = AutoModelForCausalLM.from_pretrained(hf_dir, trust_remote_code=True, dtype=torch.float32)
    with torch.no_grad():
        hf_logits = hf(input_ids=ids).logits.float()
    for r in ranks:
        assert_close_chain(hf_logits, r["logits"], n)
    # (c) the user's commands on the export
    assert _cli("eval", export, "-o", tmp_path / "eval", "--batches", "1", "--micro-batch", "2", "--episodes", "2",
                "--shots", "0,1", "--tasks", "kv_recall", "--no-plots") == 0
    res = json.loads((tmp_path / "eval" / "eval.json").read_text())
    assert 0 < res["domains"][raw["name"]]["all"]["loss"] < 2 * torch.log(torch.tensor(512.0)).item()
    capsys.readouterr()
    assert _cli("generate", export, "--prompt", "def f(", "--max-new-tokens", "5", "--mode", "greedy", "--json") == 0
    gen = json.loads(capsys.readouterr().out)
    assert gen
    # (c) the downstream evaluation of issue 15 on the same export: a harness task and the
    # HumanEval canonical-solution loss, equal to a direct evaluation of the exported model
    from smelt_ds.eval.harness import evaluate_model, run_tokenizer
    from smelt_ds.runs.load import load_run

    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "m_ll.jsonl").write_text("".join(json.dumps(r) + "\n" for r in (
        {"c": "def add(a, b):\n    return", "t": " a + b"}, {"c": "import os\nimport", "t": " sys"})))
    (tasks / "m_ll.yaml").write_text(json.dumps({
        "task": "m_ll", "dataset_path": "json", "dataset_kwargs": {"data_files": {"test": str(tasks / "m_ll.jsonl")}},
        "test_split": "test", "output_type": "loglikelihood", "doc_to_text": "{{c}}", "doc_to_target": "{{t}}",
        "target_delimiter": "", "metric_list": [{"metric": "perplexity"}, {"metric": "acc"}]}))
    assert _cli("eval", export, "--harness", "m_ll", "--include-path", tasks, "-o", tmp_path / "h") == 0
    got = json.loads((tmp_path / "h" / "harness.json").read_text())
    run = load_run(export)
    tok, eot = run_tokenizer(run)
    direct = evaluate_model(run.model, tok, eot, ["m_ll"], str(tasks))
    assert json.dumps(got).count(repr(direct["results"]["m_ll"]["perplexity,none"])) >= 1
    assert _cli("eval", export, "--humaneval", "--humaneval-loss-only", "--humaneval-limit", "2",
                "-o", tmp_path / "he") == 0
    he = json.loads((tmp_path / "he" / "humaneval.json").read_text())
    assert he["problems"] == 2
