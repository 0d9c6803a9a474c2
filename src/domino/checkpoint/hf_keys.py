"""Reading a Hugging Face ``config.json`` value by value: :class:`HFKeys` reads each key with
its type and rule and refuses a missing, null or ill-typed one in one line naming the file and
the key a user edits (each family names our config fields in those keys for the messages of
the config's own checks: :meth:`~domino.checkpoint.families.family.Family.key`)."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any, NoReturn

from domino.config import TransformerConfig

_REQUIRED, _ABSENT = object(), object()
_FIX = ("set it in config.json to the model's value (the config.json saved with these weights "
        "has it)")
FIX_PAIR = "use the config.json saved with these weights"
_RULES = {"": lambda x: True, "> 0": lambda x: x > 0, ">= 0": lambda x: x >= 0,
          "> 1": lambda x: x > 1, "in [0, 1)": lambda x: 0 <= x < 1}


def _shown(value: Any) -> str:
    text = json.dumps(value)
    text = text if len(text) <= 60 else text[:57] + "..."
    return text + (" (a string)" if isinstance(value, str) else "")


class HFKeys:
    """One ``config.json`` (``raw``, read from ``path``), each value checked as it is read: a
    ValueError names the file, the key as written there (``rope_scaling.factor`` for a nested
    one), the rule and the fix. A key may have alternatives (``("n_embd", "hidden_size")``: the
    first one set is read). ``default`` stands in for an absent key, and for a null one where it
    is None (as in transformers, which saves its keys that default to None as null); without a
    default the key is required."""

    def __init__(self, raw: dict[str, Any], path: str | Path) -> None:
        self.raw, self.path = raw, path
        self.seen: set[str] = set()  # the top-level keys looked up (read or tried)

    def refuse(self, message: str) -> NoReturn:
        raise ValueError(f"{self.path}: {message}")

    def wrong(self, key: str, value: Any, rule: str) -> NoReturn:
        self.refuse(f'"{key}" is {_shown(value)}; it must be {rule}: {_FIX}')

    def _lookup(self, key: str) -> Any:
        value: Any = self.raw
        parts = key.split(".")
        self.seen.add(parts[0])
        for i, part in enumerate(parts):
            if value is None or value is _ABSENT:
                return _ABSENT
            if not isinstance(value, dict):
                self.wrong(".".join(parts[:i]), value, "a JSON object or null")
            value = value.get(part, _ABSENT)
        return value

    def found(self, *keys: str) -> str:
        """The first of ``keys`` that is set (not null), else the first."""
        return next((k for k in keys if self._lookup(k) not in (_ABSENT, None)), keys[0])

    def value(self, keys: str | tuple[str, ...], default: Any, rule: str) -> tuple[str, Any]:
        """(the key read, its value): ``default`` when absent (or null where it is None)."""
        names = (keys,) if isinstance(keys, str) else keys
        key = self.found(*names)
        value = self._lookup(key)
        if value is _ABSENT or value is None:
            if default is _REQUIRED or (value is None and default is not None):
                what = "missing" if value is _ABSENT else "null"
                name = f'"{key}"' + "".join(f' (or "{k}")' for k in names if k != key)
                self.refuse(f"{name} is {what}; it must be {rule}: {_FIX}")
            return key, default
        return key, value

    def integer(self, keys: str | tuple[str, ...], default: Any = _REQUIRED, *,
                minimum: int = 1) -> Any:
        rule = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
        key, value = self.value(keys, default, rule)
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool)
                                  or value < minimum):
            self.wrong(key, value, rule)
        return value

    def number(self, keys: str | tuple[str, ...], default: Any = _REQUIRED, *,
               rule: str = "") -> Any:
        text = f"a number {rule}".strip()
        key, value = self.value(keys, default, text)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int | float) \
                or not math.isfinite(value) or not _RULES[rule](value):
            self.wrong(key, value, text)
        return float(value)

    def numbers(self, keys: str | tuple[str, ...], *, rule: str = "") -> list[float]:
        """A required list of finite numbers, each one ``rule``."""
        text = f"a list of numbers {rule}".strip()
        key, value = self.value(keys, _REQUIRED, text)
        if not isinstance(value, list) or not all(
                isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)
                and _RULES[rule](x) for x in value):
            self.wrong(key, value, text)
        return [float(x) for x in value]

    def flag(self, key: str, default: bool) -> bool:
        key, value = self.value(key, default, "true or false")
        if not isinstance(value, bool):
            self.wrong(key, value, "true or false")
        return value

    def text(self, keys: str | tuple[str, ...], default: Any = _REQUIRED, *,
             rule: str = "a string") -> Any:
        key, value = self.value(keys, default, rule)
        if value is not None and not isinstance(value, str):
            self.wrong(key, value, rule)
        return value

    def build(self, names: dict[str, str], **fields: Any) -> TransformerConfig:
        """Our config of ``fields``; its own refusals name the keys of ``names`` instead."""
        try:
            return TransformerConfig(**fields)
        except ValueError as err:
            pattern = r"\b(" + "|".join(sorted(names, key=len, reverse=True)) + r")\b"
            message = re.sub(pattern, lambda m: names[m[1]], str(err)).rstrip(".")
            self.refuse(f"{message}; {FIX_PAIR}")
