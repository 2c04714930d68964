"""Everything one worker process owns: the engine on its thread, the KV pool, the transfer
agent, and KV on its way from a prefill replica to its Decode call (``KVArrivals``)."""

from __future__ import annotations

import asyncio
import logging
import os
import queue
import socket
import threading
import time
from collections import OrderedDict

from engine.core.async_engine import AsyncEngine
from engine.core.config import EngineConfig
from engine.core.engine import Engine
from engine.core.model_setup import load_serving_model
from engine.kvcache.kv_dtype import resolve_kv_dtype
from engine.kvcache.tables import BlockTable
from engine.model import fp32_gemm
from services.kvtransfer.factory import create_pool, create_transfer_backend
from services.kvtransfer.interface import TransferBackend
from services.worker.arrivals import PARKED_KV_TTL_S, KVArrivals
from shared.config.schema import DeploymentConfig, ModelDeployment
from shared.kvblocks.events import KVEvent
from shared.modelfile.default import default_model_path
from shared.rpc.auth import InternalAuth
from shared.tokenizer import Tokenizer

log = logging.getLogger(__name__)

# A cancelled request id is remembered this long, so pieces of it that arrive late (KV pushed
# after the coordinator's Abort, a Decode call racing it) are refused instead of served.
CANCELLED_TTL_S = 60.0
CANCELLED_MAX = 4096


