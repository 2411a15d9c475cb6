"""Chapter 1: read a checkpoint's config.json and work out what its KV cache costs.

Compares the tiny model this repository builds with Qwen3-0.6B, whose published config.json is
written out below, so the example runs offline and loads no weights.

    python examples/ch01_config.py [--model models/tiny-qwen3]
"""

from __future__ import annotations

import argparse

from minisgl.env import ENV_VARS, read_env
from minisgl.models.config import ModelConfig
from minisgl.utils.hf import example_checkpoint

# Qwen3-0.6B's config.json as published with the model (huggingface.co/Qwen/Qwen3-0.6B,
# file config.json). Copied here, key for key, so that nothing is downloaded.
QWEN3_0_6B_CONFIG = {
    "architectures": ["Qwen3ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 1024,
    "initializer_range": 0.02,
    "intermediate_size": 3072,
    "max_position_embeddings": 40960,
    "max_window_layers": 28,
    "model_type": "qwen3",
    "num_attention_heads": 16,
    "num_hidden_layers": 28,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000,
    "sliding_window": None,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.51.0",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}
CONTEXT = 4096  # tokens: one long conversation


def mib(n_bytes: int) -> str:
    return f"{n_bytes / 2**20:,.1f} MiB"


def row(label: str, *values: object) -> None:
    print(f"{label:<30}" + "".join(f"{v!s:<20}" for v in values).rstrip())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="models/tiny-qwen3", help="a checkpoint directory")
    args = parser.parse_args()
    model_dir = example_checkpoint(args.model)

    env = read_env()  # a bad MINISGL_* value stops the program here, with the variable named
    tiny = ModelConfig.from_pretrained(model_dir)
    qwen = ModelConfig.from_dict(QWEN3_0_6B_CONFIG, source="Qwen3-0.6B config.json")
    configs = (tiny, qwen)

    print(f"model: {args.model} (config.json only; no weights are loaded, no device is used)")
    for var in ENV_VARS:
        print(f"  {var.name} = {getattr(env, var.field)!r}")
    print()
    row("", model_dir.name, "Qwen3-0.6B")
    row("architecture", *(c.architectures[0] for c in configs))
    row("layers", *(c.num_layers for c in configs))
    row("hidden size", *(c.hidden_size for c in configs))
    row("query heads / KV heads", *(f"{c.num_qo_heads} / {c.num_kv_heads}" for c in configs))
    row("queries per KV head (GQA)", *(c.group_size for c in configs))
    row("head_dim (config.json)", *(c.head_dim for c in configs))
    row("hidden size / query heads", *(c.hidden_size // c.num_qo_heads for c in configs))
    row("vocabulary", *(f"{c.vocab_size:,}" for c in configs))
    row("max positions", *(f"{c.max_position_embeddings:,}" for c in configs))
    row("rope theta", *(f"{c.rope_theta:,.0f}" for c in configs))
    row("tied embeddings", *(c.tie_word_embeddings for c in configs))
    print()
    for dtype, short in (("float32", "fp32"), ("bfloat16", "bf16")):
        row(f"KV bytes per token, {short}", *(f"{c.kv_bytes_per_token(dtype):,}" for c in configs))
    for dtype, short in (("float32", "fp32"), ("bfloat16", "bf16")):
        row(f"{CONTEXT}-token context, {short}",
            *(mib(CONTEXT * c.kv_bytes_per_token(dtype)) for c in configs))
    # The same models with one KV head per query head (no GQA), to see what grouping saves.
    row("  without GQA, bf16", *(mib(CONTEXT * c.group_size * c.kv_bytes_per_token("bfloat16"))
                                  for c in configs))
    print()
    budget = env.cpu_kv_memory
    tokens = budget // tiny.kv_bytes_per_token("float32")
    print(f"MINISGL_CPU_KV_MEMORY ({mib(budget)}) holds {tokens:,} tokens of "
          f"{model_dir.name} in fp32")


if __name__ == "__main__":
    main()
