"""``domino generate RUN_DIR --prompt TEXT``: continue a prompt with a saved model (KV cache;
greedy, or sampled with temperature / top-k / top-p), at any TP size; with ``--chat`` the prompt
is a user message rendered with the chat template, and the reply is printed."""

from __future__ import annotations

import argparse
import os

from domino.inference.session import add_launch_arguments, launch
from domino.inference.tasks import check_positions


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_launch_arguments(parser)
    parser.add_argument("--prompt", required=True, help="text to continue (with --chat: the "
                        "user's message)")
    parser.add_argument("--chat", action="store_true",
                        help="the prompt is one user message, rendered with the checkpoint "
                        "tokenizer's chat template and its generation prompt (as transformers' "
                        "apply_chat_template(add_generation_prompt=True)); prints the reply")
    parser.add_argument("--system", default=None, metavar="TEXT",
                        help="with --chat: a system message before the user's")
    parser.add_argument("--chat-template", default=None, metavar="FILE",
                        help="with --chat: this jinja chat template instead of the "
                        "tokenizer's own")
    parser.add_argument("--max-new-tokens", type=int, default=100)
    parser.add_argument("--greedy", action="store_true",
                        help="always the most likely token (ignores the sampling flags)")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0, help="sample among the k most likely "
                        "tokens (0: all; 1: greedy)")
    parser.add_argument("--top-p", type=float, default=1.0,
                        help="nucleus sampling: the smallest set of tokens with this much "
                        "probability")
    parser.add_argument("--seed", type=int, default=0, help="seed of the sampling")
    parser.add_argument("--no-stop-at-eod", dest="stop_at_eod", action="store_false",
                        help="keep going after the end-of-text token (an imported model: after "
                        "any of its eos_token_id ids)")
    parser.add_argument("--no-cache", dest="use_cache", action="store_false",
                        help="recompute the whole context every token (a check of the cache)")
    parser.add_argument("--ids", action="store_true",
                        help="print the generated token ids (one line) instead of text")
    parser.add_argument("--slide-context", action="store_true",
                        help="let the prompt + --max-new-tokens run past the model's positions "
                        "(max_position_embeddings): when they fill up, go on from the last half "
                        "of the text (the output then differs from transformers'); without it "
                        "such a request is refused")


def run(ns: argparse.Namespace) -> int:
    if ns.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens={ns.max_new_tokens} must be >= 1")
    if ns.temperature <= 0:
        raise ValueError(f"--temperature={ns.temperature} must be > 0 (use --greedy for argmax)")
    if ns.top_k < 0:
        raise ValueError(f"--top-k={ns.top_k} must be >= 0 (0 = all tokens)")
    if not 0.0 < ns.top_p <= 1.0:
        raise ValueError(f"--top-p={ns.top_p} must be in (0, 1]")
    spec = {k: getattr(ns, k) for k in ("prompt", "max_new_tokens", "greedy", "temperature",
                                         "top_k", "top_p", "seed", "stop_at_eod", "use_cache",
                                         "ids", "slide_context", "chat", "system")}
    spec.update(_chat_template(ns))
    return launch("generate", ns, spec, check=check_positions)


def _chat_template(ns: argparse.Namespace) -> dict[str, str]:
    """The ``--chat-template`` text for the spec (none: the tokenizer's own); refuses the chat
    flags without ``--chat``."""
    if not ns.chat:
        given = [f for f, v in (("--system", ns.system), ("--chat-template", ns.chat_template))
                 if v is not None]
        if given:
            raise ValueError(f"{' and '.join(given)} only apply to a chat prompt; add --chat")
        return {}
    if ns.chat_template is None:
        return {}
    if not os.path.isfile(ns.chat_template):
        raise ValueError(f"--chat-template {ns.chat_template} is not a file; pass a jinja chat "
                         "template file")
    with open(ns.chat_template, encoding="utf-8") as f:
        return {"chat_template": f.read(), "chat_template_origin": ns.chat_template}
