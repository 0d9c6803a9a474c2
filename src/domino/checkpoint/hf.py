"""Hugging Face ``transformers`` weights: our full (TP=1) state dict to theirs and back, for
GPT-2 and the Llama family (:mod:`domino.checkpoint.hf_config` says which one a model is).

Written from the formats' documented weight names and shapes, so neither direction needs
``transformers`` installed. Layouts:

* our fused QKV rows are grouped per query group, ``[q heads of group g | k_g | v_g]``; GPT-2's
  ``c_attn`` is ``[all q | all k | all v]`` (and, as a ``Conv1D``, stored transposed); the Llama
  family keeps ``q_proj`` / ``k_proj`` / ``v_proj`` apart (and Qwen3 adds ``q_norm`` /
  ``k_norm``, our ``q_layernorm`` / ``k_layernorm``, per head; OLMoE's span all heads);
* our SwiGLU ``fc1`` is ``[gate; up]`` (Llama's ``gate_proj`` and ``up_proj``);
* vocabulary tables are padded here (to a multiple of 128 x TP) and exact there.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from domino.config import TransformerConfig

_LM = "language_model."
_ENC = _LM + "encoder."


@dataclass(frozen=True)
class _Shapes:
    heads: int
    groups: int
    head_dim: int

    @property
    def per_group(self) -> int:
        return self.heads // self.groups


def _shapes(config: TransformerConfig) -> _Shapes:
    return _Shapes(config.num_attention_heads, config.num_query_groups, config.kv_channels)


def _qkv_to_ours(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, s: _Shapes) -> torch.Tensor:
    """[q (heads*d) ; k (groups*d) ; v] rows (any trailing dims) -> our per-group layout."""
    tail = q.shape[1:]
    qg = q.reshape(s.groups, s.per_group * s.head_dim, *tail)
    kg = k.reshape(s.groups, s.head_dim, *tail)
    vg = v.reshape(s.groups, s.head_dim, *tail)
    return torch.cat([qg, kg, vg], dim=1).reshape(-1, *tail)


def _qkv_from_ours(w: torch.Tensor, s: _Shapes) -> tuple[torch.Tensor, ...]:
    tail = w.shape[1:]
    g = w.reshape(s.groups, (s.per_group + 2) * s.head_dim, *tail)
    q, k, v = g.split([s.per_group * s.head_dim, s.head_dim, s.head_dim], dim=1)
    return (q.reshape(-1, *tail), k.reshape(-1, *tail), v.reshape(-1, *tail))


def _pairs(config: TransformerConfig, arch: str) -> list[tuple[str, str, bool]]:
    """(our name, HF name, stored transposed) of every one-to-one tensor (GPT-2 names without
    their ``transformer.`` prefix); the fused QKV and SwiGLU tensors and the vocabulary tables
    are mapped apart."""
    out: list[tuple[str, str, bool]] = []
    for i in range(config.num_layers):
        a = f"{_ENC}layers.{i}."
        if arch == "gpt2":
            h = f"h.{i}."
            for suffix in ("weight", "bias"):
                out += [(a + "input_layernorm." + suffix, h + "ln_1." + suffix, False),
                        (a + "post_attention_layernorm." + suffix, h + "ln_2." + suffix, False)]
                t = suffix == "weight"  # Conv1D stores [in, out]
                out += [(a + "self_attention.dense." + suffix, h + "attn.c_proj." + suffix, t),
                        (a + "mlp.dense_h_to_4h." + suffix, h + "mlp.c_fc." + suffix, t),
                        (a + "mlp.dense_4h_to_h." + suffix, h + "mlp.c_proj." + suffix, t)]
        else:
            h = f"model.layers.{i}."
            if config.qk_layernorm:
                out += [(a + f"self_attention.{x}_layernorm.weight",
                         h + f"self_attn.{x}_norm.weight", False) for x in ("q", "k")]
            out += [(a + "input_layernorm.weight", h + "input_layernorm.weight", False),
                    (a + "post_attention_layernorm.weight",
                     h + "post_attention_layernorm.weight", False)]
            for suffix in _suffixes(config.add_bias_linear):
                out.append((a + "self_attention.dense." + suffix, h + "self_attn.o_proj." + suffix,
                            False))
                if not config.is_moe_layer(i):
                    out.append((a + "mlp.dense_4h_to_h." + suffix, h + "mlp.down_proj." + suffix,
                                False))
    if arch == "gpt2":
        out += [(_LM + "embedding.position_embeddings.weight", "wpe.weight", False),
                (_ENC + "final_layernorm.weight", "ln_f.weight", False),
                (_ENC + "final_layernorm.bias", "ln_f.bias", False)]
    else:
        out.append((_ENC + "final_layernorm.weight", "model.norm.weight", False))
    return out


def _fused(config: TransformerConfig, arch: str, i: int) -> list[tuple[str, str]]:
    """(our QKV or SwiGLU fc1 name, HF name prefix) of layer i's fused tensors."""
    a = f"{_ENC}layers.{i}."
    if arch == "gpt2":
        return [(a + "self_attention.query_key_value." + x, f"h.{i}.attn.c_attn.{x}")
                for x in ("weight", "bias")]
    qkv = _suffixes(config.add_bias_linear or config.add_qkv_bias)
    mlp = () if config.is_moe_layer(i) else _suffixes(config.add_bias_linear)
    return [(a + "self_attention.query_key_value." + x, f"model.layers.{i}.self_attn.{x}")
            for x in qkv] + [(a + "mlp.dense_h_to_4h." + x, f"model.layers.{i}.mlp.{x}")
                             for x in mlp]


