"""Opening the files of a run, a checkpoint, a dataset or a cache without following links.

domino never writes a symbolic link into the folders it owns, so a link found there was planted
(or copied in by mistake): reading through it could disclose another file, writing through it
could overwrite one. These helpers open with ``O_NOFOLLOW`` and refuse anything but a regular
file, and create files with ``O_EXCL`` (or by an atomic rename, which replaces a link at the
name instead of writing where it points). A refusal never says where a link leads or whether
its target exists.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import stat
import tempfile
from pathlib import Path
from typing import IO, Any

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
# Opening a FIFO would block until a writer comes: non-blocking for the open itself only.
_NONBLOCK = getattr(os, "O_NONBLOCK", 0)


class NotAFileError(OSError):
    """The path is a symbolic link, a folder or a special file where a regular file belongs."""


def _open_fd(path: str | os.PathLike, flags: int, mode: int = 0o644,
             follow: bool = False) -> int:
    try:
        fd = os.open(path, flags | (0 if follow else _NOFOLLOW) | _CLOEXEC | _NONBLOCK, mode)
    except OSError as err:
        if err.errno == errno.ELOOP or (err.errno == errno.EISDIR):
            kind = "a symbolic link" if os.path.islink(path) else "not a regular file"
            raise NotAFileError(err.errno, f"{path} is {kind}") from None
        raise
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise NotAFileError(errno.EINVAL, f"{path} is not a regular file")
        if _NONBLOCK:
            import fcntl

            fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~_NONBLOCK)
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_regular(path: str | os.PathLike, mode: str = "rb", *, follow: bool = False) -> IO:
    """``path`` opened for reading (``"rb"`` or ``"r"``, UTF-8), never through a link unless
    ``follow`` (for a caller that has checked where the link leads): :class:`NotAFileError`
    for a link, a folder, a FIFO or a device."""
    if mode not in ("rb", "r"):
        raise ValueError(f"open_regular reads only ('rb' or 'r'), not {mode!r}")
    fd = _open_fd(path, os.O_RDONLY, follow=follow)
    return os.fdopen(fd, mode, **({} if "b" in mode else {"encoding": "utf-8"}))


def read_regular(path: str | os.PathLike, limit: int | None = None, *,
                 follow: bool = False) -> bytes:
    """The bytes of regular file ``path`` (as :func:`open_regular` opens it); OSError(EFBIG)
    past ``limit``."""
    with open_regular(path, follow=follow) as f:
        size = os.fstat(f.fileno()).st_size
        if limit is not None and size > limit:
            raise OSError(errno.EFBIG, f"{path}: {size} bytes, over the {limit}-byte limit")
        return f.read()


def open_for_write(path: str | os.PathLike, mode: str = "w") -> IO:
    """``path`` opened for writing without following a link: ``"w"``/``"wb"`` create or
    truncate, ``"a"``/``"ab"`` append, ``"x"``/``"xb"`` create a new file only (FileExistsError
    when anything, a link included, is at the name). Text is UTF-8."""
    kinds = {"w": os.O_TRUNC, "a": os.O_APPEND, "x": os.O_EXCL}
    if mode.rstrip("b") not in kinds or mode.count("b") > 1:
        raise ValueError(f"open_for_write takes w, a or x (with b), not {mode!r}")
    fd = _open_fd(path, os.O_WRONLY | os.O_CREAT | kinds[mode[0]])
    return os.fdopen(fd, mode.replace("x", "w"), **({} if "b" in mode else
                                                    {"encoding": "utf-8"}))


def write_atomic(path: str | os.PathLike, data: bytes | str, *, durable: bool = False,
                 mode: int = 0o644) -> None:
    """Write ``data`` to a new file beside ``path`` and rename it over ``path``: a reader sees
    a whole file or none, and a link at ``path`` is replaced, never written through. With
    ``durable`` the file and the rename are fsynced."""
    target = Path(path)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, mode)  # mkstemp makes owner-only files
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode("utf-8") if isinstance(data, str) else data)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    if durable:
        fsync_dir(target.parent)


def read_cache(path: str | os.PathLike, limit: int = 16 << 20) -> dict:
    """A cache file's JSON object; {} when it is absent, unreadable, a link, damaged or not an
    object (a cache is a shortcut: what it lacks is measured again)."""
    try:
        data = json.loads(read_regular(path, limit))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def update_cache(path: str | os.PathLike, key: str, value: Any) -> None:
    """Add ``key: value`` to the JSON cache at ``path`` (its folder made if need be), by an
    atomic rename: processes writing at once each leave a whole file, the last one's. A cache
    that cannot be written (a read-only home) is skipped."""
    try:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        data = {**read_cache(path), key: value}
        write_atomic(path, json.dumps(data, indent=1, sort_keys=True))
    except OSError:
        pass


def fsync_dir(path: str | os.PathLike) -> None:
    """Make a rename in folder ``path`` durable (a no-op where folders cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
