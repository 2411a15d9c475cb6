"""Train the small byte-level BPE tokenizer that the tiny model ships with.

This script was run ONCE to produce `tools/assets/tokenizer.json`; the result is committed and
`tools/make_tiny_model.py` only ever reads it. Re-running it is not part of any workflow: the
corpus includes docstrings and source read from the installed Python standard library, so a
different Python version would train a (slightly) different tokenizer, and every recorded
output in the book would drift. The committed file was trained with CPython 3.11 and
tokenizers 0.23.

    python tools/assets/build_tokenizer.py            # writes tools/assets/tokenizer.json
    python tools/assets/build_tokenizer.py --out X    # writes somewhere else, to compare

The design follows Qwen's tokenizer where it matters to an inference engine:

* byte-level BPE: every UTF-8 string maps to byte symbols first, so any text round-trips and
  there is no unknown token; characters absent from the corpus (CJK, emoji) fall apart into
  several byte tokens, which is exactly what an incremental detokenizer has to cope with;
* the same pre-tokenization split as Qwen2/Qwen3 (words, single digits, punctuation runs,
  whitespace), but without Qwen's NFC normalizer, so decode(encode(s)) == s holds for every
  string, not only for NFC-normalized ones;
* Qwen3's 26 added tokens, in Qwen3's order, placed right after the ordinary vocabulary.
"""
from __future__ import annotations

import argparse
import ast
import sys
import sysconfig
from pathlib import Path

from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    models,
    pre_tokenizers,
    processors,
    trainers,
)

ASSETS = Path(__file__).resolve().parent

# 2,022 ordinary tokens (256 byte tokens + 1,766 merges) + 26 added tokens = 2,048 ids, a
# round number that splits evenly across tensor-parallel ranks.
NUM_ORDINARY_TOKENS = 2022

# Qwen2/Qwen3's pre-tokenization pattern: contractions, letter runs (with one leading
# non-letter such as a space), ONE digit at a time, punctuation runs, newlines, other spaces.
PRETOKENIZE_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# Qwen3's added tokens in Qwen3's order, with its `special` flag: special tokens are dropped by
# decode(skip_special_tokens=True); the tool-call and thinking markers are not, because a client
# has to see them in the text.
ADDED_TOKENS: list[tuple[str, bool]] = [
    ("<|endoftext|>", True),
    ("<|im_start|>", True),
    ("<|im_end|>", True),
    ("<|object_ref_start|>", True),
    ("<|object_ref_end|>", True),
    ("<|box_start|>", True),
    ("<|box_end|>", True),
    ("<|quad_start|>", True),
    ("<|quad_end|>", True),
    ("<|vision_start|>", True),
    ("<|vision_end|>", True),
    ("<|vision_pad|>", True),
    ("<|image_pad|>", True),
    ("<|video_pad|>", True),
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<|fim_prefix|>", False),
    ("<|fim_middle|>", False),
    ("<|fim_suffix|>", False),
    ("<|fim_pad|>", False),
    ("<|repo_name|>", False),
    ("<|file_sep|>", False),
    ("<tool_response>", False),
    ("</tool_response>", False),
    ("<think>", False),
    ("</think>", False),
]

PROSE = """\
A language model reads a prompt as a list of token ids and answers one token at a time. Each
step runs the whole network over the new token, looks at the scores it gives to every entry of
the vocabulary, picks one, and appends it to the sequence. The prompt is processed in a single
large step called prefill; every later step is a small decode step that adds one token.

An inference engine exists to make those steps cheap. It keeps the keys and values of every
past token in a cache so that a decode step never recomputes them. It stores that cache in
fixed-size pages, like an operating system stores memory, so that many requests can share one
GPU without fragmenting it. It batches requests together, because a GPU that multiplies one
row at a time wastes almost all of its arithmetic. It reuses the cached prefix of a prompt it
has already seen, such as a long system message, instead of computing it again.

The scheduler decides, at every step, which requests run. New requests wait in a queue until
there is room in the cache for their prompt; running requests decode until they emit an end
token or reach their length limit. When memory runs out, the scheduler must choose what to
evict or which request to pause. A good scheduler keeps the GPU busy while the CPU prepares
the next batch, so that neither side waits for the other.

A tokenizer turns text into ids and ids back into text. Byte-level tokenizers first map every
byte of the UTF-8 encoding to a symbol, then merge frequent pairs of symbols into larger
tokens. Because every byte has a symbol, any string can be encoded, and decoding the ids gives
the original string back exactly. A single character outside the training text, such as a
Chinese character or an emoji, becomes several byte tokens, and a detokenizer that streams text
to a client must wait until the bytes form a complete character before it prints anything.

The server speaks the same protocol as the OpenAI API: a client sends a list of chat messages
and receives the answer, either at once or as a stream of small pieces. The chat template
turns the messages into one prompt string, with markers that tell the model where each turn
starts and ends and whose turn it is.

User: What is the capital of France?
Assistant: The capital of France is Paris.
User: How many tokens per second does the engine reach on one GPU?
Assistant: It depends on the model, the batch size and the length of the prompts. Measure it.
User: Write a Python function that returns the sum of a list of numbers.
Assistant: def total(numbers: list[float]) -> float:
    return sum(numbers)

Numbers and dates appear everywhere: 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 16, 32, 64, 128, 256,
512, 1024, 2048, 4096; 3.14159, 2.71828, 1e-6, 0.02; 2024-01-15, 12:30:45, 100%, $9.99.
"""

