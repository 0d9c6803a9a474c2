"""Gemma 1, 2 and 3: read only to be refused. What their modeling code does that config.json
does not show is here; the settings it shows (soft-capping, local and global layers,
query_pre_attn_scalar) are named from the file's keys
(:mod:`~domino.checkpoint.families.unknown`)."""

from __future__ import annotations

from domino.checkpoint.families.family import Family

_GEMMA = ("RMSNorm scaling by (1 + weight)", "the embedding scaled by sqrt(hidden_size)",
          "GeGLU (a tanh-GELU gate)")
_GEMMA_2_3 = ("norms before and after each sublayer (four per layer)",)


def _lacks(model_type: str) -> tuple[str, ...]:
    return _GEMMA + (_GEMMA_2_3 if model_type != "gemma" else ())


FAMILY = Family(model_type="gemma", name="Gemma", also=("gemma2", "gemma3", "gemma3_text"),
                lacks=_lacks)
