"""A no-op stand-in for a causal LM: the real model's input and output shapes, none of its work.

``model_impl="noop"`` puts it where the model goes, so that everything around the model -- scheduler, KV cache
manager, the runner's input preparation, sampler, output processing and detokenization -- runs for real while the
forward costs (almost) nothing. ``folio bench latency --profile`` uses it to measure the engine's own overhead per
step. vLLM's ``--load-format dummy`` is not this: it keeps the real forward and only randomizes the weights.

The forward returns zeros [T, hidden]; the logits are constant, one-hot on a fixed mid-vocabulary token, so
greedy decoding picks that token every step (use ``ignore_eos`` for a fixed output length). No weights are read.
"""

from __future__ import annotations

import torch
from torch import nn

from folio.attention.metadata import AttnMetadata
from folio.model.spec import ModelSpec


def noop_token_id(spec: ModelSpec) -> int:
    """The token a no-op model always predicts: the middle of the vocabulary, away from the special tokens that
    Llama-family vocabularies keep at either end (so the detokenizer has ordinary text to decode)."""
    return spec.vocab_size // 2


class NoopCausalLM(nn.Module):
    """Same interface as LlamaForCausalLM (forward, compute_logits); see the module docstring."""

    def __init__(self, spec: ModelSpec, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.spec = spec
        self.dtype = dtype
        self.device = device
        self.token_id = noop_token_id(spec)
        # One-hot rows, built once and grown on demand: writing a fresh [S, vocab] tensor every step would cost
        # ~4-7 ms of CPU for 64 x 49k logits, model-like work the no-op exists to leave out.
        self._logits = self._one_hot_rows(0)
        # Zeros, shared the same way: filling [T, hidden] each step is an intra-op parallel fill, whose barrier can
        # spin for milliseconds when another process holds the second core.
        self._hidden = torch.zeros(0, spec.hidden_size, dtype=dtype, device=device)

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        kv_caches: list[torch.Tensor],  # ignored: the no-op model neither reads nor writes K/V
        attn: AttnMetadata,
        output_rows: torch.Tensor | None = None,  # the rows asked for (LlamaModel.forward): as many zero rows
    ) -> torch.Tensor:  # [T or R, hidden] zeros (a view of a shared buffer: callers only read it)
        num_tokens = input_ids.shape[0] if output_rows is None else output_rows.shape[0]
        if self._hidden.shape[0] < num_tokens:
            self._hidden = torch.zeros(num_tokens, self.spec.hidden_size, dtype=self.dtype, device=self.device)
        return self._hidden[:num_tokens]

    def _one_hot_rows(self, num_rows: int) -> torch.Tensor:  # [num_rows, vocab] float32
        logits = torch.zeros(num_rows, self.spec.vocab_size, dtype=torch.float32, device=self.device)
        logits[:, self.token_id] = 1.0
        return logits

    def compute_greedy_token_ids(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """No fused arg-max here: the runner takes the logits path, as with any model that lacks one."""
        return None

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [S, hidden] -> [S, vocab] float32
        """A view of the shared one-hot rows. Safe to share because the sampler and the prompt-logprob code never
        modify their input logits (folio.sample.sampler: "processing works on a copy")."""
        num_rows = hidden.shape[0]
        if self._logits.shape[0] < num_rows:
            self._logits = self._one_hot_rows(num_rows)
        return self._logits[:num_rows]
