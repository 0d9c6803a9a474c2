"""``domino generate --chat``: the prompt as a user message (after ``--system``'s), rendered with
the chat template and its generation prompt, equals transformers'
``apply_chat_template(messages, add_generation_prompt=True, tokenize=True)`` token for token, on
a Llama-3-style template (it writes the BOS the tokenizer would add too: not added twice) and a
Qwen-style one (no BOS, a default system message); the greedy reply of the imported model equals
``transformers``' ``generate`` (stopping at the EOS); the template given by ``--chat-template``;
and the refusals. Random-weight models and tokenizers built here, nothing downloaded."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from domino.checkpoint.layout import open_checkpoint
from domino.checkpoint.store import load_tokenizer
from domino.cli import main
from domino.inference.chat import chat_prompt_ids

LLAMA3 = ("{{ bos_token }}{% for m in messages %}{{ '<|start_header_id|>' + m['role'] + "
          "'<|end_header_id|>\\n\\n' + m['content'] | trim + '<|eot_id|>' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>"
          "\\n\\n' }}{% endif %}")
QWEN = ("{%- if messages[0]['role'] == 'system' %}{{- '<|im_start|>system\\n' + "
        "messages[0]['content'] + '<|im_end|>\\n' }}{%- else %}{{- '<|im_start|>system\\nYou "
        "are a helpful assistant.<|im_end|>\\n' }}{%- endif %}{%- for m in messages %}"
        "{%- if not (m.role == 'system' and loop.first) %}{{- '<|im_start|>' + m.role + '\\n' + "
        "m.content + '<|im_end|>\\n' }}{%- endif %}{%- endfor %}{%- if add_generation_prompt %}"
        "{{- '<|im_start|>assistant\\n' }}{%- endif %}")
SPECIALS = {"llama": ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                      "<|end_header_id|>", "<|eot_id|>"],
            "qwen": ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]}
CORPUS = ["user: What is two plus two? assistant: It is four.", "system: You are terse.",
          "def forward(self, x): return self.alpha * x", "héllo wörld, zeta eta theta"] * 20
PROMPTS = [("What is two plus two?", None), ("  héllo wörld  ", "You are terse.")]
NEW = 10


def _tokenizer(kind: str):
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=300, special_tokens=SPECIALS[kind], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    if kind == "llama":  # Llama 3's tokenizer puts BOS before every text; its template too
        tok.post_processor = processors.TemplateProcessing(
            single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", 0)])
        return transformers.PreTrainedTokenizerFast(
            tokenizer_object=tok, bos_token="<|begin_of_text|>", eos_token="<|eot_id|>")
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>",
                                                pad_token="<|endoftext|>")


def _model_folder(kind: str, out: Path) -> Path:
    """A transformers folder: the Llama one with LLAMA3 in tokenizer_config.json, two EOS ids;
    the Qwen3 one with no chat template (it is given by --chat-template)."""
    import transformers

    hf = _tokenizer(kind)
    hf.save_pretrained(out)
    size = dict(vocab_size=len(hf), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                tie_word_embeddings=False)
    if kind == "llama":
        config_file = out / "tokenizer_config.json"
        config = json.loads(config_file.read_text())
        config_file.write_text(json.dumps({**config, "chat_template": LLAMA3}))
        ids = hf.convert_tokens_to_ids(["<|eot_id|>", "<|end_of_text|>"])
        cfg = transformers.LlamaConfig(**size, bos_token_id=0, eos_token_id=ids)
        model = transformers.LlamaForCausalLM
    else:
        cfg = transformers.Qwen3Config(**size, head_dim=8,
                                       eos_token_id=hf.convert_tokens_to_ids("<|im_end|>"))
        model = transformers.Qwen3ForCausalLM
    torch.manual_seed(5)
    model = model(cfg)
    _stop_early(model, hf, LLAMA3 if kind == "llama" else QWEN, cfg.eos_token_id)
    model.save_pretrained(out)
    return out


def _stop_early(model, hf, template: str, eos: int | list[int]) -> None:
    """Make the first prompt's greedy reply end with the (last) EOS id: its output row becomes
    1.05x the row of the reply's 4th token (random weights never choose it by themselves)."""
    eos = eos[-1] if isinstance(eos, list) else eos
    ids = torch.tensor([hf.apply_chat_template(_messages(*PROMPTS[0]), chat_template=template,
                                               add_generation_prompt=True)["input_ids"]])
    with torch.no_grad():
        reply = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4,
                               do_sample=False, pad_token_id=0)[0, ids.shape[1]:]
        model.lm_head.weight[eos] = 1.05 * model.lm_head.weight[reply[-1]]


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    """kind -> (transformers folder, its `domino import` run)."""
    tmp = tmp_path_factory.mktemp("chat_generate")
    out = {}
    for kind in ("llama", "qwen"):
        folder = _model_folder(kind, tmp / f"{kind}-hf")
        assert main(["import", str(folder), str(tmp / kind)]) == 0
        out[kind] = folder, tmp / kind
    (tmp / "qwen.jinja").write_text(QWEN)
    return out


