"""The token embedding and the LM head, split over tensor-parallel ranks by vocabulary rows.

Both are ``[vocab_size, hidden_size]`` matrices: the embedding looks rows up by token id, the
LM head multiplies by the matrix to score every token. Vocabularies are large (151,936 entries
for Qwen3), so under tensor parallelism each rank keeps a contiguous block of rows. Many small
models (tiny-qwen3 among them) *tie* the two: the LM head reuses the embedding matrix, and the
checkpoint stores it once.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from minisgl.distributed import all_reduce

from .base import BaseLayer, ShardId, copy_checked, new_parameter, take_slice
from .linear import matmul


def vocab_rows(vocab_size: int, tp_rank: int, tp_size: int) -> tuple[int, int, int]:
    """The vocabulary rows ``[start, end)`` one rank holds, and the ``padded_rows`` it allocates.

    Every rank allocates the same number of rows (the vocabulary size divided by the rank count,
    rounded up) so the ranks' logits can be laid side by side; the last rank's spare rows stay 0.
    """
    padded_rows = -(-vocab_size // tp_size)  # ceil division
    start = min(tp_rank * padded_rows, vocab_size)
    return start, min(start + padded_rows, vocab_size), padded_rows


class _VocabParallelBase(BaseLayer):
    """The bookkeeping both vocabulary-sharded layers share: this rank's rows and their loading."""

    def __init__(self, num_embeddings: int, embedding_dim: int,
                 weight: torch.nn.Parameter | None = None) -> None:
        super().__init__()
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.start, self.end, self.padded_rows = vocab_rows(num_embeddings, self.tp_rank,
                                                            self.tp_size)
        self.weight = new_parameter(self.padded_rows, embedding_dim) if weight is None else weight

    def load_weight(
        self, loaded: torch.Tensor, shard_id: ShardId = None, param_name: str = "weight"
    ) -> None:
        what, rows = f"{type(self).__name__}.{param_name}", self.end - self.start
        src = take_slice(loaded, 0, self.start, rows, self.num_embeddings, what)
        with torch.no_grad():
            self.weight[rows:].zero_()  # padding rows: never looked up, score 0
        copy_checked(self.weight[:rows], src, what)


class VocabParallelEmbedding(_VocabParallelBase):
    """Token id -> hidden vector, with the vocabulary rows split across ranks.

    A rank can only look up ids inside its own block. It returns zeros for the other ids, and the
    all-reduce (a sum) fills each position in from the one rank that owns that id.
    """

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        owned = (input_ids >= self.start) & (input_ids < self.end)
        local_ids = torch.where(owned, input_ids - self.start, 0)
        hidden = F.embedding(local_ids, self.weight) * owned.unsqueeze(-1).to(self.weight.dtype)
        return all_reduce(hidden)


class ParallelLMHead(_VocabParallelBase):
    """Hidden vector -> one score (logit) per vocabulary entry.

    ``tie_to`` makes the head share the embedding's parameter object. The checkpoint then has no
    ``lm_head.weight``, and PyTorch lists the shared tensor once, under the embedding's name,
    which is how the weight loader knows not to expect a second copy.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int,
                 tie_to: VocabParallelEmbedding | None = None) -> None:
        if tie_to is not None and (tie_to.num_embeddings, tie_to.embedding_dim) != (
                num_embeddings, embedding_dim):
            raise ValueError(
                f"cannot tie an LM head of shape ({num_embeddings}, {embedding_dim}) to an "
                f"embedding of shape ({tie_to.num_embeddings}, {tie_to.embedding_dim})"
            )
        # Tied: the embedding's Parameter object itself, not a copy.
        super().__init__(num_embeddings, embedding_dim, None if tie_to is None else tie_to.weight)

    def forward(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """``[T, vocab]`` float32 logits, written into ``out`` when given."""
        if self.tp_size == 1:
            return matmul(hidden, self.weight, out_dtype=torch.float32, out=out)
        # [T, padded_rows] float32: scores for our block only
        logits = matmul(hidden, self.weight, out_dtype=torch.float32)
        # Lay every rank's block side by side. Summing zero-padded blocks with all-reduce is an
        # all-gather written with the one collective the layers use.
        rows = self.padded_rows
        gathered = logits.new_zeros(logits.shape[0], rows * self.tp_size)
        gathered[:, self.tp_rank * rows : (self.tp_rank + 1) * rows] = logits
        logits = all_reduce(gathered)[:, : self.num_embeddings]
        return logits if out is None else out.copy_(logits)
