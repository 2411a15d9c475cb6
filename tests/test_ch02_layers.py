"""Chapter 2: every layer equals its transformers counterpart, and shards add up to the whole.

All comparisons run in float32 on the CPU with a maximum absolute error of 1e-5 on random
inputs; one GPU test repeats them in bfloat16. Tensor parallelism is simulated in one process:
a layer built while ``set_tp_info(rank, 2)`` is in effect is that rank's layer, and a fake
all-reduce adds up what the simulated ranks send.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers import Qwen3Config
from transformers.activations import ACT2FN
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.qwen3.modeling_qwen3 import (
    Qwen3MLP,
    Qwen3RMSNorm,
    Qwen3RotaryEmbedding,
    apply_rotary_pos_emb,
)

from minisgl.distributed import TPInfo, all_reduce, get_tp_info, set_all_reduce, set_tp_info
from minisgl.layers import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    ReplicatedLinear,
    RMSNorm,
    RowParallelLinear,
    VocabParallelEmbedding,
    fused,
    get_rope,
    silu_and_mul,
)
from minisgl.layers.rotary import default_inv_freq
from minisgl.utils.torch_utils import default_dtype, resolve_device, resolve_dtype

ATOL = 1e-5
HIDDEN, INTERMEDIATE, VOCAB = 256, 512, 2048
NUM_QO_HEADS, NUM_KV_HEADS, HEAD_DIM = 4, 2, 64
MAX_POSITION, THETA, EPS = 4096, 1e6, 1e-6
T = 12  # tokens per test input

ROPE_SCALINGS: dict[str, dict | None] = {
    "default": None,
    "linear": {"rope_type": "linear", "factor": 4.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 1024},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024},
    "yarn-betas-mscale": {"rope_type": "yarn", "factor": 8.0, "beta_fast": 16, "beta_slow": 2,
                          "mscale": 1.0, "mscale_all_dim": 0.5,
                          "original_max_position_embeddings": 512},
}


def max_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    assert ours.shape == ref.shape, f"shape {tuple(ours.shape)} != reference {tuple(ref.shape)}"
    return (ours.float() - ref.float()).abs().max().item()


def hf_config(rope_scaling: dict | None = None) -> Qwen3Config:
    rope = {"rope_type": "default", **(rope_scaling or {}), "rope_theta": THETA}
    return Qwen3Config(hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, vocab_size=VOCAB,
                       num_attention_heads=NUM_QO_HEADS, num_key_value_heads=NUM_KV_HEADS,
                       head_dim=HEAD_DIM, max_position_embeddings=MAX_POSITION, rms_norm_eps=EPS,
                       rope_parameters=rope)


def randomize(module: nn.Module) -> nn.Module:
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0, 1 / math.sqrt(p.shape[-1]))
    return module


def hf_rope(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
            scaling: dict | None) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' RoPE on our [T, H, D] layout (it works on [batch, H, T, D])."""
    cos, sin = Qwen3RotaryEmbedding(hf_config(scaling)).to(q.device)(q, positions[None])
    q_ref, k_ref = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    return q_ref[0].transpose(0, 1), k_ref[0].transpose(0, 1)


@pytest.fixture(autouse=True)
def _seed_and_single_rank() -> Iterator[None]:
    torch.manual_seed(0)
    yield
    set_tp_info(0, 1)  # a failing test must not leave a fake rank behind
    set_all_reduce(None)


@contextmanager
def as_rank(rank: int, size: int) -> Iterator[None]:
    """Build layers as if this process were ``rank`` of ``size``."""
    previous = set_tp_info(rank, size)
    try:
        yield
    finally:
        set_tp_info(previous.rank, previous.size)


def run_ranks(layers: Sequence[nn.Module], inputs: Sequence[tuple]) -> list[torch.Tensor]:
    """Run each simulated rank's layer; their one all-reduce returns the sum over all ranks.

    First pass: record what every rank sends. Second pass: answer each all-reduce with the sum.
    """
    sent: list[torch.Tensor] = []
    set_all_reduce(lambda t: sent.append(t.clone()) or t)
    for layer, args in zip(layers, inputs):
        layer(*args)
    assert len(sent) == len(layers), "each rank should all-reduce exactly once"
    total = torch.stack(sent).sum(dim=0)
    set_all_reduce(lambda t: total.clone())
    return [layer(*args) for layer, args in zip(layers, inputs)]


# ---------------------------------------------------------------- RMSNorm


@pytest.mark.parametrize("shape", [(T, HIDDEN), (T, NUM_QO_HEADS, HEAD_DIM)],
                         ids=["tokens", "heads"])
def test_rmsnorm_matches_qwen3_rmsnorm(shape: tuple[int, ...]) -> None:
    ref = randomize(Qwen3RMSNorm(shape[-1], eps=EPS))
    ours = RMSNorm(shape[-1], eps=EPS)
    ours.load_weight(ref.weight)
    x = torch.randn(*shape) * 3
    assert max_err(ours(x), ref(x)) <= ATOL


def test_rmsnorm_with_residual_returns_normed_sum_and_the_sum() -> None:
    ref = randomize(Qwen3RMSNorm(HIDDEN, eps=EPS))
    ours = RMSNorm(HIDDEN, eps=EPS)
    ours.load_weight(ref.weight)
    x, residual = torch.randn(T, HIDDEN), torch.randn(T, HIDDEN)
    normed, new_residual = ours(x, residual)
    assert max_err(new_residual, x + residual) <= ATOL, "the second output is the new residual"
    assert max_err(normed, ref(x + residual)) <= ATOL, "the first output is norm(x + residual)"


# ---------------------------------------------------------------- rotary embedding


@pytest.mark.parametrize("name", list(ROPE_SCALINGS))
def test_rotary_matches_transformers(name: str) -> None:
    scaling = ROPE_SCALINGS[name]
    ours = get_rope(HEAD_DIM, HEAD_DIM, MAX_POSITION, THETA, scaling)
    positions = torch.cat([torch.arange(4), torch.randint(0, MAX_POSITION, (T - 4,))])
    q, k = torch.randn(T, NUM_QO_HEADS, HEAD_DIM), torch.randn(T, NUM_KV_HEADS, HEAD_DIM)
    q_ours, k_ours = ours(positions, q, k)
    q_ref, k_ref = hf_rope(q, k, positions, scaling)
    assert max_err(q_ours, q_ref) <= ATOL and max_err(k_ours, k_ref) <= ATOL


