"""The engine: from a model's logits to generated tokens, for one request or for a batch.

- ``sample``: batched sampling with per-request parameters.
- ``simple_loop``: a one-sequence generation loop with a contiguous KV cache.
- ``config``: :class:`~minisgl.engine.config.EngineConfig`, the engine's settings.
- ``token_pool``: :class:`~minisgl.engine.token_pool.TokenPool`, every running request's
  token ids on the device.
- ``engine``: :class:`~minisgl.engine.engine.Engine`, which loads the model, sizes
  the paged KV cache and runs one batched forward step at a time.
- ``graph``: :class:`~minisgl.engine.graph.GraphRunner`, decode steps captured as
  CUDA graphs and replayed.

The modules are imported by name (``from minisgl.engine.engine import Engine``): a process that
only samples or only reads the config does not pay for loading the rest.
"""
