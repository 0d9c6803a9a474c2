"""domino: tensor-parallel language models whose TP communication hides behind computation."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__version__ = "0.1.0"

# Lazy exports: `import domino.data` (e.g. in preprocessing workers) must not pay for torch.
_EXPORTS = {
    "TransformerConfig": "domino.config",
    "ParallelState": "domino.parallel_state",
    "Plan": "domino.plan",
    "RuntimeConfig": "domino.runtime",
    "AttnMaskType": "domino.enums",
    "LayerType": "domino.enums",
}
__all__ = ["TransformerConfig", "ParallelState", "Plan", "RuntimeConfig", "AttnMaskType",
           "LayerType", "__version__"]

if TYPE_CHECKING:
    from domino.config import TransformerConfig
    from domino.enums import AttnMaskType, LayerType
    from domino.parallel_state import ParallelState
    from domino.plan import Plan
    from domino.runtime import RuntimeConfig


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'domino' has no attribute {name!r}")
