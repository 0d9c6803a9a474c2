"""Training data: the built-in corpus, tokenizer/dataset checks, the data flags (one dataset or
weighted blends, cut by --split or given per split), and per-rank batches."""

from __future__ import annotations

import contextlib
import hashlib
import os
import sysconfig
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from domino.checkpoint.tokenizer_dir import FILES, find_tokenizer
from domino.context_parallel import SequenceMask, shard_sequence
from domino.data.blend import (
    Blend,
    blend_dtype,
    blend_index,
    build_blended,
    component_seed,
    parse_blend,
)
from domino.data.blend_cache import cache_key, load_index, save_index
from domino.data.checks import normalize_prefix
from domino.data.gpt_dataset import split_documents
from domino.data.indexed_dataset import IndexedDataset, data_path, index_path
from domino.data.preprocess import preprocess, stdlib_corpus_files
from domino.data.tokenizer import BPETokenizer, Tokenizer, build_tokenizer
from domino.parallel_state import ParallelState
from domino.safe_files import NotAFileError, open_for_write
from domino.training.arguments import TrainArgs, flag
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
    """An exclusive inter-process lock on ``folder`` (POSIX advisory lock; a no-op elsewhere).

    Where the filesystem refuses locks (Lustre mounted without ``flock``, NFS without a lock
    daemon, some FUSE and SMB mounts) it goes on unlocked rather than failing the run: what it
    guards is written by atomic renames and is the same whoever writes it, so racing writers
    only repeat work."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - non-POSIX
        yield
        return
    with contextlib.ExitStack() as stack:
        try:
            handle = stack.enter_context(open_for_write(folder / ".lock", "a"))
            fcntl.flock(handle, fcntl.LOCK_EX)
            stack.callback(fcntl.flock, handle, fcntl.LOCK_UN)
        except NotAFileError:  # planted: opening it could create a file where it leads
            raise ValueError(f"{folder / '.lock'} is a symbolic link or not a regular file "
                             "(domino only ever makes a plain file there); remove it") from None
        except OSError:
            pass  # unlocked, see above
        yield


def make_tokenizer(args: TrainArgs) -> Tokenizer:
    assert args.tokenizer_type is not None, "prepare_run() resolves the tokenizer type"
    if args.tokenizer_type == "bpe" and not (args.vocab_file or args.tokenizer_dir):
        raise ValueError("--tokenizer-type bpe needs --vocab-file and --merge-file (or "
                         "--tokenizer-dir) with the vocabulary the data was made with")
    if args.tokenizer_type == "hf" and not args.tokenizer_dir:
        raise ValueError("--tokenizer-type hf needs --tokenizer-dir (an imported run folder, "
                         "its checkpoint's tokenizer/ or the transformers model folder)")
    if args.tokenizer_type in FILES and args.tokenizer_dir and not args.vocab_file:
        return find_tokenizer(args.tokenizer_type, args.tokenizer_dir)
    return build_tokenizer(args.tokenizer_type, vocab_file=args.vocab_file,
                           merges_file=args.merge_file, tokenizer_dir=args.tokenizer_dir)


@dataclass(frozen=True)
class DataSources:
    """Where a run's samples come from: blends for train, valid and test, and the --split that
    cuts each dataset (None: every split is its own datasets whole, --train-data-path & co)."""

    train: Blend
    valid: Blend | None
    test: Blend | None
    split: str | None
    flags: tuple[str, str, str]  # the flag each split's datasets came from (for errors)

    def prefixes(self) -> list[tuple[str, str]]:
        """Every distinct (prefix, flag) the run reads, first mention first."""
        seen: dict[str, str] = {}
        for blend, name in zip((self.train, self.valid, self.test), self.flags, strict=True):
            for p in blend.prefixes if blend is not None else ():
                seen.setdefault(p, name)
        return list(seen.items())

    def describe(self) -> str:
        """The start-up line's account of the data."""
        if self.split is not None:
            each = " of each" if len(self.train) > 1 else ""
            return f"{self.train.describe()} (split {self.split}{each})"
        parts = [f"{name} {blend.describe()}" for name, blend in
                 zip(SPLIT_NAMES, (self.train, self.valid, self.test), strict=True)
                 if blend is not None]
        return " | ".join(parts)


SPLIT_NAMES = ("train", "valid", "test")
_SEPARATE = ("train_data_path", "valid_data_path", "test_data_path")


