"""worker.proto messages <-> our records (sampling params, logprobs, chunks, load, KV events):
the one place each is converted, for both sides of the wire."""

from __future__ import annotations

from shared.kvblocks.events import KVEvent
from shared.proto_gen import worker_pb2 as pb
from shared.sampling.logprob import TokenLogprob
from shared.sampling.params import SamplingParamError, SamplingParams
from shared.sampling.structured import StructuredOutput, StructuredOutputError
from shared.wire.records import GenerationChunk, WorkerLoad


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
    if p.structured is not None:
        opts.structured.CopyFrom(
            pb.StructuredOutput(
                kind=p.structured.kind,
                schema_json=p.structured.schema,
                replay_tokens=p.structured.replay_tokens,
            )
        )
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
        structured=_structured_from_proto(o),
    )


def _structured_from_proto(o: pb.SamplingOptions) -> StructuredOutput | None:
    if not o.HasField("structured"):
        return None
    s = o.structured
    try:
        return StructuredOutput(s.kind, s.schema_json, s.replay_tokens)  # type: ignore[arg-type]  # validated on construction
    except StructuredOutputError as exc:
        raise SamplingParamError("response_format", str(exc)) from exc


def logprob_to_proto(lp: TokenLogprob) -> pb.TokenLogprob:
    return pb.TokenLogprob(
        token_id=lp.token_id,
        logprob=lp.logprob,
        top=[pb.TopLogprob(token_id=t, logprob=v) for t, v in lp.top],
    )


def logprob_from_proto(m: pb.TokenLogprob) -> TokenLogprob:
    return TokenLogprob(m.token_id, m.logprob, [(t.token_id, t.logprob) for t in m.top])


def prompt_logprobs_to_proto(values: list[TokenLogprob] | None) -> list[pb.TokenLogprob]:
    return [logprob_to_proto(lp) for lp in values or ()]


def prompt_logprobs_from_proto(values) -> list[TokenLogprob] | None:
    # Empty on the wire: not asked for (a one-token prompt, which has none, reads the same).
    return [logprob_from_proto(lp) for lp in values] if values else None


def first_token_chunk(m: pb.PrefillFirstToken, replica: str) -> GenerationChunk:
    return GenerationChunk(
        token_ids=[m.first_token],
        logprobs=[logprob_from_proto(m.logprob)] if m.has_logprob else [],
        finished=m.finished,
        finish_reason=m.finish_reason or None,
        num_prompt_tokens=m.num_prompt_tokens,
        num_cached_tokens=m.num_cached_tokens,
        num_output_tokens=1,
        replica=replica,
        prompt_logprobs=prompt_logprobs_from_proto(m.prompt_logprobs),
    )


def decode_chunk(m: pb.DecodeChunk, replica: str) -> GenerationChunk:
    return GenerationChunk(
        token_ids=list(m.token_ids),
        logprobs=[logprob_from_proto(lp) for lp in m.logprobs],
        finished=m.finished,
        finish_reason=m.finish_reason or None,
        num_prompt_tokens=m.num_prompt_tokens,
        num_cached_tokens=m.num_cached_tokens,
        num_output_tokens=m.num_output_tokens,
        replica=replica,
        prompt_logprobs=prompt_logprobs_from_proto(m.prompt_logprobs),
    )


def load_to_proto(load: WorkerLoad) -> pb.WorkerLoad:
    return pb.WorkerLoad(
        running=load.running,
        waiting=load.waiting,
        queued_prefill_tokens=load.queued_prefill_tokens,
        active_kv_tokens=load.active_kv_tokens,
        free_blocks=load.free_blocks,
        total_blocks=load.total_blocks,
    )


def load_from_proto(m: pb.WorkerLoad) -> WorkerLoad:
    return WorkerLoad(
        running=m.running,
        waiting=m.waiting,
        queued_prefill_tokens=m.queued_prefill_tokens,
        active_kv_tokens=m.active_kv_tokens,
        free_blocks=m.free_blocks,
        total_blocks=m.total_blocks,
    )


def kv_event_to_proto(e: KVEvent) -> pb.KVEvent:
    return pb.KVEvent(kind=e.kind, block_hashes=e.block_hashes, kv_tier=e.kv_tier, seq=e.seq)


def kv_event_from_proto(m: pb.KVEvent) -> KVEvent:
    return KVEvent(kind=m.kind, block_hashes=tuple(m.block_hashes), kv_tier=m.kv_tier, seq=m.seq)  # type: ignore[arg-type]  # the worker sent one of ours
