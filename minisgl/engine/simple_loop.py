"""The simplest complete generation loop: one sequence, one token per step.

:class:`ContiguousKVCache` keeps each layer's past keys and values for a single sequence in one
``[max_len, num_kv_heads, head_dim]`` buffer and plugs into the model through the
attention-backend seam of ``minisgl.layers.attention``; :func:`generate` runs the loop with it
(prefill once, then one new token per step) or without it (every step re-runs every token), so
the example can measure the difference. Chapter 4 tells the story; the engine (chapter 7)
replaces the one-sequence buffer by a paged pool shared by many requests.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass

import torch

from minisgl.core import FinishReason, SamplingParams
from minisgl.engine.sample import make_generator, sample_batch
from minisgl.layers.attention import AttentionBackend, causal_attention, use_attention_backend
from minisgl.models.base import BaseLLMModel


class ContiguousKVCache(AttentionBackend):
    """An attention backend that keeps one sequence's keys and values between steps.

    Buffers ``k_cache`` and ``v_cache`` are ``[num_layers, max_len, num_kv_heads, head_dim]``.
    During one forward pass of the model, every layer calls :meth:`forward` with the K/V of
    the step's new tokens; they are written at positions ``length .. length + T - 1`` and the
    queries attend to everything stored up to there. After the pass the caller moves
    ``length`` forward with :meth:`advance`, which makes the new tokens part of the past.
    """

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, max_len: int,
                 dtype: torch.dtype, device: torch.device | str) -> None:
        shape = (num_layers, max_len, num_kv_heads, head_dim)
        # Allocated once, up front, at the longest length this sequence may reach: no
        # reallocation or copying while generating, at the price of memory reserved unused.
        self.k_cache = torch.zeros(shape, dtype=dtype, device=device)
        self.v_cache = torch.zeros(shape, dtype=dtype, device=device)
        self.max_len = max_len
        self.length = 0  # tokens whose K/V are stored in every layer

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                layer_id: int) -> torch.Tensor:
        """Store this step's ``k``/``v`` for ``layer_id`` and attend over the whole prefix.

        Args:
            q: ``[T, num_qo_heads, head_dim]`` queries of the step's new tokens.
            k: ``[T, num_kv_heads, head_dim]`` their keys (rotary already applied).
            v: ``[T, num_kv_heads, head_dim]`` their values.
            layer_id: which layer is calling.

        Returns:
            ``[T, num_qo_heads, head_dim]`` attention output.
        """
        start, end = self.length, self.length + q.shape[0]
        if end > self.max_len:
            raise ValueError(f"the KV cache holds {self.max_len} tokens; "
                             f"this step would need {end}")
        self.k_cache[layer_id, start:end] = k
        self.v_cache[layer_id, start:end] = v
        return causal_attention(q, self.k_cache[layer_id, :end], self.v_cache[layer_id, :end],
                                num_cached=start)

    def advance(self, num_tokens: int) -> None:
        """Commit the last step's ``num_tokens`` tokens, after every layer has stored them."""
        assert self.length + num_tokens <= self.max_len, "advanced past the cache's end"
        self.length += num_tokens


@dataclass
class GenerationResult:
    """What :func:`generate` returns for one prompt."""

    token_ids: list[int]  # the generated tokens (not the prompt), the stopping token included
    finish_reason: FinishReason  # "stop": EOS or a stop token; "length": max_tokens reached


def finish_reason(token_id: int, num_generated: int, params: SamplingParams,
                  eos_token_ids: Sequence[int]) -> FinishReason | None:
    """Why generation ends after ``token_id`` was appended, or None to keep going."""
    if token_id in params.stop_token_ids or (not params.ignore_eos and token_id in eos_token_ids):
        return "stop"
    return "length" if num_generated >= params.max_tokens else None


@torch.inference_mode()
def generate(model: BaseLLMModel, prompt_ids: Sequence[int] | torch.Tensor,
             params: SamplingParams, *, use_cache: bool = True,
             eos_token_ids: Sequence[int] | None = None) -> GenerationResult:
    """Generate a continuation of one prompt.

    Args:
        model: a loaded model (its device and dtype are used).
        prompt_ids: the prompt's token ids, at least one.
        params: temperature, filters, stop conditions and seed.
        use_cache: prefill once and then decode one token per step with a
            :class:`ContiguousKVCache` (True), or re-run the whole sequence at every step
            (False: slower, kept to measure what the cache saves).
        eos_token_ids: ids that end generation unless ``params.ignore_eos``; by default the
            ``eos_token_id`` of the model's ``config.json``.

    Returns:
        The generated token ids and why generation stopped.
    """
    prompt = [int(t) for t in prompt_ids]  # a tensor's too
    config = model.config
    if not prompt:
        raise ValueError("prompt_ids is empty; generation needs at least one token")
    longest = len(prompt) + params.max_tokens
    if longest > config.max_position_embeddings:
        raise ValueError(f"a {len(prompt)}-token prompt plus max_tokens={params.max_tokens} "
                         f"needs {longest} positions; the model has "
                         f"{config.max_position_embeddings}")
    if eos_token_ids is None:
        eos_token_ids = config.eos_token_ids
    weight = next(model.parameters())  # the model's device and dtype
    device = weight.device
    # One generator per request, created once and advanced step after step, so a seeded
    # request walks through its own random stream (None: the global generator).
    generator = None if params.seed is None else make_generator(params.seed, device)
    # The last generated token is never fed back, so the cache never holds more than this.
    # Without it the default dense backend sees the whole sequence each step, remembers nothing.
    cache = (ContiguousKVCache(config.num_layers, config.num_kv_heads, config.head_dim,
                               len(prompt) + params.max_tokens - 1, weight.dtype, device)
             if use_cache else None)
    tokens = prompt  # grows by one token per step
    output: list[int] = []
    with nullcontext() if cache is None else use_attention_backend(cache):
        while True:
            # What runs: the tokens past the cache (the prompt, then one token per step).
            start = 0 if cache is None else cache.length
            input_ids = torch.tensor(tokens[start:], device=device)
            positions = torch.arange(start, len(tokens), device=device)
            # Only the last position predicts the next token: the LM head runs on one row.
            last_row = torch.tensor([len(tokens) - start - 1], device=device)
            logits = model(input_ids, positions, logits_indices=last_row)
            if cache is not None:
                cache.advance(len(tokens) - start)

            token = int(sample_batch(logits, [params], [generator])[0])
            output.append(token)
            tokens.append(token)
            reason = finish_reason(token, len(output), params, eos_token_ids)
            if reason is not None:
                return GenerationResult(output, reason)
