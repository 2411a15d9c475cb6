"""Small helpers shared by the whole engine, one concept per module.

- ``logger``: ``get_logger(__name__)``, the only way the engine prints.
- ``checks``: ``check_int``, the one check of an integer argument (never a bool) at an edge.
- ``hf``: a ``--model`` argument turned into a local checkpoint directory; ``config.json`` read.

Import from the modules themselves (``from minisgl.utils.logger import get_logger``): this
package file re-exports nothing, so importing one helper never imports the others' dependencies.
"""
