"""Attention masks, RoPE variants and the KV cache at TP=2 (one spawn), plus mask argument checks.

* causal: changing a later token never changes earlier outputs (and does change later ones);
* padding: changing the tokens at masked key positions never changes any other output; a query
  whose keys are all masked stays finite (outputs and gradients); the padding mask type is not
  causal;
* causal + padding at TP=2 equals the single-process model (logits and gradients);
* RoPE (rotary_percent 0.5, position interpolation): shifting all positions changes nothing, and
  interpolation by f at positions f*p equals no interpolation at positions p;
* KV cache: decoding token by token gives the logits of one full forward.
"""

from __future__ import annotations

import pytest
import torch
from tp_helpers import (
    TOL,
    config,
    copy_weights,
    failures,
    grad_errors,
    one_thread,
    perturb,
    register,
    rel_err,
    tp_results,
)

from domino import AttnMaskType, LayerType, ParallelState
from domino.gpt_model import GPTModel
from domino.transformer import DominoTransformer, InferenceParams, Plan

B, S, V = 3, 8, 100


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    with one_thread():
        yield


def _pair(state: ParallelState, plan=(2, "cross_layer", 1), **over):
    cfg = config(vocab_size=V, **over)
    torch.manual_seed(0)
    ref = GPTModel(cfg, parallel_state=ParallelState.single(), parallel_output=False)
    perturb(ref, seed=1, vocab=V)
    model = GPTModel(cfg, parallel_state=state, parallel_output=False)
    copy_weights(model, ref, state.tp, V)
    model.language_model.encoder.set_plan(Plan(*plan))
    return cfg, model, ref


def _ids(seed: int = 5) -> torch.Tensor:
    return torch.randint(0, V, (B, S), generator=torch.Generator().manual_seed(seed))


def _padding_mask() -> tuple[torch.Tensor, list[tuple[int, int]]]:
    """Key padding [B, 1, S, S] and the (sample, position) keys it masks."""
    masked = [(0, 5), (0, 6), (0, 7), (1, 1), (1, 3), (2, 0)]  # sample 2: query 0 sees nothing
    mask = torch.zeros(B, 1, S, S, dtype=torch.bool)
    for b, p in masked:
        mask[b, :, :, p] = True
    return mask, masked


def _change(ids: torch.Tensor, where) -> torch.Tensor:
    out = ids.clone()
    for b, p in where:
        out[b, p] = (out[b, p] + 17) % V
    return out


def _causal(state: ParallelState) -> dict:
    _, model, _ = _pair(state)
    ids = _ids()
    res = {}
    with torch.no_grad():
        base = model(ids, None, None)
        hid = model.language_model(ids, None, None)
        for t in (1, 4, 7):
            later = [(b, p) for b in range(B) for p in range(t, S)]
            other = _change(ids, later)
            out = model(other, None, None)
            res[f"logits_t{t}"] = rel_err(out[:, :t], base[:, :t])
            res[f"hidden_t{t}"] = rel_err(model.language_model(other, None, None)[:t], hid[:t])
            res[f"later_changed_t{t}"] = rel_err(out[:, t:], base[:, t:])
    return res


def _padding(state: ParallelState) -> dict:
    _, model, ref = _pair(state)
    ids = _ids()
    mask, masked = _padding_mask()
    keep = torch.ones(B, S, dtype=torch.bool)
    for b, p in masked:
        keep[b, p] = False
    res = {}
    with torch.no_grad():
        base = model(ids, None, mask)
        out = model(_change(ids, masked), None, mask)
        res["unmasked_unchanged"] = rel_err(out[keep], base[keep])
        res["unmasked_changed_without_mask"] = rel_err(
            model(_change(ids, masked), None, None)[keep], model(ids, None, None)[keep])
        res["finite"] = bool(torch.isfinite(base).all() and torch.isfinite(out).all())
        res["logits_vs_single"] = rel_err(base, ref(ids, None, mask))
    labels = _ids(6)
    loss = model(ids, None, mask, labels=labels)
    loss_ref = ref(ids, None, mask, labels=labels)
    res["loss_vs_single"] = rel_err(loss, loss_ref)
    loss.sum().backward()
    loss_ref.sum().backward()
    res["grads_finite"] = all(torch.isfinite(p.grad).all() for p in model.parameters())
    res["grads"] = grad_errors(model, ref, state.tp, V)
    return res


