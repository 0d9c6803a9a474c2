"""Models live on the parallel state's device (the CUDA path depends on it; meta stands in here)."""

import os

import pytest
import torch

from domino import ParallelState, TransformerConfig
from domino.distributed import init_distributed
from domino.gpt_model import GPTModel
from domino.transformer.rope import RotaryEmbedding


@pytest.mark.parametrize("pos", ["rope", "learned_absolute"])
def test_every_parameter_and_buffer_on_state_device(pos):
    cfg = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=100,
                            seq_length=16, position_embedding_type=pos, activation="swiglu",
                            num_query_groups=2)
    model = GPTModel(cfg, parallel_state=ParallelState.single("meta"))
    where = {name: t.device.type for name, t in [*model.named_parameters(), *model.named_buffers()]}
    assert set(where.values()) == {"meta"}, where


def test_rotary_angles_follow_the_positions_device():
    rope = RotaryEmbedding(16)  # built on CPU
    angles = rope(torch.zeros(2, 5, dtype=torch.long, device="meta"))
    assert angles.device.type == "meta" and angles.shape == (5, 2, 1, 16)


def test_plain_cuda_means_local_rank(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "set_device", calls.append)
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setitem(os.environ, "LOCAL_RANK", "3")
    assert init_distributed("cuda") == torch.device("cuda", 3)
    assert calls == [torch.device("cuda", 3)]
