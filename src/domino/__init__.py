"""domino: tensor-parallel language models whose TP communication hides behind computation."""

from domino.config import TransformerConfig
from domino.enums import AttnMaskType, AttnType, LayerType, ModelType
from domino.parallel_state import ParallelState

__version__ = "0.1.0"
__all__ = ["TransformerConfig", "ParallelState", "AttnMaskType", "AttnType", "LayerType",
           "ModelType", "__version__"]
