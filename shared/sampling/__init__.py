"""Sampling: per-request params, batched token selection, stop strings and logprob records.

Deliberately empty of imports: `params`, `stop` and `logprob` are torch-free and the
coordinator uses them, while `batch`, `sampler`, `penalties` and `truncation` are the engine's
torch code. Import the submodule you need.
"""
