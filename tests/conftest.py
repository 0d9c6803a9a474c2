import os
import sys

sys.path.insert(0, os.path.dirname(__file__))  # tests/dist.py and helpers

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def byte_dataset(tmp_path_factory):
    """``byte_dataset(limit_bytes)``: the prefix of a byte-tokenized dataset of the standard
    library's first ``limit_bytes`` of .py files (built once per size per session)."""
    from domino.data import ByteTokenizer, preprocess
    from domino.data.preprocess import stdlib_corpus_files

    made: dict[int, str] = {}

    def make(limit_bytes: int) -> str:
        if limit_bytes not in made:
            prefix = tmp_path_factory.mktemp("data") / "small"
            preprocess(stdlib_corpus_files(limit_bytes=limit_bytes), prefix, ByteTokenizer(),
                       progress=False)
            made[limit_bytes] = str(prefix)
        return made[limit_bytes]

    return make
