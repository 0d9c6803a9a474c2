#!/usr/bin/env bash
# Create the separate Megatron-core venv that compare.py benchmarks against.
#
#   bash scripts/compare_megatron_moe/setup.sh [VENV_DIR]      (default: <repo>/.venv-megatron)
#
# Megatron-core is only a benchmark peer: it lives in its own venv and is never a dependency of
# domino. torch is installed FIRST and pinned through a constraints file while megatron-core and
# its dependencies are installed, so pip can never swap the CPU wheel for a multi-GB CUDA build;
# the script checks afterwards that torch is still the CPU build and fails loudly otherwise.
# Nothing CUDA-only is installed: no Transformer Engine, no apex, no grouped_gemm (the worker
# uses Megatron's SequentialMLP experts and its pure-PyTorch paths).
#
# Environment overrides:
#   PYTHON           interpreter for the venv          (default: python3)
#   TORCH_VERSION    torch release to install first    (default: 2.13.0)
#   MCORE_VERSION    megatron-core requirement          (default: 0.16.*; 0.16.1 was measured)
#   TORCH_INDEX_URL  optional extra index for the CPU wheel, e.g.
#                    https://download.pytorch.org/whl/cpu (not needed where a CPU wheel is on
#                    pip's find-links, as on the machine this was written on)
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
venv="${1:-$repo/.venv-megatron}"
mcore_version="${MCORE_VERSION:-0.16.*}"

source "$here/../peer_venv.sh"
peer_venv "$venv"

# megatron-core ships binary wheels (its only required dependencies are torch, numpy and
# packaging); no extras: [dev]/[lts] would pull Transformer Engine and other CUDA packages.
echo "== megatron-core $mcore_version (torch held at $torch_version)"
"${pip[@]}" install -c "$constraints" "${extra[@]}" "megatron-core==$mcore_version"

echo "== checking"
check_torch_still_cpu megatron-core
"$venv/bin/python" - <<'PY'
import torch
import megatron.core
from megatron.core.transformer.moe.moe_layer import MoELayer  # noqa: F401
from megatron.core.transformer.moe.experts import SequentialMLP  # noqa: F401
from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher  # noqa: F401
print(f"torch {torch.__version__}, megatron-core {megatron.core.__version__}, "
      f"CUDA available: {torch.cuda.is_available()}")
PY
echo "== done: run compare.py with the project's venv, e.g."
echo "   python scripts/compare_megatron_moe/compare.py --mcore-python $venv/bin/python"
