"""The engine: from a model's logits to generated tokens.

Chapter 4 starts it with sampling (``sample.py``) and a one-sequence generation loop
(``simple_loop.py``); later chapters add the batched engine that runs a scheduler's batches.
"""
