"""``domino generate --chat``: the prompt as one user message (after an optional system one),
rendered with the chat template and its generation prompt, and encoded as ``transformers``'
``apply_chat_template(messages, add_generation_prompt=True, tokenize=True)`` encodes it."""

from __future__ import annotations

from typing import Any

from domino.data.chat import ChatEncoder, ChatOptions, encode_offsets, tokenizer_template
from domino.data.chat_template import ChatTemplateError, render, template_messages


def chat_messages(prompt: str, system: str | None) -> list[dict[str, str]]:
    """The conversation `domino generate --chat` renders."""
    head = [] if system is None else [{"role": "system", "content": system}]
    return [*head, {"role": "user", "content": prompt}]


def chat_prompt_ids(tokenizer, spec: dict[str, Any], where: str) -> list[int]:
    """The ids of ``spec``'s chat prompt: the template given (``chat_template``, the text of
    ``--chat-template``) or the tokenizer's own (at ``where``). Nothing is added to the
    rendered text, as ``transformers`` adds nothing: a template writes its own BOS.
    ValueError naming the template and the fix."""
    if spec.get("chat_template") is not None:
        source, origin = spec["chat_template"], spec["chat_template_origin"]
    else:
        try:
            source, origin = tokenizer_template(tokenizer, where)
        except ValueError as err:
            raise ValueError(f"--chat: {err}") from None
    try:
        encoder = ChatEncoder(tokenizer, ChatOptions(source, origin))
    except ChatTemplateError as err:
        raise ValueError(f"--chat: {err}; pass --chat-template FILE with a working "
                         "template") from None
    try:
        text, _ = render(encoder.template, template_messages(
            chat_messages(spec["prompt"], spec.get("system"))), encoder.variables,
            add_generation_prompt=True)
    except ChatTemplateError as err:
        raise ValueError(f"--chat: the chat template ({origin}) cannot render the prompt: {err}; "
                         "pass --chat-template FILE with a template that can") from None
    ids, _ = encode_offsets(tokenizer, text)
    if not ids:
        raise ValueError(f"--chat: the chat template ({origin}) renders the prompt as no text; "
                         "pass --chat-template FILE with a template that writes the messages")
    return ids
