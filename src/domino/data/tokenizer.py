"""Tokenizers: a byte-level fallback and byte-level BPE (GPT-2 style) via HF `tokenizers`."""

from __future__ import annotations

import hashlib
import json
import os
from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

EOD_TOKEN = "<|endoftext|>"
VOCAB_FILE = "vocab.json"
MERGES_FILE = "merges.txt"
HF_TOKENIZER_FILE = "tokenizer.json"
HF_SIDECAR = "domino.json"


class Tokenizer(ABC):
    """What the data layer needs from a tokenizer."""

    name: str = "abstract"

    @property
    @abstractmethod
    def vocab_size(self) -> int:
        """Number of token ids (including special tokens)."""

    @property
    @abstractmethod
    def eod(self) -> int:
        """End-of-document token id."""

    @property
    def stop_ids(self) -> tuple[int, ...]:
        """Every id that ends generation: EOD (an imported model: each of its EOS ids)."""
        return (self.eod,)

    @property
    def appends_eod(self) -> bool:
        """Whether ``encode`` itself ends a text with EOD (a post-processor adding EOS = EOD),
        so that ``domino preprocess`` does not append a second one."""
        return False

    @abstractmethod
    def encode(self, text: str) -> list[int]:
        """Text to token ids as the tokenizer encodes a text (a Hugging Face tokenizer's BOS/EOS
        included, as ``transformers`` adds them; no EOD appended)."""

    @abstractmethod
    def decode(self, ids: Sequence[int]) -> str:
        """Token ids to text; special tokens are dropped."""

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Encode many texts; subclasses may parallelise."""
        return [self.encode(t) for t in texts]

    @abstractmethod
    def vocab_hash(self) -> str:
        """Content hash of the vocabulary (and merges), stable across processes."""

    def describe(self) -> dict[str, Any]:
        """Small JSON-able identity record, stored next to datasets made with this tokenizer."""
        return {
            "kind": self.name,
            "vocab_size": self.vocab_size,
            "eod": self.eod,
            "vocab_hash": self.vocab_hash(),
        }


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes 0..255 plus EOD=256; needs no files, so it works everywhere."""

    name = "byte"

    @property
    def vocab_size(self) -> int:
        return 257

    @property
    def eod(self) -> int:
        return 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        data = bytes(i for i in ids if 0 <= i < 256)
        return data.decode("utf-8", errors="replace")

    def vocab_hash(self) -> str:
        return _sha256(b"byte-tokenizer:" + bytes(range(256)) + b":eod=256")


class _RustBacked(Tokenizer):
    """Encoding and decoding through a HF `tokenizers` object in ``self._tok`` (with the special
    tokens its post-processor adds when ``specials``)."""

    _tok: Any
    specials = False

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=self.specials).ids)

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        encs = self._tok.encode_batch(list(texts), add_special_tokens=self.specials)
        return [list(e.ids) for e in encs]

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=True)


