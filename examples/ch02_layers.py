"""Chapter 2: every layer of minisgl.layers next to its Hugging Face transformers twin.

Each row feeds the same random input (and the same weights, copied in through our layers'
``load_weight``) to our layer and to the reference, and prints the largest absolute difference.

    python examples/ch02_layers.py [--device cpu|cuda|auto] [--dtype float32|bfloat16]
"""

from __future__ import annotations

import argparse
import math

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

from minisgl.distributed import set_all_reduce, set_tp_info
from minisgl.layers import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RMSNorm,
    RowParallelLinear,
    VocabParallelEmbedding,
    get_rope,
    silu_and_mul,
)
from minisgl.utils.torch_utils import (
    configure_cpu_threads, default_dtype, resolve_device, resolve_dtype,
)

# tiny-qwen3's shape: every layer below is one of the model's, at its real size.
HIDDEN, INTERMEDIATE, VOCAB = 256, 512, 2048
NUM_QO_HEADS, NUM_KV_HEADS, HEAD_DIM = 4, 2, 64
MAX_POSITION, ROPE_THETA, EPS = 4096, 1e6, 1e-6
TOKENS = 16
ROPE_SCALINGS = {
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 1024},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024},
}


def hf_config(rope_scaling: dict | None = None) -> Qwen3Config:
    rope = {"rope_type": "default", **(rope_scaling or {}), "rope_theta": ROPE_THETA}
    return Qwen3Config(hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, vocab_size=VOCAB,
                       num_attention_heads=NUM_QO_HEADS, num_key_value_heads=NUM_KV_HEADS,
                       head_dim=HEAD_DIM, max_position_embeddings=MAX_POSITION,
                       rms_norm_eps=EPS, rope_parameters=rope)


def max_diff(ours: torch.Tensor, ref: torch.Tensor) -> float:
    assert ours.shape == ref.shape, (ours.shape, ref.shape)
    return (ours.float() - ref.float()).abs().max().item()


def randomize(module: nn.Module) -> nn.Module:
    """Fill a reference module's parameters with random values (their init is too regular)."""
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0, 1 / math.sqrt(p.shape[-1]))
    return module


def compare_norms(x: torch.Tensor) -> list[tuple[str, str, float]]:
    ref = randomize(Qwen3RMSNorm(HIDDEN, eps=EPS))
    ours = RMSNorm(HIDDEN, eps=EPS)
    ours.load_weight(ref.weight)
    residual = torch.randn_like(x)
    # Clones: on CUDA in bf16/fp16 the residual form overwrites its inputs (one fused kernel).
    normed, summed = ours(x.clone(), residual.clone())
    return [
        ("RMSNorm", "Qwen3RMSNorm", max_diff(ours(x), ref(x))),
        ("RMSNorm(x, residual)", "Qwen3RMSNorm(x + residual)",
         max(max_diff(normed, ref(x + residual)), max_diff(summed, x + residual))),
    ]


def compare_rope(device: torch.device, dtype: torch.dtype) -> list[tuple[str, str, float]]:
    positions = torch.randint(0, MAX_POSITION, (TOKENS,), device=device)
    q = torch.randn(TOKENS, NUM_QO_HEADS, HEAD_DIM, device=device, dtype=dtype)
    k = torch.randn(TOKENS, NUM_KV_HEADS, HEAD_DIM, device=device, dtype=dtype)
    rows = []
    for name, scaling in (("default", None), *ROPE_SCALINGS.items()):
        ours = get_rope(HEAD_DIM, HEAD_DIM, MAX_POSITION, ROPE_THETA, scaling)
        # transformers keeps its tensors as [batch, heads, tokens, head_dim].
        ref_rope = Qwen3RotaryEmbedding(hf_config(scaling))
        cos, sin = ref_rope(q, positions[None])
        q_ref, k_ref = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                            cos, sin)
        q_ours, k_ours = ours(positions, q.clone(), k.clone())  # rotated in place on CUDA
        rows.append((f"RotaryEmbedding ({name})", f"apply_rotary_pos_emb, {name} init",
                     max(max_diff(q_ours, q_ref[0].transpose(0, 1)),
                         max_diff(k_ours, k_ref[0].transpose(0, 1)))))
    assert set(ROPE_SCALINGS) <= set(ROPE_INIT_FUNCTIONS)
    return rows


def compare_mlp(x: torch.Tensor) -> list[tuple[str, str, float]]:
    ref = randomize(Qwen3MLP(hf_config()))
    gate_up = MergedColumnParallelLinear(HIDDEN, [INTERMEDIATE, INTERMEDIATE])
    gate_up.load_weight(ref.gate_proj.weight, 0)
    gate_up.load_weight(ref.up_proj.weight, 1)
    down = RowParallelLinear(INTERMEDIATE, HIDDEN)
    down.load_weight(ref.down_proj.weight)
    gu = gate_up(x)
    act_ref = ACT2FN["silu"](ref.gate_proj(x)) * ref.up_proj(x)
    return [
        ("MergedColumnParallelLinear", "cat(gate_proj(x), up_proj(x))",
         max_diff(gu, torch.cat([ref.gate_proj(x), ref.up_proj(x)], dim=-1))),
        ("silu_and_mul", "ACT2FN['silu'](gate) * up", max_diff(silu_and_mul(gu), act_ref)),
        ("MLP: merged, silu, row", "Qwen3MLP", max_diff(down(silu_and_mul(gu)), ref(x))),
    ]