def _encoder_padding(state: ParallelState) -> dict:
    """A padding-type (non-causal) stack: masked keys have no influence; later keys do."""
    cfg = config(hidden_size=32, num_attention_heads=4)
    torch.manual_seed(0)
    ref = DominoTransformer(cfg, ParallelState.single(), LayerType.encoder, AttnMaskType.padding)
    perturb(ref, seed=2)
    stack = DominoTransformer(cfg, state, LayerType.encoder, AttnMaskType.padding)
    copy_weights(stack, ref, state.tp, V)
    stack.set_plan(Plan(3, "intra_layer", 2))
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(S, B, 32, generator=gen)
    mask = torch.zeros(B, 1, S, S, dtype=torch.bool)
    mask[0, ..., 6:] = True
    mask[1, ..., :] = True  # every key of sample 1 masked
    keep = torch.ones(S, B, dtype=torch.bool)
    keep[6:, 0] = False
    keep[:, 1] = False
    res = {}
    with torch.no_grad():
        base = stack(x, mask)
        # random changes (a constant shift would vanish in the layer norm)
        x2 = x.clone()
        x2[6:, 0] += torch.randn(2, 32, generator=gen)
        x2[:, 1] += torch.randn(S, 32, generator=gen)
        res["unmasked_unchanged"] = rel_err(stack(x2, mask)[keep], base[keep])
        x2[6:, 0] = x[6:, 0]
        res["masked_changes_own_rows"] = rel_err(stack(x2, mask)[:, 1], base[:, 1])
        x3 = x.clone()
        x3[7, 2] += torch.randn(32, generator=gen)  # an unmasked later key changes earlier
        res["not_causal"] = rel_err(stack(x3, mask)[0, 2], base[0, 2])  # queries: not causal
        res["finite"] = bool(torch.isfinite(base).all())
        res["vs_single"] = rel_err(base, ref(x, mask))
    xg = x.clone().requires_grad_()
    xr = x.clone().requires_grad_()
    up = torch.randn(S, B, 32, generator=gen)
    (stack(xg, mask) * up).sum().backward()
    (ref(xr, mask) * up).sum().backward()
    res["input_grad"] = rel_err(xg.grad, xr.grad)
    res["grads_finite"] = bool(torch.isfinite(xg.grad).all()) and all(
        torch.isfinite(p.grad).all() for p in stack.parameters())
    res["grads"] = grad_errors(stack, ref, state.tp, V)
    return res


def _rope(state: ParallelState) -> dict:
    over = dict(position_embedding_type="rope", rotary_percent=0.5, hidden_size=64,
                num_attention_heads=4, num_query_groups=2)
    _, interp, _ = _pair(state, rotary_seq_len_interpolation_factor=2.0, **over)
    _, plain, _ = _pair(state, **over)
    ids = _ids()
    pos = torch.arange(S).expand(B, S)
    res = {}
    with torch.no_grad():
        for name, model in (("interp", interp), ("plain", plain)):
            base = model(ids, None, None)
            res[f"{name}_default_positions"] = rel_err(model(ids, pos, None), base)
            res[f"{name}_shift_invariant"] = rel_err(model(ids, pos + 5, None), base)
        res["interp_equals_scaled_positions"] = rel_err(interp(ids, 2 * pos, None),
                                                        plain(ids, None, None))
        res["interp_differs_from_plain"] = rel_err(interp(ids, None, None), plain(ids, None, None))
    return res


def _decode(model, ids: torch.Tensor, prompt: int, positions: bool) -> torch.Tensor:
    params = InferenceParams(max_batch_size=ids.shape[0], max_sequence_length=S)
    outs, t = [], 0
    with torch.no_grad():
        while t < S:
            n = prompt if t == 0 else 1
            pos = torch.arange(t, t + n).expand(ids.shape[0], n) if positions else None
            outs.append(model(ids[:, t:t + n], pos, None, inference_params=params))
            params.sequence_len_offset += n
            t += n
    return torch.cat(outs, dim=1)


def _kv_cache(state: ParallelState) -> dict:
    res = {}
    cases = {
        "rope_gqa": dict(position_embedding_type="rope", num_query_groups=2),
        "learned": dict(),
    }
    ids = _ids()
    for name, over in cases.items():
        _, model, _ = _pair(state, plan=(2, "cross_layer", 2), **over)
        with torch.no_grad():
            full = model(ids, None, None)
        res[f"{name}_explicit_positions"] = rel_err(_decode(model, ids, 3, True), full)
        res[f"{name}_default_positions"] = rel_err(_decode(model, ids, 1, False), full)
        params = InferenceParams(max_batch_size=B, max_sequence_length=4)
        try:
            with torch.no_grad():
                model(ids[:, :5], None, None, inference_params=params)
            res[f"{name}_overflow_raises"] = False
        except ValueError as exc:
            res[f"{name}_overflow_raises"] = "max_sequence_length" in str(exc)
    return res


def _masks_checks(state: ParallelState) -> dict:
    return {"causal": _causal(state), "padding": _padding(state),
            "encoder_padding": _encoder_padding(state), "rope": _rope(state),
            "kv_cache": _kv_cache(state)}


register(2, _masks_checks)


def _results() -> list:
    return tp_results(2, _masks_checks)


def test_causal_mask_tp2() -> None:
    for rank, res in enumerate(_results()):
        errors = res["causal"]
        for t in (1, 4, 7):
            assert errors[f"logits_t{t}"] <= 1e-6 and errors[f"hidden_t{t}"] <= 1e-6, (rank, errors)
            assert errors[f"later_changed_t{t}"] > 1e-3, (rank, errors)  # the check has teeth


