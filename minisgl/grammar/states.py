"""Each constrained request's matcher, and the bitmask that masks a batch's logits.

A request with a grammar (``SamplingParams.grammar``) gets a :class:`GrammarState` when the
scheduler takes it: an llguidance ``LLMatcher`` that has read the tokens sampled so far. Before
each sample, :class:`TokenBitmask` asks every constrained row's matcher which tokens may come
next, one bit per token in a preallocated int32 host buffer ``[rows, ceil(vocab / 32)]``
(pinned on CUDA, so its copy does not make the host wait), and sets the others' logits to
``-inf``. The host fills it while the device still computes the step's logits. Rows without a
grammar are not touched, and a batch without any constrained row never comes here. After the
sample, :meth:`GrammarState.advance` feeds the token to the matcher; a grammar that can take
nothing more ends the request. The end of sequence is one of the tokens the matcher allows
only where the grammar is complete.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path

import llguidance
import llguidance.hf
import llguidance.torch
import torch

from minisgl.core import Req
from minisgl.grammar.compile import CACHE_SIZE, GrammarError
from minisgl.utils.logger import get_logger
from minisgl.utils.torch_utils import host_to_device

logger = get_logger(__name__)


class GrammarState:
    """One request's place in its grammar: an llguidance matcher fed its sampled tokens.

    A grammar that is complete and can take nothing more (the object's last brace) leaves
    only the end of sequence allowed: the request then samples it and stops as any request
    does, its last token a signal rather than text, one step later.
    """

    def __init__(self, matcher: llguidance.LLMatcher, eos_token_ids: Sequence[int]) -> None:
        self.matcher = matcher
        self.eos_token_ids = frozenset(eos_token_ids)

    def advance(self, req: Req, token: int) -> bool:
        """Feed ``req``'s newly read ``token``; an end of sequence the grammar took ends the
        request (``"stop"``, under ``ignore_eos`` too). Returns whether ``req`` is finished."""
        if not self.matcher.consume_token(token):
            # Only a token the mask did not allow gets here: nothing after it can be right.
            logger.warning("request %d: token %d breaks its grammar: %s", req.uid, token,
                           self.matcher.get_error())
            req.finish_reason = req.finish_reason or "stop"
        elif token in self.eos_token_ids and req.finish_reason is None:
            req.finish_reason = "stop"
        return req.is_finished


class Grammars:
    """Builds the matchers of a model's requests, from the grammars' text.

    The tokenizer llguidance walks is built at the first constrained request (about a second
    for a large vocabulary), so a server that never sees one never pays. A matcher built from
    a grammar is kept (up to ``CACHE_SIZE``) and copied for the next request with the same one.
    """

    def __init__(self, model_path: str | Path, vocab_size: int,
                 eos_token_ids: Sequence[int]) -> None:
        self.model_path = model_path
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._matchers: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        if self._tokenizer is None:
            from transformers import AutoTokenizer  # the server's tokenizer, as llguidance reads it

            hf = AutoTokenizer.from_pretrained(self.model_path)
            self._tokenizer = llguidance.hf.from_tokenizer(
                hf, n_vocab=self.vocab_size, eos_token=self.eos_token_ids)
        return self._tokenizer

    def start(self, grammar: str) -> GrammarState:
        """A fresh state at the start of ``grammar``.

        Raises:
            GrammarError: the grammar does not compile (the server checks before sending).
        """
        template = self._matchers.pop(grammar, None)
        if template is None:
            template = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
            if template.is_error():
                raise GrammarError(f"grammar: {template.get_error()}")
        self._matchers[grammar] = template  # the most recently used last
        if len(self._matchers) > CACHE_SIZE:
            self._matchers.popitem(last=False)
        return GrammarState(template.deep_copy(), self.eos_token_ids)


class TokenBitmask:
    """The preallocated bitmask of up to ``max_rows`` constrained rows, and its application.

    Args:
        max_rows: the most requests a batch holds.
        vocab_size: the logits' width (bits per row, rounded up to whole int32 words).
        device: where the logits are.
    """

    def __init__(self, max_rows: int, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.device = device
        shape = llguidance.torch.get_bitmask_shape(max_rows, vocab_size)
        self.host = torch.full(shape, -1, dtype=torch.int32, pin_memory=device.type == "cuda")
        self.bits = torch.arange(32, dtype=torch.int32, device=device)
        self.executor = llguidance.LLExecutor()  # fills several rows in parallel threads

    def apply(self, logits: torch.Tensor, states: Sequence[GrammarState | None]) -> torch.Tensor:
        """``logits`` (``[B, V]``) as float32 with each constrained row's disallowed tokens at
        ``-inf`` (a new tensor: a graph's logits are its fixed memory, and logprobs read the
        raw ones). ``states``: each row's grammar, None for a row without one."""
        rows = [i for i, state in enumerate(states) if state is not None]
        llguidance.torch.fill_next_token_bitmask_par(
            self.executor, [(states[i].matcher, r) for r, i in enumerate(rows)],
            self.host)
        words = host_to_device(self.host[: len(rows)], self.device)
        allowed = self.unpack(words)
        row_ids = host_to_device(torch.tensor(rows, dtype=torch.int64), self.device)
        masked = logits[row_ids].float().masked_fill(~allowed, float("-inf"))
        return logits.float().index_put((row_ids,), masked)

    def unpack(self, words: torch.Tensor) -> torch.Tensor:
        """``[R, V]`` bool: bit ``t % 32`` of word ``t // 32`` of each row, for every token."""
        bits = (words[:, :, None] >> self.bits) & 1
        return bits.view(words.shape[0], -1)[:, : self.vocab_size].bool()
