"""Mixture of experts: the router, the expert layer, and three ways to compute it.

* :mod:`~minisgl.moe.router`: softmax, top-k, renormalisation;
* :mod:`~minisgl.moe.reference`: a loop over the experts, the reference;
* :mod:`~minisgl.moe.grouped`: tokens sorted by expert, one grouped matrix multiply (the CPU
  path);
* ``fused``: kernels that need no host synchronisation (the GPU path, inside CUDA graphs),
  where :mod:`minisgl.layers.fast` has them (:mod:`minisgl.kernel.moe`);
* :mod:`~minisgl.moe.layer`: the stacked expert weights, their loading and tensor-parallel
  split, and the sparse block a decoder layer uses.
"""

from __future__ import annotations

from .layer import MoEExperts, SparseMoeBlock, use_moe_impl
from .router import Routing, route_topk

__all__ = ["MoEExperts", "Routing", "SparseMoeBlock", "route_topk", "use_moe_impl"]
