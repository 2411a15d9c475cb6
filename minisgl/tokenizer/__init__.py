"""The tokenizer and detokenizer workers.

- ``tokenize``: a request's prompt (text, chat messages or token ids) to token ids;
- ``detokenize``: a stream of tokens back to text, a piece per token, never splitting a
  character, and cut at the request's stop strings;
- ``server``: the two processes around them (:func:`run_tokenizer`, :func:`run_detokenizer`).

Chapter 14 tells the story.
"""

from __future__ import annotations

from minisgl.tokenizer.detokenize import DecodeStream, DetokenizeManager, StopMatcher
from minisgl.tokenizer.server import (
    DETOKENIZER_COUNTERS,
    detokenizer_counters,
    run_detokenizer,
    run_tokenizer,
)
from minisgl.tokenizer.tokenize import TokenizeManager, load_tokenizer

__all__ = [
    "DETOKENIZER_COUNTERS",
    "DecodeStream",
    "DetokenizeManager",
    "StopMatcher",
    "TokenizeManager",
    "detokenizer_counters",
    "load_tokenizer",
    "run_detokenizer",
    "run_tokenizer",
]
