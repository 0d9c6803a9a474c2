"""``domino train --lora-rank`` runs, end to end through the CLI, on test_finetune's random-weight
transformers Llama import and chat data: a LoRA fine-tune at TP=2 of the TP=1 import saves only
the adapters (and their AdamW state) split as their linears are, names its base by path and
SHA-256, starts at the base's masked loss and follows TP=1's losses; stopped and resumed it is
bit-identical to a straight run; `domino generate` and `domino eval` use the adapters; and the
flag values and checkpoints a LoRA run cannot start from or continue are refused before any
process starts (a moved or re-saved base when it is read)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import test_finetune
import torch
from safetensors.torch import load_file
from test_chat_data import masked_loss
from test_finetune import SEED, SEQ, _epoch, _finetune
from train_spawn import held_launches, train_held

from domino.checkpoint import layout
from domino.checkpoint.layout import open_checkpoint
from domino.cli import main
from domino.models.lora import is_adapter_name

chat_base = test_finetune.base  # the import and its chat data (a module fixture of this file)

STEPS, CUT = 4, 2  # the straight runs' steps; the resumed run stops at CUT first
LR = "2e-2"  # large, so that 4 steps move the adapters far enough to change greedy output
LORA = ["--lora-rank", "4", "--lora-alpha", "8", "--lora-target-modules", "qkv,proj,fc1,fc2"]
DROP = ["--lora-dropout", "0.1"]  # (dropout masks follow Domino's micro-batch split: not TP=1's)
TP2 = ["--tensor-model-parallel-size", "2", "--nproc", "2"]
TP1 = ["--tensor-model-parallel-size", "1", "--nproc", "1"]
# Column-parallel linears split B with their output rows, row-parallel ones A with their input
# columns (the factor and the dimension); the other factor is whole, in TP rank 0's file.
SPLIT = {"query_key_value": ("b", 0), "dense_h_to_4h": ("b", 0), "dense": ("a", 1),
         "dense_4h_to_h": ("a", 1)}
PROMPT, NEW = "alpha beta?", 6


def _lora(load: Path, prefix: Path, save: Path, *extra: str) -> list[str]:
    """A LoRA fine-tune: STEPS steps, each over one whole epoch as a single global batch."""
    return _finetune(load, prefix, save, *LORA, "--lr", LR, "--lr-warmup-iters", "0",
                     "--train-iters", str(STEPS), *extra)


def _metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _losses(run: Path) -> list[float]:
    return [m["loss"] for m in _metrics(run) if "loss" in m]


def _files(step_dir: Path) -> dict[str, dict[str, torch.Tensor]]:
    """Every model and optimizer file of a checkpoint, by file name."""
    return {p.name: load_file(p) for p in step_dir.glob("*.safetensors")
            if p.name.startswith(("model-", "optim-"))}


def _saved(step_dir: Path) -> dict[str, torch.Tensor]:
    """The saved model (base and adapters) as the library loads it, at TP=1."""
    from domino.inference.loading import load_saved_model
    from domino.parallel_state import ParallelState

    model = load_saved_model(step_dir, ParallelState.single())[0]
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _moe(run: Path, prefix: Path, save: Path) -> list[str]:
    """A one-step Mixture-of-Experts run (with optimizer state) on the chat data."""
    return ["train", "--num-experts", "2", "--data-path", str(prefix), "--tokenizer-type", "hf",
            "--tokenizer-dir", str(run), *TP1, "--num-layers", "1", "--hidden-size", "16",
            "--num-attention-heads", "2", "--seq-length", str(SEQ), "--micro-batch-size", "2",
            "--train-iters", "1", "--split", "1,0,0", *test_finetune.QUIET, "--save", str(save)]


@pytest.fixture(scope="module")
def runs(chat_base: tuple[Path, Path], tmp_path_factory) -> dict[str, Path]:
    """LoRA fine-tunes of the TP=1 import, STEPS steps: "tp2" and "tp1" straight without
    dropout; "drop" at TP=2 with adapter dropout, straight, and "cut" the same stopped at CUT
    and resumed from its own folder. Besides: "moe", a one-step Mixture-of-Experts run (with
    optimizer state); "pair", a folder holding a copy of the import ("a/base") and a one-step
    LoRA run of it at TP=2 ("a/lora"), which test_lora_run_needs_its_base_as_it_was moves and
    edits. The runs of each --nproc are trained in one spawn (tests/train_spawn.py); the
    resumed one is launched as `domino train` launches it."""
    run, prefix = chat_base
    tmp = tmp_path_factory.mktemp("lora")
    out = {name: tmp / name for name in ("tp2", "tp1", "drop", "cut", "moe")}
    out["pair"] = tmp_path_factory.mktemp("pair")
    base = out["pair"] / "a" / "base"
    shutil.copytree(run, base)
    cut = out["cut"]
    with held_launches() as two:
        assert main(_lora(run, prefix, out["tp2"], *TP2)) == 0
        assert main(_lora(run, prefix, out["drop"], *TP2, *DROP)) == 0
        assert main(_lora(run, prefix, cut, *TP2, *DROP, "--exit-interval", str(CUT))) == 0
        assert main(_finetune(base, prefix, base.parent / "lora", *LORA, *TP2)) == 0
    with held_launches() as one:
        assert main(_lora(run, prefix, out["tp1"], *TP1)) == 0
        assert main(_moe(run, prefix, out["moe"])) == 0
    train_held(two)
    train_held(one)
    assert open_checkpoint(cut)[1].step == CUT
    assert main(["train", "--config", str(cut / "config.toml"), "--load", str(cut), "--save",
                 str(cut), "--train-iters", str(STEPS), "--exit-interval", "0"]) == 0
    return out


def _check_tensors(meta, step_dir: Path) -> None:
    """The checkpoint holds the adapters (split as their linears) and their AdamW slots only:
    no base weight, no base optimizer state."""
    slots = {n.split("/", 1)[0] for n in meta.tensors if "/" in n}
    assert slots == {"optimizer.exp_avg", "optimizer.exp_avg_sq", "optimizer.step"}
    names = {n.split("/", 1)[-1] for n in meta.tensors}
    assert all(is_adapter_name(n) for n in names), sorted(names)
    assert len(names) == 2 * 4 * 2  # 2 layers x 4 linears x (A, B)
    for name in names:
        linear, factor = name.rsplit(".", 3)[-3], name[-1]
        dim = SPLIT[linear][1] if SPLIT[linear][0] == factor else None
        spec = meta.tensors[name]
        assert (spec["dim"], len(spec["files"])) == (dim, 1 if dim is None else 2), name
    for name, tensors in _files(step_dir).items():
        assert tensors and all(is_adapter_name(k.split("/", 1)[-1]) for k in tensors), name


def test_tp2_lora_checkpoint_holds_the_adapters_and_names_its_base(
        chat_base: tuple[Path, Path], runs: dict[str, Path]) -> None:
    """The checkpoint holds the adapters only; extra["lora"] has the settings and the base's
    path and checkpoint.json hash; the first loss is the base's masked loss (B starts at zero),
    TP=2 (Domino) follows TP=1, and the base weights read back are the import's."""
    run, prefix = chat_base
    base_dir = open_checkpoint(run)[0]
    step_dir, meta, _ = open_checkpoint(runs["drop"])
    assert meta.step == STEPS and meta.has_optimizer and meta.layout["tp"] == 2
    _check_tensors(meta, step_dir)
    record = meta.extra["lora"]
    assert {k: record[k] for k in ("rank", "alpha", "dropout", "targets")} == {
        "rank": 4, "alpha": 8.0, "dropout": 0.1, "targets": ["qkv", "proj", "fc1", "fc2"]}
    assert record["base"]["path"] == str(base_dir.resolve())
    assert record["base"]["sha256"] == layout.sha256_of(base_dir / layout.META)
    assert (step_dir / record["base"]["relative"]).resolve() == base_dir.resolve()
    epoch = _epoch(prefix)  # each step's global batch: the first of STEPS x epoch samples
    first = masked_loss(base_dir, prefix, SEQ, STEPS * epoch, SEED, first=epoch)[0]
    for name in ("drop", "tp2", "tp1"):
        assert _losses(runs[name])[0] == pytest.approx(first, rel=1e-5), name
    losses = _losses(runs["tp2"])
    assert losses == pytest.approx(_losses(runs["tp1"]), rel=1e-5)
    assert losses[-1] < losses[0] - 0.05  # the adapters learnt
    saved, imported = _saved(step_dir), _saved(base_dir)
    assert {n for n in saved if not is_adapter_name(n)} == set(imported)
    for name, value in imported.items():
        assert torch.equal(saved[name], value), name
    assert all(saved[n].abs().max() > 0.01 for n in saved if n.endswith(".lora.b"))


