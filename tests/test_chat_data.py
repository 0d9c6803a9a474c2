"""Chat data (`domino preprocess --format chat`): token ids and the per-token loss mask equal to
transformers' ``apply_chat_template(..., return_assistant_tokens_mask=True)`` on a template with
``{% generation %}`` markers (a tokenizer folder built here, nothing downloaded); the fallback
rule on a template without them; ``--train-on-prompt``; prompt/completion rows; length limits;
each refusal naming file, row and field with nothing written; the jinja sandbox; the mask
beside the tokens refused when it does not fit; and a `domino train` step whose loss is the mean
over the assistant tokens only."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from domino.cli import main
from domino.data import IndexedDataset
from domino.data.gpt_dataset import GPTDataset

SPECIALS = ["<s>", "</s>", "<|im_start|>", "<|im_end|>", "<pad>"]
NL = "{{ '\\n' }}"
# ":" then a space outside the spans: the BPE token " word" crosses a span's start (it counts).
TURN = "<|im_start|>{{ m['role'] }}:{{ ' ' }}"
GEN = ("{{ bos_token }}{% for m in messages %}" + TURN
       + "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}<|im_end|>"
       "{% endgeneration %}{% else %}{{ m['content'] }}<|im_end|>{% endif %}" + NL
       + "{% endfor %}")
PLAIN = ("{{ bos_token }}{% for m in messages %}" + TURN + "{{ m['content'] }}<|im_end|>" + NL
         + "{% endfor %}")
CHATS = [
    [{"role": "system", "content": "You are terse."},
     {"role": "user", "content": "alpha beta?"},
     {"role": "assistant", "content": "gamma delta."},
     {"role": "user", "content": "héllo wörld"},
     {"role": "assistant", "content": "def forward(self, x): return x"}],
    [{"role": "user", "content": "zeta"}, {"role": "assistant", "content": " eta theta "}],
    [{"role": "user", "content": "one <|im_end|> two"},
     {"role": "assistant", "content": "iota\nkappa"}],
]


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    """A transformers tokenizer folder (byte-level BPE, ChatML specials, the GEN template) with
    a small Llama config.json, as `--tokenizer-dir` reads a model folder."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = [f"{m['role']}: {m['content']}" for chat in CHATS for m in chat] * 20
    tok.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=300, special_tokens=SPECIALS, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    # BOS on every encoded text: a chat is encoded without it (the template writes its own).
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    out = tmp_path_factory.mktemp("tok") / "model"
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>",
                                              eos_token="<|im_end|>", pad_token="<pad>")
    hf.chat_template = GEN
    hf.save_pretrained(out)
    transformers.LlamaConfig(vocab_size=320, hidden_size=32, intermediate_size=64,
                             num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                             max_position_embeddings=128, bos_token_id=0,
                             eos_token_id=3).save_pretrained(out)
    return out


def _theirs(folder: Path, chat: list[dict], template: str | None = None) -> tuple[list, list]:
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(folder)
    out = tok.apply_chat_template(chat, tokenize=True, return_dict=True, chat_template=template,
                                  return_assistant_tokens_mask=True)
    return list(out["input_ids"]), list(out["assistant_masks"])


def _jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _preprocess(folder: Path, inputs: list[Path], prefix: Path, *extra: str) -> int:
    return main(["preprocess", "--format", "chat", "--input", *map(str, inputs),
                 "--output-prefix", str(prefix), "--tokenizer-type", "hf", "--tokenizer-dir",
                 str(folder), "--no-progress", *extra])


def _docs(prefix: Path) -> tuple[list[list[int]], list[list[int]]]:
    tokens, mask = IndexedDataset(prefix), IndexedDataset(f"{prefix}_loss_mask")
    return ([tokens.get(i).tolist() for i in range(len(tokens))],
            [mask.get(i).tolist() for i in range(len(mask))])


