"""Using an imported model as a new user does, against the real ``transformers`` (models built
locally from configs with random weights, no downloads): a bf16 model exports as bf16 (half
the bytes of fp32, the original's logits) unless ``--dtype`` says otherwise, and a fine-tune
of it keeps that dtype; an MoE model imported at TP=2 fine-tunes with the config.toml import
wrote; ``--tokenizer-dir`` finds the tokenizer from the run folder, the checkpoint and the
model folder alike; ``domino generate`` refuses a request past the model's positions (where
its output would stop matching transformers') unless ``--slide-context`` asks for the sliding
window."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from hf_compat import load_hf
from safetensors import safe_open

from domino.checkpoint.layout import open_checkpoint
from domino.cli import main
from domino.data import BPETokenizer
from domino.data.indexed_dataset import IndexedDataset
from domino.data.preprocess import stdlib_corpus_files

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

TEXT = "def forward(self, x):\n    return self.alpha * x + beta"


@pytest.fixture(scope="module")
def bpe() -> BPETokenizer:
    corpus = [TEXT * 3, "alpha beta gamma delta epsilon " * 20, "import torch\n" * 10] * 5
    return BPETokenizer.train(corpus, vocab_size=300)


def _randomize(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_((torch.randn(p.shape, generator=gen) * 0.2).to(p.dtype))
    return model.eval()


def _save(model: torch.nn.Module, bpe: BPETokenizer, folder: Path) -> Path:
    model.save_pretrained(folder)
    bpe._tok.save(str(folder / "tokenizer.json"))
    return folder


def _llama(bpe: BPETokenizer, positions: int = 64, dtype: torch.dtype = torch.float32):
    import transformers as t

    cfg = t.LlamaConfig(vocab_size=bpe.vocab_size, hidden_size=48, intermediate_size=64,
                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                        head_dim=16, max_position_embeddings=positions, rms_norm_eps=1e-6,
                        tie_word_embeddings=False, bos_token_id=bpe.eod, eos_token_id=bpe.eod)
    return _randomize(t.LlamaForCausalLM(cfg).to(dtype), 3)


def _dtypes(folder: Path) -> set[torch.dtype]:
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        return {f.get_tensor(k).dtype for k in f.keys()}


def _tokens_file(prefix: Path) -> dict:
    return json.loads(prefix.with_suffix(".json").read_text())


def _data(tmp: Path, tokenizer_dir: Path) -> Path:
    """A little fine-tuning data, tokenized with the imported model's tokenizer."""
    prefix = tmp / "data"
    assert main(["preprocess", "--input", *stdlib_corpus_files(limit_bytes=30_000),
                 "--output-prefix", str(prefix), "--tokenizer-type", "hf", "--tokenizer-dir",
                 str(tokenizer_dir)]) == 0
    return prefix


