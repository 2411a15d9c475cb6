"""Tensor-parallel bookkeeping shared by the layers (explained in chapter 17)."""

from __future__ import annotations

from .info import TPInfo, all_reduce, get_tp_info, set_all_reduce, set_tp_info

__all__ = ["TPInfo", "all_reduce", "get_tp_info", "set_all_reduce", "set_tp_info"]
