# Sourced by the benchmark peers' setup.sh (compare_deepspeed/, compare_megatron_moe/): a peer's
# own venv with the CPU torch installed FIRST, and a pip constraints file that holds it while
# the peer and its dependencies are installed, so pip can never swap the CPU wheel for a
# multi-GB CUDA build.
#
#   peer_venv VENV_DIR
#
# leaves: $pip (the venv's pip, an array), $constraints (the file pinning torch), $extra (pip
# arguments for TORCH_INDEX_URL), and check_torch_still_cpu WHAT (fails loudly when installing
# WHAT replaced the CPU torch). Environment: PYTHON (default python3), TORCH_VERSION (default
# 2.13.0), TORCH_INDEX_URL (an optional extra index for the CPU wheel, e.g.
# https://download.pytorch.org/whl/cpu; not needed where a CPU wheel is on pip's find-links).

peer_venv() {
    local venv="$1" python="${PYTHON:-python3}"
    torch_version="${TORCH_VERSION:-2.13.0}"
    echo "== creating $venv (python: $($python --version 2>&1))"
    "$python" -m venv "$venv"
    # Keep the venv out of git wherever it lives (Python >= 3.13's venv writes the same file).
    printf '# created by scripts/peer_venv.sh\n*\n' >"$venv/.gitignore"
    pip=("$venv/bin/python" -m pip)
    "${pip[@]}" install --upgrade pip setuptools wheel
    constraints="$(mktemp)"
    trap 'rm -f "$constraints"' EXIT
    echo "torch==$torch_version" >"$constraints"
    extra=()
    if [[ -n "${TORCH_INDEX_URL:-}" ]]; then extra=(--extra-index-url "$TORCH_INDEX_URL"); fi

    echo "== torch $torch_version first"
    "${pip[@]}" install "${extra[@]}" "torch==$torch_version"
    "$venv/bin/python" - <<'PY'
import sys, torch
if torch.version.cuda is not None or not torch.__version__.endswith("+cpu"):
    sys.exit(f"setup.sh: got torch {torch.__version__} (CUDA {torch.version.cuda}); wanted the "
             "CPU build: set TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu and rerun")
print("torch", torch.__version__)
PY
    peer_python="$venv/bin/python"
}

check_torch_still_cpu() {
    "$peer_python" - "$1" <<'PY'
import sys, torch
if torch.version.cuda is not None or not torch.__version__.endswith("+cpu"):
    sys.exit(f"setup.sh: torch changed to {torch.__version__} while installing {sys.argv[1]}")
PY
}
