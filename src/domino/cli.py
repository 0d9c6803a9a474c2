"""The ``domino`` command: its subcommands are :data:`SUBCOMMANDS` (``train``, ``bench``, ...).

Each subcommand is a module of :mod:`domino.commands` exposing ``add_arguments(parser)`` and
``run(args)``; this file only wires them together and turns the errors a user can fix into exit
code 2 (a subcommand's module is imported only when it is run, or for the full ``--help``). A
new subcommand is its module plus one entry of :data:`SUBCOMMANDS`.
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import re
import sys

# Subcommand -> (its module in domino.commands, one line of help): the registry of subcommands
# (tests/test_architecture.py checks that it names every command module).
SUBCOMMANDS = {
    "train": ("train", "Train a GPT model with Domino tensor parallelism."),
    "generate": ("generate", "Generate text from a saved model."),
    "eval": ("eval", "Loss and perplexity of a saved model on a dataset."),
    "convert": ("convert", "Reshard a checkpoint to another TP size."),
    "export": ("export", "Export a checkpoint as a transformers model (or LoRA adapters "
                         "for PEFT)."),
    "import": ("hf_import", "Import a transformers model (GPT-2, Llama, Qwen, Mistral, ...)."),
    "preprocess": ("preprocess",
                   "Tokenize text, JSONL, Parquet or Arrow into a Megatron .bin/.idx dataset."),
    "bench": ("bench", "Measure sync TP vs Domino vs no-comm step times."),
    "demo": ("demo", "Tiny GPT forward/backward/SGD at TP=2 on CPU (sanity check)."),
}


class Parser(argparse.ArgumentParser):
    """argparse, with its usage errors as one line (no usage block): ``domino train: error:
    unrecognized arguments: --foo; see domino train --help``, and the nearest flag or command
    when one is close."""

    def error(self, message: str):  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message}{self._suggestion(message)}; see "
                     f"{self.prog} --help\n")

    def _suggestion(self, message: str) -> str:
        unknown = re.match(r"unrecognized arguments: (-\S+)", message)
        if unknown:
            word, known = unknown.group(1).split("=", 1)[0], list(self._option_string_actions)
        else:
            choice = re.search(r"invalid choice: '([^']*)' \(choose from (.*)\)", message)
            if not choice:
                return ""
            word, known = choice.group(1), re.findall(r"'([^']*)'", choice.group(2))
        close = difflib.get_close_matches(word, known, n=1)
        return f" (did you mean {close[0]}?)" if close else ""


def _command(name: str):
    """The module of subcommand ``name``."""
    return importlib.import_module(f"domino.commands.{SUBCOMMANDS[name][0]}")


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="domino", description="Tensor-parallel LM training that hides communication "
        "behind computation (Domino).")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_module, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text,
                           formatter_class=argparse.ArgumentDefaultsHelpFormatter)
        _command(name).add_arguments(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in SUBCOMMANDS and argv[0] not in ("-h", "--help"):
        # Build only the chosen subcommand's parser: validation runs before any process starts.
        name = argv[0]
        module = _command(name)
        parser = Parser(prog=f"domino {name}", description=SUBCOMMANDS[name][1],
                        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
        module.add_arguments(parser)
        args = parser.parse_args(argv[1:])
        from domino.supervisor import RankFailed

        try:
            result = module.run(args)
        except (ValueError, FileNotFoundError) as err:
            print(f"domino {name}: error: {err}", file=sys.stderr)
            return 2
        except OSError as err:  # a refusal the checks could not foresee; its text names the path
            print(f"domino {name}: error: {err}; free space or fix the permissions there, then "
                  "run again", file=sys.stderr)
            return 2
        except RankFailed as err:  # the rank's own output above says why
            print(f"domino {name}: error: {err}", file=sys.stderr)
            return err.exit_code
        except KeyboardInterrupt as err:
            print(f"domino {name}: interrupted", file=sys.stderr)
            return getattr(err, "exit_code", 130)
        return result if isinstance(result, int) else 0
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 1
    return main([args.command, *argv[1:]])


if __name__ == "__main__":
    sys.exit(main())
