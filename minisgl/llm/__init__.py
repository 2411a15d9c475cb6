"""The offline interface: a model and a list of prompts in, a list of completions out.

    from minisgl.llm import LLM
    from minisgl.core import SamplingParams

    llm = LLM("models/tiny-qwen3", device="cpu")
    outputs = llm.generate(["Hello", "The sky is"], SamplingParams(max_tokens=8))

:class:`LLM` runs the scheduler in the calling process: no server, no other process.
"""

from __future__ import annotations

from minisgl.llm.llm import LLM

__all__ = ["LLM"]
