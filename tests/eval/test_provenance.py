"""Tokenizer provenance end to end: a run records its tokenizer, exports carry it, and eval,
`eval --corpus`, generate and train.init_from use it on other text; another tokenizer is refused."""

from __future__ import annotations

import json
import random
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from tests.numerics import model_chain_length, prob_tol


def _cli(*argv) -> int:
    from smelt_ds.cli import main

    return main([str(a) for a in argv])


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """A prose document the project has never seen (generated words, fixed seed)."""
    rng = random.Random(5)
    words = ["river", "stone", "quietly", "the", "of", "lantern", "mountain", "and", "whisper", "copper", "field"]
    text = "\n".join(" ".join(rng.choice(words) for _ in range(12)) + "." for _ in range(300))
    path = tmp_path_factory.mktemp("corpus") / "prose.txt"
    path.write_text(text)
    return path


def _hash(path) -> str:
    from smelt_ds.runs.provenance import tokenizer_file_hash

    return tokenizer_file_hash(path)


def test_run_and_export_record_the_training_tokenizer(trained_run, eval_data):
    from smelt_ds.runs.load import resolve_export

    assert _hash(trained_run / "tokenizer.json") == eval_data.prepared.tokenizer_hash
    export = resolve_export(trained_run)
    assert _hash(export / "tokenizer.json") == eval_data.prepared.tokenizer_hash


def test_eval_corpus_scores_every_window_with_the_runs_tokenizer(trained_run, corpus, tmp_path):
    """Reference: tokenise the document with the run's tokenizer.json directly, cut the windows
    of seq_len + 1 tokens (stride seq_len) and average the model's cross-entropy."""
    from tokenizers import Tokenizer

    from smelt_ds.runs.load import load_run

    assert _cli("eval", trained_run, "--corpus", corpus, "-o", tmp_path / "out", "--seq-len", "32",
                "--micro-batch", "4", "--episodes", "1", "--shots", "0", "--tasks", "kv_recall", "--no-plots") == 0
    got = json.loads((tmp_path / "out" / "eval.json").read_text())
    name = next(iter(got["domains"]))
    res = got["domains"][name]["prose"]
    tok = Tokenizer.from_file(str(trained_run / "tokenizer.json"))
    ids = tok.encode(corpus.read_text()).ids + [tok.token_to_id("<|endoftext|>")]
    S = 32
    windows = torch.tensor([ids[i * S: i * S + S + 1] for i in range((len(ids) - 1) // S)])
    model = load_run(trained_run).model
    with torch.no_grad():
        logits = model(windows[:, :-1]).logits
    nll = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), windows[:, 1:].reshape(-1))
    assert res["tokens"] == windows.shape[0] * S            # every window of the corpus, none held out
    # every window in one batch here, micro-batches of 4 there (other kernels): tests/numerics.py
    assert res["loss"] == pytest.approx(float(nll), rel=prob_tol(model_chain_length(model, S) + windows.numel()))


def test_another_tokenizer_is_refused_naming_both_digests(trained_run, corpus, tmp_path, capsys):
    import shutil

    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    other = Tokenizer(models.BPE())
    other.pre_tokenizer = pre_tokenizers.ByteLevel()
    other.train([str(corpus)], trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>", "<|pad|>"]))
    other_path = tmp_path / "other.json"
    other.save(str(other_path))
    run_hash, other_hash = _hash(trained_run / "tokenizer.json"), _hash(other_path)
    assert run_hash != other_hash
    for command in (["eval", trained_run, "--no-plots", "-o", tmp_path / "e", "--batches", "1"],
                    ["generate", trained_run, "--prompt", "x", "--max-new-tokens", "2"]):
        assert _cli(*command, "--set", f"data.tokenizer.path={other_path}") == 2
        err = capsys.readouterr().err
        assert f"is tokenizer {other_hash[:16]}, but the model was trained with tokenizer {run_hash[:16]}" in err
        assert "--allow-other-tokenizer" in err
    # the same tokenizer under another path is the same tokenizer
    same = tmp_path / "same.json"
    shutil.copyfile(trained_run / "tokenizer.json", same)
    assert _cli("generate", trained_run, "--prompt", "def f(", "--max-new-tokens", "2", "--mode", "greedy",
                "--set", f"data.tokenizer.path={same}") == 0


def test_resume_with_data_of_another_tokenizer_is_refused(tmp_path, trained_run):
    from smelt_ds.errors import ConfigError
    from smelt_ds.runs.provenance import record_run_tokenizer

    run = tmp_path / "run"
    run.mkdir()
    prepared_dir = tmp_path / "prep"
    prepared_dir.mkdir()
    (prepared_dir / "tokenizer.json").write_bytes((trained_run / "tokenizer.json").read_bytes())
    good = SimpleNamespace(root=prepared_dir, tokenizer_hash=_hash(trained_run / "tokenizer.json"))
    record_run_tokenizer(run, good, resuming=False)
    assert _hash(run / "tokenizer.json") == good.tokenizer_hash
    record_run_tokenizer(run, good, resuming=True)              # same tokenizer: fine
    bad = SimpleNamespace(root=prepared_dir, tokenizer_hash="f" * 64)
    with pytest.raises(ConfigError, match=rf"trained with tokenizer {good.tokenizer_hash[:16]} .* come with "
                                          rf"tokenizer ffffffffffffffff"):
        record_run_tokenizer(run, bad, resuming=True)


def test_init_from_trains_on_with_the_exports_tokenizer(trained_run, corpus, tmp_path, eval_cache):
    """A new run from an export on other data keeps the export's tokenizer (config.yaml says so);
    another tokenizer needs train.init_from_any_tokenizer."""
    from smelt_ds.config.loading import config_from_dict
    from smelt_ds.errors import ConfigError
    from smelt_ds.runs.load import resolve_export
    from smelt_ds.runs.provenance import init_from_tokenizer
    from tests.eval.eval_test_utils import tiny_raw

    export = resolve_export(trained_run)
    raw = tiny_raw(eval_cache, tmp_path / "run")
    raw["data"]["sources"] = [{"path": str(corpus), "sample_by": "line"}]
    raw["train"]["init_from"] = str(export)
    cfg = init_from_tokenizer(config_from_dict(raw))
    assert cfg.data.tokenizer.path == str(export / "tokenizer.json")
    raw["data"]["tokenizer"]["path"] = str(tmp_path / "elsewhere.json")
    (tmp_path / "elsewhere.json").write_text(json.dumps({**json.loads((export / "tokenizer.json").read_text()),
                                                          "added_tokens": []}))
    with pytest.raises(ConfigError, match=r"set train.init_from_any_tokenizer: true"):
        init_from_tokenizer(config_from_dict(raw))
    raw["train"]["init_from_any_tokenizer"] = True
    assert init_from_tokenizer(config_from_dict(raw)).data.tokenizer.path == str(tmp_path / "elsewhere.json")
