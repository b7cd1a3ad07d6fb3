"""``smelt-ds export --format hf``: the written directory loads with transformers' Auto classes
and equals the source model (logits, tokenizer, harness numbers); bad outputs are refused."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest
import torch

from smelt_ds.cli import main
from smelt_ds.errors import ConfigError
from smelt_ds.eval.offline_tasks import validation_documents
from smelt_ds.interop.hf_export import HF_MARKER, export_hf
from smelt_ds.runs.export import load_exported
from tests.numerics import assert_close_chain, model_chain_length, prob_tol


def _cli(*argv) -> int:
    return main([str(a) for a in argv])


def _logits_equal(hf_dir: Path, export_dir: Path, remote: bool) -> None:
    from transformers import AutoModelForCausalLM

    model = load_exported(export_dir)
    hf = AutoModelForCausalLM.from_pretrained(hf_dir, trust_remote_code=remote, dtype=torch.float32)
    ids = torch.randint(0, model.model_cfg.vocab_size, (3, 40), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():  # same math, other kernels: the bound of another order (tests/numerics.py)
        assert_close_chain(hf(input_ids=ids).logits, model(ids).logits, model_chain_length(model, 40))


def test_looped_model_exports_as_smelt_with_its_code(make_export, tmp_path, capsys):
    src = make_export("tiny-smelt")
    out = tmp_path / "hf"
    assert _cli("export", src, "--format", "hf", "-o", out) == 0
    assert "model_type smelt" in capsys.readouterr().out
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "smelt"
    assert config["auto_map"]["AutoModelForCausalLM"] == "modeling_smelt.SmeltForCausalLM"
    model = load_exported(src)
    assert [tuple(v) for v in config["visit_plan"]] == [tuple(v) for v in model.schedule.plan]
    for name in ("configuration_smelt.py", "modeling_smelt.py", "model.safetensors", "tokenizer.json",
                 "tokenizer_config.json", "generation_config.json", "README.md", HF_MARKER):
        assert (out / name).is_file(), name
    for code in ("modeling_smelt.py", "configuration_smelt.py"):  # standalone: torch + transformers only
        tree = ast.parse((out / code).read_text())
        roots = {(n.module or "").split(".")[0] if isinstance(n, ast.ImportFrom) else a.name.split(".")[0]
                 for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))
                 for a in (n.names if isinstance(n, ast.Import) else [None])}
        assert "smelt_ds" not in roots and {"torch", "transformers"} & roots, roots
    _logits_equal(out, src, remote=True)
    marker = json.loads((out / HF_MARKER).read_text())
    assert marker["model_type"] == "smelt" and marker["parity"]["max_abs_diff_logits"] <= 1e-4
    card = (out / "README.md").read_text()
    assert " ".join(str(v.layer) for v in model.schedule.plan) in card  # the visit plan
    assert f"{model.num_non_embedding_params() / 1e6:.2f}M" in card or f"{model.num_non_embedding_params():,}" in card
    # no staging directory left (hf-modules: conftest's HF_MODULES_CACHE, which transformers reads once, at
    # import: it is used only when this test is the first of its process to load remote code)
    assert sorted(p.name for p in tmp_path.iterdir() if p.name != "hf-modules") == ["hf"]


def test_tokenizer_encodes_the_validation_documents_as_ours(make_export, interop_data, tmp_path):
    from transformers import AutoTokenizer

    out = export_hf(make_export("tiny-smelt-tok"), tmp_path / "hf").out
    hf = AutoTokenizer.from_pretrained(out, trust_remote_code=True)  # transformers reads config.json first
    assert json.loads((out / "tokenizer_config.json").read_text())["tokenizer_class"] == "PreTrainedTokenizerFast"
    ours, eot = interop_data.tokenizer, interop_data.eot_id
    # every validation document of the built-in corpus (the tiny cap leaves one per domain) and the
    # first training documents
    docs = [d for domain in interop_data.domains for split in ("validation", "train")
            for d in validation_documents(interop_data.prepared, domain, split)[:15]]
    assert len(docs) >= 30 and len(interop_data.domains) == 2
    for doc in docs:
        want = ours.encode(doc).ids
        assert hf(doc, add_special_tokens=False).input_ids == want
        assert hf(doc).input_ids == [eot] + want  # a document start, as in training
        assert hf.decode(want) == ours.decode(want)
    assert (hf.bos_token_id, hf.eos_token_id, hf.pad_token_id) == (eot, eot, ours.token_to_id("<|pad|>"))


@pytest.mark.parametrize("sections,model_type", [
    ({"model": {"num_layers": 6, "qk_norm": True, "first_k_dense": 1, "dense_ffn_size": 48},
      "loop": {"position": "none"}}, "qwen3_moe"),
    ({"model": {"num_layers": 6}, "loop": {"position": "none"}, "moe": {"shared_expert_ffn_size": 16}}, "qwen2_moe"),
    ({"model": {"num_layers": 6}, "loop": {"position": "none"}}, "mixtral"),
], ids=["qwen3_moe", "qwen2_moe", "mixtral"])
def test_baseline_exports_as_a_transformers_architecture(make_export, tmp_path, sections, model_type):
    from transformers import AutoConfig

    src = make_export(f"tiny-baseline-{model_type}", **sections)
    res = export_hf(src, tmp_path / "hf")
    assert res.model_type == model_type and res.reasons == []
    assert not (res.out / "modeling_smelt.py").exists()
    assert AutoConfig.from_pretrained(res.out).model_type == model_type  # no trust_remote_code
    _logits_equal(res.out, src, remote=False)


def test_unmappable_baseline_falls_back_to_smelt_and_says_why(make_export, tmp_path, capsys):
    src = make_export("tiny-baseline-sigmoid", model={"num_layers": 6}, loop={"position": "none"},
                      moe={"score_func": "sigmoid"})
    assert _cli("export", src, "--format", "hf", "-o", tmp_path / "hf") == 0
    printed = capsys.readouterr().out
    assert "model_type smelt" in printed and "moe.score_func" in printed
    _logits_equal(tmp_path / "hf", src, remote=True)
    forced = export_hf(make_export("tiny-baseline-forced", model={"num_layers": 6}, loop={"position": "none"}),
                       tmp_path / "forced", arch="smelt")
    assert forced.model_type == "smelt"


def test_sharded_weights_load_through_the_index(make_export, tmp_path):
    src = make_export("tiny-smelt-shards")
    out = export_hf(src, tmp_path / "hf", max_shard_size="60KB").out
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) > 1 and all((out / s).is_file() for s in shards)
    _logits_equal(out, src, remote=True)


@pytest.mark.slow
def test_lm_eval_hf_model_gives_the_smelt_harness_numbers(make_export, interop_data, tmp_path):
    """lm-evaluation-harness's own ``hf`` model on the export scores every request as smelt-ds's
    harness model does on the source: same accuracies, log-likelihoods and perplexities within fp32
    rounding. ``add_bos_token=True`` makes a context a document start ([eot] + context) for
    loglikelihood and multiple-choice requests; for rolling perplexity it would also score the BOS
    itself, so those run with ``add_bos_token=False`` (lm-eval then starts the first window with
    the BOS token, end-of-text, as ours does)."""
    import lm_eval
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    from smelt_ds.eval.harness import evaluate_model
    from tests.eval.test_harness import write_tasks

    src = make_export("tiny-smelt-lm-eval")
    out = export_hf(src, tmp_path / "hf").out
    root = tmp_path / "tasks"
    write_tasks(root, ["zzz"] * 4)
    L = load_exported(src).model_cfg.max_seq_len
    for tasks, bos in ((["t_mc", "t_ll"], True), (["t_roll"], False)):
        ours = evaluate_model(load_exported(src), interop_data.tokenizer, interop_data.eot_id, tasks,
                              include_path=str(root), batch_size=1)
        hf = HFLM(pretrained=str(out), trust_remote_code=True, add_bos_token=bos, batch_size=1, device="cpu",
                  dtype="float32", max_length=L)
        theirs = lm_eval.simple_evaluate(model=hf, tasks=tasks, task_manager=TaskManager(include_path=str(root)))
        for task in tasks:
            a, b = ours["results"][task], theirs["results"][task]
            metrics = [k for k in a if not k.endswith("_stderr,none") and isinstance(a[k], float)]
            assert metrics, a
            # log-likelihoods and perplexities (sums and means of log-probabilities, no cancellation):
            # Higham & Mary's bound over the forward chain (tests/numerics.py); accuracies compare
            # exactly in effect (a choice flips only if two log-likelihoods tie within that bound)
            rel = prob_tol(model_chain_length(load_exported(src), L))
            for k in metrics:
                assert b[k] == pytest.approx(a[k], rel=rel, abs=1e-6), (task, k)


# ---------------------------------------------------------------------------------------------
# bad input
# ---------------------------------------------------------------------------------------------


def test_bad_outputs_and_inputs_are_refused(make_export, tmp_path):
    src = make_export("tiny-smelt-bad")
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match="is a file"):
        export_hf(src, tmp_path / "file")
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match="holds other files.*notes.txt"):
        export_hf(src, other)
    assert (other / "notes.txt").read_text() == "mine"
    with pytest.raises(ConfigError, match="missing' does not exist"):
        export_hf(tmp_path / "missing", tmp_path / "o1")
    no_tok = tmp_path / "no-tok"
    no_tok.mkdir()
    for name in ("model.pt", "config.yaml"):
        (no_tok / name).write_bytes((src / name).read_bytes())
    with pytest.raises(ConfigError, match="no tokenizer.json"):
        export_hf(no_tok, tmp_path / "o2")
    assert _cli("export", src, "--hf-arch", "smelt", "-o", tmp_path / "o3") == 2  # hf option without --format hf


def test_an_earlier_export_is_replaced_and_nothing_else(make_export, tmp_path):
    src = make_export("tiny-smelt-again")
    out = tmp_path / "hf"
    mine = tmp_path / "hf_partial"  # looks like a staging directory, but is the user's
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    export_hf(src, out)
    (out / "model.safetensors").write_bytes(b"damaged")
    export_hf(src, out)  # an earlier export: replaced
    _logits_equal(out, src, remote=True)
    assert (mine / "notes.txt").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "hf_partial"]
    export_checkpoint_dir = tmp_path / "smelt-format"
    assert _cli("export", src, "--format", "hf", "-o", export_checkpoint_dir) == 0
    with pytest.raises(ConfigError, match="is the export being read"):
        export_hf(src, src)
    with pytest.raises(ConfigError, match="max-shard-size"):
        export_hf(src, tmp_path / "o", max_shard_size="5 parsecs")
    assert not (tmp_path / "o").exists()


def test_an_export_of_the_other_format_is_not_replaced(make_export, tmp_path, capsys):
    """`smelt-ds export RUN -o DIR` over a Hugging Face export (and `--format hf` over a smelt-ds export)
    used to replace it without a word; now it is refused naming DIR, the format it holds and the fix.
    An export of the same format is still replaced."""
    from smelt_ds.config.loading import load_config
    from tests.runs.fake_run import write_checkpoint

    src = make_export("tiny-smelt-formats")
    run = tmp_path / "run"
    write_checkpoint(run, load_config(src / "config.yaml"), 2, torch.load(src / "model.pt", weights_only=True))
    hf, native = tmp_path / "hf", tmp_path / "native"
    assert _cli("export", src, "--format", "hf", "-o", hf, "--no-check") == 0
    assert _cli("export", run, "-o", native) == 0
    capsys.readouterr()

    def contents(d: Path) -> dict[str, bytes]:
        return {p.name: p.read_bytes() for p in d.iterdir()}

    before = {d: contents(d) for d in (hf, native)}
    assert _cli("export", run, "-o", hf) == 2
    assert capsys.readouterr().err == (
        f"smelt-ds export: error: export output {str(hf)!r} holds a Hugging Face export (`smelt-ds export --format "
        f"hf`, {HF_MARKER}): refusing to replace it with a smelt-ds export (model.pt + config.yaml); pass another -o "
        "DIR, or remove that directory first to replace it\n")
    assert _cli("export", src, "--format", "hf", "-o", native, "--no-check") == 2
    assert capsys.readouterr().err == (
        f"smelt-ds export: error: export output {str(native)!r} holds a smelt-ds export (model.pt + config.yaml, "
        "`smelt-ds export` without --format hf): refusing to replace it with a Hugging Face export; pass another -o "
        "DIR, or remove that directory first to replace it\n")
    assert {d: contents(d) for d in (hf, native)} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "native", "run"]   # no staging directory left
    # the same format over itself: replaced (an earlier export)
    (native / "model.pt.sha256").write_text("0" * 64 + "  model.pt\n")
    assert _cli("export", run, "-o", native) == 0
    assert contents(native) == before[native]
    (hf / "README.md").write_text("edited")
    assert _cli("export", src, "--format", "hf", "-o", hf, "--no-check") == 0
    assert contents(hf)["README.md"] == before[hf]["README.md"]


def test_parse_shard_size():
    from smelt_ds.interop.hf_export import parse_shard_size

    assert parse_shard_size("5GB") == 5 * 10**9 and parse_shard_size("500MiB") == 500 * 2**20
    assert parse_shard_size(2_000_000) == 2_000_000 and parse_shard_size("1.5GB") == 1_500_000_000
    for bad in ("abc", "0", "5XB", "100"):
        with pytest.raises(ConfigError, match="max-shard-size"):
            parse_shard_size(bad)
