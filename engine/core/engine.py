"""The engine: `step()` is schedule -> run -> postprocess, over one model and one KV pool."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterator

import torch

from engine.core.config import EngineConfig
from engine.core.constraints import OutputConstraints, fit_drafts_to_grammar
from engine.core.draft_swap import DraftFileWatcher, DraftSwap
from engine.core.errors import RequestError
from engine.core.kv_setup import block_manager, block_salt, kv_pool
from engine.core.model_setup import load_serving_model
from engine.core.output import RequestOutput
from engine.core.runner import ModelRunner, StepResult
from engine.core.scheduler import ScheduledSeq, Scheduler, StepBatch
from engine.core.sequence import SeqStatus, Sequence
from engine.core.speculator_build import build_speculator, load_draft_file
from engine.kvcache.kv_dtype import resolve_kv_dtype
from engine.kvcache.pool import KVPool
from engine.kvcache.tables import BlockTable
from engine.model.llama import LlamaModel
from engine.sampling.batch import make_generator
from engine.speculative.calibrate import measure_step_costs
from engine.speculative.proposer import DraftProposer
from engine.speculative.tree import compaction
from engine.speculative.verify import Verified
from shared.sampling.logprob import TokenLogprob
from shared.sampling.params import SamplingParamError, SamplingParams
from shared.tokenizer.tokenizer import Tokenizer
from shared.wire.records import WorkerLoad


class Engine:
    def __init__(
        self,
        config: EngineConfig,
        model: LlamaModel | None = None,
        tokenizer: Tokenizer | None = None,
        event_sink=None,
        pool: KVPool | None = None,
        kv_salt: bytes | None = None,
        draft: DraftProposer | None = None,
    ):
        self.config = config
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.format_choice = None
        if model is None:
            model, self.format_choice = load_serving_model(
                config.model,
                config.weights,
                config.device,
                config.num_threads,
                resolve_kv_dtype(config.kv_cache_dtype, config.device)[0],
            )
        self.model = model
        self.tokenizer = tokenizer
        model_cfg = self.model.config
        self.max_model_len = min(
            config.max_model_len or model_cfg.max_position, model_cfg.max_position
        )
        self.kv_dtype, _ = resolve_kv_dtype(config.kv_cache_dtype, config.device)
        layout = self.model.kv_layout(config.block_size, self.kv_dtype)
        self.pool = kv_pool(config, layout, pool)
        salt = block_salt(tokenizer, kv_salt, model_cfg)
        self.blocks = block_manager(config, self.pool, model_cfg, salt, event_sink)
        self.scheduler = Scheduler(config, self.blocks)
        self.runner = ModelRunner(self.model, self.pool, config.block_size, seed=config.seed)
        fingerprint = tokenizer.fingerprint if tokenizer else (kv_salt or b"").decode()
        self._fingerprint = fingerprint
        self.speculator = build_speculator(
            config,
            self.max_model_len,
            config.model,
            fingerprint,
            model_cfg.vocab_size,
            draft,
            target=self.model,
        )
        self.speculator.set_calibration(
            lambda: measure_step_costs(self.model, self.pool, self.blocks, config.block_size)
        )
        self.sequences: dict[str, Sequence] = {}
        self._ids = itertools.count()
        # Requests stopped before they finished (client gone, migrated, stop string matched
        # by the coordinator): the figure cancellation tests and operators check.
        self.num_aborted = 0
        self.stop_token_ids: frozenset[int] = tokenizer.stop_token_ids if tokenizer else frozenset()
        # Structured outputs (response_format); a worker sets `constraints.tokenizer`.
        self.constraints = OutputConstraints(tokenizer)
        # Called on the engine thread after every non-empty step with (batch, start_ns, end_ns)
        # in wall-clock ns: metrics and request timelines for traces (services/worker).
        self.step_observers: list[Callable[[StepBatch, int, int], None]] = []
        # New drafts offered from any thread (a file watcher, a test), installed between steps.
        self.draft_swap = DraftSwap()
        self._draft_watcher: DraftFileWatcher | None = None
        self._unobserved: tuple[StepBatch, int, int] | None = None  # see `step`

    # -- requests ------------------------------------------------------------------------

    def add_request(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str | None = None,
        priority: int = 1,
        prompt_logprobs: bool = False,
        keep_kv: bool = False,
        max_new_tokens: int | None = None,
    ) -> str:
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self.sequences:
            raise RequestError("request_id", f"request id '{request_id}' is already in use")
        self.validate(prompt_token_ids, params)
        seq = Sequence(
            request_id=request_id,
            prompt_token_ids=list(prompt_token_ids),
            params=params,
            priority=priority,
            generator=make_generator(params.seed, self.config.device),
            keep_kv=keep_kv,
            max_new_tokens=max_new_tokens,
            grammar=self.constraints.start(request_id, params, prompt_token_ids),
        )
        if prompt_logprobs:
            seq.prompt_logprobs = []
        self.sequences[request_id] = seq
        self.scheduler.add(seq)
        return request_id

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        if not prompt_token_ids:
            raise RequestError("prompt", "the prompt is empty")
        vocab = self.model.config.vocab_size
        bad = next((t for t in prompt_token_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise RequestError("prompt", f"token id {bad} is outside the vocabulary [0, {vocab})")
        n = len(prompt_token_ids)
        if n >= self.max_model_len:
            raise RequestError(
                "prompt",
                f"the prompt has {n} tokens; this model's context window is {self.max_model_len} "
                "tokens (prompt + at least one output token)",
            )
        try:
            params.validate()
        except SamplingParamError as exc:
            raise RequestError(exc.param, str(exc)) from exc
        total_blocks = self.blocks.blocks_needed(min(n + params.max_tokens, self.max_model_len))
        if total_blocks > self.blocks.num_blocks:
            raise RequestError(
                "max_tokens",
                f"prompt + max_tokens needs {total_blocks} KV blocks but this replica has only "
                f"{self.blocks.num_blocks}",
            )

    def reserve_blocks(self, num_tokens: int) -> BlockTable | None:
        """Decode role: blocks for a prompt whose KV a prefill replica will push here."""
        return self.blocks.allocate_fresh(num_tokens)

    def free_reserved(self, table: BlockTable) -> None:
        self.blocks.free(table)

    def add_prefilled(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        first_token: int,
        table: BlockTable,
        params: SamplingParams,
        priority: int = 1,
        num_cached_tokens: int = 0,
    ) -> str:
        """Decode role: continue a request whose prompt KV is already in `table` (pushed by a
        prefill replica) and whose first token was sampled there."""
        if request_id in self.sequences:
            self.blocks.free(table)
            raise RequestError("request_id", f"request id '{request_id}' is already in use")
        try:
            self.validate(prompt_token_ids, params)
            grammar = self.constraints.start(request_id, params, prompt_token_ids, [first_token])
        except RequestError:
            self.blocks.free(table)
            raise
        seq = Sequence(
            request_id=request_id,
            prompt_token_ids=list(prompt_token_ids),
            params=params,
            priority=priority,
            generator=make_generator(params.seed, self.config.device),
            output_token_ids=[first_token],
            table=table,
            num_computed_tokens=len(prompt_token_ids),
            num_cached_prompt_tokens=num_cached_tokens,
            grammar=grammar,
        )
        # The pushed KV is now ours: register its full blocks so later turns reuse them.
        self.blocks.commit_full_blocks(table, prompt_token_ids)
        self.sequences[request_id] = seq
        self.scheduler.admit_running(seq)
        return request_id

    def weights_report(self) -> dict:
        """What this engine computes with and what it holds: each path's format, the
        measured choice behind `auto` (if any), and the bytes of weights and KV pool."""
        model = self.model
        report: dict = {
            "prefill": model.weights,
            "decode": model.decode_weights,
            "memory_bytes": model.memory_bytes() | {"kv_pool": self.pool.tensor.nbytes},
        }
        if self.format_choice is not None:
            report["choice"] = self.format_choice.to_json() | {"cached": self.format_choice.cached}
        return report

    def load(self) -> WorkerLoad:
        """What the router weighs: queued prefill work and live KV."""
        sched = self.scheduler
        return WorkerLoad(
            running=len(sched.running),
            waiting=len(sched.waiting),
            queued_prefill_tokens=sum(
                s.num_pending_tokens
                for s in sched.waiting + sched.running
                if s.num_pending_tokens > 1
            ),
            active_kv_tokens=sum(s.num_tokens for s in sched.running),
            free_blocks=self.blocks.num_available_blocks,
            total_blocks=self.blocks.num_blocks,
        )

    def abort(self, request_id: str) -> None:
        seq = self.sequences.pop(request_id, None)
        if seq is None:
            return
        if not seq.is_finished:  # a finished `keep_kv` prefill being released is no abort
            self.num_aborted += 1
        self.scheduler.remove(seq)
        if seq.table is not None:  # a finished prefill kept for hand-off
            self.scheduler.release_kv(seq)
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = seq.finish_reason or "abort"
        self.speculator.release(request_id)

    def release(self, request_id: str) -> None:
        """Free the KV a finished `keep_kv` request still holds (after it was transferred)."""
        self.abort(request_id)

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    def kv_tiers(self) -> dict[str, dict[str, int]]:
        """Blocks held and slots in each KV tier (device, host, disk): what the fleet view
        shows; a tier the engine runs without is left out."""
        blocks = self.blocks
        kv_tiers = {
            "device": {
                "used_blocks": blocks.num_blocks - blocks.num_available_blocks,
                "capacity_blocks": blocks.num_blocks,
            }
        }
        host = blocks.host_kv_tier
        if host is not None:
            kv_tiers["host"] = {
                "used_blocks": host.num_blocks + host.num_reserved_slots,
                "capacity_blocks": host.capacity_blocks,
            }
            if host.disk is not None:
                kv_tiers["disk"] = {
                    "used_blocks": host.disk.num_blocks,
                    "capacity_blocks": host.disk.capacity_blocks,
                }
        return kv_tiers

    def structured_stats(self) -> dict:
        """Grammar cache (compiled schemas, hits) and per-step mask timings."""
        return self.constraints.stats() | self.runner.mask_stats()

    def watch_draft_file(self, path: str, interval_s: float = 2.0) -> DraftFileWatcher:
        """Hot-swap to the draft at `path` whenever the file changes (see draft_swap.py)."""
        fingerprint = self.tokenizer.fingerprint if self.tokenizer else self._fingerprint
        vocab = self.model.config.vocab_size

        def load(file):
            return load_draft_file(
                self.config, str(file), fingerprint, vocab, self.model, self.config.model
            )

        if self._draft_watcher is not None:
            self._draft_watcher.stop()
        self._draft_watcher = DraftFileWatcher(path, load, self.draft_swap, interval_s).start()
        return self._draft_watcher

    def spec_stats(self) -> dict:
        """Speculative decoding: acceptance per method, histogram, and why a draft is off."""
        return self.speculator.stats.as_dict()

    # -- the step loop -------------------------------------------------------------------

    def step(self, *, defer_observers: bool = False) -> list[RequestOutput]:
        """One scheduled step. With `defer_observers` its observers run at the caller's
        `notify_observers()`: a driver hands the outputs on first, so no token waits for
        the step's telemetry."""
        self.notify_observers()  # a deferred step nobody notified is still observed, once
        offer = self.draft_swap.take()
        if offer is not None:
            self.speculator.install_draft(offer.draft, offer.version)
        start_ns = time.time_ns()
        if self.speculator.enabled:
            self.speculator.attach_drafts(self.scheduler.running)
            fit_drafts_to_grammar(self.scheduler.running)
        batch: StepBatch = self.scheduler.schedule()
        if batch.is_empty:
            return []
        want = {
            i
            for i, s in enumerate(batch.scheduled)
            if s.seq.prompt_logprobs is not None
            and s.seq.num_computed_tokens < s.seq.num_prompt_tokens
        }
        run_start = time.perf_counter()
        # Positions of each row's first computed token, before postprocess moves them on.
        first_positions = [s.seq.num_computed_tokens for s in batch.scheduled]
        result = self.runner.run(batch.scheduled, want)
        if self.speculator.enabled and all(
            s.num_tokens - s.num_draft == 1 and s.completes_prompt for s in batch.scheduled
        ):
            # A pure decode/verify step: what the adaptive controller prices k with.
            self.speculator.observe_step(batch.num_batched_tokens, time.perf_counter() - run_start)
        outputs = self._postprocess(batch, result)
        if self.speculator.consumes_hidden and result.hidden is not None:
            self.speculator.observe_hidden(
                batch.scheduled, first_positions, result.hidden, result.row_starts or []
            )
        if self.step_observers:
            self._unobserved = (batch, start_ns, time.time_ns())
            if not defer_observers:
                self.notify_observers()
        return outputs

    def notify_observers(self) -> None:
        """Runs the step observers of the last step, if `step` deferred them (idempotent)."""
        observation, self._unobserved = self._unobserved, None
        if observation is not None:
            for observe in self.step_observers:
                observe(*observation)

    def _postprocess(self, batch: StepBatch, result: StepResult) -> list[RequestOutput]:
        outputs: dict[str, RequestOutput] = {}
        for index, item in enumerate(batch.scheduled):
            seq = item.seq
            if index in result.prompt_logprobs:
                seq.add_prompt_logprobs(seq.num_computed_tokens + 1, result.prompt_logprobs[index])
            if item.num_draft:
                continue  # settled by _settle_verified once the accepted length is known
            seq.num_computed_tokens += item.num_tokens
            self.blocks.commit_full_blocks(seq.table, seq.token_ids[: seq.num_computed_tokens])
            self._release_outside_window(seq)
        if result.verified is not None:
            logprobs = result.verified_logprobs or {}
            starts = {
                id(s): r for s, r in zip(batch.scheduled, result.row_starts or [], strict=False)
            }
            for row, (item, done) in enumerate(zip(result.sampled, result.verified, strict=True)):
                if item.num_draft:
                    if done.nodes is not None:
                        self._compact_tree(item, done.nodes, result.hidden, starts.get(id(item)))
                    self._settle_verified(item, done)
                out = self._append_tokens(item.seq, done.token_ids, logprobs.get(row))
                outputs[item.seq.request_id] = out
        if result.samples is not None:
            token_ids = result.samples.token_ids.tolist()
            lps = result.samples.logprobs
            chosen = lps.tolist() if lps is not None else None  # set whenever a row asked
            top = result.samples.top_logprobs
            top_ids = top.token_ids.tolist() if top is not None else None
            top_lps = top.logprobs.tolist() if top is not None else None
            for row, item in enumerate(result.sampled):
                seq = item.seq
                logprob = None
                if seq.params.logprobs is not None:
                    n = seq.params.logprobs
                    pairs = (
                        list(zip(top_ids[row][:n], top_lps[row][:n], strict=True))
                        if top_ids
                        else []
                    )
                    assert chosen is not None
                    logprob = TokenLogprob(token_ids[row], chosen[row], pairs)
                outputs[seq.request_id] = self._append_token(seq, token_ids[row], logprob)
        return list(outputs.values())

    def _release_outside_window(self, seq: Sequence) -> None:
        """Sliding-window models: blocks behind every layer's window go back once the
        sequence decodes here. Not during its prompt: a prefill replica pushes the whole
        prompt's blocks, and the receiver registers each as real KV."""
        if seq.num_computed_tokens > seq.num_prompt_tokens and seq.table is not None:
            self.blocks.release_outside_window(seq.table, seq.num_computed_tokens)

    def _compact_tree(
        self,
        item: ScheduledSeq,
        nodes: list[int],
        hidden: torch.Tensor | None,
        first_row: int | None,
    ) -> None:
        """Move a verified tree's accepted nodes to the slots (and hidden-state rows) a chain
        of the same tokens occupies, so that what follows sees the cache a chain leaves."""
        moves = compaction(nodes)
        if not moves:
            return
        seq = item.seq
        assert seq.table is not None
        root = seq.num_computed_tokens  # the last sampled token's slot
        self.pool.move_slots(
            seq.table.attention_block_ids(), [(root + a, root + b) for a, b in moves]
        )
        if hidden is not None and first_row is not None:
            with torch.inference_mode():  # the step's states are inference tensors
                for a, b in moves:
                    hidden[first_row + b] = hidden[first_row + a]

    def _settle_verified(self, item: ScheduledSeq, done: Verified) -> None:
        """Keep the KV of the last token and the accepted drafts; roll back the rest."""
        seq, accepted = item.seq, done.num_accepted
        kept = done.token_ids[:accepted]
        self.speculator.record(seq, accepted, kept)
        seq.num_computed_tokens += 1 + accepted
        assert seq.table is not None
        # Blocks past the kept tokens go back; rejected tokens were never committed (hashed).
        if not self.blocks.truncate(seq.table, seq.num_computed_tokens):
            raise RuntimeError(f"{seq.request_id}: rollback of rejected drafts failed")
        self.blocks.commit_full_blocks(seq.table, (seq.token_ids + kept)[: seq.num_computed_tokens])
        self._release_outside_window(seq)
        # Observers (metrics, traces) see the tokens whose KV was kept.
        item.num_tokens, item.num_draft = 1 + accepted, accepted
        seq.draft = None

    def _append_tokens(
        self, seq: Sequence, tokens: list[int], logprob: TokenLogprob | None
    ) -> RequestOutput:
        """Several tokens from one step, emitted one by one so that a stop token or the length
        limit ends the sequence exactly where plain decoding would."""
        out = self._append_token(seq, tokens[0], logprob)
        for token in tokens[1:]:
            if out.finished:
                break
            more = self._append_token(seq, token, None)
            out.new_token_ids.extend(more.new_token_ids)
            out.finished, out.finish_reason = more.finished, more.finish_reason
            out.num_output_tokens = more.num_output_tokens
        return out

    def _append_token(
        self, seq: Sequence, token: int, logprob: TokenLogprob | None
    ) -> RequestOutput:
        seq.output_token_ids.append(token)
        if seq.grammar is not None:
            seq.grammar.accept(token)
        out = RequestOutput(
            request_id=seq.request_id,
            new_token_ids=[token],
            logprobs=[logprob] if logprob else [],
            num_prompt_tokens=seq.num_prompt_tokens,
            num_cached_tokens=seq.num_cached_prompt_tokens,
            num_output_tokens=len(seq.output_token_ids),
        )
        if seq.prompt_logprobs is not None and len(seq.output_token_ids) == 1:
            out.prompt_logprobs = seq.prompt_logprobs
        reason = None
        if token in seq.params.stop_token_ids or (
            not seq.params.ignore_eos and token in self.stop_token_ids
        ):
            reason = "stop"
        elif seq.grammar is not None and seq.grammar.is_finished:
            reason = "stop"  # the value is complete and nothing may follow it
        elif len(seq.output_token_ids) >= seq.output_limit or seq.num_tokens >= self.max_model_len:
            reason = "length"
        if reason is not None:
            out.finished, out.finish_reason = True, reason
            self._finish(seq, reason)
        return out

    def _finish(self, seq: Sequence, reason: str) -> None:
        self.speculator.release(seq.request_id)
        seq.finish_reason = reason
        self.scheduler.remove(seq)
        seq.status = SeqStatus.FINISHED
        if not seq.keep_kv:
            self.sequences.pop(seq.request_id, None)

    # -- conveniences --------------------------------------------------------------------

    def run_until_done(self) -> Iterator[RequestOutput]:
        while self.has_work:
            yield from self.step()

    def generate(
        self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]
    ) -> list[list[int]]:
        """Run prompts to completion together; returns each one's output token ids."""
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, params_list, strict=True)]
        results: dict[str, list[int]] = {i: [] for i in ids}
        for out in self.run_until_done():
            results[out.request_id].extend(out.new_token_ids)
        return [results[i] for i in ids]