# An MoE layer's router and expert names there: the Hub's per-expert layout (transformers
# reads it, fusing the experts itself). Our experts are stacked: fc1 [E, h, 2f] = [gate | up]
# (each [in, out]), fc2 [E, f, h].
_MOE_NAMES = {"mixtral": ("block_sparse_moe", "w1", "w3", "w2"),
              "qwen3_moe": ("mlp", "gate_proj", "up_proj", "down_proj"),
              "olmoe": ("mlp", "gate_proj", "up_proj", "down_proj")}


def _moe_to_hf(ours: dict, config: TransformerConfig, arch: str, i: int) -> dict:
    block, gate, up, down = _MOE_NAMES[arch]
    a, h = f"{_ENC}layers.{i}.mlp.moe.", f"model.layers.{i}.{block}."
    f = config.moe_ffn_hidden_size
    out = {h + "gate.weight": ours[a + "router.weight"]}
    fc1, fc2 = ours[a + "experts.fc1"], ours[a + "experts.fc2"]
    for e in range(config.num_experts):
        out[f"{h}experts.{e}.{gate}.weight"] = fc1[e][:, :f].t()
        out[f"{h}experts.{e}.{up}.weight"] = fc1[e][:, f:].t()
        out[f"{h}experts.{e}.{down}.weight"] = fc2[e].t()
    return out


def _moe_from_hf(hf: dict, config: TransformerConfig, arch: str, i: int) -> dict:
    block, gate, up, down = _MOE_NAMES[arch]
    a, h = f"{_ENC}layers.{i}.mlp.moe.", f"model.layers.{i}.{block}."
    experts = range(config.num_experts)
    fc1 = [torch.cat([hf[f"{h}experts.{e}.{gate}.weight"].t(),
                      hf[f"{h}experts.{e}.{up}.weight"].t()], dim=1) for e in experts]
    return {a + "router.weight": hf[h + "gate.weight"], a + "experts.fc1": torch.stack(fc1),
            a + "experts.fc2": torch.stack([hf[f"{h}experts.{e}.{down}.weight"].t()
                                            for e in experts])}


def _suffixes(bias: bool) -> tuple[str, ...]:
    return ("weight", "bias") if bias else ("weight",)


def _vocab_names(arch: str) -> tuple[str, str]:
    return ("wte.weight", "lm_head.weight") if arch == "gpt2" else (
        "model.embed_tokens.weight", "lm_head.weight")


