"""Tests for the merged-weights exercise: they are its specification."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from qkv_merge import load_into_merged, merged_target
from safetensors.torch import load_file

from minisgl.distributed import set_tp_info
from minisgl.layers import MergedColumnParallelLinear, QKVParallelLinear
from minisgl.models import load_model
from minisgl.models.config import ModelConfig

HIDDEN = 32


@pytest.fixture(autouse=True)
def _restore_single_rank():
    yield
    set_tp_info(0, 1)


def engine_layer(make, rank: int, size: int):
    """Build an engine layer as rank ``rank`` of ``size``."""
    set_tp_info(rank, size)
    try:
        return make()
    finally:
        set_tp_info(0, 1)


# ---------------------------------------------------------------- names


@pytest.mark.parametrize("name, expected", [
    ("model.layers.3.self_attn.q_proj.weight", ("model.layers.3.self_attn.qkv_proj.weight", 0)),
    ("model.layers.3.self_attn.k_proj.weight", ("model.layers.3.self_attn.qkv_proj.weight", 1)),
    ("model.layers.3.self_attn.v_proj.bias", ("model.layers.3.self_attn.qkv_proj.bias", 2)),
    ("model.layers.0.mlp.gate_proj.weight", ("model.layers.0.mlp.gate_up_proj.weight", 0)),
    ("model.layers.0.mlp.up_proj.weight", ("model.layers.0.mlp.gate_up_proj.weight", 1)),
])
def test_merged_target_maps_fused_modules_to_their_slot(name: str, expected: tuple) -> None:
    assert merged_target(name) == expected


@pytest.mark.parametrize("name", [
    "model.layers.3.self_attn.o_proj.weight",
    "model.layers.0.mlp.down_proj.weight",
    "model.embed_tokens.weight",
    "model.layers.1.self_attn.q_norm.weight",
    "model.layers.1.self_attn.xq_proj.weight",
])
def test_merged_target_leaves_other_names_alone(name: str) -> None:
    assert merged_target(name) == (name, None), "only whole q/k/v/gate/up_proj components merge"


# ---------------------------------------------------------------- one rank


def test_single_rank_gate_up_is_the_concatenation() -> None:
    gate, up = torch.randn(48, HIDDEN), torch.randn(48, HIDDEN)
    merged = torch.full((96, HIDDEN), float("nan"))
    load_into_merged(merged, up, [48, 48], 1, 0, 1)  # order of arrival does not matter
    load_into_merged(merged, gate, [48, 48], 0, 0, 1)
    assert torch.equal(merged, torch.cat([gate, up]))


def test_single_rank_qkv_with_grouped_kv_heads_is_the_concatenation() -> None:
    sizes = [8 * 4, 2 * 4, 2 * 4]  # 8 query heads, 2 KV heads, head_dim 4
    q, k, v = (torch.randn(s, HIDDEN) for s in sizes)
    merged = torch.empty(sum(sizes), HIDDEN)
    for i, t in enumerate((q, k, v)):
        load_into_merged(merged, t, sizes, i, 0, 1)
    assert torch.equal(merged, torch.cat([q, k, v]))


def test_only_the_slot_s_rows_change() -> None:
    sizes = [16, 8, 8]
    merged = torch.full((32, HIDDEN), float("nan"))
    k = torch.randn(8, HIDDEN)
    load_into_merged(merged, k, sizes, 1, 0, 1)
    assert torch.equal(merged[16:24], k), "k goes right after the 16 q rows"
    assert merged[:16].isnan().all() and merged[24:].isnan().all(), "other slots were touched"


def test_a_bias_vector_works_like_a_weight() -> None:
    sizes = [16, 8, 8]
    merged = torch.zeros(16)  # rank 1 of 2
    for i, s in enumerate(sizes):
        load_into_merged(merged, torch.arange(s, dtype=torch.float32) + 100 * i, sizes, i, 1, 2)
    expected = torch.cat([torch.arange(8, 16), 100 + torch.arange(4, 8), 200 + torch.arange(4, 8)])
    assert torch.equal(merged, expected.float())


def test_a_tensor_with_the_wrong_number_of_rows_is_an_error_naming_both_numbers() -> None:
    with pytest.raises(ValueError, match=r"(?s)(48.*40|40.*48)"):
        load_into_merged(torch.empty(96, HIDDEN), torch.randn(40, HIDDEN), [48, 48], 0, 0, 1)


# ---------------------------------------------------------------- several ranks, vs. the engine


@pytest.mark.parametrize("rank", [0, 1])
def test_gate_up_on_rank_of_2_matches_the_engine(rank: int) -> None:
    gate, up = torch.randn(48, HIDDEN), torch.randn(48, HIDDEN)
    layer = engine_layer(lambda: MergedColumnParallelLinear(HIDDEN, [48, 48]), rank, 2)
    layer.load_weight(gate, 0)
    layer.load_weight(up, 1)
    merged = torch.empty(48, HIDDEN)
    load_into_merged(merged, gate, [48, 48], 0, rank, 2)
    load_into_merged(merged, up, [48, 48], 1, rank, 2)
    assert torch.equal(merged, layer.weight), (
        f"rank {rank}: expected [gate block {rank}; up block {rank}], not a block of cat(gate, up)")


@pytest.mark.parametrize("rank", [0, 1, 2, 3])
def test_qkv_on_rank_of_4_matches_the_engine(rank: int) -> None:
    heads, kv_heads, head_dim = 8, 4, 4
    sizes = [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim]
    tensors = [torch.randn(s, HIDDEN) for s in sizes]
    layer = engine_layer(lambda: QKVParallelLinear(HIDDEN, head_dim, heads, kv_heads), rank, 4)
    merged = torch.empty_like(layer.weight)
    for i, (slot, t) in enumerate(zip("qkv", tensors)):
        layer.load_weight(t, slot)
        load_into_merged(merged, t, sizes, i, rank, 4)
    assert torch.equal(merged, layer.weight), f"rank {rank} of 4 holds the wrong rows"


# ---------------------------------------------------------------- the real checkpoint


def test_rebuilding_tiny_qwen3_s_merged_weights_matches_load_model(tiny_model_dir: Path) -> None:
    config = ModelConfig.from_pretrained(tiny_model_dir)
    model = load_model(tiny_model_dir, device="cpu", progress=False)
    checkpoint = load_file(tiny_model_dir / "model.safetensors")
    q, kv, inter = config.q_size, config.kv_size, config.intermediate_size
    sizes = {"qkv_proj": [q, kv, kv], "gate_up_proj": [inter, inter]}
    rebuilt: dict[str, torch.Tensor] = {}
    for name, tensor in checkpoint.items():
        target, slot = merged_target(name)
        if slot is None:
            continue
        slot_sizes = sizes[target.split(".")[-2]]
        merged = rebuilt.setdefault(target, torch.empty(sum(slot_sizes), tensor.shape[1]))
        load_into_merged(merged, tensor, slot_sizes, slot, 0, 1)
    assert len(rebuilt) == 2 * config.num_layers, f"rebuilt {sorted(rebuilt)}"
    for name, merged in rebuilt.items():
        assert torch.equal(merged, model.get_parameter(name)), f"{name} differs from load_model's"
