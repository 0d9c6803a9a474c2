"""An imported model's tokens exactly as ``transformers`` uses them (folders written by
``transformers`` itself, random weights, nothing downloaded): text encoded with the BOS/EOS the
tokenizer's post-processor adds (and, for GPT-2's vocab.json + merges.txt, as
``tokenizer_config.json``'s ``add_bos_token`` says), equal to ``AutoTokenizer``'s ids;
``domino generate`` stops at every id of an ``eos_token_id`` list, as ``model.generate`` does;
``domino preprocess`` writes BOS-first documents that ``domino eval`` reads (and refuses a
dataset made without the BOS); import then export gives back the token metadata unchanged."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from domino.checkpoint.hf_import import import_hf, read_hf_tokenizer
from domino.checkpoint.layout import open_checkpoint
from domino.cli import main
from domino.config import TransformerConfig
from domino.data import BPETokenizer, HFTokenizer, IndexedDataset

SPECIALS = ["<s>", "</s>", "<eot>", "<pad>"]
BOS, EOS, EOT, PAD = range(len(SPECIALS))
CORPUS = ["alpha beta gamma delta epsilon " * 20, "def forward(self, x):\n    return x\n",
          "import torch\nimport os\n" * 5, "zeta eta theta iota kappa lambda " * 10] * 5
TEXTS = ["alpha beta def", "", "  leading spaces", "héllo wörld\n\nnew <eot> line",
         "def forward(self, x):\n    return self.alpha * x"]
PROMPT = "def forward(self"
CHAT = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}<eot>{% endfor %}"
TOKEN_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")


def _hf():
    import transformers

    return transformers


@pytest.fixture(scope="module")
def trained() -> str:
    """A byte-level BPE with four special tokens (ids 0-3), as JSON."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=330, special_tokens=SPECIALS, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return tok.to_str()


def _rust(trained: str, template: str | None):
    """The tokenizer with a TemplateProcessing post-processor ``template`` (None: none)."""
    from tokenizers import Tokenizer, processors

    tok = Tokenizer.from_str(trained)
    if template:
        tok.post_processor = processors.TemplateProcessing(
            single=template, pair=f"{template} $B:1",
            special_tokens=[(s, i) for i, s in enumerate(SPECIALS) if s in template.split()])
    return tok


def _folder(tmp: Path, trained: str, name: str, template: str | None,
            eos: int | list[int], seed: int = 0) -> Path:
    """A Llama with random weights, its tokenizer and generation config, as transformers saves
    them (tokenizer_config.json, chat_template.jinja; a sampling generation config)."""
    t = _hf()
    rust = _rust(trained, template)
    cfg = t.LlamaConfig(vocab_size=rust.get_vocab_size(), hidden_size=32, intermediate_size=64,
                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                        max_position_embeddings=64, rms_norm_eps=1e-6, tie_word_embeddings=False,
                        bos_token_id=BOS, eos_token_id=eos, pad_token_id=PAD)
    torch.manual_seed(seed)
    model = t.LlamaForCausalLM(cfg)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # informative logits: greedy output varies along the text
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.3)
    model.generation_config = t.GenerationConfig(
        bos_token_id=BOS, eos_token_id=eos, pad_token_id=PAD, do_sample=True, temperature=0.6,
        top_p=0.9)
    folder = tmp / name
    model.save_pretrained(folder)
    hf_tok = t.PreTrainedTokenizerFast(tokenizer_object=rust, bos_token="<s>", eos_token="<eot>",
                                       pad_token="<pad>")
    hf_tok.chat_template = CHAT
    hf_tok.save_pretrained(folder)
    return folder


def _imported(folder: Path, run: Path) -> HFTokenizer:
    import_hf(folder, run, 1)
    return HFTokenizer.load(run / "checkpoints" / "step_0000000" / "tokenizer")


@pytest.mark.parametrize("template", [None, "<s> $A", "<s> $A </s>"])
def test_encode_equals_transformers(tmp_path: Path, trained: str, template: str | None) -> None:
    """Our ids == AutoTokenizer's, with BOS (and EOS) where the post-processor adds them, and
    again after export."""
    folder = _folder(tmp_path, trained, "hf", template, EOS)
    ours = _imported(folder, tmp_path / "run")
    theirs = _hf().AutoTokenizer.from_pretrained(folder)
    want = [theirs(text)["input_ids"] for text in TEXTS]
    assert [ours.encode(text) for text in TEXTS] == want
    assert ours.encode_batch(TEXTS) == want
    assert want[0][0] == BOS if template else BOS not in want[0]
    assert ours.describe()["bos"] == ([BOS] if template else [])
    assert ours.appends_eod == (template == "<s> $A </s>")
    assert main(["export", "--format", "hf", str(tmp_path / "run"), str(tmp_path / "back")]) == 0
    again = _hf().AutoTokenizer.from_pretrained(tmp_path / "back")
    assert [again(text)["input_ids"] for text in TEXTS] == want


