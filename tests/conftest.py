import contextlib
import fcntl
import os
import re
import sys
import tempfile
import uuid
from pathlib import Path

sys.path.insert(0, os.path.dirname(__file__))  # tests/dist.py and helpers

import pytest  # noqa: E402

# The README's set-up installs without compiling bytecode (pip --no-compile, uv): the first import
# in this run writes it once, for the modules the suite really imports, instead of every one of the
# suite's few hundred interpreters compiling torch again where PYTHONDONTWRITEBYTECODE is set.
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
sys.dont_write_bytecode = False

# The suite starts over a hundred ranks through the launcher: as forks of a server that imported
# torch once (domino.rank_fork), not fresh interpreters that each import it again. The launcher's
# own tests cover both ways (test_rank_fork); a test that needs fresh interpreters sets "exec".
os.environ.setdefault("DOMINO_RANK_START", "fork")

# The GEMM rates MFU is measured against (domino.gemm_rate) are cached per process of the suite
# (its ranks inherit the variable), never in the user's ~/.cache.
_CACHE = None
if "DOMINO_CACHE_DIR" not in os.environ:
    _CACHE = tempfile.mkdtemp(prefix="domino-test-cache-")
    os.environ["DOMINO_CACHE_DIR"] = _CACHE

# ---- three workers (pytest-xdist: pyproject's addopts) -------------------------------------------
#
# Each test file runs on one worker as a whole (its module fixtures are built once), except the
# files that add checks to the session's shared tensor-parallel spawns (tp_helpers.register),
# which all run on one worker so those spawns start once. A test marked `serial` runs while no
# other test does: it reads host-wide state (network namespaces, busy CPU) or compares times
# that a test on another worker would disturb.

_TESTS = Path(__file__).parent
_REGISTERS = re.compile(r"^register\(", re.M)  # a module-level tp_helpers.register(...) call


def pytest_configure(config: pytest.Config) -> None:
    if hasattr(config, "workerinput"):
        # A worker's own model code runs on one thread: the three workers' ranks and
        # subprocesses keep the cores busy, and OpenMP threads that spin against them make
        # tiny models many times slower (tp_helpers.one_thread; ranks set their own count).
        import torch

        torch.set_num_threads(1)
    config.addinivalue_line("markers", "serial: no other test runs at the same time under "
                            "pytest-xdist (host-wide state or timing)")
    if getattr(config.option, "numprocesses", None) and not hasattr(config, "workerinput"):
        # The controller names the run, so it can remove the workers' lock files at the end.
        config.option.testrunuid = config.option.testrunuid or uuid.uuid4().hex


def pytest_unconfigure(config: pytest.Config) -> None:
    if _CACHE is not None:
        import shutil

        shutil.rmtree(_CACHE, ignore_errors=True)
    uid = getattr(config.option, "testrunuid", None)
    if uid and not hasattr(config, "workerinput"):
        for suffix in (".gate", ".lock"):
            with contextlib.suppress(OSError):
                os.unlink(_lock_base(uid) + suffix)


# The longest files (pytest --durations on the dev machine) are handed out first, so that the two
# workers finish together rather than one running a long file alone at the end. Only the order of
# the hand-out depends on this list; a file not in it comes after, in collection order.
_FIRST = ("test_gpt_tp.py", "test_bench.py", "test_hf_interop.py", "test_train_cli.py",
          "test_pipeline.py", "test_bench_pipeline.py", "test_compile.py", "test_durable_cli.py",
          "test_train_parallel.py", "test_saved_run_cli.py", "test_shm.py", "test_device_check.py",
          "test_checkpoint_resume.py", "test_torchrun.py", "test_fsdp.py", "test_fsdp_pipeline.py",
          "test_lora_moe.py",
          "test_lora_runs.py", "test_fsdp_layouts.py", "test_lora_workflow.py", "test_hsdp.py",
          "test_lora_export.py")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if hasattr(config, "workerinput"):  # every worker sorts alike: the collections must agree
        rank = {name: i for i, name in enumerate(_FIRST)}
        items.sort(key=lambda item: rank.get(item.path.name, len(_FIRST)))


# Files that share a session fixture costing processes run on one worker too, so it is built
# once: the saved `domino train` run (``clock_run``) of the durability tests and of what starts
# from a saved run.
_TOGETHER = {"test_durable_cli.py": "saved runs", "test_saved_run_cli.py": "saved runs"}


def pytest_xdist_make_scheduler(config: pytest.Config, log):
    from xdist.scheduler import LoadFileScheduling

    shared = {f"{_TESTS.name}/{f.name}" for f in _TESTS.glob("test_*.py")
              if _REGISTERS.search(f.read_text(encoding="utf-8"))}
    together = {f"{_TESTS.name}/{name}": group for name, group in _TOGETHER.items()}

    class ByFile(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            file = super()._split_scope(nodeid)
            return "tensor-parallel spawns" if file in shared else together.get(file, file)

    config.option.loadscopereorder = False  # collection order (longest first, above)
    return ByFile(config, log)


def _lock_base(uid: str) -> str:
    return os.path.join(tempfile.gettempdir(), f"domino-tests-{uid}")


@contextlib.contextmanager
def _turn(uid: str, alone: bool):
    """Hold the run's lock shared (or exclusive when ``alone``). A test waiting to run alone
    holds the gate, so the other worker starts nothing new meanwhile."""
    base = _lock_base(uid)
    with open(base + ".gate", "a") as gate, open(base + ".lock", "a") as lock:
        fcntl.flock(gate, fcntl.LOCK_EX)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        finally:
            fcntl.flock(gate, fcntl.LOCK_UN)
        yield  # closing the file releases the lock


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem):
    uid = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    if uid is None:  # one process: nothing runs beside it
        yield
        return
    with _turn(uid, item.get_closest_marker("serial") is not None):
        yield


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


@pytest.fixture(scope="session")
def clock_run(tmp_path_factory, byte_dataset) -> Path:
    """A `domino train` run of 6 uninterrupted steps (2 local ranks, TP=2), saved on the clock
    (every step) keeping the last 2 checkpoints: test_durable_cli's clock and keep-K check and
    the reference losses of its SIGKILL test (saving changes no loss), and the saved run that
    test_saved_run_cli's diverging, converting, generating and evaluating start from (a test
    that writes into it works on a copy). One run of two ranks for all of them (both files
    run on one worker: ``_TOGETHER``)."""
    from test_durable_cli import FLAGS, data_flags

    from domino.cli import main

    run = tmp_path_factory.mktemp("clock") / "run"
    flags = list(FLAGS)
    flags[flags.index("--save-interval-minutes") + 1] = "0.000001"
    assert main(["train", *flags, *data_flags(byte_dataset), "--train-iters", "6",
                 "--save-interval", "0", "--keep-checkpoints", "2", "--save", str(run)]) == 0
    return run
