"""Sampling: per-request params, batched token selection, and stop strings."""

from shared.sampling.batch import SamplingBatch, make_generator
from shared.sampling.params import SamplingParamError, SamplingParams
from shared.sampling.sampler import (
    SampleOutput,
    Sampler,
    TopLogprobs,
    apply_top_k_top_p_min_p,
    probabilities,
)
from shared.sampling.stop import StopStringMatcher

__all__ = [
    "SampleOutput",
    "Sampler",
    "SamplingBatch",
    "SamplingParamError",
    "SamplingParams",
    "StopStringMatcher",
    "TopLogprobs",
    "apply_top_k_top_p_min_p",
    "make_generator",
    "probabilities",
]
