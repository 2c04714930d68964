"""worker.proto messages <-> sampling params and logprob records, for both sides of the wire."""

from __future__ import annotations

import math

from shared.proto_gen import worker_pb2 as pb
from shared.sampling.logprob import TokenLogprob
from shared.sampling.params import SamplingParams


def params_to_proto(p: SamplingParams) -> pb.SamplingOptions:
    opts = pb.SamplingOptions(
        temperature=p.temperature,
        top_k=p.top_k,
        top_p=p.top_p,
        min_p=p.min_p,
        repetition_penalty=p.repetition_penalty,
        frequency_penalty=p.frequency_penalty,
        presence_penalty=p.presence_penalty,
        stop_token_ids=list(p.stop_token_ids),
        max_tokens=p.max_tokens,
        ignore_eos=p.ignore_eos,
    )
    if p.seed is not None:
        opts.seed = p.seed
    if p.logprobs is not None:
        opts.logprobs = p.logprobs
    return opts


def params_from_proto(o: pb.SamplingOptions) -> SamplingParams:
    """Stop strings stay with the coordinator (it owns the text); workers stop on ids."""
    return SamplingParams(
        temperature=o.temperature,
        top_k=o.top_k,
        top_p=o.top_p,
        min_p=o.min_p,
        repetition_penalty=o.repetition_penalty,
        frequency_penalty=o.frequency_penalty,
        presence_penalty=o.presence_penalty,
        seed=o.seed if o.HasField("seed") else None,
        stop_token_ids=tuple(o.stop_token_ids),
        max_tokens=o.max_tokens,
        ignore_eos=o.ignore_eos,
        logprobs=o.logprobs if o.HasField("logprobs") else None,
    )


def logprob_to_proto(lp: TokenLogprob) -> pb.TokenLogprob:
    return pb.TokenLogprob(
        token_id=lp.token_id,
        logprob=lp.logprob,
        top=[pb.TopLogprob(token_id=t, logprob=v) for t, v in lp.top],
    )


def logprob_from_proto(m: pb.TokenLogprob) -> TokenLogprob:
    return TokenLogprob(m.token_id, m.logprob, [(t.token_id, t.logprob) for t in m.top])


def prompt_logprobs_to_proto(values: list[float | None] | None) -> list[float]:
    return [math.nan if v is None else v for v in (values or [])]


def prompt_logprobs_from_proto(values) -> list[float | None] | None:
    if not values:
        return None
    return [None if math.isnan(v) else v for v in values]