def test_bf16_model_exports_as_bf16(tmp_path: Path, bpe: BPETokenizer, capfd) -> None:
    """Imported from a bf16 folder, exported by default in bf16 (config.json says so, half the
    bytes of --dtype float32) with exactly the original's logits in transformers; a run that
    fine-tunes it keeps that dtype; --dtype float32 gives fp32."""
    original = _llama(bpe, dtype=torch.bfloat16)
    folder = _save(original, bpe, tmp_path / "hf")
    run = tmp_path / "run"
    assert main(["import", str(folder), str(run)]) == 0
    out = capfd.readouterr().out
    assert "(llama, bfloat16)" in out and "lr 2e-05" in out
    assert str(run / "checkpoints" / "step_0000000" / "tokenizer") in out
    assert open_checkpoint(run)[1].extra["dtype"] == "bfloat16"
    half, full = tmp_path / "bf16", tmp_path / "fp32"
    assert main(["export", "--format", "hf", str(run), str(half)]) == 0
    assert main(["export", "--format", "hf", str(run), str(full), "--dtype", "float32"]) == 0
    assert _dtypes(half) == {torch.bfloat16} and _dtypes(full) == {torch.float32}
    for where, name in ((half, "bfloat16"), (full, "float32")):
        raw = json.loads((where / "config.json").read_text())
        assert raw["torch_dtype"] == raw["dtype"] == name
    sizes = [(f / "model.safetensors").stat().st_size for f in (half, full)]
    assert abs(2 * sizes[0] - sizes[1]) < 0.01 * sizes[1], sizes
    ids = torch.tensor([bpe.encode(TEXT)[:30]])
    # The original as transformers loads it (an in-memory `.to(bfloat16)` model also rounds
    # its RoPE frequencies to bf16, which a loaded one computes in fp32).
    first, back = load_hf(folder, "auto"), load_hf(half, "auto")  # (torch_dtype on 4.x)
    assert back.dtype == first.dtype == torch.bfloat16
    weights = first.state_dict()
    assert all(torch.equal(t, weights[k]) for k, t in back.state_dict().items())
    with torch.no_grad():
        assert torch.equal(back(ids).logits, first(ids).logits)
    as_fp32 = load_hf(full, "auto")
    assert as_fp32.dtype == torch.float32
    # A fine-tune of it is still a bf16 model (its fp32 master weights exported as bf16).
    ft = tmp_path / "ft"
    assert main(["train", "--config", str(run / "config.toml"), "--load", str(run),
                 "--data-path", str(_data(tmp_path, run)), "--train-iters", "1",
                 "--micro-batch-size", "2", "--seq-length", "32", "--eval-iters", "0",
                 "--sample-tokens", "0", "--no-tensorboard", "--save", str(ft)]) == 0
    assert main(["export", "--format", "hf", str(ft), str(tmp_path / "ft-hf")]) == 0
    assert _dtypes(tmp_path / "ft-hf") == {torch.bfloat16}


def test_moe_imported_at_tp2_fine_tunes_as_written(tmp_path: Path, bpe: BPETokenizer,
                                                   capfd) -> None:
    """A Mixtral imported at TP=2: its config.toml (with the sequence parallelism MoE needs at
    TP > 1, and fine-tuning settings) trains as written; --tokenizer-dir takes the model folder
    for data made with the run folder's tokenizer (the same tokenizer, so the run accepts it)."""
    import transformers as t

    cfg = t.MixtralConfig(vocab_size=bpe.vocab_size, hidden_size=48, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, intermediate_size=40,
                          max_position_embeddings=64, num_local_experts=4,
                          num_experts_per_tok=2, bos_token_id=bpe.eod, eos_token_id=bpe.eod)
    folder = _save(_randomize(t.MixtralForCausalLM(cfg), 5), bpe, tmp_path / "hf")
    run = tmp_path / "run"
    assert main(["import", str(folder), str(run), "--tensor-model-parallel-size", "2"]) == 0
    written = tomllib.loads((run / "config.toml").read_text())
    assert written["sequence_parallel"] and written["tensor_model_parallel_size"] == 2
    assert (written["lr"], written["lr_warmup_iters"], written["weight_decay"]) == (2e-5, 10, 0)
    data = _data(tmp_path, run)
    capfd.readouterr()
    assert main(["train", "--config", str(run / "config.toml"), "--load", str(run),
                 "--data-path", str(data), "--split", "90,10,0", "--train-iters", "1",
                 "--micro-batch-size", "2", "--seq-length", "32", "--eval-iters", "1",
                 "--sample-tokens", "0", "--no-tensorboard", "--tokenizer-dir", str(folder),
                 "--save", str(tmp_path / "ft")]) == 0
    assert "initialised from the weights of" in capfd.readouterr().out
    assert open_checkpoint(tmp_path / "ft")[1].step == 1