def _messages(prompt: str, system: str | None) -> list[dict[str, str]]:
    return [*([{"role": "system", "content": system}] if system else []),
            {"role": "user", "content": prompt}]


def _theirs(folder: Path, prompt: str, system: str | None) -> tuple[list[int], list[int], str]:
    """(transformers' prompt ids, its greedy reply, the reply's text) for the conversation."""
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(folder)
    ids = tok.apply_chat_template(_messages(prompt, system), add_generation_prompt=True,
                                  tokenize=True, return_dict=True,
                                  chat_template=None if tok.chat_template else QWEN)["input_ids"]
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        prompt = torch.tensor([ids])  # (the mask given: BOS is id 0, taken for padding else)
        out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=NEW,
                             do_sample=False, pad_token_id=0)
    reply = out[0, len(ids):].tolist()
    return list(ids), reply, tok.decode(reply, skip_special_tokens=True)


def _template_flags(run: Path) -> list[str]:
    return ["--chat-template", str(run.parent / "qwen.jinja")] if run.name == "qwen" else []


@pytest.mark.parametrize("kind", ["llama", "qwen"])
def test_chat_prompt_and_reply_equal_transformers(models, kind: str, capfd) -> None:
    folder, run = models[kind]
    step_dir, meta, _ = open_checkpoint(str(run))
    tokenizer = load_tokenizer(step_dir, meta)
    stops = []
    for prompt, system in PROMPTS:
        ids, reply, text = _theirs(folder, prompt, system)
        spec = {"prompt": prompt, "system": system, "chat": True}
        if kind == "qwen":
            spec.update(chat_template=QWEN, chat_template_origin="qwen.jinja")
        assert chat_prompt_ids(tokenizer, spec, str(step_dir / "tokenizer")) == ids
        # The BOS the Llama tokenizer adds to text is written once, by the template.
        first = [0] if kind == "llama" else [tokenizer.encode("<|im_start|>")[0]]
        assert ids[:1] == first and ids.count(first[0]) == (1 if kind == "llama" else 3)
        argv = ["generate", str(run), "--prompt", prompt, "--chat", "--greedy",
                "--max-new-tokens", str(NEW), "--device", "cpu", *_template_flags(run),
                *(["--system", system] if system else [])]
        capfd.readouterr()
        assert main([*argv, "--ids"]) == 0
        assert capfd.readouterr().out.split() == list(map(str, reply))
        assert main(argv) == 0
        assert capfd.readouterr().out == text + "\n"  # the reply alone, without its EOS
        stops.append(len(reply) if reply[-1] in tokenizer.stop_ids else 0)
    assert 0 < stops[0] < NEW, stops  # the first reply ended at an EOS, before NEW tokens


def test_chat_refusals(models, tmp_path: Path, capfd) -> None:
    """Each refused before a rank starts (exit 2, nothing generated), naming the fix."""
    run = str(models["qwen"][1])
    broken = tmp_path / "broken.jinja"
    broken.write_text("{{ raise_exception('no system role') }}")
    unclosed = tmp_path / "unclosed.jinja"
    unclosed.write_text("{% for m in messages %}")
    cases = [
        (["--chat"], f"--chat: no chat template: the tokenizer at {run}"),
        (["--chat"], "pass --chat-template FILE"),
        (["--system", "x"], "--system only apply to a chat prompt; add --chat"),
        (["--chat-template", str(broken)], "--chat-template only apply to a chat prompt"),
        (["--chat", "--chat-template", str(tmp_path / "none.jinja")],
         f"--chat-template {tmp_path / 'none.jinja'} is not a file"),
        (["--chat", "--chat-template", str(broken)],
         f"--chat: the chat template ({broken}) cannot render the prompt: TemplateError: no "
         "system role; pass --chat-template FILE"),
        (["--chat", "--chat-template", str(unclosed)],
         f"--chat: the chat template of {unclosed} does not compile"),
    ]
    for flags, message in cases:
        capfd.readouterr()
        assert main(["generate", run, "--prompt", "hi", "--device", "cpu", *flags]) == 2
        out, err = capfd.readouterr()
        assert message in err and not out.strip(), (flags, err)
