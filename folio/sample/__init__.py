"""Sampling: SamplingMetadata (worker -> sampler), the Sampler pipeline, and logprobs gathering."""

from folio.sample.logprobs import LogprobsTensors, compute_prompt_logprobs, gather_logprobs
from folio.sample.metadata import SamplingMetadata
from folio.sample.sampler import Sampler, SamplerOutput

__all__ = [
    "LogprobsTensors",
    "Sampler",
    "SamplerOutput",
    "SamplingMetadata",
    "compute_prompt_logprobs",
    "gather_logprobs",
]
