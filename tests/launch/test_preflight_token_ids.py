"""Token ids of Megatron and numpy token files are checked before the queue: ``smelt-ds preflight``
and ``render-job`` (Slurm, Kubernetes when the files are visible here) refuse a file whose largest
id the tokenizer or ``model.vocab_size`` does not have, as ``smelt-ds data inspect`` does; and a
``data.tokenizer.vocab_size`` that a loaded tokenizer ignores is named.

Files are fabricated small with the formats' own writers (tests/data/token_test_utils.py); the
expected largest id is computed from the fabricated ids with numpy."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from smelt_ds.cli import main as cli_main
from smelt_ds.config.loading import load_config
from smelt_ds.errors import ConfigError
from tests.data.token_test_utils import EOT, random_documents, word_tokenizer, write_flat, write_megatron
from tests.launch.test_preflight import _rows

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "recipes" / "tiny" / "smelt.yaml")  # model.vocab_size 4096
ONE = ["--nodes", "1", "--gpus-per-node", "1"]


def _docs(high: int, seed: int) -> list[np.ndarray]:
    """Documents of ids in [2, high), the id high - 1 among them (the largest)."""
    docs = random_documents(20, high, seed)
    docs[4][0] = high - 1
    return docs


def _sets(source: str, tokenizer: Path | str, *more: str) -> list[str]:
    sets = [f"data.sources=[{{{source}}}]", f"data.tokenizer.path={tokenizer}", *more]
    return [x for s in sets for x in ("--set", s)]


@pytest.fixture
def wrong_npy(tmp_path) -> tuple[Path, Path, int]:
    """A .npy of ids up to 59,971 (a 60k-token tokenizer's) and a 322-token tokenizer: the pairing
    that reached the queue."""
    path = write_flat(tmp_path / "web.npy", _docs(59_972, seed=1), np.uint16, header=True)
    return path, word_tokenizer(tmp_path / "tok322.json", 322), int(np.load(path).max())


def test_preflight_refuses_a_file_with_ids_the_tokenizer_does_not_have(wrong_npy, tmp_path, capsys):
    path, tok, largest = wrong_npy
    assert largest == 59_971
    rc = cli_main(["preflight", TINY, *ONE, *_sets(f"tokens: {path}, eot_id: {EOT}", tok),
                   "--set", f"data.cache_dir={tmp_path / 'cache'}"])
    out = capsys.readouterr().out
    rows = _rows(out)
    assert rc == 2 and rows["token ids"][0] == "FAIL", out
    assert (f"{str(path)!r} (data.sources[0]): holds token id {largest}, but the tokenizer (data.tokenizer.path "
            f"{str(tok)!r}) has ids 0..321: the file was made with another tokenizer: use the tokenizer the file was "
            "made with (data.tokenizer.path)") in rows["token ids"][1], out
    assert [n for n, (status, _) in rows.items() if status == "FAIL"] == ["token ids"], out  # the rest passes
    assert "every check passed" not in out
    # `data inspect` refuses the same file with the same words
    assert cli_main(["data", "inspect", str(path), "--tokenizer", str(tok)]) == 2
    assert f"holds token id {largest}, but the tokenizer" in capsys.readouterr().err


def test_render_job_slurm_refuses_a_megatron_file_beyond_the_tokenizer(tmp_path, capsys):
    docs = _docs(5_000, seed=2)
    prefix = write_megatron(tmp_path / "code_text_document", docs, np.uint16)
    largest = int(np.concatenate(docs).max())
    tok = word_tokenizer(tmp_path / "tok322.json", 322)
    job = tmp_path / "jobs" / "x.sbatch"
    rc = cli_main(["render-job", TINY, "--scheduler", "slurm", *ONE, *_sets(f"megatron: {prefix}", tok),
                   "--log-dir", str(tmp_path / "logs"), "-o", str(job)])
    err = capsys.readouterr().err
    assert rc == 2 and not job.exists(), err
    assert f"token ids: {str(prefix)!r} (data.sources[0]): holds token id {largest}, but the tokenizer" in err, err
    assert "has ids 0..321" in err and "nothing written" in err


def _pod_files(workdir: Path, high: int) -> tuple[int, list[str]]:
    """A consistent .npy and its tokenizer on the pod's corpora volume, as the recipe names them."""
    (workdir / "corpora").mkdir(parents=True)
    path = write_flat(workdir / "corpora" / "web.npy", _docs(high, seed=3), np.uint16, header=True)
    word_tokenizer(workdir / "corpora" / "tok.json", high)
    return int(np.load(path).max()), _sets(f"tokens: corpora/web.npy, eot_id: {EOT}", "corpora/tok.json")


def test_render_job_kubernetes_refuses_ids_beyond_model_vocab_size_when_the_files_are_visible(tmp_path, capsys):
    largest, sets = _pod_files(tmp_path, 322)
    assert largest == 321
    job = tmp_path / "job.yaml"
    k8s = ["render-job", TINY, "--scheduler", "k8s", "--workdir", str(tmp_path), *ONE, *sets]
    rc = cli_main([*k8s, "--set", "model.vocab_size=300", "-o", str(job)])
    err = capsys.readouterr().err
    assert rc == 2 and not job.exists(), err
    assert (f"token ids: 'corpora/web.npy' (data.sources[0]) holds token id {largest}, not below `model.vocab_size` "
            f"(300): the model has no row for it; set model.vocab_size to at least {largest + 1}") in err, err
    assert cli_main([*k8s, "-o", str(job)]) == 0 and job.is_file()  # the recipe's 4096 fits
    capsys.readouterr()


def test_consistent_files_pass_and_a_pods_files_not_here_are_skipped_saying_why(tmp_path, capsys):
    largest, sets = _pod_files(tmp_path, 322)
    rc = cli_main(["preflight", TINY, *ONE, "--workdir", str(tmp_path), *sets])
    rows = _rows(capsys.readouterr().out)
    assert rc == 0 and rows["token ids"] == (
        "OK", f"1 token file(s): largest id {largest} (corpora/web.npy) fits the tokenizer's ids 0..321 and "
              "model.vocab_size 4096; every token read"), rows
    elsewhere = tmp_path / "elsewhere"  # a pod working directory with nothing of the recipe's here
    elsewhere.mkdir()
    rc = cli_main(["preflight", TINY, *ONE, "--scheduler", "k8s", "--workdir", str(elsewhere), *sets])
    rows = _rows(capsys.readouterr().out)
    assert rc == 0 and rows["token ids"][0] == "SKIP", rows
    assert f"`data.sources[0]` has no files on this machine (relative paths read in the job's working directory " \
        f"{elsewhere}, not in this directory {Path.cwd()}" in rows["token ids"][1] and "smelt-ds data inspect" in \
        rows["token ids"][1]
    rc = cli_main(["preflight", TINY, *ONE, "--workdir", str(tmp_path), *sets, "--no-data-check"])
    assert _rows(capsys.readouterr().out)["token ids"] == ("SKIP", "--no-data-check (data files are not read here)")


def test_skipped_checks_are_named_in_the_verdict_with_where_relative_paths_were_read(tmp_path, capsys, monkeypatch):
    """A Kubernetes job whose token file and tokenizer are relative paths of this directory: the
    tokenizer (read in the pod) and token ids (not found where relative paths are read) are SKIP.
    The verdict said "every check passed"; it names both skips. The SKIP line says where relative
    paths were read when that is not this directory, naming --workdir."""
    here = tmp_path / "checkout"
    sets = _pod_files(here, 322)[1]  # here/corpora/web.npy and tok.json, named relative
    pod_wd = tmp_path / "pod-wd"  # the job's working directory exists here, without the recipe's files
    pod_wd.mkdir()
    monkeypatch.chdir(here)
    k8s = [TINY, *ONE, "--scheduler", "k8s", *sets]
    verdict_end = "2 skipped: tokenizer, token ids (see above)"
    for command in (["preflight"], ["render-job", "--dry-run"]):
        assert cli_main([*command[:1], *k8s, "--workdir", str(pod_wd), *command[1:]]) == 0, command
        out = capsys.readouterr().out
        rows = _rows(out)
        assert [n for n, (status, _) in rows.items() if status == "SKIP"] == ["tokenizer", "token ids"], out
        last = out.rstrip().splitlines()[-1]
        assert last.startswith("no check failed; ") and last.endswith(verdict_end), last
        assert "every check passed" not in out
        assert (f"(relative paths read in the job's working directory {pod_wd}, not in this directory {here}: pass "
                "--workdir DIR when the job runs elsewhere)") in rows["token ids"][1], rows["token ids"]
    # a pod working directory that is not on this machine: relative paths are read here, and it says so
    empty = tmp_path / "empty"
    empty.mkdir()
    monkeypatch.chdir(empty)
    assert cli_main(["preflight", *k8s, "--workdir", "/nonexistent-smelt-pod"]) == 0
    rows = _rows(capsys.readouterr().out)
    assert (f"(relative paths read in this directory, {empty}: the job's working directory /nonexistent-smelt-pod "
            "is not on this machine (--workdir DIR names it))") in rows["token ids"][1], rows["token ids"]
    # every check OK, and only then: "every check passed" (the verdict line itself, from the results)
    from smelt_ds.launch.preflight import CheckResult, verdict

    assert verdict([CheckResult("config", "ok", ""), CheckResult("data", "ok", "")]) == "every check passed"
    assert verdict([CheckResult("config", "ok", ""), CheckResult("data", "skip", "")]) == \
        "no check failed; 1 skipped: data (see above)"


def test_beyond_the_budget_each_file_is_sampled_in_windows(tmp_path):
    """10,000 uint32 ids of 2..99; id 60,000 at position 500 (between windows), id 777 at 9,950
    (in the last window). With room for 800 tokens: 8 windows of 100 tokens at 0, 1414, 2828,
    4242, 5657, 7071, 8485, 9900 ((10,000 - 100) * k // 7), so 777 is the largest id seen; the
    whole file gives 60,000."""
    from smelt_ds.config.data import DataConfig
    from smelt_ds.data.token_files import ScanStats, open_flat, scan_ids
    from smelt_ds.data.token_sources import check_source_ids

    ids = np.random.default_rng(4).integers(2, 100, 10_000).astype(np.uint32)
    ids[500], ids[9_950], ids[9_999] = 60_000, 777, EOT
    path = tmp_path / "ids.bin"
    ids.tofile(path)
    tf = open_flat(path, "uint32")
    st = ScanStats()
    assert scan_ids(tf, st, 800) == 800 and st.max_id == 777
    st = ScanStats()
    assert scan_ids(tf, st) == 10_000 and st.max_id == 60_000
    tok = word_tokenizer(tmp_path / "tok.json", 1000)
    data = DataConfig(sources=[{"tokens": str(path), "token_dtype": "uint32", "eot_id": EOT}],
                      tokenizer={"path": str(tok)})
    assert check_source_ids(data, 1024, max_tokens=800).endswith(
        "largest id 777 (" + str(path) + ") fits the tokenizer's ids 0..999 and model.vocab_size 1024; 800 of "
        "10,000 tokens read: 1 file(s) in 8 windows each (preparing reads every id)")
    with pytest.raises(ConfigError, match="holds token id 60000, but the tokenizer"):
        check_source_ids(data, 1024)  # within the budget: every token


def test_a_tokenizer_vocab_size_the_loaded_tokenizer_ignores_is_named(tmp_path, capsys):
    """With data.tokenizer.path, data.tokenizer.vocab_size sizes nothing: a value other than the
    tokenizer's size (322) and model.vocab_size (4096) is a warning naming both fields and the fix."""
    tok = word_tokenizer(tmp_path / "tok322.json", 322)
    base = ["preflight", TINY, *ONE, "--set", f"data.tokenizer.path={tok}"]
    assert cli_main([*base, "--set", "data.tokenizer.vocab_size=1000"]) == 0
    status, detail = _rows(capsys.readouterr().out)["tokenizer"]
    assert status == "WARN" and (
        f"`data.tokenizer.vocab_size` (1000) is not used: `data.tokenizer.path` ({str(tok)!r}) gives the tokenizer, "
        "of 322 tokens") in detail and "remove data.tokenizer.vocab_size from the recipe or set it to 322" in detail \
        and "unset data.tokenizer.path (--set data.tokenizer.path=null)" in detail, detail
    for same in ([], ["--set", "data.tokenizer.vocab_size=322"], ["--set", "data.tokenizer.vocab_size=4096"]):
        assert cli_main([*base, *same]) == 0
        assert _rows(capsys.readouterr().out)["tokenizer"][0] == "OK", same


def test_the_shipped_recipes_vocab_size_beside_a_tokenizer_path_is_not_named():
    """recipes/m repeats model.vocab_size (50304) in data.tokenizer.vocab_size; docs/cluster.md
    extends it with GPT-NeoX's tokenizer (50277 tokens): nothing wrong, nothing said."""
    from smelt_ds.data.tokenizer import unused_vocab_size

    cfg = load_config(ROOT / "recipes" / "m" / "smelt.yaml", ["data.tokenizer.path=/shared/gpt-neox-20b"])
    assert "vocab_size" in cfg.data.tokenizer.model_fields_set
    assert unused_vocab_size(cfg.data.tokenizer, 50277, cfg.model.vocab_size) is None
    cfg = load_config(ROOT / "recipes" / "m" / "smelt.yaml", ["data.tokenizer.path=/shared/gpt-neox-20b",
                                                              "data.tokenizer.vocab_size=32000"])
    assert "(32000) is not used" in unused_vocab_size(cfg.data.tokenizer, 50277, cfg.model.vocab_size)


def test_training_names_the_unused_vocab_size_at_start(tmp_path, capsys):
    """Training's data start (token source: prepared by a scan, nothing tokenised) prints the same
    warning on rank 0, and nothing for a vocab_size equal to the tokenizer's."""
    from smelt_ds.train.data import build_data

    path = write_flat(tmp_path / "web.npy", random_documents(60, 322, seed=5), np.uint16, header=True)
    tok = word_tokenizer(tmp_path / "tok322.json", 322)
    sets = [f"data.sources=[{{tokens: {path}, eot_id: {EOT}}}]", f"data.tokenizer.path={tok}",
            f"data.cache_dir={tmp_path / 'cache'}", "train.seq_len=16", "train.micro_batch_size=2"]
    build_data(load_config(TINY, [*sets, "data.tokenizer.vocab_size=1000"]), 0, 1)
    assert "smelt-ds data: warning: `data.tokenizer.vocab_size` (1000) is not used: `data.tokenizer.path` " \
           f"({str(tok)!r}) gives the tokenizer, of 322 tokens" in capsys.readouterr().err
    build_data(load_config(TINY, [*sets, "data.tokenizer.vocab_size=322"]), 0, 1)
    assert "warning" not in capsys.readouterr().err
