"""`domino preprocess`: text, folders, JSONL, Parquet or Arrow -> a Megatron .bin/.idx dataset."""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shlex
import time
from collections.abc import Iterator
from pathlib import Path

from domino.checkpoint.tokenizer_dir import find_tokenizer
from domino.data.chat import ChatOptions, tokenizer_template, write_chat_dataset
from domino.data.loss_mask import loss_mask_prefix
from domino.data.preprocess import (
    DEFAULT_PATTERNS,
    PreprocessStats,
    check_not_inputs,
    collect_files,
    commit,
    dataset_files,
    staging,
    write_dataset,
)
from domino.data.readers import MAX_RECORD_BYTES, check_inputs, input_kind, iter_documents
from domino.data.tokenizer import (
    MERGES_FILE,
    VOCAB_FILE,
    BPETokenizer,
    Tokenizer,
    build_tokenizer,
)
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
  domino preprocess --format chat --input chats.jsonl --output-prefix data/chats \
      --tokenizer-type hf --tokenizer-dir runs/llama --max-tokens 2049 --truncate

Inputs: text files (one document each), .jsonl/.json (also .jsonl.gz, .jsonl.zst: one document
per line), .parquet and .arrow (one document per row of the --json-keys column), folders.

With one JSON key the dataset is written to exactly PREFIX.{bin,idx,json}; with several keys,
one dataset per key at PREFIX_<key>_document (Megatron's naming). Existing outputs are replaced
only with --overwrite, and never when they are inputs. A JSON line or text file over
--max-record-bytes (default 256M) is refused. A refused or failed run writes nothing.

--format chat: rows holding `messages` (a list of {role, content}) or `prompt`/`completion`,
rendered with the tokenizer's chat template (or --chat-template FILE); writes PREFIX.{bin,idx,
json} and the loss mask PREFIX_loss_mask.{bin,idx,json} (1 = the token counts: the template's
{% generation %} spans, else each assistant content and its closing special token; every token
with --train-on-prompt). `domino train` and `domino eval` use the mask beside the tokens.
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
    parser.add_argument("--overwrite", action="store_true",
                        help="Replace the files of an existing dataset at PREFIX (and a trained "
                        "tokenizer's files); never an input.")
    parser.add_argument("--max-record-bytes", default=f"{MAX_RECORD_BYTES >> 20}M",
                        metavar="BYTES",
                        help="The most one JSON line or text file may hold (K, M, G: KiB, MiB, "
                        f"GiB); longer ones are refused. [default: {MAX_RECORD_BYTES >> 20}M]")
    parser.add_argument("--tokenizer-type", default="byte", choices=("byte", "bpe", "hf"),
                        help="byte: UTF-8 bytes + EOD (no files); bpe: byte-level BPE; hf: an "
                        "imported model's tokenizer (--tokenizer-dir). [default: byte]")
    parser.add_argument("--vocab-file", metavar="FILE", help="BPE vocab.json (GPT-2 style).")
    parser.add_argument("--merge-file", metavar="FILE", help="BPE merges.txt (GPT-2 style).")
    parser.add_argument("--tokenizer-dir", metavar="DIR",
                        help="Where the tokenizer is: bpe: a folder with vocab.json + "
                        "merges.txt; hf: one with tokenizer.json + domino.json (a checkpoint's "
                        "tokenizer/), or the transformers model folder itself; either: a run or "
                        "checkpoint folder (its latest checkpoint's tokenizer/, e.g. `domino "
                        "import`'s OUT). With --train-bpe-vocab-size: where the trained "
                        "tokenizer is saved; default PREFIX_tokenizer.")
    parser.add_argument("--train-bpe-vocab-size", type=int, metavar="N",
                        help="Train a byte-level BPE of N tokens on the inputs first.")
    parser.add_argument("--json-keys", nargs="+", default=["text"], metavar="KEY",
                        help="JSONL field(s) or Parquet/Arrow column(s) holding the text. "
                        "[default: text]")
    parser.add_argument("--append-eod", action=argparse.BooleanOptionalAction, default=None,
                        help="End every document with the EOD token. [default: on; off for "
                        "--format chat, whose template ends each turn itself]")
    parser.add_argument("--workers", type=int, default=1,
                        help="Tokenizer processes. [default: 1]")
    parser.add_argument("--patterns", default=",".join(DEFAULT_PATTERNS),
                        help="Comma-separated file-name patterns searched in folders. "
                        f"[default: {','.join(DEFAULT_PATTERNS)}]")
    parser.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True,
                        help="Show a progress bar. [default: on]")
    chat = parser.add_argument_group("chat data (--format chat)")
    chat.add_argument("--format", default="text", choices=("text", "chat"),
                      help="text: one document per text/field; chat: conversations rendered "
                      "with a chat template, plus a per-token loss mask. [default: text]")
    chat.add_argument("--chat-template", metavar="FILE",
                      help="A jinja chat template file, instead of the tokenizer folder's "
                      "own (chat_template.jinja or tokenizer_config.json's chat_template).")
    chat.add_argument("--train-on-prompt", action="store_true",
                      help="Count every token for the loss, not only the assistant's.")
    chat.add_argument("--max-tokens", type=int, metavar="N",
                      help="Drop conversations longer than N tokens (e.g. --seq-length + 1), "
                      "or cut them with --truncate; counted in the summary.")
    chat.add_argument("--truncate", action="store_true",
                      help="With --max-tokens: keep a long conversation's first N tokens "
                      "instead of dropping it.")