def compare_linear_and_embedding(x: torch.Tensor) -> list[tuple[str, str, float]]:
    q_ref, k_ref, v_ref = (randomize(nn.Linear(HIDDEN, heads * HEAD_DIM, bias=False))
                           for heads in (NUM_QO_HEADS, NUM_KV_HEADS, NUM_KV_HEADS))
    qkv = QKVParallelLinear(HIDDEN, HEAD_DIM, NUM_QO_HEADS, NUM_KV_HEADS)
    for shard_id, ref in zip("qkv", (q_ref, k_ref, v_ref)):
        qkv.load_weight(ref.weight, shard_id)
    linear_ref = randomize(nn.Linear(HIDDEN, INTERMEDIATE, bias=True))
    column = ColumnParallelLinear(HIDDEN, INTERMEDIATE, bias=True)
    column.load_weight(linear_ref.weight)
    column.load_weight(linear_ref.bias, param_name="bias")

    embedding_ref = randomize(nn.Embedding(VOCAB, HIDDEN))
    embedding = VocabParallelEmbedding(VOCAB, HIDDEN)
    embedding.load_weight(embedding_ref.weight)
    head = ParallelLMHead(VOCAB, HIDDEN, tie_to=embedding)
    ids = torch.randint(0, VOCAB, (TOKENS,), device=x.device)
    return [
        ("ColumnParallelLinear", "nn.Linear", max_diff(column(x), linear_ref(x))),
        ("QKVParallelLinear", "cat(q_proj, k_proj, v_proj)",
         max_diff(qkv(x), torch.cat([q_ref(x), k_ref(x), v_ref(x)], dim=-1))),
        ("VocabParallelEmbedding", "nn.Embedding", max_diff(embedding(ids), embedding_ref(ids))),
        ("ParallelLMHead (tied)", "x @ nn.Embedding.weight.T",
         max_diff(head(x), x @ embedding_ref.weight.T)),
    ]


def compare_two_ranks(x: torch.Tensor) -> list[tuple[str, str, float]]:
    """Pretend to be rank 0 and rank 1 of two, and check the shards add up to the whole."""
    full = RowParallelLinear(INTERMEDIATE, HIDDEN)
    full_weight = torch.randn(HIDDEN, INTERMEDIATE) / math.sqrt(INTERMEDIATE)
    full.load_weight(full_weight)
    h = torch.randn(TOKENS, INTERMEDIATE, device=x.device, dtype=x.dtype)
    partials = []
    try:
        set_all_reduce(lambda t: t)  # keep each rank's partial sum; we add them up below
        for rank in (0, 1):
            set_tp_info(rank, 2)
            shard = RowParallelLinear(INTERMEDIATE, HIDDEN)
            shard.load_weight(full_weight)
            partials.append(shard(h[:, rank * INTERMEDIATE // 2:(rank + 1) * INTERMEDIATE // 2]))
    finally:
        set_tp_info(0, 1)
        set_all_reduce(None)
    return [("RowParallelLinear, 2 ranks", "sum of the shards' outputs",
             max_diff(partials[0] + partials[1], full(h)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", help="cpu, cuda or auto (default: cpu)")
    parser.add_argument("--dtype", default="float32", help="float32 (default), bfloat16, float16")
    args = parser.parse_args()
    configure_cpu_threads()  # share the cores with the rest of the machine
    try:
        device = resolve_device(args.device)
        dtype = resolve_dtype(args.dtype, device)
    except ValueError as exc:  # a bad --device/--dtype, or CUDA asked for and absent
        parser.error(str(exc))
    torch.manual_seed(0)

    print(f"device: {device}, dtype: {str(dtype).removeprefix('torch.')}, "
          f"shapes of tiny-qwen3 (hidden {HIDDEN}, {NUM_QO_HEADS}/{NUM_KV_HEADS} heads of "
          f"{HEAD_DIM}), {TOKENS} random tokens")
    with torch.device(device), default_dtype(dtype), torch.inference_mode():
        x = torch.randn(TOKENS, HIDDEN)
        rows = [*compare_norms(x), *compare_rope(device, dtype), *compare_mlp(x),
                *compare_linear_and_embedding(x), *compare_two_ranks(x)]
    print()
    print(f"{'minisgl layer':<28}{'transformers reference':<36}{'max abs diff':>12}")
    print("-" * 76)
    for ours, ref, diff in rows:
        print(f"{ours:<28}{ref:<36}{diff:>12.2e}")
    print()
    print(f"largest difference: {max(d for _, _, d in rows):.2e}")


if __name__ == "__main__":
    main()
