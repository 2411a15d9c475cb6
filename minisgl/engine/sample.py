"""From logits to tokens: batched sampling with per-row parameters.

Each row of logits carries its own :class:`~minisgl.core.SamplingParams`. Greedy rows take the
argmax and stop there; the others go through temperature and softmax, top-k, top-p and min-p as
masks from per-row thresholds, and an *exponential race*, each seeded row drawing from its own
``torch.Generator`` so its tokens never depend on the rest of the batch. The only Python loop is
over the seeded rows. Chapter 4 tells the story.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from minisgl.core import SamplingParams
from minisgl.utils.torch_utils import host_to_device


@dataclass
class SamplingTensors:
    """The sampling parameters of a batch's rows, one tensor per parameter.

    Every filter below is then one masked tensor operation, not a loop over rows. Which
    filters any row uses is decided on the host, from the parameters: asking the tensors would
    make the host wait for the device.
    """

    temperatures: torch.Tensor  # [B, 1] float32 (a column, to broadcast over the vocabulary)
    top_k: torch.Tensor  # [B] int64; "off" is stored as the vocabulary size
    top_p: torch.Tensor  # [B] float32; "off" is 1.0
    min_p: torch.Tensor  # [B] float32; "off" is 0.0
    needs_sort: bool = True  # some row asks for top-k or top-p
    needs_min_p: bool = True  # some row asks for min-p

    @classmethod
    def from_params(cls, params: Sequence[SamplingParams], vocab_size: int,
                    device: torch.device) -> SamplingTensors:
        """Gather the per-row parameters into tensors on ``device``."""
        top_k = [vocab_size if p.top_k == -1 else min(p.top_k, vocab_size) for p in params]
        # One host tensor per dtype, each crossing to the device in one copy that the host
        # does not wait for.
        floats = host_to_device(torch.tensor(
            [[p.temperature for p in params], [p.top_p for p in params], [p.min_p for p in params]],
            dtype=torch.float32), device)
        return cls(
            temperatures=floats[0].unsqueeze(1),
            top_k=host_to_device(torch.tensor(top_k, dtype=torch.int64), device),
            top_p=floats[1],
            min_p=floats[2],
            needs_sort=any(k < vocab_size for k in top_k) or any(p.top_p < 1.0 for p in params),
            needs_min_p=any(p.min_p > 0.0 for p in params),
        )


def temperature_softmax(logits: torch.Tensor, temperatures: torch.Tensor) -> torch.Tensor:
    """Softmax of ``logits / temperature`` row by row, in float32.

    Args:
        logits: ``[B, V]`` logits of rows that are *not* greedy (every temperature > 0).
        temperatures: ``[B, 1]`` temperatures.

    Returns:
        ``[B, V]`` float32 probabilities, each row summing to 1.
    """
    # float32 whatever the model's dtype: in bf16 the small probabilities that top-p adds up
    # would be rounded away, and exp() of a large scaled logit would overflow in fp16.
    return torch.softmax(logits.float() / temperatures, dim=-1)


def top_k_mask(sorted_probs: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """Which entries of each sorted row fall among that row's ``k`` largest.

    Args:
        sorted_probs: ``[B, V]`` probabilities, each row sorted in descending order.
        top_k: ``[B]`` the ``k`` of each row (the vocabulary size when the filter is off).

    Returns:
        ``[B, V]`` bool mask in sorted order: True for ranks ``0 .. k-1``.
    """
    # Once a row is sorted, "the k best" is "rank < k", whatever k each row asked for.
    ranks = torch.arange(sorted_probs.shape[-1], device=sorted_probs.device)
    return ranks[None, :] < top_k[:, None]


def top_p_mask(sorted_probs: torch.Tensor, keep: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """The nucleus of each sorted row, computed over the entries ``keep`` still allows.

    The nucleus is the smallest prefix of the sorted row whose mass reaches ``top_p``: token
    ``i`` belongs to it exactly when the mass ranked before it is still below ``top_p``, so the
    top token is always kept.

    Args:
        sorted_probs: ``[B, V]`` probabilities, each row sorted in descending order.
        keep: ``[B, V]`` bool mask (sorted order) of what earlier filters kept.
        top_p: ``[B]`` nucleus mass of each row (1.0 when the filter is off).

    Returns:
        ``[B, V]`` bool mask in sorted order: ``keep`` narrowed to the nucleus.
    """
    kept = sorted_probs.masked_fill(~keep, 0.0)
    cumulative = kept.cumsum(dim=-1)
    # Renormalise by what the earlier filters left, so that top_p=0.9 after top_k=50 means
    # 90% of the top-50 mass (the order transformers and FlashInfer use too).
    mass_before = (cumulative - kept) / cumulative[:, -1:]
    in_nucleus = mass_before < top_p[:, None]
    # top_p == 1 must keep everything: without this a tail token whose probability is lost
    # in float32 rounding would see mass_before == 1.0 and be dropped.
    in_nucleus |= (top_p >= 1.0)[:, None]
    return keep & in_nucleus


def min_p_mask(probs: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Keep the tokens at least ``min_p`` times as likely as the row's most likely token.

    Args:
        probs: ``[B, V]`` probabilities (any order; no sort needed).
        min_p: ``[B]`` relative threshold of each row (0.0 keeps everything).

    Returns:
        ``[B, V]`` bool mask in the same order as ``probs``.
    """
    # The most likely token always passes because min_p <= 1.
    threshold = min_p[:, None] * probs.amax(dim=-1, keepdim=True)
    return probs >= threshold