@pytest.mark.parametrize("name", [n for n in ROPE_SCALINGS if ROPE_SCALINGS[n]])
def test_rotary_frequencies_equal_transformers_rope_init_functions(name: str) -> None:
    scaling = ROPE_SCALINGS[name]
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS[scaling["rope_type"]](hf_config(scaling))
    ours = get_rope(HEAD_DIM, HEAD_DIM, MAX_POSITION, THETA, scaling)
    # Row 1 of the table is position 1: cos/sin of inv_freq itself, times the attention factor.
    assert max_err(ours.cos_cache[1], inv_freq.cos() * attention_factor) <= ATOL
    assert max_err(ours.sin_cache[1], inv_freq.sin() * attention_factor) <= ATOL


def test_rotary_accepts_flat_and_per_head_layouts() -> None:
    rope = get_rope(HEAD_DIM, HEAD_DIM, MAX_POSITION, THETA)
    positions = torch.randint(0, MAX_POSITION, (T,))
    q, k = torch.randn(T, NUM_QO_HEADS, HEAD_DIM), torch.randn(T, NUM_KV_HEADS, HEAD_DIM)
    q_flat, k_flat = rope(positions, q.reshape(T, -1), k.reshape(T, -1))
    q_heads, k_heads = rope(positions, q, k)
    assert q_flat.shape == (T, NUM_QO_HEADS * HEAD_DIM), "outputs keep the input's layout"
    assert torch.equal(q_flat.view_as(q_heads), q_heads) and torch.equal(k_flat.view_as(k), k_heads)


def test_position_zero_is_the_identity_and_inputs_are_not_modified() -> None:
    rope = get_rope(HEAD_DIM, HEAD_DIM, MAX_POSITION, THETA)
    q, k = torch.randn(1, NUM_QO_HEADS, HEAD_DIM), torch.randn(1, NUM_KV_HEADS, HEAD_DIM)
    q_copy = q.clone()
    q_rot, k_rot = rope(torch.zeros(1, dtype=torch.long), q, k)
    assert torch.equal(q, q_copy), "RoPE must return new tensors, not rotate in place"
    assert max_err(q_rot, q) <= ATOL and max_err(k_rot, k) <= ATOL


