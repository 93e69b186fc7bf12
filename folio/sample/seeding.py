"""Per-position generators for seeded requests: every random draw of a seeded request at output position i comes
from a generator seeded with ``step_seed(seed, i)``, in plain decoding and in draft verification alike."""

from __future__ import annotations

import torch

from folio.sampling_params import SamplingParams

_SEED_MIX = 0x9E3779B97F4A7C15  # golden-ratio constant: spreads (seed, step) pairs over the 64-bit space


def step_seed(seed: int, num_output_tokens: int) -> int:
    """Seed for a seeded request's draw at one output position.

    Stateless per position, so a request gives the same tokens alone, inside any batch, and after a
    preemption that recomputes it (a stateful generator would be lost or replayed when the worker drops it).
    """
    return (seed * _SEED_MIX + num_output_tokens) % (2**63)


def position_generator(params: SamplingParams, num_output_tokens: int, device: torch.device) -> torch.Generator | None:
    """The generator of a seeded sampled request's draw at output position ``num_output_tokens``; None for greedy
    or unseeded requests (they draw from the device's default generator, or not at all)."""
    if params.seed is None or params.is_greedy:
        return None
    generator = torch.Generator(device=device)
    generator.manual_seed(step_seed(params.seed, num_output_tokens))
    return generator