def to_hf(ours: dict[str, torch.Tensor], config: TransformerConfig, arch: str
          ) -> dict[str, torch.Tensor]:
    """Our full (TP=1) weights -> the HF model's state dict (vocabulary padding dropped)."""
    s, v = _shapes(config), config.vocab_size
    out = {hf: ours[mine].t() if t else ours[mine] for mine, hf, t in _pairs(config, arch)}
    for i in range(config.num_layers):
        for mine, hf in _fused(config, arch, i):
            w = ours[mine]
            if "query_key_value" in mine:
                q, k, vv = _qkv_from_ours(w, s)
                if arch == "gpt2":  # one Conv1D [in, out] holding [all q | all k | all v]
                    both = torch.cat([q, k, vv])
                    out[hf] = both.t() if hf.endswith("weight") else both
                else:
                    kind = hf.rsplit(".", 1)
                    for name, part in (("q_proj", q), ("k_proj", k), ("v_proj", vv)):
                        out[f"{kind[0]}.{name}.{kind[1]}"] = part
            else:  # SwiGLU fc1 rows are [gate; up]
                gate, up = w.chunk(2, dim=0)
                base, x = hf.rsplit(".", 1)
                out[f"{base}.gate_proj.{x}"], out[f"{base}.up_proj.{x}"] = gate, up
    for i in range(config.num_layers):
        if config.is_moe_layer(i):
            out.update(_moe_to_hf(ours, config, arch, i))
    table, head = _vocab_names(arch)
    out[table] = ours[_LM + "embedding.word_embeddings.weight"][:v]
    if config.untie_embeddings_and_output_weights:
        out[head] = ours[_LM + "output_layer.weight"][:v]
    if arch == "gpt2":
        out = {k if k == head else "transformer." + k: t for k, t in out.items()}
    return {k: t.contiguous() for k, t in out.items()}


def expected_hf_shapes(config: TransformerConfig, arch: str) -> dict[str, tuple[int, ...]]:
    """Every weight an HF folder of this config must hold, with its shape (from our model
    built on the meta device: nothing is allocated)."""
    from domino.models.gpt import GPTModel
    from domino.parallel_state import ParallelState

    model = GPTModel(config, parallel_state=ParallelState.single("meta"))
    return {name: tuple(t.shape)
            for name, t in to_hf(dict(model.named_parameters()), config, arch).items()}


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    if t.shape[0] == rows:
        return t
    return torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])])


def from_hf(hf: dict[str, torch.Tensor], config: TransformerConfig, arch: str,
            padded_vocab: int) -> dict[str, torch.Tensor]:
    """An HF state dict -> our full (TP=1) weights; KeyError names a missing weight."""
    s = _shapes(config)
    if arch == "gpt2":
        hf = {k.removeprefix("transformer."): t for k, t in hf.items()}
    ours = {mine: hf[name].t() if t else hf[name] for mine, name, t in _pairs(config, arch)}
    for i in range(config.num_layers):
        for mine, name in _fused(config, arch, i):
            if "query_key_value" in mine:
                if arch == "gpt2":
                    w = hf[name].t() if name.endswith("weight") else hf[name]
                    q, k, v = w.chunk(3, dim=0)
                else:
                    base, x = name.rsplit(".", 1)
                    q, k, v = (hf[f"{base}.{p}.{x}"] for p in ("q_proj", "k_proj", "v_proj"))
                ours[mine] = _qkv_to_ours(q, k, v, s)
            else:
                base, x = name.rsplit(".", 1)
                ours[mine] = torch.cat([hf[f"{base}.gate_proj.{x}"], hf[f"{base}.up_proj.{x}"]])
        if config.is_moe_layer(i):
            ours.update(_moe_from_hf(hf, config, arch, i))
    table, head = _vocab_names(arch)
    ours[_LM + "embedding.word_embeddings.weight"] = _pad_rows(hf[table], padded_vocab)
    if config.untie_embeddings_and_output_weights:
        ours[_LM + "output_layer.weight"] = _pad_rows(hf[head], padded_vocab)
    return {k: t.contiguous() for k, t in ours.items()}