class BPETokenizer(_RustBacked):
    """Byte-level BPE (GPT-2 compatible vocab.json + merges.txt) backed by HF `tokenizers`."""

    name = "bpe"

    def __init__(self, tokenizer: Any, eod_token: str = EOD_TOKEN) -> None:
        self._tok = tokenizer
        self.eod_token = eod_token
        # Register the marker as special (appending it when the vocabulary lacks it), so decode
        # drops it and the literal text "<|endoftext|>" maps to the EOD id.
        tokenizer.add_special_tokens([eod_token])
        self._eod = int(tokenizer.token_to_id(eod_token))

    @staticmethod
    def _empty(vocab: str | dict | None = None, merges: str | list | None = None) -> Any:
        from tokenizers import Tokenizer as HFTokenizer
        from tokenizers import decoders, models, pre_tokenizers

        if isinstance(vocab, str):
            model = models.BPE.from_file(vocab, merges)
        elif vocab is not None:
            model = models.BPE(vocab, merges)
        else:
            model = models.BPE()
        tok = HFTokenizer(model)
        # GPT-2 convention: no prefix space, so encode/decode round-trips exactly.
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        return tok

    @classmethod
    def train(
        cls,
        files_or_iterator: Iterable[str] | str | os.PathLike,
        vocab_size: int,
        min_frequency: int = 2,
        eod_token: str = EOD_TOKEN,
        show_progress: bool = False,
    ) -> BPETokenizer:
        """Train byte-level BPE on files (list of paths) or an iterator of texts."""
        from tokenizers import pre_tokenizers, trainers

        if vocab_size < 257:
            raise ValueError(f"BPE vocab_size must be >= 257 (256 bytes + EOD), got {vocab_size}")
        tok = cls._empty()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            min_frequency=min_frequency,
            special_tokens=[eod_token],
            # Seed all 256 byte symbols so any input stays encodable.
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=show_progress,
        )
        items: Any = files_or_iterator
        if isinstance(items, str | os.PathLike):
            items = [items]  # a lone string is a path, never a one-text corpus
            if not os.path.isfile(items[0]):
                raise FileNotFoundError(f"BPE training file not found: {os.fspath(items[0])}")
        # A list of existing paths (or Path objects) means files; anything else is texts.
        if (
            isinstance(items, list | tuple)
            and items
            and all(
                isinstance(p, os.PathLike) or (isinstance(p, str) and os.path.isfile(p))
                for p in items
            )
        ):
            missing = [p for p in items if not os.path.isfile(p)]
            if missing:
                raise FileNotFoundError(f"BPE training file not found: {os.fspath(missing[0])}")
            tok.train([os.fspath(p) for p in items], trainer)
        else:
            tok.train_from_iterator(items, trainer)
        return cls(tok, eod_token)

    @classmethod
    def from_files(
        cls,
        vocab_json: str | os.PathLike,
        merges_txt: str | os.PathLike,
        eod_token: str = EOD_TOKEN,
    ) -> BPETokenizer:
        """Load a GPT-2 style byte-level vocab.json + merges.txt."""
        for path, what in ((vocab_json, "vocab_file"), (merges_txt, "merges_file")):
            if not os.path.isfile(path):
                raise FileNotFoundError(
                    f"BPE {what} not found: {path}; pass an existing GPT-2 style {what} "
                    "(or train one with BPETokenizer.train)"
                )
        _check_vocab_json(vocab_json)
        try:
            tok = cls._empty(os.fspath(vocab_json), os.fspath(merges_txt))
        except Exception as err:  # the tokenizers library raises a bare Exception
            raise ValueError(
                f"BPE merges_file {os.fspath(merges_txt)} cannot be read with vocab_file "
                f"{os.fspath(vocab_json)} ({err}); pass the GPT-2 style merges.txt that belongs "
                "to that vocab.json (one 'left right' pair per line, tokens from the vocab)"
            ) from None
        return cls(tok, eod_token)

    @classmethod
    def load(cls, directory: str | os.PathLike, eod_token: str = EOD_TOKEN) -> BPETokenizer:
        """Load what `save` wrote."""
        d = Path(directory)
        return cls.from_files(d / VOCAB_FILE, d / MERGES_FILE, eod_token)

    def save(self, directory: str | os.PathLike) -> list[str]:
        """Write vocab.json + merges.txt (GPT-2 layout) into `directory`; returns the paths."""
        os.makedirs(directory, exist_ok=True)
        return list(self._tok.model.save(os.fspath(directory)))

    @property
    def vocab_size(self) -> int:
        return int(self._tok.get_vocab_size(with_added_tokens=True))

    @property
    def eod(self) -> int:
        return self._eod

    def vocab_hash(self) -> str:
        state = json.loads(self._tok.to_str())
        # Merges serialise as "a b" strings or [a, b] pairs depending on the library version.
        merges = [m if isinstance(m, str) else " ".join(m) for m in state["model"]["merges"]]
        vocab = sorted(self._tok.get_vocab(with_added_tokens=True).items(), key=lambda kv: kv[1])
        payload = json.dumps({"vocab": vocab, "merges": merges}, ensure_ascii=False)
        return _sha256(payload.encode("utf-8"))


