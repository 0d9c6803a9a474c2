"""``domino generate RUN_DIR --prompt TEXT``: continue a prompt with a saved model (KV cache;
greedy, or sampled with temperature / top-k / top-p), at any TP size."""

from __future__ import annotations

import argparse

from domino.inference.session import add_launch_arguments, launch
from domino.inference.tasks import check_positions


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_launch_arguments(parser)
    parser.add_argument("--prompt", required=True, help="text to continue")
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
                                         "ids", "slide_context")}
    return launch("generate", ns, spec, check=check_positions)
