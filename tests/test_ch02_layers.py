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
    "yarn-betas": {"rope_type": "yarn", "factor": 8.0, "beta_fast": 16, "beta_slow": 2,
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
    cos, sin = ours.cos_sin_cache[1].chunk(2)
    assert max_err(cos, inv_freq.cos() * attention_factor) <= ATOL
    assert max_err(sin, inv_freq.sin() * attention_factor) <= ATOL


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
    assert "cos_sin_cache" not in rope.state_dict(), "the table is rebuilt, never loaded"
    partial = get_rope(HEAD_DIM, HEAD_DIM // 2, MAX_POSITION, THETA)
    assert partial.cos_sin_cache.shape == (MAX_POSITION, HEAD_DIM // 2)
    sin = partial.cos_sin_cache[3, HEAD_DIM // 4 :]  # the second half of the row
    assert torch.equal(sin, (3 * default_inv_freq(HEAD_DIM // 2, THETA)).sin())


def test_get_rope_rejects_an_unknown_type_naming_the_supported_ones() -> None:
    with pytest.raises(ValueError, match="dynamic.*supported: default, linear, llama3, yarn"):
        get_rope(HEAD_DIM, HEAD_DIM, MAX_POSITION, THETA, {"rope_type": "dynamic", "factor": 2.0})
    with pytest.raises(ValueError, match="low_freq_factor"):
        get_rope(HEAD_DIM, HEAD_DIM, MAX_POSITION, THETA, {"rope_type": "llama3", "factor": 8.0})


def test_get_rope_reads_the_old_type_key_and_ignores_rope_theta() -> None:
    old = get_rope(HEAD_DIM, HEAD_DIM, 64, THETA, {"type": "linear", "factor": 2.0})
    new = get_rope(HEAD_DIM, HEAD_DIM, 64, THETA,
                   {"rope_type": "linear", "factor": 2.0, "rope_theta": THETA})
    assert torch.equal(old.cos_sin_cache, new.cos_sin_cache)


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
    with pytest.raises(ValueError, match=r"shard_id in \('q', 'k', 'v'\), got 'o'"):
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
    assert (layers[1].start, layers[1].end, layers[1].padded_rows) == (501, 1001, 501)
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
        # Clones: a kernel behind minisgl.layers.fast may overwrite the residual form's inputs.
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