def test_lora_resume_is_bit_exact(runs: dict[str, Path]) -> None:
    """Stopped at CUT and resumed (--config RUN/config.toml --load RUN --save RUN): the same
    losses (adapter dropout on) and the same adapters and AdamW state as the straight run, bit
    for bit (the base read again from the base checkpoint: training left it as it was)."""
    keys = ("step", "loss", "grad_norm", "lr")
    straight, resumed = _metrics(runs["drop"]), _metrics(runs["cut"])
    assert [{k: m[k] for k in keys} for m in resumed] == [{k: m[k] for k in keys}
                                                          for m in straight]
    a, b = _files(open_checkpoint(runs["drop"])[0]), _files(open_checkpoint(runs["cut"])[0])
    assert a.keys() == b.keys() and len(a) == 4  # model and optimizer files of 2 TP ranks
    for name in a:
        assert a[name].keys() == b[name].keys(), name
        for key in a[name]:
            assert torch.equal(a[name][key], b[name][key]), (name, key)


def _greedy(step_dir: Path, n: int) -> list[int]:
    """PROMPT's greedy continuation by the saved model, loaded as generate does, with a full
    forward per token (no KV cache)."""
    from domino.inference.loading import load_saved_model
    from domino.parallel_state import ParallelState

    model, config, tokenizer, _ = load_saved_model(step_dir, ParallelState.single())
    ids = tokenizer.encode(PROMPT)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids]), None, None)[0, -1, :config.vocab_size]
                           .argmax()))
    return ids[-n:]


