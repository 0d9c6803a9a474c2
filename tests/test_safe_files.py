"""Files domino reads or writes in its own folders (runs, checkpoints, caches, datasets) are
never reached through a link: reads refuse links and special files without following them
(a FIFO does not hang), writes refuse links or replace them, and a run folder holding a link
where domino writes is refused before anything starts."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from domino.cli import main
from domino.safe_files import (
    NotAFileError,
    open_for_write,
    open_regular,
    read_regular,
    write_atomic,
)


@pytest.fixture
def planted(tmp_path: Path) -> tuple[Path, Path]:
    """A link ``link`` to a file ``secret`` holding b"secret"."""
    secret = tmp_path / "secret"
    secret.write_bytes(b"secret")
    link = tmp_path / "link"
    link.symlink_to(secret)
    return link, secret


def test_reads_refuse_links_folders_and_fifos(tmp_path: Path, planted) -> None:
    link, secret = planted
    for path in (link, tmp_path):
        with pytest.raises(NotAFileError):
            read_regular(path)
    dangling = tmp_path / "dangling"
    dangling.symlink_to(tmp_path / "nowhere")
    with pytest.raises(NotAFileError, match="is a symbolic link"):
        open_regular(dangling)  # the same refusal whether the target exists or not
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(NotAFileError, match="not a regular file"):
        read_regular(fifo)  # refused at once, not blocked waiting for a writer
    assert read_regular(secret) == b"secret"
    with pytest.raises(OSError, match="over the 3-byte limit"):
        read_regular(secret, limit=3)
    assert read_regular(link, follow=True) == b"secret"  # where a caller judged the link


@pytest.mark.parametrize("mode", ["w", "wb", "a", "ab", "x", "xb"])
def test_writes_never_go_through_a_link(planted, mode: str) -> None:
    link, secret = planted
    with pytest.raises((NotAFileError, FileExistsError)):
        open_for_write(link, mode)
    assert secret.read_bytes() == b"secret"


def test_write_atomic_replaces_a_link(planted) -> None:
    link, secret = planted
    write_atomic(link, "mine", durable=True)
    assert not link.is_symlink() and link.read_text() == "mine"
    assert secret.read_bytes() == b"secret"
    assert [p.name for p in link.parent.iterdir() if p.name.endswith(".tmp")] == []


def test_a_run_folder_with_a_link_where_domino_writes_is_refused(tmp_path: Path, planted,
                                                                  byte_dataset, capfd) -> None:
    link, secret = planted
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").symlink_to(secret)
    capfd.readouterr()
    rc = main(["train", "--data-path", byte_dataset(20_000), "--num-layers", "1",
               "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
               "--train-iters", "1", "--save", str(run), "--overwrite"])
    err = capfd.readouterr().err
    assert rc == 2, err
    line = [ln for ln in err.splitlines() if ln.strip()]
    assert len(line) == 1 and "metrics.jsonl is a symbolic link" in line[0], err
    assert secret.read_bytes() == b"secret" and (run / "metrics.jsonl").is_symlink()