# Standard library modules read for the corpus. Docstrings give English prose; the full source
# of a few modules gives the tokens of Python code (indentation, `self.`, `def`, `return`).
DOCSTRING_MODULES = [
    "abc.py", "argparse.py", "asyncio/locks.py", "asyncio/queues.py", "bisect.py",
    "collections/__init__.py", "contextlib.py", "dataclasses.py", "difflib.py", "enum.py",
    "fractions.py", "functools.py", "heapq.py", "http/server.py", "json/decoder.py",
    "json/encoder.py", "logging/__init__.py", "pathlib.py", "queue.py", "random.py",
    "selectors.py", "shutil.py", "socketserver.py", "statistics.py", "string.py",
    "textwrap.py", "threading.py", "tokenize.py", "typing.py", "unittest/case.py",
]
SOURCE_MODULES = [
    "bisect.py", "heapq.py", "queue.py", "textwrap.py", "json/encoder.py", "string.py",
    "contextlib.py", "abc.py",
]


def module_docstrings(source: str) -> list[str]:
    """Every module, class and function docstring of `source`, in source order."""
    tree = ast.parse(source)
    found: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node)
            if doc:
                found.append(doc)
    return found


def build_corpus() -> list[str]:
    """The training texts, in a fixed order: our prose, stdlib docstrings, stdlib source."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts = [PROSE] * 4  # weigh plain English prose above docstrings
    for name in DOCSTRING_MODULES:
        texts.extend(module_docstrings((stdlib / name).read_text(encoding="utf-8")))
    for name in SOURCE_MODULES:
        texts.append((stdlib / name).read_text(encoding="utf-8"))
    return texts


def train_tokenizer(texts: list[str], num_ordinary: int = NUM_ORDINARY_TOKENS) -> Tokenizer:
    """Train a byte-level BPE of `num_ordinary` tokens on `texts` and add Qwen3's added tokens
    after it (tools/train_tiny_model.py trains a larger one on its own corpus the same way)."""
    tokenizer = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tokenizer.normalizer = None
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=num_ordinary,
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    tokenizer.train_from_iterator(texts, trainer=trainer, length=len(texts))
    got = tokenizer.get_vocab_size(with_added_tokens=False)
    if got != num_ordinary:
        raise RuntimeError(f"trained {got} ordinary tokens, wanted {num_ordinary}")
    for content, special in ADDED_TOKENS:
        token = AddedToken(content, special=special, normalized=False)
        # add_special_tokens vs add_tokens only differs in the `special` flag; both append the
        # token at the next free id, so Qwen3's order is kept.
        added = tokenizer.add_special_tokens([token]) if special else tokenizer.add_tokens([token])
        assert added == 1, content
    return tokenizer


def main(argv: list[str] | None = None) -> int:
    """Train and write the tokenizer; print a short summary."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ASSETS / "tokenizer.json")
    args = parser.parse_args(argv)
    texts = build_corpus()
    tokenizer = train_tokenizer(texts)
    args.out.write_text(tokenizer.to_str(pretty=True) + "\n", encoding="utf-8")
    size = args.out.stat().st_size
    print(f"corpus: {len(texts)} texts, {sum(len(t) for t in texts):,} characters "
          f"(Python {sys.version.split()[0]})")
    print(f"wrote {args.out} ({size / 1024:.0f} KiB): "
          f"{tokenizer.get_vocab_size(with_added_tokens=True)} ids")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
