"""Chapter 18: Llama, Qwen2, Qwen3 and Qwen3-MoE on the same engine, each checked.

For every family's tiny checkpoint (built here with tools/make_tiny_model.py if missing): load
it through ``LLM``, decode three prompts greedily and compare the tokens with
``transformers.generate``; then start the server on it and ask the same through the ``openai``
client. Last, the arithmetic of a sparse model: how many bytes one decode step must read for
Qwen3-30B-A3B's shape, worked out from its config.json.

    python examples/ch18_models.py [--device cpu|cuda] [--families llama,qwen2,qwen3,qwen3-moe]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from openai import OpenAI
from transformers import AutoModelForCausalLM, GenerationConfig
from transformers.utils import logging as hf_logging

from minisgl.core import SamplingParams
from minisgl.llm import LLM
from minisgl.models.config import ModelConfig

ROOT = Path(__file__).resolve().parent.parent
# The server harness is a tool of this repository, not part of the engine.
sys.path.insert(0, str(ROOT / "tools"))
from server_process import ServerProcess  # noqa: E402
FAMILIES = ("llama", "qwen2", "qwen3", "qwen3-moe")
PROMPTS = ["The capital of France is", "def fibonacci(n):", "东京是日本的首都"]
NEW_TOKENS = 16
H200_BYTES_PER_S = 4.8e12  # HBM3e bandwidth on the H200's data sheet
PUBLISHED_LAYERS = 48  # Qwen3-30B-A3B; the --like checkpoint keeps 4 of them


def tiny_checkpoint(arch: str) -> Path:
    """models/tiny-<arch>, written by make_tiny_model.py on first use (about a second)."""
    out = ROOT / "models" / f"tiny-{arch}"
    if not (out / "model.safetensors").exists():
        print(f"building {out.relative_to(ROOT)} ...")
        subprocess.run([sys.executable, str(ROOT / "tools" / "make_tiny_model.py"), "--arch",
                        arch, "--out", str(out)], check=True, capture_output=True)
    return out


def transformers_greedy(ckpt: Path, prompts: list[list[int]]) -> list[list[int]]:
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    config = GenerationConfig(max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None,
                              pad_token_id=0)
    with torch.inference_mode():
        return [model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids),
                               dtype=torch.long), generation_config=config)[0, len(ids):].tolist()
                for ids in prompts]


def run_family(arch: str, device: str) -> bool:
    ckpt = tiny_checkpoint(arch)
    server = ServerProcess(ckpt, device=device, args=("--served-model-name", arch))
    server.start()  # it loads in its own processes while LLM loads here
    try:
        llm = LLM(ckpt, device=device)
        model = llm.engine.model
        config = model.config
        num_params = sum(p.numel() for p in model.parameters())  # a tied tensor counts once
        print(f"\n{arch}: {config.architectures[0]} -> {type(model).__name__}, "
              f"{num_params:,} parameters, tied head: {config.tie_word_embeddings}")
        if config.is_moe:
            sparse = [i for i, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "experts")]
            print(f"  {config.num_experts} experts, {config.num_experts_per_tok} per token; "
                  f"sparse layers {sparse}, dense layers "
                  f"{[i for i in range(config.num_layers) if i not in sparse]}")
        prompts = [llm.tokenizer.encode(p) for p in PROMPTS]
        params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
        ours = llm.generate(prompts, params)
        reference = transformers_greedy(ckpt, prompts) if device == "cpu" else None
        server.wait_ready()
        client = OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
        same = True
        for text, ids, result, ref in zip(PROMPTS, prompts, ours, reference or [None] * 3):
            reply = client.completions.create(model=arch, prompt=ids, max_tokens=NEW_TOKENS,
                                              temperature=0, extra_body={"ignore_eos": True})
            agrees = reply.choices[0].text == result["text"]
            hf_agrees = ref is None or ref == result["token_ids"]
            same = same and agrees and hf_agrees
            print(f"  {text!r:30} -> {result['text'][:32]!r:36} transformers "
                  f"{'same' if hf_agrees else 'DIFFERENT'}, server "
                  f"{'same' if agrees else 'DIFFERENT'}")
        return same
    finally:
        server.stop()


def weight_bytes_per_token(config: ModelConfig, layers: int, bytes_per_param: int = 2
                           ) -> tuple[int, int]:
    """(bytes of every weight, bytes one decode token must read) for ``layers`` MoE layers.

    A decode step at batch 1 reads each weight it uses once: attention, the router, the
    ``top_k`` chosen experts of every layer, the LM head. The embedding is a table lookup (one
    row), and the experts nobody chose are not read at all.
    """
    h, e, k = config.hidden_size, config.num_experts, config.num_experts_per_tok
    attention = h * (config.q_size + 2 * config.kv_size) + config.q_size * h
    expert = 3 * h * config.moe_intermediate_size  # gate, up and down
    router = e * h
    head = config.vocab_size * h
    total = layers * (attention + router + e * expert) + 2 * head  # untied: embedding + head
    active = layers * (attention + router + k * expert) + head
    return total * bytes_per_param, active * bytes_per_param


def print_hbm_floor() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, str(ROOT / "tools" / "make_tiny_model.py"), "--like",
                        "qwen3-moe", "--no-weights", "--out", tmp], check=True, capture_output=True)
        config = ModelConfig.from_pretrained(tmp)
    total, active = weight_bytes_per_token(config, PUBLISHED_LAYERS)
    print(f"\nQwen3-30B-A3B's shape ({PUBLISHED_LAYERS} layers, {config.num_experts} experts, "
          f"{config.num_experts_per_tok} per token, moe_intermediate "
          f"{config.moe_intermediate_size}), bfloat16:")
    print(f"  all weights:            {total / 1e9:6.1f} GB")
    print(f"  read per decode token:  {active / 1e9:6.2f} GB ({active / total:.1%} of them)")
    dense = total - 2 * config.vocab_size * config.hidden_size  # all but the embedding table
    for name, size in (("sparse", active), ("dense, every expert read", dense)):
        floor_ms = size / H200_BYTES_PER_S * 1e3
        print(f"  HBM floor at 4.8 TB/s, batch 1, {name}: {floor_ms:.2f} ms per step, "
              f"at most {1e3 / floor_ms:,.0f} tokens/s")
    e, k = config.num_experts, config.num_experts_per_tok
    for batch in (1, 4, 16, 64):
        touched = e * (1 - (1 - k / e) ** batch)  # expected experts chosen by at least one token
        print(f"  batch {batch:3d}: about {touched:5.1f} of {e} experts read per layer")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--families", default=",".join(FAMILIES))
    args = parser.parse_args()
    families = args.families.split(",")
    unknown = [f for f in families if f not in FAMILIES]
    if unknown:
        parser.error(f"unknown families {unknown}; choose from {', '.join(FAMILIES)}")
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    print("Chapter 18: more models on the same engine")
    start = time.perf_counter()
    results = {arch: run_family(arch, args.device) for arch in families}
    print(f"\nevery family the same as transformers and through the server: "
          f"{all(results.values())} ({time.perf_counter() - start:.0f} s)")
    print_hbm_floor()
    if not all(results.values()):
        sys.exit(1)


if __name__ == "__main__":
    main()