def test_generate_and_eval_use_the_adapters(chat_base: tuple[Path, Path], runs: dict[str, Path],
                                            capfd) -> None:
    """`domino generate` of the LoRA run (at TP=2, KV cache) continues as its base and adapters
    do, not as the base; `domino eval` reports the adapted model's masked loss."""
    run, prefix = chat_base
    lora = runs["tp2"]

    def generate(path: Path, *flags: str) -> list[int]:
        capfd.readouterr()
        assert main(["generate", str(path), "--prompt", PROMPT, "--greedy", "--ids",
                     "--no-stop-at-eod", "--max-new-tokens", str(NEW), *flags]) == 0
        return [int(x) for x in capfd.readouterr().out.split()]

    adapted = generate(lora, *TP2)
    assert adapted == _greedy(open_checkpoint(lora)[0], NEW)
    assert generate(run) == _greedy(open_checkpoint(run)[0], NEW) != adapted

    def evaluate(path: Path) -> str:
        capfd.readouterr()
        assert main(["eval", str(path), "--data-path", str(prefix), "--split", "1,0,0",
                     "--split-name", "train", "--seq-length", str(SEQ), "--seed",
                     str(SEED)]) == 0
        return capfd.readouterr().out

    loss = masked_loss(open_checkpoint(lora)[0], prefix, SEQ, _epoch(prefix), SEED)[0]
    base_loss = masked_loss(open_checkpoint(run)[0], prefix, SEQ, _epoch(prefix), SEED)[0]
    assert loss < base_loss - 0.05
    assert f"loss {loss:.4f}," in evaluate(lora)


def _no_process(monkeypatch) -> None:
    """Fail the test if `domino train` starts a rank."""
    import domino.training.launch

    def started(*args, **kwargs):
        raise AssertionError("a rank process was started")

    monkeypatch.setattr(domino.training.launch, "run_ranks", started)


