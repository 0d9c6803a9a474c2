"""Chat templates rendered as ``transformers`` renders them (5.x), with the character spans whose
tokens count for the loss.

Templates come from model folders people download, so they are untrusted code: they run in
jinja2's ``ImmutableSandboxedEnvironment`` with ``trim_blocks`` / ``lstrip_blocks``, the
``loopcontrols`` extension, and the globals and filters ``transformers`` gives them
(``raise_exception``, ``strftime_now``, a ``tojson`` that does not escape HTML, ``dict``, a
``namespace`` that refuses underscore names). The ``{% generation %}`` block marks what the
assistant generates: its spans are recorded while rendering, as ``return_assistant_tokens_mask``
does.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from contextvars import ContextVar
from datetime import datetime
from typing import Any

import numpy as np

GENERATION_RE = re.compile(r"\{%-?\s*generation\s*-?%\}")
# Private-use characters around each assistant content in the fallback rule's second rendering.
_OPEN, _CLOSE = "\ue000", "\ue001"


class ChatTemplateError(ValueError):
    """A template that does not compile or render; the message is jinja's."""


def _tracker_class(jinja2: Any) -> Any:
    from jinja2.ext import Extension

    class GenerationBlocks(Extension):
        """``{% generation %}...{% endgeneration %}``: renders its body, and while a recording
        is active notes the body's (start, end) characters in the output."""

        tags = {"generation"}

        def __init__(self, environment: Any) -> None:
            super().__init__(environment)
            self.recording: ContextVar[tuple[list[str], list] | None] = ContextVar(
                "generation_spans", default=None)

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            call = self.call_method("_record", [], [])
            return jinja2.nodes.CallBlock(call, [], [], body).set_lineno(lineno)

        def _record(self, caller: Any) -> str:
            text = caller()
            if (rec := self.recording.get()) is not None:
                blocks, spans = rec
                start = sum(map(len, blocks))  # the output so far: the blocks yielded before
                spans.append((start, start + len(text)))
            return text

    return GenerationBlocks


def compile_template(source: str, where: str) -> Any:
    """The sandboxed jinja2 template of ``source``; ChatTemplateError naming ``where``."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    class TemplateDict:  # dict() and dict.fromkeys() without the type's attributes
        def __call__(self, *args: Any, **kwargs: Any) -> dict:
            return dict(*args, **kwargs)

        def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
            return dict.fromkeys(*args, **kwargs)

    class Namespace(jinja2.utils.Namespace):  # no underscore names: no way to CPython internals
        def __init__(*args: Any, **kwargs: Any) -> None:
            self, rest = args[0], args[1:]
            attrs = dict(*rest, **kwargs)
            for name in attrs:
                Namespace.check(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name: str, value: Any) -> None:
            Namespace.check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def check(name: Any) -> None:
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(
                    f"a chat template may not store the underscore name {name!r} on a namespace")

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True,
        extensions=[_tracker_class(jinja2), jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=strftime_now,
                       dict=TemplateDict(), namespace=Namespace)
    try:
        return env.from_string(source)
    except jinja2.TemplateError as err:
        raise ChatTemplateError(f"the chat template of {where} does not compile: "
                                f"{type(err).__name__}: {err}") from None


_REASONING = ("reasoning_content", "thinking", "reasoning")


def template_messages(messages: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """What the template sees, as ``transformers`` passes it: keys holding None dropped, and a
    message's reasoning under ``reasoning_content`` and ``thinking`` too."""
    out = []
    for message in messages:
        m = {k: v for k, v in message.items() if v is not None}
        reasoning = next((m[k] for k in _REASONING if m.get(k) is not None), None)
        if reasoning is not None:
            m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
        out.append(m)
    return out


def render(template: Any, messages: list[dict[str, Any]], variables: dict[str, str],
           add_generation_prompt: bool = False) -> tuple[str, list[tuple[int, int]]]:
    """(text, generation spans): the conversation rendered with ``variables`` (the special
    tokens, as ``transformers`` passes them); with ``add_generation_prompt`` the template's
    header of the assistant turn to come is written after it (`domino generate --chat`)."""
    import jinja2

    ext = next(e for e in template.environment.extensions.values() if hasattr(e, "recording"))
    blocks: list[str] = []
    spans: list[tuple[int, int]] = []
    token = ext.recording.set((blocks, spans))
    try:
        for block in template.generate(messages=messages, tools=None, documents=None,
                                       add_generation_prompt=add_generation_prompt,
                                       **variables):
            blocks.append(block)
    except jinja2.TemplateError as err:
        raise ChatTemplateError(f"{type(err).__name__}: {err}") from None
    except (TypeError, ValueError, KeyError, IndexError, AttributeError,
            ArithmeticError, RecursionError) as err:  # errors of the template's own code
        raise ChatTemplateError(f"{type(err).__name__}: {err}") from None
    finally:
        ext.recording.reset(token)
    return "".join(blocks), spans


def content_spans(template: Any, messages: list[dict[str, Any]], variables: dict[str, str],
                  text: str, ends: Sequence[str]) -> list[tuple[int, int]] | None:
    """The fallback rule's spans in ``text`` (the plain rendering): each assistant message's
    content, extended over the end token that closes it (one of ``ends``, the tokenizer's
    special tokens, after optional whitespace). Found by rendering again with each assistant
    content between private-use marks; None when that rendering, marks removed, is not
    ``text`` (the template rewrites the content): then use ``{% generation %}`` markers."""
    marked = [({**m, "content": f"{_OPEN}{m['content']}{_CLOSE}"}
               if m.get("role") == "assistant" else m) for m in messages]
    try:
        with_marks, _ = render(template, marked, variables)
    except ChatTemplateError:
        return None
    spans, pos, plain = [], 0, []
    for piece in re.split(f"([{_OPEN}{_CLOSE}])", with_marks):
        if piece == _OPEN:
            spans.append([pos, -1])
        elif piece == _CLOSE:
            if not spans or spans[-1][1] != -1:
                return None
            spans[-1][1] = pos
        else:
            plain.append(piece)
            pos += len(piece)
    if "".join(plain) != text or any(end < 0 for _, end in spans):
        return None
    out = []
    longest_first = sorted((e for e in ends if e), key=len, reverse=True)
    for start, end in spans:
        rest = text[end:]
        gap = len(rest) - len(rest.lstrip())
        hit = next((e for e in longest_first if rest.startswith(e, gap)), None)
        out.append((start, end + gap + len(hit) if hit else end))
    return out


def token_mask(offsets: np.ndarray, spans: Sequence[tuple[int, int]]) -> np.ndarray:
    """uint8 per token: 1 where the token's characters [start, end) overlap a span (the rule of
    ``return_assistant_tokens_mask``: a token cut by a span's edge counts)."""
    mask = np.zeros(len(offsets), dtype=np.uint8)
    if len(offsets):
        starts, ends = offsets[:, 0], offsets[:, 1]
        for s, e in spans:
            mask |= ((ends > s) & (starts < e)).astype(np.uint8)
    return mask