def _check_flags(args: argparse.Namespace) -> int:
    """Refuse flag values and combinations before any work; the record limit in bytes."""
    _check_chat_flags(args)
    if args.workers < 1:
        raise ValueError(f"--workers={args.workers} must be >= 1")
    if args.train_bpe_vocab_size is not None and args.train_bpe_vocab_size < 257:
        raise ValueError(f"--train-bpe-vocab-size={args.train_bpe_vocab_size} must be >= 257 "
                         "(256 bytes + EOD)")
    bpe_files = args.vocab_file or args.merge_file
    if args.tokenizer_type == "byte" and (bpe_files or args.train_bpe_vocab_size):
        raise ValueError("--vocab-file/--merge-file/--train-bpe-vocab-size need "
                         "--tokenizer-type bpe")
    if args.tokenizer_type == "hf" and (bpe_files or args.train_bpe_vocab_size):
        raise ValueError("--tokenizer-type hf takes only --tokenizer-dir")
    if args.tokenizer_type == "bpe" and args.train_bpe_vocab_size is not None and bpe_files:
        raise ValueError("pass either --train-bpe-vocab-size or --vocab-file/--merge-file")
    if (args.tokenizer_type == "bpe" and bool(args.vocab_file) != bool(args.merge_file)
            and not args.tokenizer_dir):
        raise ValueError("--tokenizer-type bpe needs both --vocab-file and --merge-file")
    return _byte_count(args.max_record_bytes)


def _check_chat_flags(args: argparse.Namespace) -> None:
    chat_only = [f for f, on in (("--chat-template", args.chat_template is not None),
                                 ("--train-on-prompt", args.train_on_prompt),
                                 ("--max-tokens", args.max_tokens is not None),
                                 ("--truncate", args.truncate)) if on]
    if args.format == "text" and chat_only:
        raise ValueError(f"{', '.join(chat_only)} apply to --format chat only; add --format chat")
    if args.format == "text":
        return
    if args.train_bpe_vocab_size is not None:
        raise ValueError("--format chat does not train a BPE: give the model's tokenizer "
                         "(--tokenizer-type hf --tokenizer-dir DIR)")
    if args.workers != 1:
        raise ValueError(f"--workers={args.workers}: --format chat renders in one process; "
                         "drop --workers")
    if args.json_keys != ["text"]:
        raise ValueError("--json-keys: --format chat reads the 'messages' field (or 'prompt' "
                         "and 'completion'); drop --json-keys")
    if args.max_tokens is not None and args.max_tokens < 1:
        raise ValueError(f"--max-tokens={args.max_tokens} must be >= 1")
    if args.truncate and args.max_tokens is None:
        raise ValueError("--truncate cuts conversations to --max-tokens N; pass --max-tokens "
                         "(e.g. --seq-length + 1)")
    if args.chat_template is not None and not os.path.isfile(args.chat_template):
        raise ValueError(f"--chat-template {args.chat_template} is not a file; pass a jinja "
                         "chat template file")


def _byte_count(text: str) -> int:
    """``--max-record-bytes``: a whole number of bytes, or of KiB / MiB / GiB with K, M, G."""
    m = re.fullmatch(r"\s*(\d+)\s*(?:([KMG])(?:i?B)?)?\s*", text, re.IGNORECASE)
    shift = {"K": 10, "M": 20, "G": 30}.get(((m and m.group(2)) or "").upper(), 0)
    value = int(m.group(1)) << shift if m else 0
    if value < 1:
        raise ValueError(f"--max-record-bytes={text!r} is not a size of at least 1 byte; give "
                         "bytes as a whole number, optionally with K, M or G (e.g. 512M)")
    return value


def _check_prefix(prefix: str) -> None:
    """``--output-prefix`` must end in a file-name prefix: ``dir/`` would write ``dir/.bin``."""
    if os.path.basename(prefix) in ("", ".", "..") or os.path.isdir(prefix):
        raise ValueError(f"--output-prefix {prefix!r} names a folder, not a file-name prefix (it "
                         f"would write hidden files like {os.path.join(prefix, '')}.bin); "
                         f"give a file-name prefix like {os.path.join(prefix, 'corpus')}")


