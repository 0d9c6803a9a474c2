"""Training data: the built-in corpus, tokenizer/dataset checks, and per-rank batches."""

from __future__ import annotations

import contextlib
import hashlib
import os
import sysconfig
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch

from domino.data.indexed_dataset import IndexedDataset, data_path, index_path
from domino.data.preprocess import preprocess, stdlib_corpus_files
from domino.data.tokenizer import BPETokenizer, Tokenizer, build_tokenizer
from domino.training.arguments import TrainArgs
from domino.utils import cache_root

DEFAULT_BPE_VOCAB = 2048


def _writable_dir(preferred: Path, fallback: Path) -> Path:
    for folder in (preferred, fallback):
        try:
            folder.mkdir(parents=True, exist_ok=True)
            if os.access(folder, os.W_OK):
                return folder
        except OSError:
            continue
    raise ValueError(f"cannot write the corpus cache to {preferred} or {fallback}")


def _content_hash(files: Sequence[str]) -> str:
    h = hashlib.sha256()
    for path in files:
        h.update(os.path.basename(path).encode())
        with open(path, "rb") as f:
            h.update(f.read())
    return h.hexdigest()[:16]


# Generated tables and prose, not code: codec maps and pydoc's topic texts would otherwise be
# ~20% of the corpus and teach the model to recite "LATIN CAPITAL LETTER ..." lines.
_NOT_CODE = {"encodings", "pydoc_data"}


def default_corpus_files() -> list[str]:
    """The standard library's .py files, minus generated tables."""
    root = sysconfig.get_paths()["stdlib"]
    return [f for f in stdlib_corpus_files()
            if Path(os.path.relpath(f, root)).parts[0] not in _NOT_CODE]


def prepare_default_corpus(args: TrainArgs, run_dir: Path, progress: bool) -> str:
    """Tokenize the standard library's .py files once; returns the dataset prefix.

    Cached by content hash (of the files and the tokenizer) so later runs start at once.
    """
    files = default_corpus_files()
    if not files:
        raise ValueError("no Python standard library .py files found for the built-in corpus; "
                         "pass --data-path")
    corpus = _content_hash(files)
    folder = _writable_dir(cache_root() / f"stdlib-{corpus}", run_dir / "data")
    with _locked(folder):  # torchrun ranks on one host: the first builds, the others reuse
        if args.tokenizer_type == "bpe" and not (args.vocab_file or args.tokenizer_dir):
            tok_dir = folder / f"bpe-{DEFAULT_BPE_VOCAB}"
            if not (tok_dir / "vocab.json").is_file():
                if progress:
                    print(f"built-in corpus: training a {DEFAULT_BPE_VOCAB}-token BPE on "
                          f"{len(files)} standard-library files (once; cached in {folder})")
                BPETokenizer.train(files, DEFAULT_BPE_VOCAB).save(tok_dir)
            args.tokenizer_dir = str(tok_dir)
        tokenizer = make_tokenizer(args)
        prefix = folder / f"stdlib_{tokenizer.name}_{tokenizer.vocab_hash()}"
        if not (Path(data_path(prefix)).is_file() and Path(index_path(prefix)).is_file()):
            preprocess(files, prefix, tokenizer, append_eod=True, progress=progress)
    return str(prefix)


@contextlib.contextmanager
def _locked(folder: Path) -> Iterator[None]:
    """An exclusive inter-process lock on ``folder`` (POSIX advisory lock; a no-op elsewhere)."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - non-POSIX
        yield
        return
    with open(folder / ".lock", "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def make_tokenizer(args: TrainArgs) -> Tokenizer:
    assert args.tokenizer_type is not None, "prepare_run() resolves the tokenizer type"
    if args.tokenizer_type == "bpe" and not (args.vocab_file or args.tokenizer_dir):
        raise ValueError("--tokenizer-type bpe needs --vocab-file and --merge-file (or "
                         "--tokenizer-dir) with the vocabulary the data was made with")
    if args.tokenizer_type == "hf" and not args.tokenizer_dir:
        raise ValueError("--tokenizer-type hf needs --tokenizer-dir (a folder with "
                         "tokenizer.json, e.g. the tokenizer/ of an imported checkpoint)")
    return build_tokenizer(args.tokenizer_type, vocab_file=args.vocab_file,
                           merges_file=args.merge_file, tokenizer_dir=args.tokenizer_dir)


def build_datasets(args: TrainArgs, ds: IndexedDataset, eod: int, start_step: int = 0,
                   consumed_samples: int = 0):
    """(train, valid) GPT datasets sized for the whole run (a resumed one continues at
    ``consumed_samples``); valid holds the fixed validation batches (the same ones every
    evaluation, so the numbers compare across steps)."""
    from domino.data.gpt_dataset import build_train_valid_datasets

    assert args.global_batch_size is not None
    needed = consumed_samples + max(args.train_iters - start_step, 0) * args.global_batch_size
    return build_train_valid_datasets(
        ds.prefix, args.seq_length, max(needed, args.global_batch_size),
        args.eval_iters * args.global_batch_size, seed=args.seed, splits=args.split,
        eod_token=eod, reset_position_ids=args.reset_position_ids,
        reset_attention_mask=args.reset_attention_mask, eod_mask_loss=args.eod_mask_loss,
        create_attention_mask=args.reset_attention_mask)


def rank_batches(dataset, first_sample: int, global_batch: int, dp_size: int, dp_rank: int,
                 micro_batch: int, device: torch.device) -> list[dict[str, torch.Tensor]]:
    """This DP rank's micro-batches of the global batch of samples ``first_sample`` ..
    ``first_sample + global_batch - 1``.

    Samples are picked by global index: DP rank r takes the r-th contiguous slice, so the set of
    samples per step does not depend on the DP size.
    """
    per_rank = global_batch // dp_size
    first = first_sample + dp_rank * per_rank
    out = []
    for start in range(first, first + per_rank, micro_batch):
        items = [dataset[i] for i in range(start, start + micro_batch)]
        # attention_mask (only with --reset-attention-mask) stacks to [b, 1, s, s], True = masked.
        out.append({k: torch.stack([it[k] for it in items]).to(device) for k in items[0]})
    return out
