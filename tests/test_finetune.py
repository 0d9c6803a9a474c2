"""``domino train --load RUN --finetune`` on chat data, against a random-weight transformers
Llama imported with ``domino import`` (no downloads): the model and tokenizer come from the
checkpoint (no --config), only its weights are loaded (step 0, a fresh optimizer, schedule and
data position even when the checkpoint holds optimizer state), the first step's loss is the
base model's mean loss over the chat mask's tokens (at TP=2 from the TP=1 import too),
evaluation counts the same tokens, the fine-tuning defaults are printed, and a flag that
contradicts the checkpoint or a --save onto the base is refused before any process starts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from test_chat_data import masked_loss

from domino.checkpoint.layout import open_checkpoint
from domino.cli import main
from domino.data import IndexedDataset

SPECIALS = ["<s>", "</s>", "<|im_start|>", "<|im_end|>", "<pad>"]
TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] }}:{{ ' ' }}"
            "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}<|im_end|>"
            "{% endgeneration %}{% else %}{{ m['content'] }}<|im_end|>{% endif %}{{ '\\n' }}"
            "{% endfor %}")
CHATS = [
    [{"role": "system", "content": "You are terse."},
     {"role": "user", "content": "alpha beta?"},
     {"role": "assistant", "content": "gamma delta."}],
    [{"role": "user", "content": "zeta"}, {"role": "assistant", "content": " eta theta "}],
    [{"role": "user", "content": "def forward(self, x):"},
     {"role": "assistant", "content": "return self.alpha * x"}],
]
SEQ, SEED = 16, 7
QUIET = ["--eval-iters", "0", "--log-interval", "1", "--sample-tokens", "0",
         "--no-tensorboard", "--seed", str(SEED)]


def _model_folder(out: Path) -> Path:
    """A transformers Llama folder with random weights and a ChatML-like chat template."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = [f"{m['role']}: {m['content']}" for chat in CHATS for m in chat] * 20
    tok.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=300, special_tokens=SPECIALS, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>",
                                              eos_token="<|im_end|>", pad_token="<pad>")
    hf.chat_template = TEMPLATE
    hf.save_pretrained(out)
    cfg = transformers.LlamaConfig(vocab_size=len(hf), hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=64,
                                   rms_norm_eps=1e-6, tie_word_embeddings=False,
                                   bos_token_id=0, eos_token_id=3)
    torch.manual_seed(3)
    transformers.LlamaForCausalLM(cfg).save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> tuple[Path, Path]:
    """(RUN: the imported model at TP=1, PREFIX: chat data made with its tokenizer)."""
    tmp = tmp_path_factory.mktemp("finetune")
    run = tmp / "run"
    assert main(["import", str(_model_folder(tmp / "hf")), str(run)]) == 0
    rows = tmp / "chats.jsonl"
    rows.write_text("".join(json.dumps({"messages": c}) + "\n" for c in CHATS * 4))
    prefix = tmp / "chats"
    assert main(["preprocess", "--format", "chat", "--input", str(rows), "--output-prefix",
                 str(prefix), "--tokenizer-type", "hf", "--tokenizer-dir", str(run),
                 "--no-progress"]) == 0
    return run, prefix


def _epoch(prefix: Path) -> int:
    """Samples of SEQ tokens in one epoch of the whole dataset."""
    return (IndexedDataset(prefix).num_tokens - 1) // SEQ


def _masked_loss(step_dir: Path, prefix: Path) -> tuple[float, int]:
    """The saved model's mean loss over the chat mask's tokens of one epoch (any order: the
    mean of all its samples), and how many tokens that counts."""
    return masked_loss(step_dir, prefix, SEQ, _epoch(prefix), SEED)[:2]


def _finetune(load: Path, prefix: Path, save: Path, *extra: str) -> list[str]:
    """One step of ``--finetune`` over one whole epoch as a single global batch."""
    n = str(_epoch(prefix))
    return ["train", "--load", str(load), "--finetune", "--data-path", str(prefix),
            "--split", "1,0,0", "--seq-length", str(SEQ), "--micro-batch-size", n,
            "--global-batch-size", n, "--train-iters", "1", *QUIET, "--save", str(save), *extra]


def _first(save: Path) -> dict:
    return json.loads((save / "metrics.jsonl").read_text().splitlines()[0])


def _adam_steps(step_dir: Path) -> set[float]:
    """The AdamW step counts a checkpoint holds (one per parameter)."""
    out = set()
    for path in step_dir.glob("*.safetensors"):
        with safe_open(str(path), framework="pt") as f:
            out |= {float(f.get_tensor(k)) for k in f.keys() if k.startswith("optimizer.step/")}
    return out