def _tokenizer(args: argparse.Namespace, files: list[str], limit: int,
               tok_stage: str | None) -> tuple[Tokenizer, list[str]]:
    """The tokenizer, plus the `domino train` flags that select it (a trained BPE is saved in
    ``tok_stage``, moved into its folder with the dataset)."""
    if args.tokenizer_type == "byte":
        return build_tokenizer("byte"), ["--tokenizer-type", "byte"]
    if args.tokenizer_type == "hf":
        tok = find_tokenizer("hf", args.tokenizer_dir)
        return tok, ["--tokenizer-type", "hf", "--tokenizer-dir", args.tokenizer_dir]
    if args.train_bpe_vocab_size is not None:
        assert tok_stage is not None
        out = Path(args.tokenizer_dir or f"{args.output_prefix}_tokenizer")
        print(f"training a {args.train_bpe_vocab_size}-token BPE on {len(files)} file(s)...")
        t0 = time.perf_counter()
        tok = BPETokenizer.train(_training_texts(files, args.json_keys, limit),
                                 args.train_bpe_vocab_size, show_progress=args.progress)
        tok.save(tok_stage)
        print(f"trained the tokenizer in {time.perf_counter() - t0:.1f} s")
        return tok, ["--tokenizer-type", "bpe", "--tokenizer-dir", str(out)]
    tok = (find_tokenizer("bpe", args.tokenizer_dir) if args.tokenizer_dir and not args.vocab_file
           else build_tokenizer("bpe", vocab_file=args.vocab_file,
                                merges_file=args.merge_file))
    flags = ["--tokenizer-type", "bpe"]
    if args.tokenizer_dir and not args.vocab_file:
        flags += ["--tokenizer-dir", args.tokenizer_dir]
    else:
        flags += ["--vocab-file", args.vocab_file, "--merge-file", args.merge_file]
    return tok, flags


def _training_texts(files: list[str], keys: list[str], limit: int) -> list[str] | Iterator[str]:
    """What the BPE trains on: plain text files as they are; JSONL and tables by their text
    fields, never their raw bytes (JSON syntax, compressed or columnar data)."""
    if all(input_kind(f) == "text" for f in files):
        return files
    return (text for key in dict.fromkeys(keys)
            for text, _ in iter_documents(files, key, limit) if text)


def run(args: argparse.Namespace) -> int:
    limit = _check_flags(args)
    _check_prefix(args.output_prefix)
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
    keys = list(dict.fromkeys(args.json_keys))
    if args.format == "chat":
        outputs = [("--output-prefix", p) for prefix in
                   (args.output_prefix, loss_mask_prefix(args.output_prefix))
                   for p in dataset_files(prefix)]
        _check_outputs(files, outputs, args.overwrite)
        with removed_on_error(parent):
            _write_chat(args, files, limit)
        return 0
    _check_outputs(files, _outputs(args.output_prefix, keys, tok_dir), args.overwrite)
    check_inputs(files, keys, limit)  # a wrong key or a damaged file fails before any work
    with removed_on_error(parent), removed_on_error(tok_dir):
        _write(args, files, keys, limit, tok_dir)
    return 0


def _datasets(prefix: str, keys: list[str]) -> list[tuple[str, str]]:
    """(JSON key, dataset prefix) per key: PREFIX itself for one key, else Megatron's names."""
    if len(keys) == 1:
        return [(keys[0], prefix)]
    for key in keys:
        if not key or any(c in key for c in ("/", "\\", "\0", os.sep)):
            raise ValueError(f"--json-keys {key!r}: with several keys each one names an output "
                             "(PREFIX_<key>_document), so it cannot be empty or hold '/', '\\' "
                             "or NUL; preprocess that field on its own")
    return [(key, f"{prefix}_{key}_document") for key in keys]


def _outputs(prefix: str, keys: list[str], tok_dir: str | None) -> list[tuple[str, str]]:
    """(flag, path) of every file the command writes."""
    # A loss mask left beside a prefix by a chat run would apply to the new tokens: replaced
    # (removed) only with --overwrite, like the dataset's own files.
    out = [("--output-prefix", path) for _, ds in _datasets(prefix, keys)
           for path in (*dataset_files(ds), *dataset_files(loss_mask_prefix(ds)))]
    if tok_dir is not None:
        out += [("--tokenizer-dir", os.path.join(tok_dir, name))
                for name in (VOCAB_FILE, MERGES_FILE)]
    return out