def data_sources(args: TrainArgs) -> DataSources | None:
    """The run's data flags parsed (None: none given, the built-in corpus); ValueError names the
    flag, the value, the rule and the fix."""
    given = [name for name in _SEPARATE if getattr(args, name) is not None]
    if args.data_path is not None and given:
        raise ValueError(f"--data-path and --{flag(given[0])} are two ways to name the data: "
                         "--data-path (cut by --split) or --train-data-path/--valid-data-path/"
                         "--test-data-path (each split its own datasets, whole); pass one")
    if args.data_path is not None:
        blend = parse_blend(args.data_path, "--data-path")
        return DataSources(blend, blend, blend, args.split, ("--data-path",) * 3)
    if not given:
        return None
    if args.train_data_path is None:
        raise ValueError(f"--{flag(given[0])} needs --train-data-path (the training data)")
    blends = [None if getattr(args, n) is None else parse_blend(getattr(args, n), f"--{flag(n)}")
              for n in _SEPARATE]
    if blends[1] is None and args.eval_iters > 0:
        raise ValueError(f"--train-data-path without --valid-data-path leaves --eval-iters="
                         f"{args.eval_iters} no validation data: pass --valid-data-path PREFIX "
                         "(or a blend), or --eval-iters 0")
    return DataSources(blends[0], blends[1], blends[2], None,  # type: ignore[arg-type]
                       tuple(f"--{flag(n)}" for n in _SEPARATE))  # type: ignore[arg-type]


def normalized_blend(tokens: list[str]) -> list[str]:
    """The flag's values with each prefix in PREFIX form (not PREFIX.bin), weights as given."""
    if len(tokens) == 1:
        return [normalize_prefix(tokens[0])]
    return [t if i % 2 == 0 else normalize_prefix(t) for i, t in enumerate(tokens)]


def cache_folder(args: TrainArgs, sources: DataSources) -> tuple[Path | None, str | None]:
    """Where blend indices are cached, and a note when they cannot be (no blend: nothing to
    cache). Creates nothing (the folder is made when the first index is written, so a run
    refused later leaves none behind). A --data-cache-path that cannot be written is an error
    naming the flag; the default folder a link is not used (its files would be written where
    the link leads)."""
    if all(b is None or len(b) == 1 for b in (sources.train, sources.valid)):
        return None, None
    explicit = args.data_cache_path is not None
    folder = Path(args.data_cache_path if explicit else
                  Path(sources.train.prefixes[0]).parent / "domino_cache")
    problem = _cache_problem(folder, explicit)
    if problem is None:
        return folder, None
    if explicit:
        raise ValueError(f"--data-cache-path {folder} {problem}; pass a folder this user can "
                         "write")
    return None, (f"the blend index is not cached: {folder} {problem} (pass --data-cache-path "
                  "DIR to cache it); every rank builds it in memory")


def _cache_problem(folder: Path, explicit: bool) -> str | None:
    """Why blend indices cannot be cached in ``folder`` (None when they can)."""
    if not explicit and folder.is_symlink():
        return "is a symbolic link (domino never makes one)"
    existing = folder
    while not os.path.lexists(existing):  # the nearest existing folder on the way
        existing = existing.parent
    if existing != folder and not existing.is_dir():
        return f"cannot be created ({existing} is not a folder)"
    if existing == folder and not folder.is_dir():
        return "cannot be created (a file is in the way)"
    if not os.access(existing, os.W_OK | os.X_OK):
        return "is not writable" if existing == folder else (
            f"cannot be created ({existing} is not writable)")
    return None


def build_datasets(args: TrainArgs, datasets: Mapping[str, IndexedDataset] | IndexedDataset,
                   eod: int, start_step: int = 0, consumed_samples: int = 0):
    """(train, valid) datasets sized for the whole run (a resumed one continues at
    ``consumed_samples``); valid holds the fixed validation batches (the same ones every
    evaluation, so the numbers compare across steps). ``datasets`` are the opened datasets by
    prefix. A blend is a :class:`~domino.data.blend.BlendedDataset` of GPT datasets, one
    dataset alone a plain :class:`~domino.data.gpt_dataset.GPTDataset`."""
    if isinstance(datasets, IndexedDataset):
        datasets = {datasets.prefix: datasets}
    sources = data_sources(args)
    assert sources is not None and args.global_batch_size is not None
    needed = consumed_samples + max(args.train_iters - start_step, 0) * args.global_batch_size
    sizes = (max(needed, args.global_batch_size), args.eval_iters * args.global_batch_size)
    folder, _ = cache_folder(args, sources)
    ranges = {}
    if sources.split is not None:  # each dataset cut once, both splits checked
        for prefix, name in sources.prefixes():
            try:
                ranges[prefix] = split_documents(datasets[prefix].num_documents, sources.split,
                                                 required=(sizes[0] > 0, sizes[1] > 0, False))
            except ValueError as err:
                raise ValueError(f"{name} {prefix}: {err}") from None
    out = []
    for which, (blend, n) in enumerate(zip((sources.train, sources.valid), sizes, strict=True)):
        if blend is None or (which == 1 and n == 0):
            out.append(None)
            continue
        out.append(_split_dataset(args, blend, which, n, datasets, ranges, eod, folder))
    return out[0], out[1]