def test_finetune_loads_weights_only(base: tuple[Path, Path], tmp_path: Path, capfd) -> None:
    """From a checkpoint with optimizer state at step 2 (a run trained on the import): step 0
    with a fresh AdamW and schedule, no --config, the printed defaults, and the first loss the
    checkpoint's own masked loss on that batch."""
    run, prefix = base
    pre = tmp_path / "pre"
    assert main(["train", "--config", str(run / "config.toml"), "--load", str(run),
                 "--data-path", str(prefix), "--seq-length", str(SEQ), "--micro-batch-size",
                 "2", "--train-iters", "2", "--lr", "1e-3", "--lr-warmup-iters", "0", *QUIET,
                 "--save", str(pre)]) == 0
    pre_dir, pre_meta, _ = open_checkpoint(pre)
    assert pre_meta.has_optimizer and pre_meta.step == 2 and _adam_steps(pre_dir) == {2.0}
    capfd.readouterr()
    ft = tmp_path / "ft"
    assert main(_finetune(pre, prefix, ft)) == 0
    out = capfd.readouterr().out
    assert "--finetune: the model and tokenizer of" in out
    # Only the defaults not given (--train-iters, --split and --sample-tokens were).
    assert ("fine-tuning defaults (docs/finetune.md; flags or --config override them): --lr "
            "2e-05, --min-lr 2e-06, --lr-warmup-iters 10, --weight-decay 0\n") in out
    first = _first(ft)
    # Step 1 of a fresh schedule: the first warm-up step of the default 10 (2e-5 / 10).
    assert first["step"] == 1 and first["lr"] == pytest.approx(2e-6)
    loss, _ = _masked_loss(pre_dir, prefix)
    assert first["loss"] == pytest.approx(loss, rel=1e-5)
    ft_dir, ft_meta, _ = open_checkpoint(ft)
    assert ft_meta.step == 1 and ft_meta.consumed_samples == _epoch(prefix)
    assert _adam_steps(ft_dir) == {1.0}  # a fresh AdamW: one step, not the base's 2 + 1
    config = (ft / "config.toml").read_text()
    assert "finetune = false" in config and "\nlr = 2e-05" in config
    # As written, it resumes the fine-tune (its optimizer and step), not the base.
    assert main(["train", "--config", str(ft / "config.toml"), "--load", str(ft), "--save",
                 str(ft), "--train-iters", "2"]) == 0
    again_dir, again, _ = open_checkpoint(ft)
    assert again.step == 2 and _adam_steps(again_dir) == {2.0}
    assert f"initialised from the weights of {pre_dir} (--finetune: weights only)" in out


def test_tp2_finetune_of_the_tp1_import_and_masked_eval(base: tuple[Path, Path],
                                                        tmp_path: Path, capfd) -> None:
    """The TP=1 import fine-tuned at TP=2 (resharded on load): its first loss is the import's
    masked mean, and `domino eval` of the import counts exactly the mask's tokens."""
    run, prefix = base
    ft = tmp_path / "ft2"
    assert main(_finetune(run, prefix, ft, "--tensor-model-parallel-size", "2", "--nproc",
                          "2")) == 0
    loss, counted = _masked_loss(open_checkpoint(run)[0], prefix)
    assert _first(ft)["loss"] == pytest.approx(loss, rel=1e-5)
    assert open_checkpoint(ft)[1].layout["tp"] == 2
    capfd.readouterr()
    assert main(["eval", str(run), "--data-path", str(prefix), "--split", "1,0,0",
                 "--split-name", "train", "--seq-length", str(SEQ), "--seed", str(SEED)]) == 0
    out = capfd.readouterr().out
    assert f"loss {loss:.4f}," in out and f"over {counted:,} tokens" in out


def test_finetune_refusals_before_any_process(base: tuple[Path, Path], tmp_path: Path,
                                              capfd) -> None:
    """A flag that contradicts the checkpoint's model names it and both values; --save onto
    the base run and --finetune without --load are refused; nothing is written."""
    run, prefix = base
    cases = [(["--hidden-size", "64"], "--hidden-size is 32 in the checkpoint but 64 here"),
             (["--num-layers", "3"], "--num-layers is 2 in the checkpoint but 3 here")]
    for extra, message in cases:
        assert main(_finetune(run, prefix, tmp_path / "bad", *extra)) == 2
        assert message in capfd.readouterr().err
    assert main(_finetune(run, prefix, run)) == 2
    assert "is the run --finetune starts from" in capfd.readouterr().err
    assert main(["train", "--finetune", "--data-path", str(prefix)]) == 2
    assert "--finetune starts from a model's weights: pass --load RUN" in capfd.readouterr().err
    assert not (tmp_path / "bad" / "metrics.jsonl").exists()
    assert [p.name for p in (run / "checkpoints").glob("step_*")] == ["step_0000000"]