def filter_probs(probs: torch.Tensor, args: SamplingTensors) -> torch.Tensor:
    """Apply top-k, then top-p, then min-p to a batch of rows and renormalise.

    Args:
        probs: ``[B, V]`` float32 probabilities after temperature.
        args: the rows' parameters.

    Returns:
        ``[B, V]`` float32 probabilities with filtered tokens at exactly 0, rows summing to 1.
    """
    keep = torch.ones_like(probs, dtype=torch.bool)
    # Sorting a row of a 150k vocabulary is the expensive part: skip it when no row asks
    # for top-k or top-p.
    if args.needs_sort:
        # stable=True: among equal probabilities the lower token id ranks first, the same
        # tie-break as argmax, so top_k=1 picks exactly the greedy token.
        sorted_probs, order = probs.sort(dim=-1, descending=True, stable=True)
        keep_sorted = top_k_mask(sorted_probs, args.top_k)
        keep_sorted = top_p_mask(sorted_probs, keep_sorted, args.top_p)
        keep = torch.empty_like(keep_sorted).scatter_(-1, order, keep_sorted)
    if args.needs_min_p:
        keep &= min_p_mask(probs, args.min_p)
    filtered = probs.masked_fill(~keep, 0.0)
    return filtered / filtered.sum(dim=-1, keepdim=True)


def compute_probs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """The distribution each row's next token is drawn from.

    Greedy rows get a one-hot row at their argmax. For inspecting and testing the filters;
    :func:`sample_batch` never builds the one-hots.

    Args:
        logits: ``[B, V]`` logits, one row per sequence.
        params: one :class:`SamplingParams` per row.

    Returns:
        ``[B, V]`` float32 probabilities, each row summing to 1.
    """
    _check_batch(logits, params)
    probs = torch.nn.functional.one_hot(logits.argmax(dim=-1), logits.shape[-1]).float()
    sampled = [i for i, p in enumerate(params) if not p.is_greedy]
    if sampled:  # the greedy rows keep their one-hot
        rows = torch.tensor(sampled, device=logits.device)
        probs[rows] = _sampled_rows_probs(logits[rows], [params[i] for i in sampled])
    return probs