def test_partial_rotary_rotates_only_the_first_rotary_dim_features() -> None:
    rope = get_rope(HEAD_DIM, HEAD_DIM // 2, MAX_POSITION, THETA)
    full = get_rope(HEAD_DIM // 2, HEAD_DIM // 2, MAX_POSITION, THETA)
    positions = torch.randint(0, MAX_POSITION, (T,))
    q, k = torch.randn(T, NUM_QO_HEADS, HEAD_DIM), torch.randn(T, NUM_KV_HEADS, HEAD_DIM)
    q_rot, _ = rope(positions, q, k)
    half = HEAD_DIM // 2
    q_head, _ = full(positions, q[..., :half].contiguous(), k[..., :half].contiguous())
    assert torch.equal(q_rot[..., half:], q[..., half:]), "features past rotary_dim pass through"
    assert max_err(q_rot[..., :half], q_head) <= ATOL


def test_the_rope_table_holds_cos_then_sin_per_position_as_flashinfer_reads_it() -> None:
    scaling = ROPE_SCALINGS["yarn"]
    rope = get_rope(HEAD_DIM, HEAD_DIM, MAX_POSITION, THETA, scaling)
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS["yarn"](hf_config(scaling))
    row = rope.cos_sin_cache[7]  # position 7: [cos(7 * inv_freq) | sin(7 * inv_freq)] * factor
    assert rope.cos_sin_cache.shape == (MAX_POSITION, HEAD_DIM)
    assert rope.cos_sin_cache.dtype == torch.float32 and rope.cos_sin_cache.is_contiguous()
    assert max_err(row, torch.cat([(7 * inv_freq).cos(), (7 * inv_freq).sin()])
                   * attention_factor) <= ATOL
    assert torch.equal(rope.cos_cache, rope.cos_sin_cache[:, : HEAD_DIM // 2])
    assert "cos_sin_cache" not in rope.state_dict(), "the table is rebuilt, never loaded"
    partial = get_rope(HEAD_DIM, HEAD_DIM // 2, MAX_POSITION, THETA)
    assert partial.cos_sin_cache.shape == (MAX_POSITION, HEAD_DIM // 2)
    assert torch.equal(partial.sin_cache[3], (3 * default_inv_freq(HEAD_DIM // 2, THETA)).sin())


def test_fused_kernels_are_never_used_for_cpu_tensors() -> None:
    x = torch.randn(T, HIDDEN)
    norm = RMSNorm(HIDDEN, eps=EPS)
    norm.load_weight(torch.ones(HIDDEN))
    assert not fused.available(x) and not fused.available(x.bfloat16())
    assert not fused.can_rmsnorm(x, norm.weight, x.clone())
    assert not fused.can_silu_and_mul(torch.randn(T, 2 * INTERMEDIATE))
    assert not fused.can_gemv(x[:1], torch.randn(8, HIDDEN))
    assert not fused.can_gemv(x[:1].bfloat16(), torch.randn(8, HIDDEN).bfloat16())


def test_get_rope_rejects_an_unknown_type_naming_the_supported_ones() -> None:
    with pytest.raises(ValueError, match="dynamic.*supported: default, linear, llama3, yarn"):
        get_rope(HEAD_DIM, HEAD_DIM, MAX_POSITION, THETA, {"rope_type": "dynamic", "factor": 2.0})
    with pytest.raises(ValueError, match="low_freq_factor"):
        get_rope(HEAD_DIM, HEAD_DIM, MAX_POSITION, THETA, {"rope_type": "llama3", "factor": 8.0})


def test_get_rope_reads_the_old_type_key_and_ignores_rope_theta() -> None:
    old = get_rope(HEAD_DIM, HEAD_DIM, 64, THETA, {"type": "linear", "factor": 2.0})
    new = get_rope(HEAD_DIM, HEAD_DIM, 64, THETA,
                   {"rope_type": "linear", "factor": 2.0, "rope_theta": THETA})
    assert torch.equal(old.cos_cache, new.cos_cache)


# ---------------------------------------------------------------- activation and MLP


def test_silu_and_mul_matches_the_qwen3_mlp_activation() -> None:
    gate, up = torch.randn(T, INTERMEDIATE) * 4, torch.randn(T, INTERMEDIATE)
    ref = ACT2FN[hf_config().hidden_act](gate) * up
    assert max_err(silu_and_mul(torch.cat([gate, up], dim=-1)), ref) <= ATOL


def test_silu_and_mul_rejects_an_odd_width() -> None:
    with pytest.raises(ValueError, match="even last dimension"):
        silu_and_mul(torch.randn(2, 7))


def test_merged_gate_up_with_silu_and_row_parallel_down_equals_qwen3_mlp() -> None:
    ref = randomize(Qwen3MLP(hf_config()))
    gate_up = MergedColumnParallelLinear(HIDDEN, [INTERMEDIATE, INTERMEDIATE])
    gate_up.load_weight(ref.gate_proj.weight, 0)
    gate_up.load_weight(ref.up_proj.weight, 1)
    down = RowParallelLinear(INTERMEDIATE, HIDDEN)
    down.load_weight(ref.down_proj.weight)
    x = torch.randn(T, HIDDEN)
    assert max_err(gate_up.weight, torch.cat([ref.gate_proj.weight, ref.up_proj.weight])) == 0
    assert max_err(down(silu_and_mul(gate_up(x))), ref(x)) <= ATOL


# ---------------------------------------------------------------- linear layers, tp = 1


@pytest.mark.parametrize("cls", [ReplicatedLinear, ColumnParallelLinear, RowParallelLinear])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_layers_equal_nn_linear(cls: type, bias: bool) -> None:
    ref = randomize(nn.Linear(HIDDEN, INTERMEDIATE, bias=bias))
    ours = cls(HIDDEN, INTERMEDIATE, bias=bias)
    ours.load_weight(ref.weight)
    if bias:
        ours.load_weight(ref.bias, param_name="bias")
    x = torch.randn(T, HIDDEN)
    assert max_err(ours(x), ref(x)) <= ATOL


def test_qkv_linear_equals_separate_q_k_v_projections() -> None:
    q_ref, k_ref, v_ref = (randomize(nn.Linear(HIDDEN, h * HEAD_DIM, bias=True))
                           for h in (NUM_QO_HEADS, NUM_KV_HEADS, NUM_KV_HEADS))
    qkv = QKVParallelLinear(HIDDEN, HEAD_DIM, NUM_QO_HEADS, NUM_KV_HEADS, bias=True)
    for shard_id, ref in zip("qkv", (q_ref, k_ref, v_ref)):
        qkv.load_weight(ref.weight, shard_id)
        qkv.load_weight(ref.bias, shard_id, param_name="bias")
    x = torch.randn(T, HIDDEN)
    assert max_err(qkv(x), torch.cat([q_ref(x), k_ref(x), v_ref(x)], dim=-1)) <= ATOL


def test_merged_layers_reject_an_unknown_shard_id() -> None:
    with pytest.raises(ValueError, match="'q', 'k' or 'v'"):
        QKVParallelLinear(HIDDEN, HEAD_DIM, 4, 2).load_weight(torch.zeros(256, HIDDEN), "o")
    with pytest.raises(ValueError, match=r"shard_id in \(0, 1\)"):
        MergedColumnParallelLinear(HIDDEN, [8, 8]).load_weight(torch.zeros(8, HIDDEN), 2)


def test_load_weight_rejects_a_tensor_of_the_wrong_shape_naming_both_shapes() -> None:
    layer = ColumnParallelLinear(HIDDEN, INTERMEDIATE)
    with pytest.raises(ValueError, match=r"512 entries along dim 0, got shape \(500, 256\)"):
        layer.load_weight(torch.zeros(500, HIDDEN))
    with pytest.raises(ValueError, match=r"shape \(512, 255\).*expects \(512, 256\)"):
        layer.load_weight(torch.zeros(INTERMEDIATE, HIDDEN - 1))


# ---------------------------------------------------------------- embedding and LM head, tp = 1


def test_embedding_equals_nn_embedding() -> None:
    ref = randomize(nn.Embedding(VOCAB, HIDDEN))
    ours = VocabParallelEmbedding(VOCAB, HIDDEN)
    ours.load_weight(ref.weight)
    ids = torch.randint(0, VOCAB, (T,))
    assert max_err(ours(ids), ref(ids)) <= ATOL


def test_lm_head_untied_and_tied_equal_a_linear_layer() -> None:
    embedding_ref = randomize(nn.Embedding(VOCAB, HIDDEN))
    head_ref = randomize(nn.Linear(HIDDEN, VOCAB, bias=False))
    embedding = VocabParallelEmbedding(VOCAB, HIDDEN)
    embedding.load_weight(embedding_ref.weight)
    untied = ParallelLMHead(VOCAB, HIDDEN)
    untied.load_weight(head_ref.weight)
    tied = ParallelLMHead(VOCAB, HIDDEN, tie_to=embedding)
    x = torch.randn(T, HIDDEN)
    assert max_err(untied(x), head_ref(x)) <= ATOL
    assert tied.weight is embedding.weight, "a tied head shares the embedding's Parameter"
    assert max_err(tied(x), x @ embedding_ref.weight.T) <= ATOL


def test_tied_head_must_match_the_embedding_shape() -> None:
    with pytest.raises(ValueError, match="cannot tie"):
        ParallelLMHead(VOCAB, HIDDEN * 2, tie_to=VocabParallelEmbedding(VOCAB, HIDDEN))


# ---------------------------------------------------------------- simulated tensor parallelism


def test_column_parallel_rank_1_of_2_holds_the_second_half_of_the_rows() -> None:
    full = torch.randn(INTERMEDIATE, HIDDEN)
    with as_rank(1, 2):
        layer = ColumnParallelLinear(HIDDEN, INTERMEDIATE)
    layer.load_weight(full)
    assert torch.equal(layer.weight, full[INTERMEDIATE // 2:])


def test_merged_rank_1_of_2_holds_the_second_half_of_gate_then_of_up() -> None:
    gate, up = torch.randn(INTERMEDIATE, HIDDEN), torch.randn(INTERMEDIATE, HIDDEN)
    with as_rank(1, 2):
        layer = MergedColumnParallelLinear(HIDDEN, [INTERMEDIATE, INTERMEDIATE])
    layer.load_weight(gate, 0)
    layer.load_weight(up, 1)
    half = INTERMEDIATE // 2
    # Not rows [512:1024] of cat(gate, up): each slot is sliced on its own.
    assert torch.equal(layer.weight, torch.cat([gate[half:], up[half:]]))


def test_qkv_rank_1_of_2_holds_its_query_heads_then_its_kv_heads() -> None:
    q = torch.randn(NUM_QO_HEADS * HEAD_DIM, HIDDEN)
    k, v = torch.randn(2, NUM_KV_HEADS * HEAD_DIM, HIDDEN)
    with as_rank(1, 2):
        layer = QKVParallelLinear(HIDDEN, HEAD_DIM, NUM_QO_HEADS, NUM_KV_HEADS)
    for shard_id, tensor in zip("qkv", (q, k, v)):
        layer.load_weight(tensor, shard_id)
    d = HEAD_DIM
    expected = torch.cat([q[2 * d:4 * d], k[1 * d:2 * d], v[1 * d:2 * d]])  # q heads 2,3; kv head 1
    assert layer.weight.shape == (4 * d, HIDDEN)
    assert torch.equal(layer.weight, expected)


@pytest.mark.parametrize("rank, kv_head", [(0, 0), (1, 0), (2, 1), (3, 1)])
def test_qkv_replicates_kv_heads_when_there_are_fewer_than_ranks(rank: int, kv_head: int) -> None:
    k = torch.randn(NUM_KV_HEADS * HEAD_DIM, HIDDEN)
    with as_rank(rank, 4):
        layer = QKVParallelLinear(HIDDEN, HEAD_DIM, NUM_QO_HEADS, NUM_KV_HEADS)
    layer.load_weight(k, "k")
    d = HEAD_DIM
    assert layer.local_qo_heads == 1 and layer.local_kv_heads == 1
    assert torch.equal(layer.weight[d:2 * d], k[kv_head * d:(kv_head + 1) * d])


def test_sharding_that_does_not_divide_is_an_error() -> None:
    with as_rank(0, 3), pytest.raises(ValueError, match="num_qo_heads=4 evenly over 3"):
        QKVParallelLinear(HIDDEN, HEAD_DIM, NUM_QO_HEADS, NUM_KV_HEADS)


def test_row_parallel_shards_sum_to_the_full_layer_with_the_bias_added_once() -> None:
    ref = randomize(nn.Linear(INTERMEDIATE, HIDDEN, bias=True))
    layers = []
    for rank in (0, 1):
        with as_rank(rank, 2):
            layer = RowParallelLinear(INTERMEDIATE, HIDDEN, bias=True)
        layer.load_weight(ref.weight)
        layer.load_weight(ref.bias, param_name="bias")
        layers.append(layer)
    x = torch.randn(T, INTERMEDIATE)
    halves = x.chunk(2, dim=-1)  # each rank receives its slice of the features
    outputs = run_ranks(layers, [(halves[0],), (halves[1],)])
    for out in outputs:
        assert max_err(out, ref(x)) <= ATOL


def test_vocab_parallel_embedding_ranks_sum_to_the_full_lookup() -> None:
    vocab = 1001  # not divisible by 2: rank 1 has one padding row
    ref = randomize(nn.Embedding(vocab, HIDDEN))
    layers = []
    for rank in (0, 1):
        with as_rank(rank, 2):
            layer = VocabParallelEmbedding(vocab, HIDDEN)
        layer.load_weight(ref.weight)
        layers.append(layer)
    shard = layers[1].shard
    assert (shard.start, shard.end, shard.padded_rows) == (501, 1001, 501)
    ids = torch.tensor([0, 500, 501, 1000, 7, 999])  # both sides of the boundary
    for out in run_ranks(layers, [(ids,), (ids,)]):
        assert max_err(out, ref(ids)) <= ATOL


def test_lm_head_ranks_gather_the_full_logits() -> None:
    vocab = 1001
    ref = randomize(nn.Linear(HIDDEN, vocab, bias=False))
    layers = []
    for rank in (0, 1):
        with as_rank(rank, 2):
            layer = ParallelLMHead(vocab, HIDDEN)
        layer.load_weight(ref.weight)
        layers.append(layer)
    x = torch.randn(T, HIDDEN)
    for out in run_ranks(layers, [(x,), (x,)]):
        assert max_err(out, ref(x)) <= ATOL


# ---------------------------------------------------------------- distributed info, torch utils


def test_all_reduce_is_the_identity_on_one_rank_and_an_error_on_several_without_a_backend() -> None:
    x = torch.randn(3)
    assert all_reduce(x) is x
    set_tp_info(0, 2)
    with pytest.raises(RuntimeError, match="set_all_reduce"):
        all_reduce(x)


def test_tp_info_rejects_impossible_positions() -> None:
    assert get_tp_info() == TPInfo(0, 1)
    with pytest.raises(ValueError, match="rank must be in"):
        set_tp_info(2, 2)
    with pytest.raises(ValueError, match="size must be >= 1"):
        TPInfo(0, 0)


def test_resolve_device_and_dtype() -> None:
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_dtype("auto", "cpu") == torch.float32
    assert resolve_dtype("bf16", "cpu") == torch.bfloat16
    with pytest.raises(ValueError, match="unknown device 'gpu'"):
        resolve_device("gpu")
    with pytest.raises(ValueError, match="unknown dtype 'float64'"):
        resolve_dtype("float64")
    if not torch.cuda.is_available():
        assert resolve_device("auto") == torch.device("cpu")
        with pytest.raises(ValueError, match="CUDA is not available"):
            resolve_device("cuda")


def test_layers_are_built_on_the_default_device_in_the_default_dtype() -> None:
    with torch.device("meta"), default_dtype(torch.bfloat16):
        layer = QKVParallelLinear(HIDDEN, HEAD_DIM, NUM_QO_HEADS, NUM_KV_HEADS)
    assert layer.weight.device.type == "meta" and layer.weight.dtype == torch.bfloat16
    assert not layer.weight.requires_grad, "inference-only parameters need no gradients"


# ---------------------------------------------------------------- the same on a GPU, in bfloat16

# bfloat16 keeps 8 significant bits: one rounding moves a value by up to 2**-8 (0.4%) of itself.
# RoPE differs by design (our cos/sin stay float32, transformers rounds them to bf16 first), so
# allow a few roundings: max abs error <= 1e-2 * max |reference|.
BF16_REL_TOL = 1e-2


def rel(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return max_err(ours, ref) / ref.float().abs().max().item()


@pytest.mark.gpu
def test_layers_match_transformers_in_bfloat16_on_cuda() -> None:
    """Same comparisons in bf16 on CUDA: max abs error <= 1e-2 * max |reference| per layer."""
    errors: dict[str, float] = {}
    with torch.device("cuda"), default_dtype(torch.bfloat16), torch.inference_mode():
        x = torch.randn(T, HIDDEN)
        norm_ref = randomize(Qwen3RMSNorm(HIDDEN, eps=EPS))
        norm = RMSNorm(HIDDEN, eps=EPS)
        norm.load_weight(norm_ref.weight)
        errors["rmsnorm"] = rel(norm(x), norm_ref(x))
        residual = torch.randn(T, HIDDEN)
        # Clones: on CUDA the residual form overwrites its inputs (FlashInfer's fused kernel).
        normed = norm(x.clone(), residual.clone())[0]
        errors["rmsnorm+residual"] = rel(normed, norm_ref(x + residual))
        positions = torch.randint(0, MAX_POSITION, (T,))
        q, k = torch.randn(T, NUM_QO_HEADS, HEAD_DIM), torch.randn(T, NUM_KV_HEADS, HEAD_DIM)
        for name, scaling in ROPE_SCALINGS.items():
            rope = get_rope(HEAD_DIM, HEAD_DIM, MAX_POSITION, THETA, scaling)
            q_ours, k_ours = rope(positions, q.clone(), k.clone())  # rotated in place on CUDA
            q_ref, k_ref = hf_rope(q, k, positions, scaling)
            errors[f"rope-{name}"] = max(rel(q_ours, q_ref), rel(k_ours, k_ref))
        mlp_ref = randomize(Qwen3MLP(hf_config()))
        gate_up = MergedColumnParallelLinear(HIDDEN, [INTERMEDIATE, INTERMEDIATE])
        gate_up.load_weight(mlp_ref.gate_proj.weight, 0)
        gate_up.load_weight(mlp_ref.up_proj.weight, 1)
        down = RowParallelLinear(INTERMEDIATE, HIDDEN)
        down.load_weight(mlp_ref.down_proj.weight)
        errors["mlp"] = rel(down(silu_and_mul(gate_up(x))), mlp_ref(x))
        emb_ref = randomize(nn.Embedding(VOCAB, HIDDEN))
        emb = VocabParallelEmbedding(VOCAB, HIDDEN)
        emb.load_weight(emb_ref.weight)
        ids = torch.randint(0, VOCAB, (T,))
        errors["embedding"] = rel(emb(ids), emb_ref(ids))
        errors["lm_head"] = rel(ParallelLMHead(VOCAB, HIDDEN, tie_to=emb)(x), x @ emb_ref.weight.T)
    print("bf16 max abs error / max |reference|:", {k: f"{v:.2e}" for k, v in errors.items()})
    too_large = {k: v for k, v in errors.items() if v > BF16_REL_TOL}
    assert not too_large, f"bf16 relative errors above {BF16_REL_TOL}: {too_large}"


# ---------------------------------------------------------------- fused kernels on CUDA

# On CUDA in bfloat16 the norms, RoPE and SiLU-and-multiply run as FlashInfer kernels
# (minisgl/layers/fused.py); fused.use_fused(False) runs the PyTorch code on the same GPU, the
# reference. Shapes are Qwen3-0.6B's, token counts those of a decode step (1 and 138 requests)
# and of a prefill (2,048 tokens). Both paths round differently (the kernels once, PyTorch after
# each operation), so an element may differ by |d| <= 1e-2 + 2e-2 |reference|.
BIG_HIDDEN, BIG_INTERMEDIATE, BIG_QO_HEADS, BIG_KV_HEADS, BIG_HEAD_DIM = 1024, 3072, 16, 8, 128
FUSED_TOKENS = [1, 138, 2048]


def assert_close_bf16(ours: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    assert ours.shape == ref.shape, f"{what}: shape {tuple(ours.shape)} != {tuple(ref.shape)}"
    diff = (ours.float() - ref.float()).abs()
    excess = diff - (1e-2 + 2e-2 * ref.float().abs())
    assert excess.max().item() <= 0, (f"{what}: max |diff| {diff.max().item():.3e} "
                                      "above 1e-2 + 2e-2 |reference|")


def random_norm(size: int) -> RMSNorm:
    norm = RMSNorm(size, eps=EPS)
    norm.load_weight(1 + 0.1 * torch.randn(size))
    return norm


def split_qkv(qkv: torch.Tensor, num_qo: int, num_kv: int,
              head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """q and k as the attention layer cuts them from the qkv output: strided per-head views."""
    q, k, _ = qkv.split([num_qo * head_dim, num_kv * head_dim, num_kv * head_dim], dim=-1)
    return q.view(-1, num_qo, head_dim), k.view(-1, num_kv, head_dim)


@pytest.fixture
def cuda_bf16() -> Iterator[None]:
    pytest.importorskip("flashinfer", reason="flashinfer-python is not installed")
    with torch.device("cuda"), default_dtype(torch.bfloat16), torch.inference_mode():
        yield


@pytest.mark.gpu
def test_fused_kernels_are_on_for_bfloat16_cuda_tensors(cuda_bf16: None) -> None:
    x = torch.randn(4, BIG_HIDDEN)
    norm = random_norm(BIG_HIDDEN)
    rope = get_rope(BIG_HEAD_DIM, BIG_HEAD_DIM, MAX_POSITION, THETA)
    q, k = torch.randn(4, BIG_QO_HEADS * BIG_HEAD_DIM), torch.randn(4, BIG_HEAD_DIM)
    positions = torch.arange(4)
    assert fused.available(x), fused.kernel_status()
    assert fused.can_rmsnorm(x, norm.weight), fused.kernel_status()
    assert fused.can_rmsnorm(x, norm.weight, x.clone()), fused.kernel_status()
    assert fused.can_rope(positions, q, k, rope.cos_sin_cache, BIG_HEAD_DIM), fused.kernel_status()
    assert fused.can_silu_and_mul(torch.randn(4, 2 * BIG_INTERMEDIATE)), fused.kernel_status()
    qkv = torch.randn(4, (BIG_QO_HEADS + 2 * BIG_KV_HEADS) * BIG_HEAD_DIM)
    assert fused.can_qk_prologue(qkv, positions, rope.cos_sin_cache, BIG_HEAD_DIM,
                                 (norm.weight[:BIG_HEAD_DIM],) * 2), fused.kernel_status()
    assert fused.can_gemv(x[:1], torch.randn(8, BIG_HIDDEN)), fused.kernel_status()
    assert fused.can_mm_float32(x, torch.float32), fused.kernel_status()
    assert set(fused.kernel_status().values()) == {"on"}, fused.kernel_status()
    assert not fused.available(x.float()), "float32 has no FlashInfer kernel: PyTorch code"
    with fused.use_fused(False):
        assert not fused.can_rmsnorm(x, norm.weight)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", FUSED_TOKENS)
def test_fused_rmsnorm_equals_the_pytorch_path_on_cuda(cuda_bf16: None, tokens: int) -> None:
    norm, q_norm = random_norm(BIG_HIDDEN), random_norm(BIG_HEAD_DIM)
    x = torch.randn(tokens, BIG_HIDDEN) * 3
    x_before = x.clone()
    assert fused.can_rmsnorm(x, norm.weight), fused.kernel_status()
    out = norm(x)
    with fused.use_fused(False):
        ref = norm(x)
    assert torch.equal(x, x_before), "the plain form returns a new tensor, its input untouched"
    assert_close_bf16(out, ref, f"rmsnorm, {tokens} tokens")
    # qk-norm: one scale per head_dim feature, on the q slice of a qkv output, not copied first.
    qkv = torch.randn(tokens, (BIG_QO_HEADS + 2 * BIG_KV_HEADS) * BIG_HEAD_DIM) * 3
    q, _ = split_qkv(qkv, BIG_QO_HEADS, BIG_KV_HEADS, BIG_HEAD_DIM)
    assert fused.can_rmsnorm(q, q_norm.weight), fused.kernel_status()
    out = q_norm(q)
    with fused.use_fused(False):
        ref = q_norm(q)
    assert_close_bf16(out, ref, f"qk-norm, {tokens} tokens")


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", FUSED_TOKENS)
def test_fused_add_rmsnorm_equals_the_pytorch_path_in_place(cuda_bf16: None, tokens: int) -> None:
    norm = random_norm(BIG_HIDDEN)
    x, residual = torch.randn(tokens, BIG_HIDDEN) * 3, torch.randn(tokens, BIG_HIDDEN) * 3
    with fused.use_fused(False):
        ref_normed, ref_sum = norm(x, residual)  # the PyTorch code leaves its inputs alone
    x_in, residual_in = x.clone(), residual.clone()
    assert fused.can_rmsnorm(x_in, norm.weight, residual_in), fused.kernel_status()
    normed, new_residual = norm(x_in, residual_in)
    # One kernel, in place: the residual becomes the sum, x its normalised value.
    assert normed is x_in and new_residual is residual_in
    assert_close_bf16(new_residual, ref_sum, f"residual (x + residual), {tokens} tokens")
    assert_close_bf16(normed, ref_normed, f"norm(x + residual), {tokens} tokens")


ROPE_CASES = {  # name: (head_dim, rotary_dim, rope_scaling)
    **{name: (BIG_HEAD_DIM, BIG_HEAD_DIM, scaling) for name, scaling in ROPE_SCALINGS.items()},
    "partial-64-of-128": (BIG_HEAD_DIM, BIG_HEAD_DIM // 2, None),
    "tiny-head-64": (HEAD_DIM, HEAD_DIM, None),
}


@pytest.mark.gpu
@pytest.mark.parametrize("case", list(ROPE_CASES))
def test_fused_rope_equals_the_pytorch_path_in_place(cuda_bf16: None, case: str) -> None:
    head_dim, rotary_dim, scaling = ROPE_CASES[case]
    rope = get_rope(head_dim, rotary_dim, MAX_POSITION, THETA, scaling)
    for tokens in FUSED_TOKENS:
        # int64 positions as the engine passes them; int32 works too.
        dtype = torch.int32 if tokens == 138 else torch.int64
        positions = torch.randint(0, MAX_POSITION, (tokens,), dtype=dtype)
        qkv = torch.randn(tokens, (BIG_QO_HEADS + 2 * BIG_KV_HEADS) * head_dim)
        qkv_before = qkv.clone()
        q, k = split_qkv(qkv, BIG_QO_HEADS, BIG_KV_HEADS, head_dim)
        with fused.use_fused(False):
            q_ref, k_ref = rope(positions, q, k)
        assert torch.equal(qkv, qkv_before), "the PyTorch code leaves q and k alone"
        assert fused.can_rope(positions, q, k, rope.cos_sin_cache, head_dim), (
            case, fused.kernel_status())
        q_out, k_out = rope(positions, q, k)
        assert q_out is q and k_out is k, "the kernel rotates q and k in place"
        assert_close_bf16(q_out, q_ref, f"{case}: q, {tokens} tokens")
        assert_close_bf16(k_out, k_ref, f"{case}: k, {tokens} tokens")
        v_start = (BIG_QO_HEADS + BIG_KV_HEADS) * head_dim
        assert torch.equal(qkv[:, v_start:], qkv_before[:, v_start:]), "v must be untouched"
        if rotary_dim < head_dim:  # the features past rotary_dim pass through unchanged
            q_before, _ = split_qkv(qkv_before, BIG_QO_HEADS, BIG_KV_HEADS, head_dim)
            assert torch.equal(q_out[..., rotary_dim:], q_before[..., rotary_dim:])
    # The flat [T, H * D] layout (no qk-norm) goes through the same kernel.
    q_flat, k_flat = torch.randn(8, 2 * head_dim), torch.randn(8, head_dim)
    positions = torch.arange(8)
    with fused.use_fused(False):
        q_ref, k_ref = rope(positions, q_flat, k_flat)
    q_out, k_out = rope(positions, q_flat, k_flat)
    assert q_out.shape == (8, 2 * head_dim) and q_out is q_flat
    assert_close_bf16(q_out, q_ref, f"{case}: flat q")
    assert_close_bf16(k_out, k_ref, f"{case}: flat k")


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", FUSED_TOKENS)
@pytest.mark.parametrize("into_pool", [False, True])
@pytest.mark.parametrize("qk_norm", [True, False])
def test_qk_prologue_equals_norm_rope_and_store(cuda_bf16: None, tokens: int, into_pool: bool,
                                                qk_norm: bool) -> None:
    """One Triton kernel against the qk-norm, RoPE and K/V scatter it replaces: FlashInfer's
    norm and rotation (each checked against the PyTorch code above), then an index store.
    Without qk-norm (Llama, Qwen2) it only rotates and stores."""
    q_norm, k_norm = random_norm(BIG_HEAD_DIM), random_norm(BIG_HEAD_DIM)
    rope = get_rope(BIG_HEAD_DIM, BIG_HEAD_DIM, MAX_POSITION, THETA)
    qkv = torch.randn(tokens, (BIG_QO_HEADS + 2 * BIG_KV_HEADS) * BIG_HEAD_DIM) * 3
    positions = torch.randint(0, MAX_POSITION, (tokens,))
    q, k = split_qkv(qkv, BIG_QO_HEADS, BIG_KV_HEADS, BIG_HEAD_DIM)
    if qk_norm:
        assert fused.can_rmsnorm(q, q_norm.weight) and fused.can_rmsnorm(k, k_norm.weight)
        q, k = q_norm(q), k_norm(k)
    else:
        # The rotation works in place: on copies (with one token the q and k views of the
        # single qkv row are contiguous already, so .contiguous() would not copy them).
        q, k = q.clone(), k.clone()
    assert fused.can_rope(positions, q, k, rope.cos_sin_cache, BIG_HEAD_DIM)
    ref_q, ref_k = rope(positions, q, k)
    ref_v = qkv[:, (BIG_QO_HEADS + BIG_KV_HEADS) * BIG_HEAD_DIM:].view(tokens, BIG_KV_HEADS, -1)
    weights = (q_norm.weight, k_norm.weight) if qk_norm else None
    assert fused.can_qk_prologue(qkv, positions, rope.cos_sin_cache, BIG_HEAD_DIM, weights)
    qkv_before = qkv.clone()
    if into_pool:  # the tokens' slots are scattered over a larger cache, as in a KV pool
        num_slots = 4 * tokens + 7
        k_cache = torch.zeros(num_slots, BIG_KV_HEADS, BIG_HEAD_DIM)
        v_cache = torch.zeros_like(k_cache)
        loc = torch.randperm(num_slots)[:tokens]
        assert fused.can_store_into(k_cache, v_cache, BIG_HEAD_DIM)
        out_q, none_k, none_v = fused.qk_prologue(
            qkv, positions, BIG_QO_HEADS, BIG_KV_HEADS, BIG_HEAD_DIM, rope.cos_sin_cache,
            weights, EPS, fused.KVDestination(k_cache, v_cache, loc))
        assert none_k is None and none_v is None
        out_k, out_v = k_cache[loc], v_cache[loc]
        untouched = torch.ones(num_slots, dtype=torch.bool)
        untouched[loc] = False
        assert not k_cache[untouched].any() and not v_cache[untouched].any()
    else:
        out_q, out_k, out_v = fused.qk_prologue(
            qkv, positions, BIG_QO_HEADS, BIG_KV_HEADS, BIG_HEAD_DIM, rope.cos_sin_cache,
            weights, EPS, None)
    assert torch.equal(qkv, qkv_before), "the qkv output is read, not written"
    assert_close_per_head(out_q, ref_q.view(tokens, BIG_QO_HEADS, -1), f"q, {tokens} tokens")
    assert_close_per_head(out_k, ref_k.view(tokens, BIG_KV_HEADS, -1), f"k, {tokens} tokens")
    assert torch.equal(out_v, ref_v), "values are copied as they are"


@pytest.mark.gpu
def test_qk_prologue_writes_each_query_to_every_row_the_backend_names(cuda_bf16: None) -> None:
    """A decode batch cut into pieces reads a token's query once per piece. With
    ``query_rows`` the kernel writes each token's query to each of its rows (and nowhere
    else): the same values it writes to row t without them; keys and values are unchanged."""
    rope = get_rope(BIG_HEAD_DIM, BIG_HEAD_DIM, MAX_POSITION, THETA)
    weights = (random_norm(BIG_HEAD_DIM).weight, random_norm(BIG_HEAD_DIM).weight)
    rows_per_token = [1, 3, 2, 4, 1]
    tokens, spare_rows = len(rows_per_token), 2
    qkv = torch.randn(tokens, (BIG_QO_HEADS + 2 * BIG_KV_HEADS) * BIG_HEAD_DIM) * 3
    positions = torch.randint(0, MAX_POSITION, (tokens,))
    loc = torch.randperm(3 * tokens)[:tokens]
    indptr = torch.tensor([0] + rows_per_token, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    num_rows = int(indptr[-1]) + spare_rows
    outputs = []
    for rows in (None, indptr):
        caches = torch.zeros(2, 3 * tokens, BIG_KV_HEADS, BIG_HEAD_DIM).unbind(0)
        destination = fused.KVDestination(*caches, loc, rows, num_rows if rows is not None else 0)
        q, _, _ = fused.qk_prologue(qkv, positions, BIG_QO_HEADS, BIG_KV_HEADS, BIG_HEAD_DIM,
                                    rope.cos_sin_cache, weights, EPS, destination)
        outputs.append((q, caches))
    (q_plain, caches_plain), (q_rows, caches_rows) = outputs
    assert q_plain.shape == (tokens, BIG_QO_HEADS, BIG_HEAD_DIM)
    assert q_rows.shape == (num_rows, BIG_QO_HEADS, BIG_HEAD_DIM)
    owners = torch.repeat_interleave(torch.arange(tokens), torch.tensor(rows_per_token))
    assert torch.equal(q_rows[: num_rows - spare_rows], q_plain[owners])
    assert all(torch.equal(a, b) for a, b in zip(caches_rows, caches_plain))


def assert_close_per_head(ours: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    """bf16 agreement of rotated heads. The norm rounds before the rotation, and a last-bit
    difference in its float32 sum can round one entry the other way: the rotation then moves
    that step of a large entry into a small one. So the bound scales with the head's largest
    entry, not with each entry (a wrong pairing, position or scale is off by far more)."""
    assert ours.shape == ref.shape, f"{what}: shape {tuple(ours.shape)} != {tuple(ref.shape)}"
    diff = (ours.float() - ref.float()).abs()
    scale = ref.float().abs().amax(dim=-1, keepdim=True)
    excess = diff - (1e-2 + 2e-2 * scale)
    assert excess.max().item() <= 0, (f"{what}: max |diff| {diff.max().item():.3e} above "
                                      "1e-2 + 2e-2 |largest entry of the head|")


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", FUSED_TOKENS)
def test_fused_silu_and_mul_equals_the_pytorch_path_on_cuda(cuda_bf16: None, tokens: int) -> None:
    for width in (BIG_INTERMEDIATE, INTERMEDIATE):
        x = torch.randn(tokens, 2 * width) * 3
        x_before = x.clone()
        assert fused.can_silu_and_mul(x), fused.kernel_status()
        out = silu_and_mul(x)
        with fused.use_fused(False):
            ref = silu_and_mul(x)
        assert torch.equal(x, x_before), "silu_and_mul returns a new tensor"
        assert_close_bf16(out, ref, f"silu_and_mul, {tokens} x {2 * width}")


@pytest.mark.gpu
def test_fused_kernels_replay_in_a_cuda_graph(cuda_bf16: None) -> None:
    """A CUDA graph captures the fused kernels and replays them on new inputs, bit for bit."""
    norm, q_norm, k_norm = random_norm(HIDDEN), random_norm(HEAD_DIM), random_norm(HEAD_DIM)
    rope = get_rope(HEAD_DIM, HEAD_DIM, MAX_POSITION, THETA)
    x, residual = torch.zeros(T, HIDDEN), torch.zeros(T, HIDDEN)
    qkv = torch.zeros(T, (NUM_QO_HEADS + 2 * NUM_KV_HEADS) * HEAD_DIM)
    gate_up = torch.zeros(T, 2 * INTERMEDIATE)
    positions = torch.zeros(T, dtype=torch.int64)

    def step() -> list[torch.Tensor]:
        # Clones first: the in-place kernels must not overwrite the graph's input buffers.
        normed, summed = norm(x.clone(), residual.clone())
        q, k = split_qkv(qkv, NUM_QO_HEADS, NUM_KV_HEADS, HEAD_DIM)
        q, k = rope(positions, q_norm(q), k_norm(k))
        return [normed, summed, q, k, silu_and_mul(gate_up)]

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # warm up: the kernels' first trial and any compilation happen here
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        captured = step()
    for seed in (1, 2):
        torch.manual_seed(seed)
        for buffer in (x, residual, qkv, gate_up):
            buffer.copy_(torch.randn(buffer.shape) * 3)
        positions.copy_(torch.randint(0, MAX_POSITION, (T,)))
        graph.replay()
        for replayed, eager in zip(captured, step()):
            assert torch.equal(replayed, eager), "a replay must equal the eager fused kernels"


@pytest.mark.gpu
@pytest.mark.parametrize("out_features, in_features", [
    (4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072),  # Qwen3-0.6B's four projections
    (37, 700), (151_936, 1024),  # ragged edges in both dimensions; an LM head past 2**31 bytes
])
def test_one_row_matmul_kernel_equals_cublas(cuda_bf16: None, out_features: int,
                                             in_features: int) -> None:
    """The batch-1 projection kernel against F.linear, each output within bf16's rounding of
    the same float32 sum; and a layer at batch 1 takes it, with or without bias."""
    x = torch.randn(1, in_features)
    weight = torch.randn(out_features, in_features) / in_features ** 0.5
    assert fused.can_gemv(x, weight), fused.kernel_status()
    assert_close_bf16(fused.gemv(x, weight), F.linear(x, weight), f"{out_features}x{in_features}")
    strided = torch.randn(1, 2 * in_features)[:, ::2]  # one row whose elements are not adjacent
    for refused in (torch.randn(2, in_features), x.float(), strided):
        assert not fused.can_gemv(refused, weight.to(refused.dtype)), tuple(refused.shape)
    layer = ReplicatedLinear(in_features, out_features, bias=True)
    layer.load_weight(weight)
    layer.load_weight(torch.randn(out_features), param_name="bias")
    with fused.use_fused(False):
        expected = layer(x)
    assert_close_bf16(layer(x), expected, "a layer at batch 1")


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 5, 128])
def test_lm_head_writes_float32_logits_without_rounding_them_to_16_bits(
        cuda_bf16: None, rows: int) -> None:
    """The LM head's logits come from the matrix kernel in float32 (the one-row kernel at batch
    1, cuBLAS above): within float32 summation error of the exact product of the bf16
    operands, closer than the bf16-rounded product that F.linear gives."""
    from minisgl.layers.linear import matmul

    vocab, hidden = 4099, 1024
    x = torch.randn(rows, hidden)
    weight = torch.randn(vocab, hidden) / hidden ** 0.5
    exact = x.double() @ weight.double().T
    logits = matmul(x, weight, out_dtype=torch.float32)
    assert logits.dtype == torch.float32 and logits.shape == (rows, vocab)
    error = float((logits.double() - exact).abs().max())
    rounded = float((F.linear(x, weight).double() - exact).abs().max())
    assert error < 1e-4 * float(exact.abs().max()) and error < rounded / 10, (error, rounded)

