"""Gemma 1, 2 and 3: read only to be refused, naming what this model cannot express."""

from __future__ import annotations

from domino.checkpoint.families.family import Family

_GEMMA = ("RMSNorm scaling by (1 + weight)", "the embedding scaled by sqrt(hidden_size)",
          "GeGLU (a tanh-GELU gate)")
_GEMMA_2_3 = ("attention and final logit soft-capping", "norms before and after each "
              "sublayer (four per layer)", "local sliding-window layers alternating with "
              "global ones", "query_pre_attn_scalar")


def _lacks(model_type: str) -> tuple[str, ...]:
    return _GEMMA + (_GEMMA_2_3 if model_type != "gemma" else ())


FAMILY = Family(model_type="gemma", name="Gemma", also=("gemma2", "gemma3", "gemma3_text"),
                lacks=_lacks)
