"""Model configurations and, from chapter 3 on, the networks themselves.

``minisgl.models.config`` turns a checkpoint's ``config.json`` into a validated
:class:`~minisgl.models.config.ModelConfig`; every shape in the engine is read from it.
"""