def _split_dataset(args: TrainArgs, blend: Blend, which: int, num_samples: int,
                   datasets: Mapping[str, IndexedDataset], ranges: dict, eod: int,
                   folder: Path | None):
    from domino.data.gpt_dataset import GPTDataset
    from domino.data.packed import PackedDataset

    options = dict(eod_token=eod, reset_position_ids=args.reset_position_ids,
                   reset_attention_mask=args.reset_attention_mask,
                   eod_mask_loss=args.eod_mask_loss,
                   create_attention_mask=args.reset_attention_mask)
    kind = GPTDataset
    if args.pack_documents:  # padding is EOD (never counted, never attended by real tokens)
        kind, options = PackedDataset, dict(pad_token=eod, create_attention_mask=True)

    def make(k: int, count: int, seed: int) -> GPTDataset | PackedDataset:
        prefix = blend.prefixes[k]
        part = ranges[prefix][which] if prefix in ranges else None
        try:
            return kind(datasets[prefix], args.seq_length, count, seed=seed, split=part,
                        **options)
        except ValueError as err:
            raise ValueError(f"{prefix}: {err}") from None

    if len(blend) == 1:  # exactly the samples of a run before blends existed
        return make(0, num_samples, args.seed)
    index = None
    if folder is not None:
        key = cache_key(blend.prefixes, blend.weights, split_name=SPLIT_NAMES[which],
                        split=args.split if ranges else None, seed=args.seed,
                        seq_length=args.seq_length, num_samples=num_samples)
        dtype = blend_dtype(len(blend))
        # Files appear whole or not at all (atomic renames), so a ready index is read without
        # the lock: thousands of ranks on a shared filesystem then check it in parallel
        # instead of one after another.
        index, _ = load_index(folder, key, dtype)
        if index is None:
            # The lock makes the first rank on each host build and write it while the others
            # wait and then read it back, checked. No process group exists yet (this runs
            # before any process starts, and again in each rank), and the index is
            # deterministic, so a rank on another host that builds its own copy gets the same.
            folder.mkdir(parents=True, exist_ok=True)
            with _locked(folder):
                index, _ = load_index(folder, key, dtype)
                if index is None:
                    index = blend_index(blend.weights, num_samples)
                    with contextlib.suppress(OSError):  # a full disk costs the cache, not the run
                        save_index(folder, key, index)
    return build_blended(blend.weights, num_samples,
                         lambda k, count: make(k, count, component_seed(args.seed, k)),
                         index=index, description=blend.describe())


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


def state_batches(dataset, first_sample: int, global_batch: int, micro_batch: int,
                  state: ParallelState) -> list[dict[str, torch.Tensor]]:
    """:func:`rank_batches` of this rank's DP slice; under context parallelism each [b, s]
    tensor (tokens, labels, loss mask, position ids) cut to this CP rank's shard of the
    sequence (chunks r and 2CP-1-r), the position ids staying the tokens' own, and the
    attention mask of ``--reset-attention-mask`` given as the whole sequence's document ids."""
    batches = rank_batches(dataset, first_sample, global_batch, state.dp.size, state.dp.rank,
                           micro_batch, state.device)
    cp = state.cp
    if cp.size == 1:
        return batches
    out = []
    for batch in batches:
        mask = batch.pop("attention_mask", None)  # [b, 1, s, s]: causal and within documents
        out.append({k: shard_sequence(v, cp.rank, cp.size, dim=1) for k, v in batch.items()})
        if mask is not None:
            # A row sees its document's start .. itself: the first key it sees names the
            # document (with the causal rule, the same mask).
            out[-1]["attention_mask"] = SequenceMask(
                document_ids=(~mask[:, 0]).to(torch.uint8).argmax(-1))
    return out