def _check_outputs(files: list[str], outputs: list[tuple[str, str]], overwrite: bool) -> None:
    """Never an input; an existing file (or link) only with --overwrite; never a folder."""
    check_not_inputs(files, [path for _, path in outputs])
    for flag, path in outputs:
        if os.path.isdir(path) and not os.path.islink(path):
            raise ValueError(f"{flag}: {path} is a folder, where a file of the output goes; "
                             f"move it away or pass another {flag}")
        if os.path.lexists(path) and not overwrite:
            raise ValueError(f"{flag}: {path} exists already (an earlier run's output?); pass "
                             f"--overwrite to replace it, or another {flag}")


def _write(args: argparse.Namespace, files: list[str], keys: list[str], limit: int,
           tok_dir: str | None) -> None:
    """Tokenize ``files`` into the dataset(s) ``--output-prefix`` names: all of them (and a
    trained tokenizer) are staged, then renamed into place together once every one is done."""
    parent = Path(args.output_prefix).parent
    parent.mkdir(parents=True, exist_ok=True)
    done: list[tuple[str, PreprocessStats, float]] = []
    with contextlib.ExitStack() as stack:
        stage = stack.enter_context(staging(parent))
        tok_stage = None
        if tok_dir is not None:
            Path(tok_dir).parent.mkdir(parents=True, exist_ok=True)
            tok_stage = stack.enter_context(staging(Path(tok_dir).parent))
        tokenizer, train_flags = _tokenizer(args, files, limit, tok_stage)
        moves: list[tuple[str, str]] = []
        for i, (key, prefix) in enumerate(_datasets(args.output_prefix, keys)):
            staged, t0 = os.path.join(stage, f"dataset{i}"), time.perf_counter()
            stats = write_dataset(files, staged, tokenizer, key,
                                  append_eod=args.append_eod is not False, workers=args.workers,
                                  progress=args.progress, max_record_bytes=limit)
            done.append((prefix, stats, time.perf_counter() - t0))
            moves += zip(dataset_files(staged), dataset_files(prefix))
        if tok_dir is not None and tok_stage is not None:
            os.makedirs(tok_dir, exist_ok=True)
            moves += [(os.path.join(tok_stage, n), os.path.join(tok_dir, n))
                      for n in (VOCAB_FILE, MERGES_FILE)]
        commit(moves, overwrite=args.overwrite)
        for _, prefix in _datasets(args.output_prefix, keys):  # a stale chat run's mask
            for path in dataset_files(loss_mask_prefix(prefix)):
                if os.path.lexists(path):
                    os.remove(path)
    if tok_dir is not None:
        print(f"saved the tokenizer to {tok_dir}/")
    for prefix, stats, dt in done:
        print(f"wrote {prefix}.bin/.idx: {stats.documents:,} documents, {stats.tokens:,} tokens "
              f"from {stats.files} file(s), {stats.bytes / 1e6:.1f} MB in {dt:.1f} s "
              f"({stats.empty_skipped} empty skipped)")
        cmd = ["domino", "train", "--data-path", os.fspath(prefix), *train_flags]
        print(f"train on it with: {shlex.join(cmd)}")


def _write_chat(args: argparse.Namespace, files: list[str], limit: int) -> None:
    """Conversations into PREFIX and PREFIX_loss_mask: staged, renamed into place together."""
    tokenizer, train_flags = _tokenizer(args, files, limit, None)
    if args.chat_template is not None:
        with open(args.chat_template, encoding="utf-8") as f:
            template, origin = f.read(), args.chat_template
    else:
        template, origin = tokenizer_template(tokenizer, args.tokenizer_dir or
                                              f"the {tokenizer.name} tokenizer")
    options = ChatOptions(template, origin, train_on_prompt=args.train_on_prompt,
                          max_tokens=args.max_tokens, truncate=args.truncate,
                          append_eod=bool(args.append_eod))
    prefix, mask = args.output_prefix, loss_mask_prefix(args.output_prefix)
    parent = Path(prefix).parent
    parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with staging(parent) as stage:
        staged = os.path.join(stage, "dataset")
        stats = write_chat_dataset(files, staged, tokenizer, options, limit=limit,
                                   progress=args.progress)
        moves = [*zip(dataset_files(staged), dataset_files(prefix)),
                 *zip(dataset_files(loss_mask_prefix(staged)), dataset_files(mask))]
        commit(moves, overwrite=args.overwrite)
    print(f"wrote {prefix}.bin/.idx and the loss mask {mask}.bin/.idx from {len(files)} "
          f"file(s) in {time.perf_counter() - t0:.1f} s: {stats.summary()}")
    cmd = ["domino", "train", "--data-path", os.fspath(prefix), *train_flags]
    print(f"train on it with: {shlex.join(cmd)}")
