"""The engine: from a model's logits to generated tokens, for one request or for a batch.

- ``sample`` (chapter 4): batched sampling with per-request parameters.
- ``simple_loop`` (chapter 4): a one-sequence generation loop with a contiguous KV cache.
- ``config`` (chapter 7): :class:`~minisgl.engine.config.EngineConfig`, the engine's settings.
- ``context`` (chapter 7): :class:`~minisgl.engine.context.Context`, one forward pass made
  ready to run.
- ``engine`` (chapter 7): :class:`~minisgl.engine.engine.Engine`, which loads the model, sizes
  the paged KV cache and runs one batched forward step at a time.
- ``graph`` (chapter 8): :class:`~minisgl.engine.graph.GraphRunner`, decode steps captured as
  CUDA graphs and replayed.

The modules are imported by name (``from minisgl.engine.engine import Engine``): a process that
only samples or only reads the config does not pay for loading the rest.
"""
