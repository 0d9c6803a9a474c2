#!/usr/bin/env bash
# Create the separate DeepSpeed venv that compare.py benchmarks against.
#
#   bash scripts/compare_deepspeed/setup.sh [VENV_DIR]      (default: <repo>/.venv-deepspeed)
#
# DeepSpeed is only a benchmark peer: it lives in its own venv and is never a dependency of
# domino. torch is installed FIRST and pinned through a constraints file while DeepSpeed and its
# dependencies are installed, so pip can never swap the CPU wheel for a multi-GB CUDA build; the
# script checks afterwards that torch is still the CPU build and fails loudly otherwise.
#
# Environment overrides:
#   PYTHON           interpreter for the venv          (default: python3)
#   TORCH_VERSION    torch release to install first    (default: 2.13.0)
#   DEEPSPEED_VERSION                                  (default: 0.19.8, the version measured)
#   TORCH_INDEX_URL  optional extra index for the CPU wheel, e.g.
#                    https://download.pytorch.org/whl/cpu (not needed where a CPU wheel is on
#                    pip's find-links, as on the machine this was written on)
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
venv="${1:-$repo/.venv-deepspeed}"
ds_version="${DEEPSPEED_VERSION:-0.19.8}"

source "$here/../peer_venv.sh"
peer_venv "$venv"

# DeepSpeed ships an sdist whose setup.py imports torch: --no-build-isolation makes it build
# against the torch just installed (an isolated build env would download another torch).
# DS_BUILD_OPS=0: no C++/CUDA ops are compiled at install time (none are needed on CPU here).
echo "== deepspeed $ds_version (DS_BUILD_OPS=0, torch held at $torch_version)"
"${pip[@]}" install packaging ninja
DS_BUILD_OPS=0 DS_ACCELERATOR=cpu "${pip[@]}" install --no-build-isolation \
    -c "$constraints" "${extra[@]}" "deepspeed==$ds_version"

echo "== checking"
check_torch_still_cpu deepspeed
DS_ACCELERATOR=cpu "$venv/bin/python" - <<'EOF'
import torch
import deepspeed
from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.domino.transformer import DominoTransformer  # noqa: F401
print(f"torch {torch.__version__}, deepspeed {deepspeed.__version__}, "
      f"accelerator {get_accelerator()._name}")
EOF
echo "== done: run compare.py with the project's venv, e.g."
echo "   python scripts/compare_deepspeed/compare.py --ds-python $venv/bin/python"