def _config(vocab: int) -> TransformerConfig:
    return TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=2,
                             vocab_size=vocab, seq_length=16, max_position_embeddings=16)


@pytest.mark.parametrize("flags", [{}, {"add_bos_token": True},
                                   {"add_bos_token": True, "add_eos_token": True}])
def test_gpt2_vocab_files_add_what_tokenizer_config_says(tmp_path: Path, flags: dict) -> None:
    """vocab.json + merges.txt: BOS/EOS as GPT2Tokenizer adds them from tokenizer_config.json
    (transformers 4's GPT-2 tokenizer reads add_bos_token only; we follow 5's, which reads
    both)."""
    if "add_eos_token" in flags and int(_hf().__version__.split(".")[0]) < 5:
        pytest.skip("transformers 4's GPT2TokenizerFast ignores add_eos_token")
    bpe = BPETokenizer.train(CORPUS, vocab_size=300)
    bpe.save(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "GPT2Tokenizer", "bos_token": "<|endoftext|>",
         "eos_token": "<|endoftext|>", **flags}))
    ours = read_hf_tokenizer(tmp_path, _config(bpe.vocab_size), bpe.eod)
    theirs = _hf().AutoTokenizer.from_pretrained(tmp_path)
    want = [theirs(text)["input_ids"] for text in TEXTS]
    assert [ours.encode(text) for text in TEXTS] == want
    assert (want[0][0] == bpe.eod) == bool(flags)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"add_bos_token": True, "bos_token": "<nope>"}))
    with pytest.raises(ValueError, match=r"tokenizer_config.json: add_bos_token is true but "
                                         r"bos_token '<nope>' is not a token of vocab.json"):
        read_hf_tokenizer(tmp_path, _config(bpe.vocab_size), bpe.eod)


def _greedy(model, ids: list[int], steps: int) -> list[int]:
    """transformers' model, argmax token by token over the whole text (no stop id)."""
    out = list(ids)
    with torch.no_grad():
        for _ in range(steps):
            out.append(int(model(torch.tensor([out])).logits[0, -1].argmax()))
    return out[len(ids):]


def test_generate_stops_at_every_eos_id(tmp_path: Path, trained: str, capfd) -> None:
    """An eos_token_id list [EOS, X] with X the token greedy decoding reaches at step k:
    transformers stops there, and so does `domino generate` (BOS-first prompt, same ids)."""
    t = _hf()
    folder = _folder(tmp_path, trained, "hf", "<s> $A", EOS, seed=1)
    prompt = t.AutoTokenizer.from_pretrained(folder)(PROMPT)["input_ids"]
    assert prompt[0] == BOS
    free = _greedy(t.AutoModelForCausalLM.from_pretrained(folder), prompt, 12)
    k = next((i for i in range(2, 10) if free[i] not in free[:i] + [BOS, EOS, EOT, PAD]), None)
    assert k is not None and EOS not in free, free  # (a model that varies its output)
    stop = [EOS, free[k]]
    for name in ("config.json", "generation_config.json"):
        raw = json.loads((folder / name).read_text())
        (folder / name).write_text(json.dumps({**raw, "eos_token_id": stop}, indent=2))
    model = t.AutoModelForCausalLM.from_pretrained(folder)  # (fp32, as saved)
    theirs = model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)
    assert theirs[0, len(prompt):].tolist() == free[:k + 1]  # it stopped at the second id
    run = tmp_path / "run"
    assert main(["import", str(folder), str(run)]) == 0
    meta = open_checkpoint(run)[1]
    assert meta.tokenizer["eos"] == stop and meta.tokenizer["eod"] == EOS
    sidecar = run / "checkpoints" / "step_0000000" / "tokenizer" / "domino.json"
    assert json.loads(sidecar.read_text())["eos"] == stop
    capfd.readouterr()
    args = ["generate", str(run), "--prompt", PROMPT, "--greedy", "--ids", "--max-new-tokens",
            "12"]
    assert main(args) == 0
    assert [int(x) for x in capfd.readouterr().out.split()] == free[:k + 1]
    assert main([*args, "--no-stop-at-eod"]) == 0
    assert [int(x) for x in capfd.readouterr().out.split()] == free


