"""Distil a draft for speculative decoding: a small model trained to write what its target writes.

    python tools/distill_draft.py        # models/shakespeare-draft, for models/shakespeare-target
    python tools/distill_draft.py --target models/shakespeare-target --layers 2 --time-limit 75

A draft's guesses are worth what the target keeps of them. tiny-shakespeare and
shakespeare-target read the same plays, but each learned them its own way: where the text is
open, the two pick different words, and greedy speculation keeps a guess only when it is the
target's own argmax. Distillation closes that gap at its source. The draft is trained on the
target's own text, the greedy continuations the target writes, so what it learns to predict
is the target, not the plays.

What the script does, in order:

1. prompts: ``--num-prompts`` windows of ``--prompt-len`` tokens from the training plays (the
   held-out plays of ``tools/train_tiny_model.py`` are never used);
2. the target's greedy continuation of each, ``--gen-len`` tokens, written by minisgl's ``LLM``;
3. the draft's starting point: the first ``--layers`` layers of ``--init`` with its embedding,
   final norm and head (``tools/cut_model.py``);
4. training with AdamW on the continuations only (cross-entropy against the target's tokens),
   with a linear warm-up and decay, until ``--max-steps`` or ``--time-limit``, logging the
   held-out agreement (step 5) every 1,000 steps;
5. the agreement of the draft with the target, before and after: the target's greedy
   continuation of each held-out prompt (``readability_prompts.json``), scored by the draft in
   one teacher-forced pass. The share of positions where the draft's argmax is the target's
   token, and the tokens per round greedy speculation would make with ``k`` guesses: exact, not
   an estimate, since a draft whose guesses were right saw exactly the target's text;
6. the checkpoint (bfloat16, the target's tokenizer files copied) and ``training_log.txt``.

On one GPU it takes about three minutes; on a CPU it runs too, slowly (the tests run it there
on tiny sizes).
"""

from __future__ import annotations

import argparse
import random
import shlex
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # the sibling scripts
from cut_model import cut_layers  # noqa: E402
from train_tiny_model import (HELD_OUT, ROOT, TARGET_OUT, TOKENIZER_FILES,  # noqa: E402
                              find_archive, read_plays, readability_prompts,
                              refuse_to_overwrite)

try:
    import minisgl  # noqa: F401
except ImportError:  # run from a checkout that was not pip-installed
    sys.path.insert(0, str(ROOT))

DRAFT_OUT = ROOT / "models" / "shakespeare-draft"
INIT = ROOT / "models" / "tiny-shakespeare"
REPORTED_K = (2, 4, 6, 8)


def training_prompts(tokenizer, plays: dict[str, str], count: int, length: int,
                     seed: int) -> list[list[int]]:
    """``count`` windows of ``length`` token ids from the training plays, at random places."""
    text = "\n".join(play for name, play in plays.items() if name not in HELD_OUT)
    ids = tokenizer(text)["input_ids"]
    rng = random.Random(seed)
    return [ids[s:s + length] for s in (rng.randrange(len(ids) - length) for _ in range(count))]


def continuations(target: Path, prompts: list[list[int]], max_tokens: int,
                  device: str) -> list[list[int]]:
    """The target's greedy continuation of every prompt, ``max_tokens`` tokens each."""
    from minisgl.core import SamplingParams
    from minisgl.llm import LLM

    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
    # a large batch: thousands of short requests, and the more at once, the fewer weight reads
    with LLM(str(target), device=device, max_running_reqs=min(1024, len(prompts))) as llm:
        return [out["token_ids"] for out in llm.generate(prompts, params, progress=False)]


def tokens_per_round(matches: Sequence[bool], k: int) -> tuple[int, int]:
    """Walk a text as greedy speculation with ``k`` guesses a round would: ``matches[i]`` says
    whether the draft's guess for token ``i`` is the target's. A round keeps the guesses up to
    the first wrong one (at most ``k``) and adds the target's own token. Returns (tokens,
    rounds)."""
    i = rounds = 0
    while i < len(matches):
        kept = 0
        while kept < k and i + kept < len(matches) and matches[i + kept]:
            kept += 1
        rounds += 1
        i += kept + 1
    return len(matches), rounds