def _sampled_rows_probs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    args = SamplingTensors.from_params(params, logits.shape[-1], logits.device)
    return filter_probs(temperature_softmax(logits, args.temperatures), args)


def make_generator(seed: int, device: torch.device | str) -> torch.Generator:
    """A random generator on ``device`` seeded with ``seed``, owned by one request.

    A generation loop keeps one per seeded request across steps (re-seeding every step would
    replay the same noise). The same seed reproduces the same tokens on the same device type;
    CPU and CUDA generators produce different streams.
    """
    return torch.Generator(device=device).manual_seed(seed)


def sample_from_probs(probs: torch.Tensor,
                      generators: Sequence[torch.Generator | None]) -> torch.Tensor:
    """Draw one token per row with an exponential race.

    Give every token an independent ``E ~ Exponential(1)`` and pick ``argmax(p / E)``: ``E / p``
    is exponential with rate ``p``, and the smallest of independent exponentials is token ``i``
    with probability ``p_i / sum(p)``, so this samples exactly from ``probs``. Unlike
    ``torch.multinomial`` it is one noise tensor and one argmax for the batch, and each row's
    noise can come from its own generator.

    Args:
        probs: ``[B, V]`` non-negative weights (need not sum to 1).
        generators: one entry per row: that row's generator, or None for the global one.

    Returns:
        ``[B]`` int64 token ids.
    """
    noise = torch.empty_like(probs)
    noise.exponential_()  # rows without a generator share the global random stream
    for row, generator in enumerate(generators):
        if generator is not None:
            if generator.device.type != probs.device.type:
                raise ValueError(f"generator for row {row} is on {generator.device}, "
                                 f"but the logits are on {probs.device}")
            # The row's noise depends only on its own generator and the vocabulary size:
            # the same seed draws the same tokens whoever else is in the batch.
            noise[row].exponential_(generator=generator)
    # An exponential draw can be exactly 0; dividing by it would give inf (or 0/0 = NaN for a
    # filtered token). Clamping keeps every filtered token at exactly 0.
    noise.clamp_(min=torch.finfo(noise.dtype).tiny)
    return (probs / noise).argmax(dim=-1)


def sample_batch(logits: torch.Tensor, params: Sequence[SamplingParams],
                 generators: Sequence[torch.Generator | None] | None = None) -> torch.Tensor:
    """Pick the next token of every row of a batch.

    Args:
        logits: ``[B, V]`` logits, one row per sequence (any float dtype).
        params: one :class:`SamplingParams` per row.
        generators: one entry per row, the row's own generator or None. When omitted, a
            fresh generator is made for each seeded row: fine for a single call, but a loop
            should keep each request's generator across steps (see :func:`make_generator`).

    Returns:
        ``[B]`` int64 token ids on the logits' device.
    """
    _check_batch(logits, params)
    if generators is None:
        generators = [None if p.seed is None else make_generator(p.seed, logits.device)
                      for p in params]
    if len(generators) != len(params):
        raise ValueError(f"got {len(generators)} generators for {len(params)} rows")

    # argmax is cheap and exact: greedy rows need nothing else, not even a softmax.
    tokens = logits.argmax(dim=-1)
    sampled = [i for i, p in enumerate(params) if not p.is_greedy]
    if not sampled:
        return tokens

    rows = host_to_device(torch.tensor(sampled), logits.device)
    probs = _sampled_rows_probs(logits[rows], [params[i] for i in sampled])
    tokens[rows] = sample_from_probs(probs, [generators[i] for i in sampled])
    return tokens


def _check_batch(logits: torch.Tensor, params: Sequence[SamplingParams]) -> None:
    if logits.dim() != 2:
        raise ValueError(f"logits must be [batch, vocab], got shape {tuple(logits.shape)}")
    if len(params) != logits.shape[0]:
        raise ValueError(f"got {len(params)} SamplingParams for {logits.shape[0]} rows of logits")