class HFTokenizer(_RustBacked):
    """Any Hugging Face ``tokenizer.json`` (e.g. an imported Llama's), via HF `tokenizers`.

    A text is encoded as ``transformers`` encodes it: with the BOS/EOS the tokenizer's
    post-processor adds. ``vocab_size`` is the model's vocabulary (its embedding rows), which
    may exceed the tokenizer's own; ``eod`` is the model's end-of-text id (it ends documents);
    ``eos`` every id that ends generation (``generation_config.json``'s ``eos_token_id``, which
    may be a list); ``hf`` the model folder's token metadata, which export writes back (see
    :mod:`domino.checkpoint.hf_tokens`). All but the tokenizer are kept in ``domino.json``
    next to ``tokenizer.json``.
    """

    name = "hf"
    specials = True

    def __init__(self, tokenizer: Any, eod: int, vocab_size: int, eos: Sequence[int] = (),
                 hf: dict[str, Any] | None = None) -> None:
        self._tok, self._eod, self._vocab_size = tokenizer, int(eod), int(vocab_size)
        self._eos = tuple(int(i) for i in eos) or (self._eod,)
        self.hf: dict[str, Any] = dict(hf or {})
        self._added = self._around()

    @classmethod
    def load(cls, directory: str | os.PathLike) -> HFTokenizer:
        from tokenizers import Tokenizer as RustTokenizer

        d = Path(directory)
        for name in (HF_TOKENIZER_FILE, HF_SIDECAR):
            if not (d / name).is_file():
                raise ValueError(f"tokenizer kind 'hf': {d / name} is missing; pass the folder "
                                 f"holding {HF_TOKENIZER_FILE} and {HF_SIDECAR}")
        try:
            info = json.loads((d / HF_SIDECAR).read_text(encoding="utf-8"))
            tok = RustTokenizer.from_file(str(d / HF_TOKENIZER_FILE))
            return cls(tok, int(info["eod"]), int(info["vocab_size"]), info.get("eos", ()),
                       info.get("hf"))
        except (ValueError, KeyError, TypeError, Exception) as err:
            raise ValueError(f"tokenizer kind 'hf': cannot read {d}: {err}") from None

    def save(self, directory: str | os.PathLike) -> list[str]:
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        self._tok.save(str(d / HF_TOKENIZER_FILE))
        sidecar = {"eod": self._eod, "vocab_size": self._vocab_size, "eos": list(self._eos),
                   **({"hf": self.hf} if self.hf else {})}
        (d / HF_SIDECAR).write_text(json.dumps(sidecar) + "\n")
        return [str(d / HF_TOKENIZER_FILE), str(d / HF_SIDECAR)]

    @property
    def stop_ids(self) -> tuple[int, ...]:
        return self._eos

    @property
    def appends_eod(self) -> bool:
        return self._added[1][-1:] == [self._eod]

    def added(self) -> tuple[list[int], list[int]]:
        """The ids the post-processor puts before and after a text (e.g. ([BOS], []))."""
        return list(self._added[0]), list(self._added[1])

    def _around(self) -> tuple[list[int], list[int]]:
        try:
            plain = self._tok.encode("a", add_special_tokens=False).ids
            full = self._tok.encode("a").ids
        except Exception:  # a vocabulary that cannot spell "a" (the library's own error type)
            return [], []
        for i in range(len(full) - len(plain) + 1):
            if full[i:i + len(plain)] == plain:
                return full[:i], full[i + len(plain):]
        return [], []

    def describe(self) -> dict[str, Any]:
        """The base record, with the ids that start every encoded text (``bos``) and every id
        that ends generation (``eos``)."""
        return {**super().describe(), "bos": self.added()[0], "eos": list(self._eos)}

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def eod(self) -> int:
        return self._eod

    def vocab_hash(self) -> str:
        payload = json.dumps({"tokenizer": json.loads(self._tok.to_str()), "eod": self._eod,
                              "vocab_size": self._vocab_size}, sort_keys=True)
        return _sha256(payload.encode("utf-8"))

    @property
    def rust(self) -> Any:
        """The underlying ``tokenizers.Tokenizer``."""
        return self._tok


