"""`domino preprocess`: text, folders, JSONL, Parquet or Arrow -> a Megatron .bin/.idx dataset."""

from __future__ import annotations

import argparse
import os
import shlex
import time
from collections.abc import Iterator
from pathlib import Path

from domino.data.preprocess import DEFAULT_PATTERNS, collect_files, preprocess
from domino.data.readers import check_inputs, input_kind, iter_documents
from domino.data.tokenizer import BPETokenizer, Tokenizer, build_tokenizer
from domino.utils import check_output_dir, removed_on_error

EPILOG = """examples:
  domino preprocess --input notes/ --output-prefix data/notes
  domino preprocess --input corpus.jsonl --json-keys text --output-prefix data/corpus \\
      --tokenizer-type bpe --train-bpe-vocab-size 8192
  domino preprocess --input corpus.jsonl --output-prefix data/gpt2 --tokenizer-type bpe \\
      --vocab-file gpt2-vocab.json --merge-file gpt2-merges.txt --workers 4
  domino preprocess --input train-00000-of-00002.parquet train-00001-of-00002.parquet \\
      --json-keys text --output-prefix data/hub
  domino preprocess --input saved_dataset/ --output-prefix data/saved   # datasets' save_to_disk

Inputs: text files (one document each), .jsonl/.json (also .jsonl.gz, .jsonl.zst: one document
per line), .parquet and .arrow (one document per row of the --json-keys column), folders.

With one JSON key the dataset is written to exactly PREFIX.{bin,idx,json}; with several keys,
one dataset per key at PREFIX_<key>_document (Megatron's naming).
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = EPILOG
    parser.add_argument("--input", nargs="+", required=True, metavar="PATH",
                        help="Text files, folders (searched recursively; a datasets "
                        "save_to_disk folder reads its .arrow files), .jsonl/.json (also .gz, "
                        ".zst), .parquet or .arrow files.")
    parser.add_argument("--output-prefix", required=True, metavar="PREFIX",
                        help="Write PREFIX.bin, PREFIX.idx and the PREFIX.json sidecar.")
    parser.add_argument("--tokenizer-type", default="byte", choices=("byte", "bpe", "hf"),
                        help="byte: UTF-8 bytes + EOD (no files); bpe: byte-level BPE; hf: the "
                        "tokenizer.json of an imported model (--tokenizer-dir). [default: byte]")
    parser.add_argument("--vocab-file", metavar="FILE", help="BPE vocab.json (GPT-2 style).")
    parser.add_argument("--merge-file", metavar="FILE", help="BPE merges.txt (GPT-2 style).")
    parser.add_argument("--tokenizer-dir", metavar="DIR",
                        help="Folder with vocab.json + merges.txt (with --train-bpe-vocab-size: "
                        "where the trained tokenizer is saved; default PREFIX_tokenizer).")
    parser.add_argument("--train-bpe-vocab-size", type=int, metavar="N",
                        help="Train a byte-level BPE of N tokens on the inputs first.")
    parser.add_argument("--json-keys", nargs="+", default=["text"], metavar="KEY",
                        help="JSONL field(s) or Parquet/Arrow column(s) holding the text. "
                        "[default: text]")
    parser.add_argument("--append-eod", action=argparse.BooleanOptionalAction, default=True,
                        help="End every document with the EOD token. [default: on]")
    parser.add_argument("--workers", type=int, default=1,
                        help="Tokenizer processes. [default: 1]")
    parser.add_argument("--patterns", default=",".join(DEFAULT_PATTERNS),
                        help="Comma-separated file-name patterns searched in folders. "
                        f"[default: {','.join(DEFAULT_PATTERNS)}]")
    parser.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True,
                        help="Show a progress bar. [default: on]")


def _tokenizer(args: argparse.Namespace, files: list[str]) -> tuple[Tokenizer, list[str]]:
    """The tokenizer, plus the `domino train` flags that select it."""
    if args.tokenizer_type == "byte":
        if args.vocab_file or args.merge_file or args.train_bpe_vocab_size:
            raise ValueError("--vocab-file/--merge-file/--train-bpe-vocab-size need "
                             "--tokenizer-type bpe")
        return build_tokenizer("byte"), ["--tokenizer-type", "byte"]
    if args.tokenizer_type == "hf":
        if args.vocab_file or args.merge_file or args.train_bpe_vocab_size:
            raise ValueError("--tokenizer-type hf takes only --tokenizer-dir")
        tok = build_tokenizer("hf", tokenizer_dir=args.tokenizer_dir)
        return tok, ["--tokenizer-type", "hf", "--tokenizer-dir", args.tokenizer_dir]
    if args.train_bpe_vocab_size is not None:
        if args.vocab_file or args.merge_file:
            raise ValueError("pass either --train-bpe-vocab-size or --vocab-file/--merge-file")
        out = Path(args.tokenizer_dir or f"{args.output_prefix}_tokenizer")
        print(f"training a {args.train_bpe_vocab_size}-token BPE on {len(files)} file(s)...")
        t0 = time.perf_counter()
        tok = BPETokenizer.train(_training_texts(files, args.json_keys),
                                 args.train_bpe_vocab_size, show_progress=args.progress)
        tok.save(out)
        print(f"saved the tokenizer to {out}/ ({time.perf_counter() - t0:.1f} s)")
        return tok, ["--tokenizer-type", "bpe", "--tokenizer-dir", str(out)]
    if bool(args.vocab_file) != bool(args.merge_file) and not args.tokenizer_dir:
        raise ValueError("--tokenizer-type bpe needs both --vocab-file and --merge-file")
    tok = build_tokenizer("bpe", vocab_file=args.vocab_file, merges_file=args.merge_file,
                          tokenizer_dir=args.tokenizer_dir)
    flags = ["--tokenizer-type", "bpe"]
    if args.tokenizer_dir and not args.vocab_file:
        flags += ["--tokenizer-dir", args.tokenizer_dir]
    else:
        flags += ["--vocab-file", args.vocab_file, "--merge-file", args.merge_file]
    return tok, flags


def _training_texts(files: list[str], keys: list[str]) -> list[str] | Iterator[str]:
    """What the BPE trains on: plain text files as they are; JSONL and tables by their text
    fields, never their raw bytes (JSON syntax, compressed or columnar data)."""
    if all(input_kind(f) == "text" for f in files):
        return files
    return (text for key in dict.fromkeys(keys) for text, _ in iter_documents(files, key) if text)


def run(args: argparse.Namespace) -> int:
    if args.workers < 1:
        raise ValueError(f"--workers={args.workers} must be >= 1")
    if args.train_bpe_vocab_size is not None and args.train_bpe_vocab_size < 257:
        raise ValueError(f"--train-bpe-vocab-size={args.train_bpe_vocab_size} must be >= 257 "
                         "(256 bytes + EOD)")
    parent = Path(args.output_prefix).parent
    check_output_dir(parent, "--output-prefix")
    tok_dir = None
    if args.train_bpe_vocab_size is not None:
        tok_dir = args.tokenizer_dir or f"{args.output_prefix}_tokenizer"
        check_output_dir(tok_dir, "--tokenizer-dir" if args.tokenizer_dir else
                         "the tokenizer folder (--tokenizer-dir)")
    patterns = [p.strip() for p in args.patterns.split(",") if p.strip()]
    files = collect_files(args.input, patterns)
    if not files:
        raise ValueError(f"no input files found in {' '.join(args.input)} "
                         f"(folder patterns: {', '.join(patterns)})")
    check_inputs(files, args.json_keys)  # a wrong key or a damaged file fails before any work
    with removed_on_error(parent), removed_on_error(tok_dir):
        _write(args, files, patterns, parent)
    return 0


def _write(args: argparse.Namespace, files: list[str], patterns: list[str], parent: Path) -> None:
    """Tokenize ``files`` into the dataset(s) ``--output-prefix`` names."""
    tokenizer, train_flags = _tokenizer(args, files)
    keys = list(dict.fromkeys(args.json_keys))
    parent.mkdir(parents=True, exist_ok=True)
    for key in keys:
        prefix = args.output_prefix if len(keys) == 1 else f"{args.output_prefix}_{key}_document"
        t0 = time.perf_counter()
        stats = preprocess(files, prefix, tokenizer, json_key=key, append_eod=args.append_eod,
                           workers=args.workers, progress=args.progress, patterns=patterns,
                           checked=True)  # run() checked every input for every key
        dt = time.perf_counter() - t0
        print(f"wrote {prefix}.bin/.idx: {stats.documents:,} documents, {stats.tokens:,} tokens "
              f"from {stats.files} file(s), {stats.bytes / 1e6:.1f} MB in {dt:.1f} s "
              f"({stats.empty_skipped} empty skipped)")
        cmd = ["domino", "train", "--data-path", os.fspath(prefix), *train_flags]
        print(f"train on it with: {shlex.join(cmd)}")
