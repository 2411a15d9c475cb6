"""minisgl: a small, real LLM inference engine in the shape of SGLang, built chapter by chapter.

The package is organised one concept per module: ``env`` (the environment variables),
``utils`` (logging, Hugging Face checkpoints), ``models`` (configs, and later the networks), and
so on. Importing ``minisgl`` itself is cheap on purpose: it loads no torch and no transformers,
so a command that only needs a config or an environment check starts instantly.
"""

from __future__ import annotations

__version__ = "0.1.0"
