"""Run the Hugging Face interop tests against older ``transformers`` releases than the one
installed (the test extra installs the newest; users' folders are often written by 4.x).

Each version is installed once, with the ``tokenizers`` and ``huggingface_hub`` its wheel
requires and nothing else (``pip install --no-deps --target``), into
``${DOMINO_CACHE_DIR:-~/.cache/domino}/transformers-VERSION``, which is put first on
``PYTHONPATH`` for the test run; the virtual environment is not touched. Then the HF test files
(``tests/test_hf_*.py``, ``tests/test_bf16_rounding.py``) run against it, and a table per
version and file gives passed / skipped / failed. A family the version predates is skipped with
the release that added it (``tests/hf_compat.py``). Needs PyPI the first time.

    python scripts/test_transformers_versions.py                  # 4.57.6 and 4.45.2
    python scripts/test_transformers_versions.py 4.50.0 --installed  # and the installed one
    python scripts/test_transformers_versions.py 4.57.6 -- -k gemma  # extra pytest arguments

Exit status 1 when a test failed. Not part of the default test command.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT = ("4.57.6", "4.45.2")  # the last 4.x release, and the floor pyproject states
COMPANIONS = ("tokenizers", "huggingface-hub")  # what the wheel pins that 5.x's venv has newer
# Optional packages a 4.x release imports when they are installed: where this environment has
# one (transformers 5 pulls in ``kernels``, whose new releases need huggingface_hub 1.x), the
# release's own pin (from its extras) goes into the target too.
OPTIONAL = ("kernels",)


def cache_dir() -> Path:
    return Path(os.environ.get("DOMINO_CACHE_DIR") or Path.home() / ".cache" / "domino")


def _pip(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", "--disable-pip-version-check", "-q", *args],
                   check=True)


def _installed(name: str) -> bool:
    try:
        importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def _companions(wheel: Path) -> list[str]:
    """The wheel's requirements on COMPANIONS (unconditional ones), and on the OPTIONAL
    packages this environment has (from any extra), as pip specifiers."""
    with zipfile.ZipFile(wheel) as zf:
        meta = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        lines = zf.read(meta).decode().splitlines()
    out: dict[str, str] = {}
    for line in lines:
        if not line.startswith("Requires-Dist:"):
            continue
        spec, _, marker = line.split(":", 1)[1].replace(" ", "").partition(";")
        name = re.match(r"[A-Za-z0-9_.-]+", spec)[0].lower().replace("_", "-")
        if (name in COMPANIONS and not marker) or (name in OPTIONAL and _installed(name)):
            out.setdefault(name, spec)
    return list(out.values())


def install(version: str) -> Path:
    """``transformers==version`` with its tokenizers and huggingface_hub in the cache (once)."""
    target = cache_dir() / f"transformers-{version}"
    if (target / ".complete").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        _pip("download", "--no-deps", "--dest", tmp, f"transformers=={version}")
        wheel = next(Path(tmp).glob("transformers-*.whl"))
        partial = Path(tmp) / "site"
        _pip("install", "--no-deps", "--target", str(partial), str(wheel), *_companions(wheel))
        shutil.rmtree(target, ignore_errors=True)
        partial.rename(target)
    (target / ".complete").write_text(version + "\n")
    return target


def _env(site: Path | None) -> dict[str, str]:
    env = dict(os.environ)
    if site is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), env.get("PYTHONPATH")]))
    return env


def _check_version(site: Path | None, version: str | None) -> str:
    """The transformers version the run imports (it must be ``version`` when given)."""
    got = subprocess.run([sys.executable, "-c", "import transformers; print("
                          "transformers.__version__)"], env=_env(site), cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout.strip()
    if version is not None and got != version:
        raise SystemExit(f"{site} imports transformers {got}, not {version}")
    return got


def run_tests(site: Path | None, report: Path, extra: list[str], workers: int) -> int:
    files = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").glob("test_hf_*.py"))
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-n", str(workers),
           "-rfEs", f"--junitxml={report}", *files, "tests/test_bf16_rounding.py", *extra]
    return subprocess.run(cmd, env=_env(site), cwd=ROOT).returncode


def counts(report: Path) -> dict[str, dict[str, int]]:
    """{test file: {passed, skipped, failed}} from pytest's JUnit XML."""
    out: dict[str, dict[str, int]] = {}
    for case in ET.parse(report).iter("testcase"):
        name = "tests/" + case.get("classname", "").split(".")[-1] + ".py"
        row = out.setdefault(name, {"passed": 0, "skipped": 0, "failed": 0})
        tags = {child.tag for child in case}
        kind = "failed" if tags & {"failure", "error"} else (
            "skipped" if "skipped" in tags else "passed")
        row[kind] += 1
    return out


def table(version: str, rows: dict[str, dict[str, int]]) -> str:
    lines = [f"transformers {version}", f"  {'file':<36} passed skipped failed"]
    total = {"passed": 0, "skipped": 0, "failed": 0}
    for name in sorted(rows):
        r = rows[name]
        lines.append(f"  {name:<36} {r['passed']:>6} {r['skipped']:>7} {r['failed']:>6}")
        for k in total:
            total[k] += r[k]
    lines.append(f"  {'total':<36} {total['passed']:>6} {total['skipped']:>7} "
                 f"{total['failed']:>6}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("versions", nargs="*", default=list(DEFAULT),
                        help=f"transformers releases to test (default: {' '.join(DEFAULT)})")
    parser.add_argument("--installed", action="store_true",
                        help="also run against the transformers installed in this environment")
    parser.add_argument("-n", "--workers", type=int, default=2, help="pytest-xdist workers")
    args = parser.parse_args(argv)
    runs: list[tuple[str, Path | None]] = [(v, install(v)) for v in args.versions]
    if args.installed:
        runs.append((_check_version(None, None) + " (installed)", None))
    summaries, status = [], 0
    with tempfile.TemporaryDirectory() as tmp:
        for i, (version, site) in enumerate(runs):
            if site is not None:
                _check_version(site, version)
            print(f"\n=== transformers {version} ===", flush=True)
            report = Path(tmp) / f"report-{i}.xml"
            status |= run_tests(site, report, extra, args.workers) not in (0, 5)
            summaries.append(table(version, counts(report)) if report.is_file()
                             else f"transformers {version}: no report (pytest did not run)")
    print("\n" + "\n\n".join(summaries))
    return int(status)


if __name__ == "__main__":
    sys.exit(main())
