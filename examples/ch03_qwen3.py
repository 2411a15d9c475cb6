"""Chapter 3: load tiny-qwen3 from its safetensors into our Qwen3 and check its logits.

Loads the checkpoint twice, with minisgl and with transformers, runs the same prompt through
both, and compares the logits and the five most likely next tokens.

    python examples/ch03_qwen3.py [--model models/tiny-qwen3] [--device auto|cpu|cuda]
                                  [--dtype auto|float32|bfloat16|float16] [--prompt TEXT]
"""

from __future__ import annotations

import argparse
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.utils import logging as hf_logging

from minisgl.models import load_model
from minisgl.utils.hf import example_checkpoint
from minisgl.utils.torch_utils import configure_cpu_threads, resolve_device, resolve_dtype


def top5(logits: torch.Tensor, tokenizer) -> list[str]:
    probs = logits.float().softmax(dim=-1)
    values, ids = probs.topk(5)
    return [f"{i:>4} {tokenizer.decode([i])!r:<10} {p:.5f}"
            for i, p in zip(ids.tolist(), values.tolist())]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="models/tiny-qwen3", help="a checkpoint directory")
    parser.add_argument("--device", default="cpu", help="auto, cpu (default) or cuda")
    parser.add_argument("--dtype", default="auto", help="auto (float32 on CPU, bfloat16 on CUDA), "
                        "float32, bfloat16 or float16")
    parser.add_argument("--prompt", default="The capital of France is")
    args = parser.parse_args()
    configure_cpu_threads()  # share the cores with the rest of the machine
    example_checkpoint(args.model)
    try:
        device = resolve_device(args.device)
        dtype = resolve_dtype(args.dtype, device)
    except ValueError as exc:  # a bad --device/--dtype, or CUDA asked for and absent
        parser.error(str(exc))
    print(f"model: {args.model}, device: {device}, dtype: {str(dtype).removeprefix('torch.')}")

    start = time.perf_counter()
    model = load_model(args.model, device=device, dtype=dtype)
    load_seconds = time.perf_counter() - start
    num_params = sum(p.numel() for p in model.parameters())  # a tied tensor counts once
    print(f"minisgl {type(model).__name__}: {num_params:,} parameters, "
          f"loaded in {load_seconds:.2f} s")
    print(f"  qkv_proj of layer 0: {tuple(model.model.layers[0].self_attn.qkv_proj.weight.shape)}"
          f"  (q, k, v of the checkpoint stacked)")
    print(f"  lm_head tied to embed_tokens: "
          f"{model.lm_head.weight is model.model.embed_tokens.weight}")

    hf_logging.disable_progress_bar()  # keep the output to what we print
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    reference = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype).to(device).eval()
    ids = torch.tensor(tokenizer.encode(args.prompt), device=device)
    print(f"\nprompt: {args.prompt!r} -> {len(ids)} tokens {ids.tolist()}")

    with torch.inference_mode():
        ours = model(ids, torch.arange(len(ids), device=device))
        ref = reference(ids[None]).logits[0].float()
        last_only = model(ids, torch.arange(len(ids), device=device),
                          logits_indices=torch.tensor([len(ids) - 1], device=device))
    diff = (ours - ref).abs().max().item()
    print(f"logits {tuple(ours.shape)}: max abs diff {diff:.2e}, "
          f"relative {diff / ref.abs().max().item():.2e}")
    print(f"logits_indices=[{len(ids) - 1}] gives {tuple(last_only.shape)}, "
          f"equal to the last row: {torch.allclose(last_only[0], ours[-1], atol=1e-5)}")
    print("\nnext token, top 5 (id, text, probability; the weights are random, so the text means nothing):")
    print(f"  {'minisgl':<26}transformers")
    for mine, theirs in zip(top5(ours[-1], tokenizer), top5(ref[-1], tokenizer)):
        print(f"  {mine:<26}{theirs}")
    same = torch.equal(ours[-1].topk(5).indices, ref[-1].topk(5).indices)
    print(f"same top 5: {same}")


if __name__ == "__main__":
    main()