@torch.no_grad()
def agreement(model: torch.nn.Module, texts: Sequence[tuple[list[int], int]],
              device: torch.device) -> list[list[bool]]:
    """For each (ids, start): whether the model's argmax after ``ids[:i]`` is ``ids[i]``, for
    every ``i`` from ``start`` on (one teacher-forced pass per text). No gradients: it also
    runs in the middle of training, every 1,000 steps."""
    model.eval()
    out = []
    for ids, start in texts:
        x = torch.tensor(ids, device=device)[None]
        with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16,
                                             enabled=device.type == "cuda"):
            guesses = model(x).logits[0, start - 1:-1].argmax(-1)
        out.append((guesses == x[0, start:]).tolist())
    return out


def rounds_in(matches: Sequence[Sequence[bool]], k: int) -> tuple[int, int]:
    """The tokens and rounds of greedy speculation with ``k`` guesses over every text of
    ``matches``, as the engine runs them: a request's first token comes from its prefill, so
    its rounds start at the second."""
    tokens, rounds = map(sum, zip(*(tokens_per_round(m[1:], k) for m in matches)))
    return tokens, rounds


def agreement_share(matches: Sequence[Sequence[bool]]) -> float:
    """The share of every text's positions where the draft agreed with the target."""
    flat = [m for text in matches for m in text]
    return sum(flat) / len(flat)


def describe(matches: list[list[bool]]) -> str:
    """The share of guesses that agree, and tokens per round at each reported k."""
    parts = [f"agreement {agreement_share(matches):.3f}"]
    for k in REPORTED_K:
        tokens, rounds = rounds_in(matches, k)
        parts.append(f"k={k}: {tokens / rounds:.2f} tokens/round")
    return ", ".join(parts)