class CancelledRequests:
    """Request ids the coordinator aborted: bounded in count and in time."""

    def __init__(self, ttl_s: float = CANCELLED_TTL_S, capacity: int = CANCELLED_MAX):
        self.ttl_s = ttl_s
        self.capacity = capacity
        self._until: OrderedDict[str, float] = OrderedDict()

    def add(self, request_id: str, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        self._until[request_id] = now + self.ttl_s
        self._until.move_to_end(request_id)
        while len(self._until) > self.capacity:
            self._until.popitem(last=False)

    def __contains__(self, request_id: object) -> bool:
        until = self._until.get(request_id)  # type: ignore[arg-type]
        if until is None:
            return False
        if until < time.monotonic():
            del self._until[request_id]  # type: ignore[arg-type]
            return False
        return True


class WorkerRuntime:
    def __init__(self, config: DeploymentConfig, model_id: str, role: str, index: int):
        self.config = config
        self.model_cfg: ModelDeployment = config.model(model_id)
        self.role = role
        # First: a missing token file should stop the start before the model loads.
        self.auth = InternalAuth.from_config(config)
        # The replica keeps its name across restarts (host name too: a pod's container
        # restarts in the same pod); worker_id names this process of it, so a restarted
        # replica is a new transfer peer that nothing cached about the old one can match.
        # The pid stays last (tests match it), and a pod's pid is always 1: the host name
        # carries the difference there.
        self.replica = f"{model_id}-{role}-{index}@{socket.gethostname()}"
        self.worker_id = f"{model_id}-{role}-{index}-{socket.gethostname()}-{os.getpid()}"
        path = self.model_cfg.path or default_model_path()
        worker = self.model_cfg.worker
        spec = self.model_cfg.speculative
        threads = worker.threads or max(1, (os.cpu_count() or 1) // max(1, config.num_workers))
        self.engine_config = EngineConfig(
            model=path,
            weights=self.model_cfg.weights,
            block_size=config.block_size,
            kv_cache_bytes=worker.kv_cache_bytes,
            kv_cache_dtype=worker.kv_cache_dtype,
            host_cache_bytes=worker.host_cache_bytes,
            disk_cache_dir=worker.disk_cache_dir,
            disk_cache_bytes=worker.disk_cache_bytes,
            max_num_batched_tokens=worker.max_num_batched_tokens,
            background_chunk_tokens=worker.background_chunk_tokens,
            chunk_tokens_while_decoding=worker.chunk_tokens_while_decoding,
            max_num_seqs=worker.max_num_seqs,
            max_model_len=self.model_cfg.max_model_len,
            preemption_mode=worker.preemption_mode,
            num_threads=threads,
            speculative_method=spec.method,
            num_speculative_tokens=spec.num_speculative_tokens,
            draft_path=spec.draft_path,
            draft_min_confidence=spec.draft_min_confidence,
            draft_tree_width=spec.draft_tree_width,
            draft_tree_min_confidence=spec.draft_tree_min_confidence,
            draft_tree_max_batch=spec.draft_tree_max_batch,
            ngram_max=spec.ngram_max,
            ngram_min=spec.ngram_min,
        )
        # A folder without tokenizer.json (tests' tiny models) serves token ids only.
        has_tokenizer = path.endswith(".gguf") or os.path.isfile(
            os.path.join(path, "tokenizer.json")
        )
        self.tokenizer = Tokenizer.from_model_path(path) if has_tokenizer else None
        # A cheaper build serves only if it passed the quality gate against fp32; `auto`
        # measures the eligible formats on this machine and serves the fastest per path.
        kv_dtype, kv_why = resolve_kv_dtype(worker.kv_cache_dtype)
        model, self.format_choice = load_serving_model(
            self.model_cfg.path, self.model_cfg.weights, threads=threads, kv_dtype=kv_dtype
        )
        memory = ", ".join(f"{k} {v / 2**20:.0f} MiB" for k, v in model.memory_bytes().items())
        log.info(
            "%s weights: prefill %s, decode %s; memory: %s; KV %d MiB; host tier %d MiB "
            "(reserved, resident as used)",
            self.worker_id,
            model.weights,
            model.decode_weights,
            memory,
            worker.kv_cache_bytes // 2**20,
            worker.host_cache_bytes // 2**20,
        )
        log.info("%s KV cache %s", self.worker_id, kv_why)
        layout = model.kv_layout(config.block_size, kv_dtype)
        num_blocks = worker.kv_cache_bytes // layout.block_bytes
        self.transfer_kind = config.transfer.backend
        pool = create_pool(
            self.transfer_kind if self.transfer_kind != "fake" else "tcp", layout, num_blocks
        )
        self.kv_events: queue.Queue[KVEvent] = queue.Queue()
        # The engine has no tokenizer on purpose: the coordinator owns text (stop strings,
        # detokenization); workers deal in token ids.
        self.engine = Engine(
            self.engine_config,
            model=model,
            event_sink=self.kv_events.put,
            pool=pool,
            kv_salt=self.tokenizer_fingerprint.encode() or None,
        )
        self.engine.format_choice = self.format_choice  # shown in Stats and /metrics
        self._settle_fp32_gemm()
        if self.tokenizer is not None:  # EOS / <|im_end|> end a reply on the worker itself
            self.engine.stop_token_ids = self.tokenizer.stop_token_ids
            # Structured outputs: grammars are compiled against the model's own vocabulary,
            # whose token trie is built now, off the engine thread (~0.3 s).
            self.engine.constraints.tokenizer = self.tokenizer
            threading.Thread(
                target=self.engine.constraints.warm, name="grammar-vocabulary", daemon=True
            ).start()
        if spec.draft_path and spec.method in ("draft", "adaptive"):
            # `splitserve draft gate` replaces this file when a better draft passed: the pool
            # installs it between two steps, without a restart (engine/core/draft_swap.py).
            self.engine.watch_draft_file(spec.draft_path)
        self.async_engine = AsyncEngine(self.engine)
        options: dict = {"host": config.worker_host} if self.transfer_kind == "tcp" else {}
        if self.transfer_kind in ("tcp", "shm"):  # NIXL's handshake is UCX's own
            options["auth_key"] = self.auth.transfer_key
        self.transfer: TransferBackend = create_transfer_backend(
            self.transfer_kind, self.worker_id, **options
        )
        self.transfer.register_pool(pool, replica=self.replica)
        self.arrivals = KVArrivals(self.free_blocks)
        self.cancelled = CancelledRequests()
        self.faults = worker.fault_injection
        if self.faults.active:
            log.warning("FAULT INJECTION is on for %s: %s", self.worker_id, self.faults)

    def _settle_fp32_gemm(self) -> None:
        """Choose the fp32 GEMM call for every row count a step here can have before the
        replica serves.

        A row count's call is otherwise measured at the first step that has it: a verify
        step of a new batch size then stalls a live stream for the measurement (seconds on
        a cold pod, whose cache directory starts empty). Nothing registered (no fp32 weights,
        no fp32 draft head): nothing to do."""
        started = time.monotonic()
        rows = min(fp32_gemm.ROW_BUCKETS[-1], self.engine_config.max_num_batched_tokens)
        fp32_gemm.settle(rows)
        spent = time.monotonic() - started
        if spent > 0.5:
            log.info(
                "%s fp32 GEMM calls for 1..%d rows chosen in %.1f s", self.worker_id, rows, spent
            )

    @property
    def tokenizer_fingerprint(self) -> str:
        return self.tokenizer.fingerprint if self.tokenizer else ""

    def start(self) -> None:
        self.async_engine.start()

    async def stop(self) -> None:
        self.arrivals.close()
        self.async_engine.stop()
        self.transfer.close()

    def free_blocks(self, table: BlockTable) -> None:
        """Gives blocks reserved for pushed KV back (thread-safe: on the engine thread)."""
        self.async_engine.post(lambda e: e.free_reserved(table))

    def cancel(self, request_id: str) -> None:
        """Stop the request here whatever stage it is in; later pieces of it are refused."""
        self.cancelled.add(request_id)
        self.async_engine.abort(request_id)
        self.arrivals.cancel(request_id)

    async def delay_first_token(self) -> None:
        """Fault injection (test only): stall before a request's first token."""
        if self.faults.first_token_delay_ms:
            await asyncio.sleep(self.faults.first_token_delay_s)

    async def expire_parked_forever(self) -> None:
        """KV whose Decode call never came (coordinator died, client left) goes back."""
        while True:
            await asyncio.sleep(1.0)
            for request_id in self.arrivals.expire():
                log.warning(
                    "dropping KV of %s: no Decode call within %ss", request_id, PARKED_KV_TTL_S
                )
