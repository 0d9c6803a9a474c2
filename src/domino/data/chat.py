"""Chat and instruction data: conversations rendered with a chat template, tokenized, and written
as a token dataset plus a per-token loss mask (``PREFIX_loss_mask``, uint8, 1 = counts).

Rows hold ``messages`` (a list of ``{role, content}``, the Hugging Face datasets chat layout) or
``prompt`` / ``completion`` (strings: a user then an assistant message; or lists of messages, the
conversational layout). The mask rule: with ``train_on_prompt`` every token counts; otherwise
the spans a template marks with ``{% generation %}``, or, where it has none, each assistant
message's rendered content plus the special token that closes it (whitespace between
included). Tokens are the rendered text encoded without added BOS/EOS (the template writes its
own), as ``transformers``' ``apply_chat_template(tokenize=True)`` does.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from tqdm import tqdm

from domino.data.chat_template import (
    GENERATION_RE,
    ChatTemplateError,
    compile_template,
    content_spans,
    render,
    template_messages,
    token_mask,
)
from domino.data.indexed_dataset import IndexedDatasetBuilder, best_dtype
from domino.data.loss_mask import loss_mask_prefix
from domino.data.readers import _lines, _open_table, _why, input_kind
from domino.data.tokenizer import EOD_TOKEN, BPETokenizer, ByteTokenizer, HFTokenizer, Tokenizer

ROLES = ("system", "developer", "user", "assistant", "tool", "function", "ipython")
CHAT_COLUMNS = ("messages", "prompt", "completion")


@dataclass(frozen=True)
class ChatOptions:
    """How conversations become tokens and mask."""

    template: str  # the jinja source
    template_origin: str  # where it came from (for errors and the sidecar)
    train_on_prompt: bool = False
    max_tokens: int | None = None  # longer conversations are dropped (or cut: truncate)
    truncate: bool = False
    append_eod: bool = False  # an EOD after each conversation (its mask 0, unless on prompt)


@dataclass
class ChatStats:
    """What a chat preprocessing wrote."""

    conversations: int = 0
    tokens: int = 0
    counted: int = 0
    dropped: int = 0
    truncated: int = 0

    def summary(self) -> str:
        share = self.counted / self.tokens if self.tokens else 0.0
        return (f"{self.conversations:,} conversations, {self.tokens:,} tokens, "
                f"{self.counted:,} counted for the loss ({share:.1%}); {self.dropped:,} dropped "
                f"and {self.truncated:,} truncated for length")


# ---------------------------------------------------------------- template and tokenizer


def tokenizer_template(tokenizer: Tokenizer, where: str) -> tuple[str, str]:
    """(source, origin) of the tokenizer folder's own chat template, as ``transformers`` picks
    it: chat_template.jinja over tokenizer_config.json's ``chat_template`` (a list of named
    templates: the one named ``default``). ValueError saying how to give one."""
    hf = getattr(tokenizer, "hf", {}) or {}
    if isinstance(text := hf.get("chat_template.jinja"), str):
        return text, f"{where}/chat_template.jinja"
    found = (hf.get("tokenizer_config.json") or {}).get("chat_template")
    origin = f"{where}/tokenizer_config.json (chat_template)"
    if isinstance(found, list):
        named = {t.get("name"): t.get("template") for t in found if isinstance(t, dict)}
        if not isinstance(named.get("default"), str):
            raise ValueError(f"{origin} holds the named templates {sorted(map(str, named))} but "
                             "none named 'default'; pass --chat-template FILE with the one to use")
        return named["default"], origin
    if isinstance(found, str):
        return found, origin
    raise ValueError(f"no chat template: the tokenizer at {where} has no chat_template.jinja "
                     "and no chat_template in tokenizer_config.json; pass --chat-template FILE "
                     "(a jinja chat template, e.g. the chat_template.jinja of the model's "
                     "instruct version)")


def _special_strings(tokenizer: Tokenizer) -> dict[str, str]:
    """The ``*_token`` variables a template reads (bos_token, eos_token, ...): tokenizer_config
    .json's, then special_tokens_map.json's for the ones it lacks."""
    if not isinstance(tokenizer, HFTokenizer):
        return {} if isinstance(tokenizer, ByteTokenizer) else {"bos_token": EOD_TOKEN,
                                                                "eos_token": EOD_TOKEN}
    out: dict[str, str] = {}
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        for key, value in (tokenizer.hf.get(name) or {}).items():
            text = value.get("content") if isinstance(value, dict) else value
            if key.endswith("_token") and isinstance(text, str):
                out.setdefault(key, text)
    return out


def _end_tokens(tokenizer: Tokenizer) -> list[str]:
    """The special tokens that may close an assistant turn (the fallback rule)."""
    if isinstance(tokenizer, HFTokenizer | BPETokenizer):
        decoder = tokenizer._tok.get_added_tokens_decoder()
        return [t.content for t in decoder.values() if t.special]
    return []


def encode_offsets(tokenizer: Tokenizer, text: str) -> tuple[list[int], np.ndarray]:
    """(ids, [n, 2] character offsets) of ``text`` encoded with no BOS/EOS added."""
    if isinstance(tokenizer, HFTokenizer | BPETokenizer):
        enc = tokenizer._tok.encode(text, add_special_tokens=False)
        return list(enc.ids), np.asarray(enc.offsets, dtype=np.int64).reshape(-1, 2)
    if isinstance(tokenizer, ByteTokenizer):
        ids, offsets = [], []
        for i, ch in enumerate(text):
            raw = ch.encode("utf-8", errors="replace")
            ids += list(raw)
            offsets += [(i, i + 1)] * len(raw)
        return ids, np.asarray(offsets, dtype=np.int64).reshape(-1, 2)
    raise ValueError(f"--format chat needs a byte, bpe or hf tokenizer, not {tokenizer.name}")


# ---------------------------------------------------------------- rows


def iter_rows(path: str, limit: int) -> Iterator[tuple[str, dict[str, Any]]]:
    """(where, row) per conversation of a JSONL, Parquet or Arrow file; ``where`` names the
    file and line (JSONL, 1-based) or row (tables, 0-based)."""
    kind = input_kind(path)
    if kind in ("parquet", "arrow"):
        yield from _table_rows(path, kind)
        return
    if kind == "text":
        raise ValueError(f"{path}: --format chat reads JSONL (.jsonl, .json, also .gz/.zst), "
                         "Parquet or Arrow files, not text; pass the conversations as JSON lines")
    with contextlib.closing(_lines(path, kind, limit)) as lines:
        for lineno, (raw, _) in enumerate(lines, start=1):
            line = raw.decode("utf-8", errors="replace").strip()
            if not line:
                continue
            where = f"{path}: line {lineno}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{where}: invalid JSON ({err.msg})") from None
            if not isinstance(row, dict):
                raise ValueError(f"{where}: expected a JSON object, got {type(row).__name__}")
            yield where, row


def _table_rows(path: str, kind: str) -> Iterator[tuple[str, dict[str, Any]]]:
    import pyarrow as pa

    row = 0
    with _open_table(path, kind) as (schema, batches):
        columns = [c for c in CHAT_COLUMNS if c in schema.names]
        if not columns:
            shown = ", ".join(schema.names[:20]) or "none"
            raise ValueError(f"{path}: no column 'messages' (a list of {{role, content}}) nor "
                             f"'prompt' and 'completion' (columns: {shown})")
        if kind == "parquet":
            import pyarrow.parquet as pq

            batches = ((b, 0) for b in pq.ParquetFile(path).iter_batches(columns=columns))
        try:
            for batch, _ in batches:
                for values in batch.select(columns).to_pylist():
                    yield f"{path}: row {row}", values
                    row += 1
        except (pa.ArrowException, OSError) as err:
            raise ValueError(f"{path}: not readable after {row} row(s) ({_why(err)}); the file "
                             "is truncated or damaged: re-create it") from None


def row_messages(where: str, row: dict[str, Any]) -> list[dict[str, Any]]:
    """The conversation of one row, checked; ValueError naming the row and the field."""
    if row.get("messages") is not None:
        messages = row["messages"]
        field = "messages"
    elif row.get("prompt") is not None or row.get("completion") is not None:
        prompt, completion = row.get("prompt"), row.get("completion")
        for name, value in (("prompt", prompt), ("completion", completion)):
            if not isinstance(value, str | list):
                got = "missing" if value is None else f"of type {type(value).__name__}"
                raise ValueError(f"{where}: field {name!r} is {got}; give 'prompt' and "
                                 "'completion' as strings (or lists of messages)")
        if isinstance(prompt, str) != isinstance(completion, str):
            raise ValueError(f"{where}: 'prompt' and 'completion' must both be strings or both "
                             "lists of messages")
        messages = (prompt + completion if isinstance(prompt, list) else
                    [{"role": "user", "content": prompt},
                     {"role": "assistant", "content": completion}])
        field = "prompt/completion"
    else:
        keys = ", ".join(sorted(map(str, row))[:10]) or "none"
        raise ValueError(f"{where}: no field 'messages' (a list of {{role, content}}) nor "
                         f"'prompt' and 'completion' (fields present: {keys})")
    if not isinstance(messages, list) or not messages:
        what = "empty" if isinstance(messages, list) else f"a {type(messages).__name__}"
        raise ValueError(f"{where}: field {field!r} is {what}; give a non-empty list of "
                         "{role, content} messages")
    for i, message in enumerate(messages):
        _check_message(f"{where}: {field}[{i}]", message)
    return messages


def _check_message(where: str, message: Any) -> None:
    if not isinstance(message, dict):
        raise ValueError(f"{where}: a message must be an object with 'role' and 'content', "
                         f"got {type(message).__name__}")
    role, content = message.get("role"), message.get("content")
    if role is None:
        raise ValueError(f"{where}: missing field 'role' (one of {', '.join(ROLES)})")
    if role not in ROLES:
        raise ValueError(f"{where}: unknown role {role!r}; use one of {', '.join(ROLES)}")
    if not isinstance(content, str):
        got = "missing" if content is None else f"of type {type(content).__name__}"
        raise ValueError(f"{where}: field 'content' is {got}; it must be a string (content "
                         "blocks are not read: join their text)")
    if not content.strip():
        raise ValueError(f"{where}: empty {role} turn (field 'content' holds no text); drop "
                         "the message or the conversation")


# ---------------------------------------------------------------- conversations


class ChatEncoder:
    """Conversation -> (ids, mask) with one tokenizer and template."""

    def __init__(self, tokenizer: Tokenizer, options: ChatOptions) -> None:
        self.tokenizer, self.options = tokenizer, options
        self.template = compile_template(options.template, options.template_origin)
        self.marked = bool(GENERATION_RE.search(options.template))
        self.variables = _special_strings(tokenizer)
        self.ends = _end_tokens(tokenizer)

    def encode(self, where: str, messages: list[dict[str, Any]]) -> tuple[list[int], np.ndarray]:
        """The conversation's token ids and uint8 loss mask; ValueError naming ``where``."""
        shown = template_messages(messages)
        try:
            text, spans = render(self.template, shown, self.variables)
        except ChatTemplateError as err:
            raise ValueError(f"{where}: the chat template ({self.options.template_origin}) "
                             f"failed to render: {err}") from None
        ids, offsets = encode_offsets(self.tokenizer, text)
        if self.options.train_on_prompt:
            return ids, np.ones(len(ids), dtype=np.uint8)
        if not self.marked:
            found = content_spans(self.template, shown, self.variables, text, self.ends)
            if found is None:
                raise ValueError(f"{where}: the chat template ({self.options.template_origin}) "
                                 "does not render the assistant content as written, so its "
                                 "tokens cannot be found; mark the assistant output with "
                                 "{% generation %}...{% endgeneration %} or pass "
                                 "--train-on-prompt")
            spans = found
        return ids, token_mask(offsets, spans)


