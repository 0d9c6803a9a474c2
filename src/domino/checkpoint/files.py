"""Writing and checking a checkpoint's files: atomic JSON, durable renames, size and SHA-256
records, and whether a file is safetensors (its header parsed as JSON, nothing else read)."""

from __future__ import annotations

import hashlib
import json
import os
import struct
from pathlib import Path
from typing import Any

from domino.safe_files import open_regular, write_atomic

TMP_SUFFIX = ".tmp"  # a file or folder being written; renamed into place once complete


def write_json_atomic(path: Path, value: dict[str, Any]) -> None:
    """Write JSON to a new file beside ``path``, fsync it, then rename it over ``path`` (a link
    at either name is never written through)."""
    write_atomic(path, json.dumps(value, indent=1) + "\n", durable=True)


def file_record(path: Path) -> dict[str, Any]:
    """Size and SHA-256 of a written file (after fsyncing it)."""
    with open_regular(path) as f:
        os.fsync(f.fileno())
    return {"bytes": path.stat().st_size, "sha256": sha256_of(path)}


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open_regular(path) as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def safetensors_header_problem(path: Path, follow: bool = False) -> str | None:
    """Why ``path`` is not a safetensors file (None when its header parses); a link is
    refused unless ``follow`` (a caller that checked where it leads)."""
    try:
        with open_regular(path, follow=follow) as f:
            head = f.read(8)
            if len(head) < 8:
                return "too short to be a safetensors file"
            (n,) = struct.unpack("<Q", head)
            if n > 100 << 20 or n + 8 > path.stat().st_size:
                return "not a safetensors file (bad header length)"
            header = json.loads(f.read(n).decode("utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return "not a safetensors file (its header is not JSON)"
    if not isinstance(header, dict):
        return "not a safetensors file (its header is not a JSON object)"
    return None