def test_ids_and_mask_equal_transformers(folder: Path, tmp_path: Path, capfd) -> None:
    data = _jsonl(tmp_path / "chats.jsonl", [{"messages": c} for c in CHATS])
    prefix = tmp_path / "out" / "chats"
    assert _preprocess(folder, [data], prefix) == 0
    ids, masks = _docs(prefix)
    theirs = [_theirs(folder, c) for c in CHATS]
    assert ids == [t[0] for t in theirs] and masks == [t[1] for t in theirs]
    assert ids[0][0] == 0 and ids[0].count(0) == 1  # the template's BOS, none added
    starts = [i for i, m in enumerate(masks[0]) if m and not masks[0][i - 1]]
    assert starts and all(ids[0][i] != 0 for i in starts)
    assert 0 < sum(map(sum, masks)) < sum(map(len, ids))
    out = capfd.readouterr().out
    share = sum(map(sum, masks)) / sum(map(len, ids))
    assert (f"3 conversations, {sum(map(len, ids)):,} tokens, {sum(map(sum, masks)):,} counted "
            f"for the loss ({share:.1%}); 0 dropped and 0 truncated") in out
    meta = json.loads(Path(f"{prefix}.json").read_text())
    assert meta["chat"]["rule"] == "generation blocks"


def test_fallback_rule_tables_and_prompt_completion(folder: Path, tmp_path: Path) -> None:
    """Without markers: each assistant content and the <|im_end|> closing it, which is what
    the GEN template marks; read from Parquet and Arrow, prompt/completion as user+assistant."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"messages": CHATS}), tmp_path / "chats.parquet")
    pairs = [("alpha beta?", "gamma."), ("zeta", "eta theta")]
    table = pa.table({"prompt": [p for p, _ in pairs], "completion": [c for _, c in pairs]})
    with pa.ipc.new_file(str(tmp_path / "pairs.arrow"), table.schema) as writer:
        writer.write_table(table)
    (tmp_path / "plain.jinja").write_text(PLAIN)
    prefix = tmp_path / "fallback"
    assert _preprocess(folder, [tmp_path / "chats.parquet", tmp_path / "pairs.arrow"], prefix,
                       "--chat-template", str(tmp_path / "plain.jinja")) == 0
    chats = CHATS + [[{"role": "user", "content": p}, {"role": "assistant", "content": c}]
                     for p, c in pairs]
    theirs = [_theirs(folder, c) for c in chats]
    assert _docs(prefix) == ([t[0] for t in theirs], [t[1] for t in theirs])
    assert json.loads(Path(f"{prefix}.json").read_text())["chat"]["rule"] == (
        "assistant content + end token")


def test_train_on_prompt_and_length_limits(folder: Path, tmp_path: Path, capfd) -> None:
    data = _jsonl(tmp_path / "chats.jsonl", [{"messages": c} for c in CHATS])
    lengths = [len(_theirs(folder, c)[0]) for c in CHATS]
    assert _preprocess(folder, [data], tmp_path / "all", "--train-on-prompt") == 0
    ids, masks = _docs(tmp_path / "all")
    assert [len(i) for i in ids] == lengths and all(set(m) == {1} for m in masks)
    limit = sorted(lengths)[1]
    assert _preprocess(folder, [data], tmp_path / "drop", "--max-tokens", str(limit)) == 0
    assert [len(i) for i in _docs(tmp_path / "drop")[0]] == [n for n in lengths if n <= limit]
    assert "1 dropped and 0 truncated" in capfd.readouterr().out
    assert _preprocess(folder, [data], tmp_path / "cut", "--max-tokens", str(limit),
                       "--truncate") == 0
    ids, masks = _docs(tmp_path / "cut")
    full = [_theirs(folder, c) for c in CHATS]
    assert ids == [t[0][:limit] for t in full] and masks == [t[1][:limit] for t in full]
    assert "0 dropped and 1 truncated" in capfd.readouterr().out


BAD_ROWS = [
    ({"text": "hi"}, "line 2: no field 'messages'"),
    ({"messages": [{"content": "hi"}]}, "line 2: messages[0]: missing field 'role'"),
    ({"messages": [{"role": "robot", "content": "hi"}]},
     "line 2: messages[0]: unknown role 'robot'"),
    ({"messages": [{"role": "user", "content": ["hi"]}]},
     "line 2: messages[0]: field 'content' is of type list"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": " "}]},
     "line 2: messages[1]: empty assistant turn"),
    ({"messages": []}, "line 2: field 'messages' is empty"),
    ({"prompt": "hi", "completion": 3}, "line 2: field 'completion' is of type int"),
    ({"messages": [{"role": "user", "content": "boom"}]},
     "line 2: the chat template (TEMPLATE) failed to render: TemplateError: no boom"),
]


@pytest.mark.parametrize("row,message", BAD_ROWS)
def test_refusals_name_file_row_and_field(folder: Path, tmp_path: Path, capfd, row: dict,
                                          message: str) -> None:
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}{% if m['content'] == 'boom' %}"
                        "{{ raise_exception('no boom') }}{% endif %}{{ m['content'] }}"
                        "{% endfor %}")
    data = _jsonl(tmp_path / "chats.jsonl", [{"messages": CHATS[1]}, row])
    before = sorted(p.name for p in tmp_path.iterdir())
    assert _preprocess(folder, [data], tmp_path / "out", "--chat-template", str(template)) == 2
    err = capfd.readouterr().err
    assert f"{data}: {message.replace('TEMPLATE', str(template))}" in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # nothing written


def test_template_problems(folder: Path, tmp_path: Path, capfd) -> None:
    """The sandbox refuses reaching CPython internals; a folder without a template says how to
    give one; flags that need --format chat or --max-tokens are refused."""
    data = _jsonl(tmp_path / "chats.jsonl", [{"messages": CHATS[1]}])
    unsafe = tmp_path / "unsafe.jinja"
    unsafe.write_text("{{ messages.__class__.__mro__[1].__subclasses__() }}")
    assert _preprocess(folder, [data], tmp_path / "a", "--chat-template", str(unsafe)) == 2
    err = capfd.readouterr().err
    assert f"{data}: line 1: the chat template ({unsafe}) failed to render: SecurityError" in err
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("tokenizer.json", "config.json"):
        (bare / name).write_bytes((folder / name).read_bytes())
    assert _preprocess(bare, [data], tmp_path / "b") == 2
    assert f"no chat template: the tokenizer at {bare} has no chat_template.jinja" in (
        capfd.readouterr().err)
    assert _preprocess(folder, [data], tmp_path / "c", "--truncate") == 2
    assert "--truncate cuts conversations to --max-tokens N" in capfd.readouterr().err
    assert main(["preprocess", "--input", str(data), "--output-prefix", str(tmp_path / "d"),
                 "--train-on-prompt"]) == 2
    assert "apply to --format chat only" in capfd.readouterr().err
    assert not list(tmp_path.glob("[abcd].*")) and not list(tmp_path.glob("[abcd]_loss*"))


def test_dataset_uses_the_mask_and_refuses_one_that_does_not_fit(folder: Path,
                                                                 tmp_path: Path) -> None:
    data = _jsonl(tmp_path / "chats.jsonl", [{"messages": c} for c in CHATS])
    prefix = tmp_path / "chats"
    assert _preprocess(folder, [data], prefix) == 0
    ds = IndexedDataset(prefix)
    gpt = GPTDataset(ds, 8, epochs=1, seed=3, eod_token=3)
    plain = GPTDataset(ds, 8, epochs=1, seed=3, eod_token=3, loss_mask=None)
    for i in range(len(gpt)):  # the label's mask entry decides: sample entries 1..s
        want = gpt._window(IndexedDataset(f"{prefix}_loss_mask"), i)[1:]
        assert gpt[i]["loss_mask"].tolist() == want.astype(np.float32).tolist()
        assert plain[i]["loss_mask"].tolist() == [1.0] * 8
    # A mask of other document lengths: refused naming both files.
    other = _jsonl(tmp_path / "other.jsonl", [{"messages": c} for c in CHATS[:2]])
    assert _preprocess(folder, [other], tmp_path / "other") == 0
    for suffix in (".bin", ".idx"):
        Path(f"{prefix}_loss_mask{suffix}").write_bytes(
            Path(f"{tmp_path}/other_loss_mask{suffix}").read_bytes())
    with pytest.raises(ValueError, match=f"{prefix}_loss_mask.idx does not fit {prefix}.idx"):
        GPTDataset(IndexedDataset(prefix), 8, epochs=1, eod_token=3)


def test_train_loss_is_the_mean_over_assistant_tokens(folder: Path, tmp_path: Path) -> None:
    """One `domino train` step (its learning rate too small to move fp32 weights) over every
    sample of an epoch: its loss is the saved model's per-token losses averaged over the
    labels whose mask entry is 1 (the mask file read here, aligned to the labels)."""
    data = _jsonl(tmp_path / "chats.jsonl", [{"messages": c} for c in CHATS * 4])
    prefix = tmp_path / "chats"
    assert _preprocess(folder, [data], prefix) == 0
    seq = 16
    samples = (IndexedDataset(prefix).num_tokens - 1) // seq
    run = tmp_path / "run"
    assert main(["train", "--data-path", str(prefix), "--tokenizer-type", "hf",
                 "--tokenizer-dir", str(folder), "--split", "1,0,0", "--seq-length", str(seq),
                 "--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "4",
                 "--micro-batch-size", str(samples), "--global-batch-size", str(samples),
                 "--train-iters", "1", "--lr", "1e-30", "--min-lr", "0", "--eval-iters", "0",
                 "--log-interval", "1", "--sample-tokens", "0", "--no-tensorboard",
                 "--nproc", "1", "--tensor-model-parallel-size", "1", "--seed", "7",
                 "--save", str(run)]) == 0
    loss = json.loads((run / "metrics.jsonl").read_text().splitlines()[0])["loss"]
    step_dir = sorted((run / "checkpoints").glob("step_*"))[-1]
    masked, _, unmasked = masked_loss(step_dir, prefix, seq, samples, seed=7)
    assert loss == pytest.approx(masked, rel=1e-5)
    assert loss != pytest.approx(unmasked, rel=1e-4)


def masked_loss(step_dir: Path, prefix: Path, seq: int, samples: int, seed: int,
                first: int | None = None) -> tuple[float, int, float]:
    """The saved model's per-token losses over ``samples`` samples of ``seq`` tokens (the
    dataset's order for ``seed``; only its ``first`` samples, where given: a run's first global
    batch): their mean over the labels whose loss-mask entry is 1 (the mask file read here,
    aligned to the labels), how many that counts, and their plain mean."""
    from domino.inference.loading import load_saved_model
    from domino.parallel_state import ParallelState

    model = load_saved_model(step_dir, ParallelState.single())[0]
    dataset = GPTDataset(IndexedDataset(prefix), seq, samples, seed=seed, eod_token=3)
    samples = samples if first is None else first
    batch = {k: torch.stack([dataset[i][k] for i in range(samples)]) for k in
             ("tokens", "labels", "position_ids")}
    with torch.no_grad():
        per_token = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    mask_ds = IndexedDataset(f"{prefix}_loss_mask")
    mask = torch.tensor(np.stack([dataset._window(mask_ds, i)[1:] for i in range(samples)]),
                        dtype=torch.float32)
    assert 0 < mask.sum() < mask.numel()
    return (float((per_token * mask).sum() / mask.sum()), int(mask.sum()),
            float(per_token.mean()))


def test_text_over_a_chat_dataset_replaces_its_mask(folder: Path, tmp_path: Path,
                                                    capfd) -> None:
    """A text dataset written over a chat one: its stale mask would apply to the new tokens,
    so it is refused without --overwrite and removed with it."""
    prefix = tmp_path / "data"
    assert _preprocess(folder, [_jsonl(tmp_path / "c.jsonl", [{"messages": CHATS[0]}])],
                       prefix) == 0
    text = _jsonl(tmp_path / "t.jsonl", [{"text": "alpha beta gamma"}])
    argv = ["preprocess", "--input", str(text), "--output-prefix", str(prefix), "--no-progress"]
    assert main(argv) == 2
    assert f"{prefix}.bin exists already" in capfd.readouterr().err
    assert main([*argv, "--overwrite"]) == 0
    assert not list(tmp_path.glob("data_loss_mask*"))
    assert GPTDataset(IndexedDataset(prefix), 4, epochs=1, eod_token=256).loss_mask is None