def write_chat_dataset(files: Sequence[str], prefix: str, tokenizer: Tokenizer,
                       options: ChatOptions, *, limit: int, progress: bool = True) -> ChatStats:
    """Write ``prefix.{bin,idx,json}`` and ``prefix_loss_mask.{bin,idx,json}`` as new files
    (O_EXCL; meant for a staging folder the caller removes on failure)."""
    encoder = ChatEncoder(tokenizer, options)
    for path in files:  # fail fast: the first row of every file, before any work
        for where, row in iter_rows(path, limit):
            encoder.encode(where, row_messages(where, row))
            break
    stats = ChatStats()
    mask_prefix = loss_mask_prefix(prefix)
    eod = [tokenizer.eod] if options.append_eod else []
    bar = tqdm(unit=" conv", desc="rendering", disable=not progress)
    with IndexedDatasetBuilder(prefix, best_dtype(tokenizer.vocab_size), exclusive=True) as out, \
            IndexedDatasetBuilder(mask_prefix, np.uint8, exclusive=True) as masks:
        try:
            for path in files:
                for where, row in iter_rows(path, limit):
                    ids, mask = encoder.encode(where, row_messages(where, row))
                    if eod and ids[-1:] != eod:
                        ids = [*ids, *eod]
                        mask = np.append(mask, np.uint8(options.train_on_prompt))
                    if options.max_tokens is not None and len(ids) > options.max_tokens:
                        if not options.truncate:
                            stats.dropped += 1
                            continue
                        ids, mask = ids[:options.max_tokens], mask[:options.max_tokens]
                        stats.truncated += 1
                    out.add_document(np.asarray(ids, dtype=np.int64))
                    masks.add_document(mask)
                    stats.conversations += 1
                    stats.tokens += len(ids)
                    stats.counted += int(mask.sum())
                    bar.update(1)
        finally:
            bar.close()
        if stats.conversations == 0:
            raise ValueError(f"no conversation to write: {stats.dropped} dropped as longer than "
                             f"--max-tokens={options.max_tokens}; pass --truncate or a larger "
                             "--max-tokens")
        digest = hashlib.sha256(options.template.encode("utf-8")).hexdigest()[:16]
        chat = {"template": options.template_origin, "template_hash": digest,
                "train_on_prompt": options.train_on_prompt, "counted": stats.counted,
                "rule": "all tokens" if options.train_on_prompt else
                "generation blocks" if encoder.marked else "assistant content + end token"}
        out.finalize(metadata={"format": "MMIDIDX", "tokenizer": tokenizer.describe(),
                               "documents": stats.conversations, "tokens": stats.tokens,
                               "append_eod": options.append_eod, "chat": chat})
        masks.finalize(metadata={"format": "MMIDIDX", "loss_mask_of": os.path.basename(prefix),
                                 "documents": stats.conversations, "tokens": stats.tokens})
    return stats
