"""The Hugging Face tests against more than one ``transformers``: the installed 5.x and older
4.x releases (``scripts/test_transformers_versions.py`` runs them so). Configs are built with
the keywords the installed version reads, models loaded with its dtype keyword, and a family
the version predates is skipped, naming the release that added it.

Where 5.x and 4.x write a folder differently (``rope_parameters`` against ``rope_theta`` +
``rope_scaling``, ``dtype`` against ``torch_dtype``), each version's own folder is what the
import tests read, so both layouts are tested."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

# The 4.x release whose transformers added each family's classes (from the releases on PyPI:
# the first one whose wheel holds transformers/models/<name>/).
ADDED_IN = {"Olmo2": "4.47.0", "Gemma3": "4.50.0", "Qwen3": "4.51.0", "Qwen3Moe": "4.51.0",
            "SmolLM3": "4.53.0", "GptOss": "4.55.0", "VaultGemma": "4.57.0",
            "FlexOlmo": "4.57.0", "Ministral": "4.57.0"}


def hf():
    """``transformers``, imported when a test first needs it (its import costs each xdist
    worker seconds at collection)."""
    import transformers

    return transformers


def hf_version() -> tuple[int, int]:
    """(major, minor) of the installed transformers."""
    major, minor = hf().__version__.split(".")[:2]
    return int(major), int(minor)


def is_v5() -> bool:
    return hf_version() >= (5, 0)


def hf_class(name: str) -> Any:
    """transformers' class ``name`` (e.g. ``Qwen3Config``), or skip the test, naming the release
    that added it, where the installed transformers predates it."""
    t = hf()
    if not hasattr(t, name):
        family = next((f for f in sorted(ADDED_IN, key=len, reverse=True)
                       if name.startswith(f)), None)
        added = f", added in transformers {ADDED_IN[family]}" if family else ""
        pytest.skip(f"transformers {t.__version__} has no {name}{added}")
    return getattr(t, name)


# The config class of each model_type some supported 4.x release lacks.
CONFIG_OF = {"olmo2": "Olmo2Config", "gemma3_text": "Gemma3TextConfig", "qwen3": "Qwen3Config",
             "qwen3_moe": "Qwen3MoeConfig", "smollm3": "SmolLM3Config", "gpt_oss": "GptOssConfig",
             "vaultgemma": "VaultGemmaConfig", "flex_olmo": "FlexOlmoConfig"}


def needs_model_type(model_type: str) -> None:
    """Skip unless the installed transformers reads ``model_type`` (its config class exists)."""
    if model_type in CONFIG_OF:
        hf_class(CONFIG_OF[model_type])


def needs_phi3_partial_rotary() -> None:
    """Skip where transformers' Phi-3 rotates whole heads whatever ``partial_rotary_factor``
    says (and checks LongRoPE factors against whole heads): before 4.49.0, which added it."""
    if hf_version() < (4, 49):
        pytest.skip(f"transformers {hf().__version__}'s Phi-3 ignores partial_rotary_factor "
                    "(read from 4.49.0)")


def rope_kwargs(params: dict[str, Any]) -> dict[str, Any]:
    """RoPE settings (``rope_parameters`` as transformers 5 takes them: ``rope_type``,
    ``rope_theta`` and the scaling's keys) as the installed version's config keywords: 4.x
    takes ``rope_theta`` and a ``rope_scaling`` without it (None for the default RoPE)."""
    if is_v5():
        return {"rope_parameters": dict(params)}
    scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    if scaling.get("rope_type", "default") == "default":
        assert set(scaling) <= {"rope_type"}, f"a default RoPE has no settings: {scaling}"
        scaling = None
    return {"rope_scaling": scaling,
            **({"rope_theta": params["rope_theta"]} if "rope_theta" in params else {})}


def dtype_kwarg(dtype: Any) -> dict[str, Any]:
    """``from_pretrained``'s dtype keyword: ``dtype`` from 4.56, ``torch_dtype`` before."""
    return {"dtype" if hf_version() >= (4, 56) else "torch_dtype": dtype}


# Families with attention soft-capping, which SDPA skips: transformers 4.48 to 4.57 load them
# with SDPA by default (5.x refuses SDPA for them; 4.47 and older swap in eager themselves).
SOFT_CAPPED = ("gemma2", "vaultgemma")


def sdpa_skips_softcap() -> bool:
    """Whether this transformers loads a Gemma 2 with SDPA (no attention soft-capping) unless
    ``attn_implementation="eager"`` is asked for."""
    return (4, 48) <= hf_version() < (5, 0)


def load_hf(folder, dtype: Any = torch.float32) -> torch.nn.Module:
    """``AutoModelForCausalLM.from_pretrained(folder)`` in ``dtype`` (or "auto"), eval mode;
    eager attention for a soft-capped family where the default would skip its soft-cap."""
    kw = dtype_kwarg(dtype)
    model_type = json.loads((Path(folder) / "config.json").read_text())["model_type"]
    if model_type in SOFT_CAPPED and sdpa_skips_softcap():
        kw["attn_implementation"] = "eager"
    return hf().AutoModelForCausalLM.from_pretrained(folder, **kw).eval()