def test_tokenizer_dir_finds_the_tokenizer(tmp_path: Path, bpe: BPETokenizer, capfd) -> None:
    """--tokenizer-dir takes the run folder, its checkpoints and step folders, the tokenizer/
    folder and the transformers model folder, all giving transformers' own ids; elsewhere one
    line names what was looked for where, exit 2, nothing written."""
    import transformers as t

    folder = _save(_llama(bpe), bpe, tmp_path / "hf")
    run = tmp_path / "run"
    assert main(["import", str(folder), str(run)]) == 0
    text = tmp_path / "in.txt"
    text.write_text(TEXT)
    step = run / "checkpoints" / "step_0000000"
    expected = t.PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"))(TEXT)
    hashes = set()
    for i, where in enumerate((run, run / "checkpoints", step, step / "tokenizer", folder)):
        prefix = tmp_path / f"data{i}"
        assert main(["preprocess", "--input", str(text), "--output-prefix", str(prefix),
                     "--tokenizer-type", "hf", "--tokenizer-dir", str(where)]) == 0
        hashes.add(_tokens_file(prefix)["tokenizer"]["vocab_hash"])
        doc = IndexedDataset(str(prefix))[0].tolist()
        assert doc[:len(expected["input_ids"])] == expected["input_ids"]
    assert len(hashes) == 1
    capfd.readouterr()
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["preprocess", "--input", str(text), "--output-prefix",
                 str(tmp_path / "out" / "x"), "--tokenizer-type", "hf", "--tokenizer-dir",
                 str(empty)]) == 2
    err = capfd.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and not (tmp_path / "out").exists(), err
    for named in (str(empty), "tokenizer.json + domino.json", "latest.json", "config.json",
                  "pass a run folder"):
        assert named in err, err
    assert main(["preprocess", "--input", str(text), "--output-prefix", str(tmp_path / "y"),
                 "--tokenizer-type", "bpe", "--tokenizer-dir", str(run)]) == 2
    assert "holds a hf tokenizer, not bpe; pass --tokenizer-type hf" in capfd.readouterr().err
    from domino.training.arguments import TrainArgs

    help_text = TrainArgs.__dataclass_fields__["tokenizer_dir"].metadata["help"]
    assert "tokenizer.json" in help_text and "run" in help_text


def test_generate_refuses_past_the_position_limit(tmp_path: Path, bpe: BPETokenizer,
                                                  capfd) -> None:
    """Within max_position_embeddings greedy output equals transformers.generate; a prompt +
    --max-new-tokens past it is refused before any work (one line, exit 2, the numbers and the
    fix), and runs with --slide-context, equal to transformers until the window slides."""
    original = _llama(bpe, positions=24)
    run = tmp_path / "run"
    assert main(["import", str(_save(original, bpe, tmp_path / "hf")), str(run)]) == 0
    prompt = "alpha beta gamma delta epsilon alpha beta"
    ids = bpe.encode(prompt)
    room = 24 - len(ids)
    hf = original.generate(torch.tensor([ids]), max_new_tokens=room + 6, do_sample=False,
                           pad_token_id=bpe.eod, eos_token_id=None)[0, len(ids):].tolist()
    assert len(hf) == room + 6

    def ours(*flags: str) -> tuple[int, list[int], str]:
        capfd.readouterr()
        code = main(["generate", str(run), "--prompt", prompt, "--greedy", "--ids",
                     "--no-stop-at-eod", *flags])
        out = capfd.readouterr()
        return code, [int(x) for x in out.out.split()], out.err.strip()

    code, got, _ = ours("--max-new-tokens", str(room))
    assert code == 0 and got == hf[:room]
    code, got, err = ours("--max-new-tokens", str(room + 6))
    assert code == 2 and not got and len(err.splitlines()) == 1, err
    for named in (f"{len(ids)} tokens", f"--max-new-tokens {room + 6}", "24",
                  f"lower --max-new-tokens to {room}", "--slide-context"):
        assert named in err, err
    code, got, _ = ours("--max-new-tokens", str(room + 6), "--slide-context")
    assert code == 0 and len(got) == room + 6 and got[:room + 1] == hf[:room + 1]


def test_export_refuses_a_dtype_that_cannot_hold_the_weights(tmp_path: Path, bpe: BPETokenizer,
                                                            capfd) -> None:
    """--dtype float16 of a model with a weight past float16's range: one line naming the
    weight and the fix, exit 2, no OUT; bfloat16 holds it."""
    model = _llama(bpe)
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight[0, 0] = 1e6
    run = tmp_path / "run"
    assert main(["import", str(_save(model, bpe, tmp_path / "hf")), str(run)]) == 0
    capfd.readouterr()
    out = tmp_path / "out"
    assert main(["export", "--format", "hf", str(run), str(out), "--dtype", "float16"]) == 2
    err = capfd.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and not out.exists(), err
    assert "model.layers.1.mlp.down_proj.weight" in err and "--dtype bfloat16" in err, err
    assert main(["export", "--format", "hf", str(run), str(out), "--dtype", "bfloat16"]) == 0
    assert _dtypes(out) == {torch.bfloat16}