def test_lora_refusals_before_any_process(chat_base: tuple[Path, Path], runs: dict[str, Path],
                                          tmp_path: Path, capfd, monkeypatch) -> None:
    """Flag values a LoRA run cannot have, and checkpoints it cannot start from or continue
    as asked: exit 2 with the flag and the fix named, no rank started, nothing written."""
    run, prefix = chat_base
    lora, moe, bad = runs["drop"], runs["moe"], tmp_path / "bad"
    _no_process(monkeypatch)

    def refused(argv: list[str], *named: str) -> None:
        capfd.readouterr()
        assert main(argv) == 2, argv
        err = capfd.readouterr().err
        for text in named:
            assert text in err, (argv, err)

    refused(["train", "--lora-rank", "4", "--data-path", str(prefix), "--tokenizer-type", "hf",
             "--tokenizer-dir", str(run)], "--lora-rank", "pass --load BASE --finetune")
    for flags, named in [(["--lora-rank", "-1"], "--lora-rank -1: the adapters' rank must be "
                          "a positive integer"),
                         (["--lora-dropout", "1.0"], "--lora-dropout 1.0: a probability in "
                          "[0, 1)"),
                         (["--lora-target-modules", "qkv,bogus"], "unknown bogus; choose from "
                          "qkv,proj,fc1,fc2"),
                         (["--lora-alpha", "0"], "--lora-alpha 0.0: must be positive")]:
        refused(_finetune(run, prefix, bad, "--lora-rank", "4", *flags), named)
    refused(["train", "--load", str(moe), "--data-path", str(prefix), "--lora-rank", "4",
             "--save", str(bad)], "is a run with optimizer state: add --finetune")
    again = ["train", "--load", str(lora), "--data-path", str(prefix), "--save", str(bad)]
    refused(again, "holds LoRA adapters (rank 4 on qkv,proj,fc1,fc2): continue it with its "
            "settings (--config RUN/config.toml")
    refused([*again, *LORA, "--lora-rank", "8", *DROP],
            "was trained with other LoRA settings (rank 4 there, 8 here)")
    refused([*again, *LORA], "other LoRA settings (dropout 0.1 there, 0.0 here)")
    refused([*again, *LORA, *DROP, "--finetune"], "is a LoRA run: drop --finetune")
    refused(_finetune(moe, prefix, bad, "--lora-rank", "4", *TP1, *DROP),
            "--lora-dropout 0.1 with adapters on the experts", "--lora-dropout 0")
    assert not bad.exists()
    assert [p.name for p in (lora / "checkpoints").glob("step_*")] == [f"step_{STEPS:07d}"]


def test_lora_run_needs_its_base_as_it_was(chat_base: tuple[Path, Path], runs: dict[str, Path],
                                           capfd, monkeypatch) -> None:
    """The base is found by its path relative to the LoRA run (both moved together: found),
    then its absolute path (neither there: an error naming both), and must be the very one
    the adapters were trained on (a re-saved checkpoint.json: an error naming both hashes),
    for generate, eval and a resumed run (refused before any rank starts)."""
    prefix, pair = chat_base[1], runs["pair"]  # (a copy of the import and its LoRA run)
    base, lora = pair / "a" / "base", pair / "a" / "lora"
    step = open_checkpoint(lora)[0]
    generate = ["generate", str(lora), "--prompt", PROMPT, "--greedy", "--ids",
                "--max-new-tokens", "2"]
    meta = base / "checkpoints" / "step_0000000" / layout.META
    saved = meta.read_text()
    resaved = json.loads(saved)
    resaved["extra"]["note"] = "re-saved"
    meta.write_text(json.dumps(resaved))
    resume = ["train", "--config", str(lora / "config.toml"), "--load", str(lora), "--save",
              str(lora), "--train-iters", "2"]
    for argv in (generate, ["eval", str(lora), "--data-path", str(prefix), "--split", "1,0,0",
                            "--split-name", "train", "--seq-length", str(SEQ)], resume):
        capfd.readouterr()
        with monkeypatch.context() as patched:
            if argv is resume:
                _no_process(patched)
            assert main(argv) == 2, argv
        err = capfd.readouterr().err
        assert ("its LoRA adapters were trained on the base checkpoint with checkpoint.json "
                "SHA-256") in err and "(a different or re-saved base)" in err, err
    meta.write_text(saved)
    assert main(generate) == 0
    moved = pair / "b"
    shutil.move(pair / "a", moved)  # both: the relative path finds the base
    assert main(["generate", str(moved / "lora"), *generate[2:]]) == 0
    shutil.move(moved / "base", pair / "elsewhere")
    capfd.readouterr()
    assert main(["generate", str(moved / "lora"), *generate[2:]]) == 2
    err = capfd.readouterr().err
    relative = moved / "lora" / step.relative_to(lora) / "../../../base/checkpoints/step_0000000"
    assert "the base checkpoint its LoRA adapters adapt is not found (tried " in err, err
    assert f"{relative}, {base / 'checkpoints' / 'step_0000000'}" in err, err