def test_padding_mask_with_causal_tp2() -> None:
    for rank, res in enumerate(_results()):
        errors = res["padding"]
        assert errors["unmasked_unchanged"] <= 1e-6, (rank, errors)
        assert errors["unmasked_changed_without_mask"] > 1e-3, (rank, errors)
        assert errors["finite"] and errors["grads_finite"], (rank, errors)
        scalars = {k: errors[k] for k in ("logits_vs_single", "loss_vs_single")}
        assert not failures(scalars) and not failures(errors["grads"]), (rank, errors)


def test_padding_mask_encoder_tp2() -> None:
    for rank, res in enumerate(_results()):
        errors = res["encoder_padding"]
        assert errors["unmasked_unchanged"] <= 1e-6, (rank, errors)
        assert errors["not_causal"] > 1e-3, (rank, errors)
        assert errors["masked_changes_own_rows"] > 1e-3, (rank, errors)
        assert errors["finite"] and errors["grads_finite"], (rank, errors)
        assert errors["vs_single"] <= TOL and errors["input_grad"] <= TOL, (rank, errors)
        assert not failures(errors["grads"]), (rank, failures(errors["grads"]))


def test_rope_partial_and_interpolation_tp2() -> None:
    for rank, res in enumerate(_results()):
        errors = dict(res["rope"])
        assert errors.pop("interp_differs_from_plain") > 1e-3, (rank, res["rope"])
        assert not failures(errors), (rank, errors)


@pytest.mark.parametrize("case", ["rope_gqa_explicit_positions", "rope_gqa_default_positions",
                                  "learned_explicit_positions"])
def test_kv_cache_decoding_matches_full_forward_tp2(case) -> None:
    for rank, res in enumerate(_results()):
        assert res["kv_cache"][case] <= TOL, (rank, res["kv_cache"])


def test_kv_cache_learned_positions_default_to_cache_offset_tp2() -> None:
    """Without explicit position_ids, the learned position embedding of a decoding step must
    start at inference_params.sequence_len_offset (as RoPE's positions already do)."""
    for rank, res in enumerate(_results()):
        assert res["kv_cache"]["learned_default_positions"] <= TOL, (rank, res["kv_cache"])


def test_kv_cache_overflow_raises_tp2() -> None:
    for rank, res in enumerate(_results()):
        assert res["kv_cache"]["rope_gqa_overflow_raises"], rank
        assert res["kv_cache"]["learned_overflow_raises"], rank


# ---- single-process argument checks -------------------------------------------------------------

@pytest.fixture(scope="module")
def stack():
    torch.manual_seed(0)
    return DominoTransformer(config(), ParallelState.single())


@pytest.mark.parametrize("bad, match", [
    (torch.zeros(3, 1, 8, 8), "dtype"),
    (torch.zeros(3, 1, 8, 8, dtype=torch.int64), "dtype"),
    (torch.zeros(3, 1, 8, 8, dtype=torch.uint8), "dtype"),
    (torch.zeros(8, 8, dtype=torch.bool), "shape"),
    (torch.zeros(3, 8, 8, dtype=torch.bool), "shape"),
    (torch.zeros(2, 1, 8, 8, dtype=torch.bool), "shape"),
    (torch.zeros(3, 4, 8, 8, dtype=torch.bool), "shape"),
])
def test_mask_type_and_shape_errors(stack, bad, match) -> None:
    x = torch.randn(8, 3, 32)
    with pytest.raises(ValueError, match=match):
        stack(x, bad)


def test_mask_errors_name_the_argument() -> None:
    torch.manual_seed(0)
    cfg = config()
    dec = DominoTransformer(cfg, ParallelState.single(), LayerType.decoder, AttnMaskType.causal)
    x, mem = torch.randn(4, 2, 32), torch.randn(6, 2, 32)
    with pytest.raises(ValueError, match="enc_dec_attn_mask"):
        dec(x, None, encoder_output=mem, enc_dec_attn_mask=torch.zeros(2, 1, 4, 6))
    with pytest.raises(ValueError, match="attention_mask"):
        dec(x, torch.ones(2, 1, 4, 4), encoder_output=mem)


def test_broadcast_masks_are_accepted(stack) -> None:
    x = torch.randn(8, 3, 32)
    mask = torch.zeros(1, 1, 8, 8, dtype=torch.bool)
    mask[..., 6:] = True
    with torch.no_grad():
        a = stack(x, mask)
        b = stack(x, mask.expand(3, 1, 8, 8).contiguous())
        stack.set_plan(Plan(3, "cross_layer", 1))
        c = stack(x, mask)
        stack.set_plan(Plan(1, "none", 1))
    assert rel_err(a, b) <= 1e-6 and rel_err(c, a) <= TOL


def test_gpt_label_shape_error() -> None:
    torch.manual_seed(0)
    model = GPTModel(config(), parallel_state=ParallelState.single())
    ids = torch.zeros(2, 8, dtype=torch.long)
    with pytest.raises(ValueError, match="labels"):
        model(ids, None, None, labels=ids[:, :4])
