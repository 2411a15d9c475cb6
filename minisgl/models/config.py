"""A checkpoint's ``config.json``, parsed into the numbers the engine is built from.

Every tensor shape in the engine comes from here, so the config is parsed once, at the edge,
checked for consistency, and frozen. It reads the JSON itself rather than through
``transformers.AutoConfig``: no model-class defaults filled in, and exactly the keys the engine
depends on. Both transformers spellings of the rotary settings (``rope_theta`` +
``rope_scaling``, or ``rope_parameters``) and of the dtype are accepted. Chapter 1 tells the
story.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from minisgl.utils.checks import check_int, is_number
from minisgl.utils.hf import load_hf_config

if TYPE_CHECKING:
    import torch

# Bytes per element of the dtypes a KV cache is kept in; spelled as in config.json / torch.
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1}

# The config.json key behind each field, so an error names what the user can actually edit.
_JSON_KEY = {
    "num_layers": "num_hidden_layers",
    "num_qo_heads": "num_attention_heads",
    "num_kv_heads": "num_key_value_heads",
}
# What a config.json value of each kind must look like, in an error message.
_EXPECTED = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}
_MISSING = object()


class ConfigError(ValueError):
    """A ``config.json`` is missing a key the engine needs, or its values do not fit together."""


def dtype_bytes(dtype: str | torch.dtype) -> int:
    """Bytes per element of ``dtype``, given by name (``"bfloat16"``) or as a torch.dtype."""
    if not isinstance(dtype, str):
        return dtype.itemsize  # a torch.dtype knows it: no torch import needed
    name = dtype.removeprefix("torch.")
    if name not in DTYPE_BYTES:
        raise ValueError(f"unknown dtype {dtype!r}; expected one of {', '.join(DTYPE_BYTES)}")
    return DTYPE_BYTES[name]


@dataclass(frozen=True)
class ModelConfig:
    """The architecture of one checkpoint, validated; see :meth:`from_dict` for the keys read."""

    # shapes: these decide every weight tensor and the KV cache
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    # numerics and positions
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    rope_scaling: Mapping[str, Any] | None = None  # None, or {"rope_type": "yarn", ...}
    partial_rotary_factor: float = 1.0
    hidden_act: str = "silu"
    # wiring
    architectures: tuple[str, ...] = ()
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    torch_dtype: str | None = None  # the dtype the weights were published in
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # mixture of experts; all zero for a dense model
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    # every key of config.json, for a later architecture that needs one not listed above
    raw: Mapping[str, Any] = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                     "num_qo_heads", "num_kv_heads", "head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            check_int(_JSON_KEY.get(name, name), value, at_least=1, error=ConfigError)
        if self.num_qo_heads % self.num_kv_heads:
            raise ConfigError(
                f"num_attention_heads ({self.num_qo_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads}): each KV head serves a whole "
                "group of query heads")
        if not 0 < self.partial_rotary_factor <= 1 or self.rotary_dim % 2:
            raise ConfigError(f"partial_rotary_factor {self.partial_rotary_factor} must be in "
                              f"(0, 1] and turn an even number of the head_dim "
                              f"({self.head_dim}) features: rotary embedding turns pairs")
        if not self.rms_norm_eps > 0 or not self.rope_theta > 0:
            raise ConfigError(f"rms_norm_eps ({self.rms_norm_eps}) and rope_theta "
                              f"({self.rope_theta}) must be positive")
        if self.num_experts and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ConfigError(f"num_experts_per_tok ({self.num_experts_per_tok}) must be "
                              f"between 1 and num_experts ({self.num_experts})")

    @property
    def group_size(self) -> int:
        """Query heads per KV head: 1 is plain multi-head attention, more is GQA."""
        return self.num_qo_heads // self.num_kv_heads

    @property
    def q_size(self) -> int:
        """Width of the query projection's output (all heads side by side)."""
        return self.num_qo_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        """Width of the key (and of the value) projection's output."""
        return self.num_kv_heads * self.head_dim

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def rotary_dim(self) -> int:
        """How many of a head's features rotary embedding turns: all, unless partial."""
        return int(self.head_dim * self.partial_rotary_factor)

    def kv_bytes_per_token(self, dtype: str | torch.dtype) -> int:
        """Bytes of KV cache one token occupies: a K and a V vector per KV head, in every layer."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes(dtype)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], source: str = "config") -> ModelConfig:
        """Parse a ``config.json`` dict; ``source`` (a file name) starts every error message."""
        def get(key: str, kind: type, default: Any = _MISSING) -> Any:
            return _read(d, source, key, kind, default)

        hidden, heads = get("hidden_size", int), get("num_attention_heads", int)
        head_dim = get("head_dim", int, None)
        if head_dim is None:  # older configs: the heads split the hidden size evenly
            if hidden % heads:
                raise ConfigError(f"{source}: no head_dim, and hidden_size ({hidden}) is not "
                                  f"divisible by num_attention_heads ({heads})")
            head_dim = hidden // heads
        theta, scaling, partial = _rope_settings(d, source)
        values: dict[str, Any] = {
            "model_type": get("model_type", str),
            "vocab_size": get("vocab_size", int),
            "hidden_size": hidden,
            "intermediate_size": get("intermediate_size", int),
            "num_layers": get("num_hidden_layers", int),
            "num_qo_heads": heads,
            "num_kv_heads": get("num_key_value_heads", int, heads),  # absent: plain multi-head
            "head_dim": head_dim,
            "rms_norm_eps": get("rms_norm_eps", float),
            "rope_theta": theta,
            "rope_scaling": scaling,
            "partial_rotary_factor": partial,
            "max_position_embeddings": get("max_position_embeddings", int),
            "hidden_act": get("hidden_act", str, "silu"),
            "architectures": _read_list(d, source, "architectures", str),
            "tie_word_embeddings": get("tie_word_embeddings", bool, False),
            "attention_bias": get("attention_bias", bool, False),
            "torch_dtype": get("torch_dtype", str, None) or get("dtype", str, None),
            "bos_token_id": get("bos_token_id", int, None),
            "eos_token_ids": _read_list(d, source, "eos_token_id", int),  # one id, or a list
            "num_experts": get("num_experts", int, get("num_local_experts", int, 0)),
            "num_experts_per_tok": get("num_experts_per_tok", int, 0),
            "moe_intermediate_size": get("moe_intermediate_size", int, 0),
            "norm_topk_prob": get("norm_topk_prob", bool, False),
            "raw": MappingProxyType(dict(d)),
        }
        try:
            return cls(**values)
        except ConfigError as exc:  # __post_init__ found values that do not fit together
            raise ConfigError(f"{source}: {exc}") from None

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike[str]) -> ModelConfig:
        """Read ``config.json`` from a local checkpoint directory (resolve hub ids first).

        A checkpoint may list more end-of-sequence ids in ``generation_config.json`` than in
        ``config.json`` (Qwen3 stops on ``<|im_end|>`` and ``<|endoftext|>``, but its
        config.json names one of them). ``transformers.generate`` stops on the ids of
        generation_config.json, so they are added here: the engine stops where it does.
        """
        config = cls.from_dict(load_hf_config(path), source=os.path.join(path, "config.json"))
        generation_file = os.path.join(path, "generation_config.json")
        if os.path.isfile(generation_file):
            extra = _read_list(load_hf_config(generation_file), generation_file, "eos_token_id", int)
            merged = tuple(dict.fromkeys(config.eos_token_ids + extra))  # in order, no repeats
            config = dataclasses.replace(config, eos_token_ids=merged)
        return config


def _read(d: Mapping[str, Any], source: str, key: str, kind: type, default: Any = _MISSING) -> Any:
    """``d[key]``, which must be a ``kind`` (for ``float``: any number, returned as a float).

    Absent and JSON null both mean "not specified": ``default``, or an error naming the file
    and the key when there is none. A JSON ``true`` is not an integer here, although Python's
    ``bool`` is an ``int``.
    """
    value = d.get(key)
    if value is None:
        if default is not _MISSING:
            return default
        hint = (" (this config keeps its language model under 'text_config'; multimodal "
                "checkpoints are not supported)") if "text_config" in d else ""
        raise ConfigError(f"{source}: missing required key {key!r}{hint}")
    if not (is_number(value) if kind is float else type(value) is kind):
        raise ConfigError(f"{source}: {key} must be {_EXPECTED[kind]}, got {value!r}")
    return float(value) if kind is float else value


def _read_list(d: Mapping[str, Any], source: str, key: str, kind: type) -> tuple[Any, ...]:
    """An optional key holding one ``kind`` value or a list of them, as a tuple."""
    value = d.get(key)
    values = [] if value is None else value if isinstance(value, list) else [value]
    if any(type(v) is not kind for v in values):
        raise ConfigError(f"{source}: {key} must be {_EXPECTED[kind]} or a list of them, "
                          f"got {value!r}")
    return tuple(values)


def _rope_settings(d: Mapping[str, Any], source: str) -> tuple[float, dict[str, Any] | None, float]:
    """(rope_theta, scaling or None, partial_rotary_factor) from either transformers spelling.

    Before transformers 5: top-level ``rope_theta`` and an optional ``rope_scaling`` dict whose
    kind is under ``type`` or ``rope_type``. From 5 on: one ``rope_parameters`` dict holding
    ``rope_theta`` and ``rope_type`` (``"default"`` meaning no scaling) and the scaling's keys.
    """
    params = d.get("rope_parameters") or d.get("rope_scaling") or {}
    if not isinstance(params, Mapping):
        raise ConfigError(f"{source}: rope_parameters/rope_scaling must be an object, "
                          f"got {params!r}")
    # Inside rope_parameters wins (`or` would skip a 0 there, which must be checked).
    given = {**d, **{key: value for key, value in params.items() if value is not None}}
    if given.get("rope_theta") is None:
        raise ConfigError(f"{source}: missing required key 'rope_theta' "
                          "(or 'rope_theta' inside 'rope_parameters')")
    theta = _read(given, source, "rope_theta", float)
    partial = _read(given, source, "partial_rotary_factor", float, 1.0)
    rope_type = params.get("rope_type") or params.get("type") or "default"
    read = ("rope_theta", "partial_rotary_factor", "rope_type", "type")
    rest = {key: value for key, value in params.items() if key not in read}
    scaling = None if rope_type == "default" else {"rope_type": rope_type, **rest}
    return theta, scaling, partial