@pytest.mark.parametrize("template", ["<s> $A", "<s> $A </s>"])
def test_preprocess_writes_bos_first_documents(tmp_path: Path, trained: str, template: str,
                                               capfd) -> None:
    """Each document is transformers' encoding (BOS first) then EOD, unless the encoding ends
    with EOD already; `domino eval` reads it, and refuses a dataset made without the BOS."""
    folder = _folder(tmp_path, trained, "hf", template, EOS)
    run = tmp_path / "run"
    _imported(folder, run)
    texts = [t for t in TEXTS if t] * 4
    jsonl = tmp_path / "docs.jsonl"
    jsonl.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    prefix = tmp_path / "data" / "docs"
    tok_dir = run / "checkpoints" / "step_0000000" / "tokenizer"
    assert main(["preprocess", "--input", str(jsonl), "--output-prefix", str(prefix),
                 "--tokenizer-type", "hf", "--tokenizer-dir", str(tok_dir),
                 "--no-progress"]) == 0
    theirs = _hf().AutoTokenizer.from_pretrained(folder)
    tail = [] if template.endswith("</s>") else [EOS]
    ds = IndexedDataset(prefix)
    assert [ds.get(i).tolist() for i in range(len(ds))] == [
        theirs(t)["input_ids"] + tail for t in texts]
    assert all(ds.get(i).tolist()[0] == BOS for i in range(len(ds)))
    evaluate = ["eval", str(run), "--data-path", str(prefix), "--split", "1,0,0",
                "--split-name", "train", "--seq-length", "16", "--micro-batch-size", "2"]
    capfd.readouterr()
    assert main(evaluate) == 0
    assert "perplexity" in capfd.readouterr().out
    sidecar = Path(f"{prefix}.json")
    info = json.loads(sidecar.read_text())
    del info["tokenizer"]["bos"]  # as a dataset made before documents started with BOS
    sidecar.write_text(json.dumps(info))
    assert main(evaluate) == 2
    err = capfd.readouterr().err
    assert "was made without the BOS id(s) [0]" in err and "re-run `domino preprocess`" in err


def test_import_then_export_keeps_token_metadata(tmp_path: Path, trained: str) -> None:
    """config.json's token ids (an EOS list), generation_config.json, tokenizer_config.json and
    the chat template come back as they were, through a copy of the run's tokenizer too."""
    folder = _folder(tmp_path, trained, "hf", "<s> $A", [EOS, EOT])
    run, back = tmp_path / "run", tmp_path / "back"
    assert main(["import", str(folder), str(run)]) == 0
    tok = HFTokenizer.load(run / "checkpoints" / "step_0000000" / "tokenizer")
    assert tok.stop_ids == (EOS, EOT) and tok.eod == EOS
    tok.save(tmp_path / "copy")  # (what each checkpoint of a fine-tune writes)
    copy = HFTokenizer.load(tmp_path / "copy")
    assert (copy.hf, copy.stop_ids, copy.describe()) == (tok.hf, tok.stop_ids, tok.describe())
    assert main(["export", "--format", "hf", str(run), str(back)]) == 0

    def read(where: Path, name: str) -> dict:
        return json.loads((where / name).read_text())

    original, exported = read(folder, "config.json"), read(back, "config.json")
    assert {k: exported.get(k) for k in TOKEN_KEYS} == {k: original.get(k) for k in TOKEN_KEYS}
    assert exported["eos_token_id"] == [EOS, EOT] and exported["bos_token_id"] == BOS
    for name in ("generation_config.json", "tokenizer_config.json"):
        assert read(back, name) == read(folder, name), name
    for name in ("chat_template.jinja", "special_tokens_map.json"):  # (as the version saves)
        assert (back / name).exists() == (folder / name).exists(), name
        if (folder / name).exists():
            assert (back / name).read_text() == (folder / name).read_text(), name
    t = _hf()
    mine, theirs = (t.AutoTokenizer.from_pretrained(f) for f in (back, folder))
    assert (mine.bos_token, mine.eos_token, mine.pad_token) == ("<s>", "<eot>", "<pad>")
    assert mine.chat_template == theirs.chat_template == CHAT
    assert [mine(x)["input_ids"] for x in TEXTS] == [theirs(x)["input_ids"] for x in TEXTS]
    assert t.GenerationConfig.from_pretrained(back).eos_token_id == [EOS, EOT]