def byte_level_unicode() -> dict[int, str]:
    """GPT-2's printable stand-in character for each byte (what byte-level BPE vocabularies
    spell tokens with): printable Latin-1 bytes map to themselves, the rest to U+0100 on."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
            *range(ord("\u00ae"), ord("\u00ff") + 1)]
    out, extra = {b: chr(b) for b in keep}, 0
    for b in range(256):
        if b not in out:
            out[b] = chr(256 + extra)
            extra += 1
    return out


def as_rust_tokenizer(tokenizer: Tokenizer) -> Any:
    """A ``tokenizers.Tokenizer`` that encodes exactly as ``tokenizer`` (for export): the BPE's
    own, or, for bytes, a byte-level BPE without merges whose ids are the byte values."""
    if isinstance(tokenizer, _RustBacked):
        return tokenizer._tok
    if isinstance(tokenizer, ByteTokenizer):
        vocab = {ch: b for b, ch in byte_level_unicode().items()}
        tok = BPETokenizer._empty(vocab, [])
        tok.add_special_tokens([EOD_TOKEN])
        assert tok.token_to_id(EOD_TOKEN) == tokenizer.eod
        return tok
    raise ValueError(f"a {tokenizer.name} tokenizer cannot be exported")


def _check_vocab_json(path: str | os.PathLike) -> None:
    """A GPT-2 style vocab.json is a JSON object of token -> id; ValueError naming the file
    (the tokenizers library's own message names neither file nor rule)."""
    try:
        with open(path, encoding="utf-8") as f:
            vocab = json.load(f)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"BPE vocab_file {os.fspath(path)} is not JSON ({err}); pass a GPT-2 "
                         "style vocab.json (a JSON object of token -> id)") from None
    if not isinstance(vocab, dict) or not all(
            isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool)
            for k, v in vocab.items()):
        raise ValueError(f"BPE vocab_file {os.fspath(path)} is not a JSON object of token -> "
                         "integer id; pass a GPT-2 style vocab.json")


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:16]


def build_tokenizer(
    kind: str,
    *,
    vocab_file: str | os.PathLike | None = None,
    merges_file: str | os.PathLike | None = None,
    tokenizer_dir: str | os.PathLike | None = None,
) -> Tokenizer:
    """Make a tokenizer: "byte" (no files), "bpe" (vocab_file+merges_file, or tokenizer_dir)
    or "hf" (tokenizer_dir holding a Hugging Face tokenizer.json, e.g. from `domino import`)."""
    kind = kind.lower()
    if kind == "byte":
        return ByteTokenizer()
    if kind == "hf":
        if tokenizer_dir is None:
            raise ValueError("tokenizer kind 'hf' needs tokenizer_dir= (a folder with "
                             f"{HF_TOKENIZER_FILE} and {HF_SIDECAR}, as `domino import` writes)")
        return HFTokenizer.load(tokenizer_dir)
    if kind == "bpe":
        if tokenizer_dir is not None:
            vocab_file = vocab_file or Path(tokenizer_dir) / VOCAB_FILE
            merges_file = merges_file or Path(tokenizer_dir) / MERGES_FILE
        if vocab_file is None or merges_file is None:
            raise ValueError(
                "tokenizer kind 'bpe' needs vocab_file= and merges_file= (GPT-2 style "
                "vocab.json + merges.txt) or tokenizer_dir= holding both"
            )
        for path, what in ((vocab_file, "vocab_file"), (merges_file, "merges_file")):
            if not os.path.isfile(path):
                raise ValueError(
                    f"tokenizer kind 'bpe': {what} {os.fspath(path)!r} does not exist; "
                    f"pass {what}= pointing at an existing file"
                )
        return BPETokenizer.from_files(vocab_file, merges_file)
    raise ValueError(f"unknown tokenizer kind {kind!r}; choose one of: 'byte', 'bpe', 'hf'")
