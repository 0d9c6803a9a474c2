"""The LoRA fine-tuning workflow end to end, as docs/finetune.md shows it, on a random-weight
transformers Llama and Qwen3, each with a chat template: ``domino import`` at TP=2 ->
``domino preprocess --format chat`` -> a LoRA fine-tune at TP=2 (packed conversations) ->
``domino export --format hf`` (merged) and ``--format peft`` (beside the base's own export) ->
the greedy reply of transformers (merged model) and of peft (base + adapter) to a chat prompt
equals ``domino generate --chat`` of the LoRA run at TP=2, token for token."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from test_generate_chat import QWEN, _messages, _model_folder

from domino.checkpoint.layout import open_checkpoint
from domino.cli import main

CHATS = [
    [{"role": "user", "content": "What is two plus two?"},
     {"role": "assistant", "content": "It is four."}],
    [{"role": "system", "content": "You are terse."},
     {"role": "user", "content": "def forward(self, x):"},
     {"role": "assistant", "content": "return self.alpha * x"}],
    [{"role": "user", "content": "héllo wörld"}, {"role": "assistant", "content": "zeta eta"}],
]
PROMPT, NEW = "What is two plus two?", 8
TP2 = ["--tensor-model-parallel-size", "2", "--nproc", "2"]


def _folder(kind: str, out: Path) -> Path:
    """test_generate_chat's folder, the Qwen3 one with its chat template kept in it too."""
    folder = _model_folder(kind, out)
    if kind == "qwen":
        config_file = folder / "tokenizer_config.json"
        config = json.loads(config_file.read_text())
        config_file.write_text(json.dumps({**config, "chat_template": QWEN}))
    return folder


def _workflow(kind: str, tmp: Path) -> dict[str, Path]:
    """Every command of the workflow; the folders it wrote, by name."""
    out = {"hf": _folder(kind, tmp / "hf"), "run": tmp / "run", "lora": tmp / "lora",
           "base_hf": tmp / "base-hf", "merged": tmp / "merged", "adapter": tmp / "adapter"}
    assert main(["import", str(out["hf"]), str(out["run"]), *TP2[:2]]) == 0
    rows = tmp / "chats.jsonl"
    rows.write_text("".join(json.dumps({"messages": c}) + "\n" for c in CHATS * 4))
    prefix = tmp / "chats"
    assert main(["preprocess", "--format", "chat", "--input", str(rows), "--output-prefix",
                 str(prefix), "--tokenizer-type", "hf", "--tokenizer-dir", str(out["run"]),
                 "--no-progress"]) == 0
    assert main(["train", "--load", str(out["run"]), "--finetune", "--lora-rank", "4",
                 "--lora-alpha", "16", "--data-path", str(prefix), "--split", "1,0,0",
                 "--seq-length", "64", "--pack-documents", "--micro-batch-size", "2",
                 "--global-batch-size", "4", "--train-iters", "4", "--lr", "5e-2",
                 "--lr-warmup-iters", "0", "--eval-iters", "0", "--sample-tokens", "0",
                 "--no-tensorboard", "--seed", "3", *TP2, "--save", str(out["lora"])]) == 0
    assert main(["export", "--format", "hf", str(out["run"]), str(out["base_hf"])]) == 0
    assert main(["export", "--format", "hf", str(out["lora"]), str(out["merged"])]) == 0
    assert main(["export", "--format", "peft", str(out["lora"]), str(out["adapter"]),
                 "--base-model-path", str(out["base_hf"])]) == 0
    return out


def _greedy(model, ids: list[int]) -> list[int]:
    prompt = torch.tensor([ids])
    with torch.no_grad():
        out = model.generate(prompt, attention_mask=torch.ones_like(prompt),
                             max_new_tokens=NEW, do_sample=False, pad_token_id=0)
    return out[0, len(ids):].tolist()


@pytest.mark.parametrize("kind", ["llama", "qwen"])
def test_lora_workflow_replies_equal_transformers_and_peft(kind: str, tmp_path: Path,
                                                           capfd) -> None:
    import peft
    import transformers

    out = _workflow(kind, tmp_path)
    assert open_checkpoint(out["run"])[1].layout["tp"] == 2
    lora_meta = open_checkpoint(out["lora"])[1]
    assert lora_meta.layout["tp"] == 2 and lora_meta.extra["lora"]["rank"] == 4
    capfd.readouterr()
    assert main(["generate", str(out["lora"]), "--prompt", PROMPT, "--chat", "--greedy",
                 "--max-new-tokens", str(NEW), "--ids", "--device", "cpu", *TP2]) == 0
    ours = [int(t) for t in capfd.readouterr().out.split()]

    tok = transformers.AutoTokenizer.from_pretrained(out["hf"])
    ids = tok.apply_chat_template(_messages(PROMPT, None), add_generation_prompt=True,
                                  tokenize=True, return_dict=True)["input_ids"]
    load = transformers.AutoModelForCausalLM.from_pretrained
    merged = load(out["merged"], dtype=torch.float32)
    adapted = peft.PeftModel.from_pretrained(load(out["base_hf"], dtype=torch.float32),
                                             out["adapter"])
    base = load(out["base_hf"], dtype=torch.float32)
    assert _greedy(merged, ids) == ours
    assert _greedy(adapted, ids) == ours
    assert _greedy(base, ids) != ours  # (so a lost or misplaced adapter shows)
    # The fine-tune moved the model: the merged weights are not the base's.
    moved = [n for n, p in merged.state_dict().items()
             if not torch.equal(p, base.state_dict()[n])]
    assert any("q_proj" in n for n in moved) and any("down_proj" in n for n in moved)