def distil(model: torch.nn.Module, rows: torch.Tensor, prompt_len: int,
           args: argparse.Namespace, log: Callable[[str], None],
           held_out: Sequence[tuple[list[int], int]]) -> None:
    """Train ``model`` on ``rows`` (prompt then the target's continuation) to predict the
    continuation; every 1,000 steps, log the loss and the agreement on ``held_out``."""
    device = rows.device
    generator = torch.Generator(device=device).manual_seed(args.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    model.train()
    start = time.perf_counter()
    step = 0
    while step < args.max_steps and time.perf_counter() - start < args.time_limit:
        # warm-up over the first 5% of the steps, then down to a tenth by the last step or
        # second, whichever comes first
        done = max(step / args.max_steps, (time.perf_counter() - start) / args.time_limit)
        scale = min(1.0, (step + 1) / max(1, args.max_steps // 20)) * max(0.1, 1.0 - done)
        for group in optimizer.param_groups:
            group["lr"] = args.lr * scale
        batch = rows[torch.randint(0, len(rows), (args.batch_size,), device=device,
                                   generator=generator)]
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            logits = model(batch[:, :-1]).logits[:, prompt_len - 1:]
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1),
                                                 batch[:, prompt_len:].flatten())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        step += 1
        if step % 1000 == 0:  # the held-out agreement says when more steps only memorise
            share = agreement_share(agreement(model, held_out, device))
            model.train()
            log(f"  step {step}: loss {loss.item():.3f}, held-out agreement {share:.3f}")
    log(f"distilled {step} steps in {time.perf_counter() - start:.1f} s, last loss "
        f"{loss.item():.3f}")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python tools/distill_draft.py",
                                description=__doc__.splitlines()[0])
    p.add_argument("--target", type=Path, default=TARGET_OUT,
                   help="the target's checkpoint (default: models/shakespeare-target)")
    p.add_argument("--init", type=Path, default=INIT,
                   help="the checkpoint whose first layers the draft starts from "
                        "(default: models/tiny-shakespeare)")
    p.add_argument("--layers", type=int, default=2, help="the draft's layers (default: 2)")
    p.add_argument("--out", type=Path, default=DRAFT_OUT,
                   help="checkpoint directory to write (default: models/shakespeare-draft)")
    p.add_argument("--overwrite", action="store_true", help="replace the files of --out")
    p.add_argument("--archive", type=Path, default=None,
                   help="the corpus's source archive (default: downloaded into --cache, as "
                        "tools/train_tiny_model.py does)")
    p.add_argument("--cache", type=Path, default=ROOT / "models" / ".corpus")
    p.add_argument("--device", default="auto", help="auto, cpu or cuda (default: auto)")
    # With half as many, a minute of training memorised them (agreement 0.98 on its own
    # training text, 0.80-0.84 held out); with these, 0.91 and 0.86 (runs on an H100).
    p.add_argument("--num-prompts", type=int, default=32768,
                   help="passages of the training plays the target continues (default: 32768)")
    p.add_argument("--prompt-len", type=int, default=48)
    p.add_argument("--gen-len", type=int, default=96,
                   help="tokens the target writes after each prompt (default: 96)")
    p.add_argument("--eval-len", type=int, default=128,
                   help="tokens the target writes after each held-out prompt (default: 128, "
                        "as many as benchmark/speculative.py generates)")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--max-steps", type=int, default=100_000)
    p.add_argument("--time-limit", type=float, default=75.0, metavar="S")
    p.add_argument("--seed", type=int, default=0)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    for name in ("layers", "num_prompts", "prompt_len", "gen_len", "eval_len", "batch_size",
                 "max_steps"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be at least 1")
    if args.eval_len < 2:  # the first token is the prefill's: a round needs one more
        raise SystemExit("--eval-len must be at least 2")
    if not (args.target / "config.json").is_file():
        raise SystemExit(f"--target {args.target} holds no checkpoint; train it first: "
                         "python tools/train_tiny_model.py --shape target")
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available()
                          else "cpu" if args.device == "auto" else args.device)
    refuse_to_overwrite(args.out, args.overwrite)
    lines: list[str] = []

    def log(line: str) -> None:
        print(line, flush=True)
        lines.append(line)

    shown = [a.replace(str(ROOT) + "/", "") for a in (argv if argv is not None else sys.argv[1:])]
    log(f"$ python tools/distill_draft.py {shlex.join(shown)}".rstrip())
    log(f"device: {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'CPU'}")
    wall = time.perf_counter()
    torch.manual_seed(args.seed)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.target)
    plays = read_plays(args.archive or find_archive(args.cache))
    prompts = training_prompts(tokenizer, plays, args.num_prompts, args.prompt_len, args.seed)
    held_out = [tokenizer.encode(p) for p in
                readability_prompts({p: t for p, t in plays.items() if p in HELD_OUT})]
    written = continuations(args.target, prompts, args.gen_len, device.type)
    evaluated = continuations(args.target, held_out, args.eval_len, device.type)
    rows = torch.tensor([p + w for p, w in zip(prompts, written)], device=device)
    texts = [(p + w, len(p)) for p, w in zip(held_out, evaluated)]
    log(f"the target's greedy text: {len(prompts)} training prompts x {args.gen_len} tokens, "
        f"{len(held_out)} held-out prompts x {args.eval_len}, in "
        f"{time.perf_counter() - wall:.0f} s")

    whole = AutoModelForCausalLM.from_pretrained(args.init, dtype=torch.float32).to(device)
    log(f"{args.init.name} whole, held-out: {describe(agreement(whole, texts, device))}")
    del whole
    with tempfile.TemporaryDirectory() as tmp:
        start = cut_layers(args.init, args.layers, Path(tmp) / "init")
        model = AutoModelForCausalLM.from_pretrained(start, dtype=torch.float32)
    model.to(device)
    params = sum(p.numel() for p in model.parameters())
    log(f"draft: the first {args.layers} layers of {args.init.name}, {params:,} parameters")
    train_texts = [(row.tolist(), args.prompt_len) for row in rows[:len(held_out)]]
    log(f"before, held-out: {describe(agreement(model, texts, device))}")
    log(f"before, training: {describe(agreement(model, train_texts, device))}")
    distil(model, rows, args.prompt_len, args, log, texts)
    log(f"after, held-out: {describe(agreement(model, texts, device))}")
    log(f"after, training: {describe(agreement(model, train_texts, device))}")

    args.out.mkdir(parents=True, exist_ok=True)
    model.to(torch.bfloat16).save_pretrained(args.out, safe_serialization=True)
    for name in ("generation_config.json", "readability_prompts.json"):
        if (args.init / name).is_file():
            shutil.copyfile(args.init / name, args.out / name)
    for name in TOKENIZER_FILES:  # the target's: a guess is one of its token ids
        shutil.copyfile(args.target / name, args.out / name)
    log(f"wrote {args.out.name}/ in {time.perf_counter() - wall:.0f} s in all")
    (args.out / "training_log.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
