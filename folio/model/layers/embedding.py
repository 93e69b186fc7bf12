"""Token embedding and the LM head (which may share the embedding's weight when embeddings are tied)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class VocabEmbedding(nn.Module):
    """input_ids [T] -> embeddings [T, hidden]."""

    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size), requires_grad=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight)


def compute_lm_logits(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """hidden [S, hidden] @ weight[vocab, hidden].T -> logits [S, vocab] in float32 (samplers work in float32)."""
    return F.linear(hidden, weight).float()
