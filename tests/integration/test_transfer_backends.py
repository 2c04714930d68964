"""Every KV-transfer backend (shm, tcp, nixl) between real prefill and decode worker processes
(one prefill, two decode replicas, as `splitserve up` runs them): the greedy reply through
the disaggregated path equals the single-process engine's, with its KV pushed by that
backend; and `kill -9` of the decode replica a push is under way to (its blocks reserved,
the push held by a test-only fault so the kill lands inside the transfer) still ends the
stream with the same text, through the other replica, with every block released: the
coordinator sees the Decode call break, moves the stream, and cancels the first attempt's
push (a send to a receiver that died is pinned per backend in tests/unit/test_kvtransfer_*)."""

from __future__ import annotations

import json
import re
import signal
import threading

import httpx
import pytest

from services.launcher import start_local_stack
from services.launcher.presets import loopback_config
from shared.config.schema import parse_config
from shared.modelfile.default import DEFAULT_MODEL_ID
from shared.proto_gen import worker_pb2 as pb
from shared.proto_gen import worker_pb2_grpc as pb_grpc
from tests.integration.test_local_stack import expected_greedy
from tests.waiting import wait_until

pytestmark = pytest.mark.real_model

MAX_TOKENS = 10
# Long enough to find the receiver mid-transfer and kill it; short next to the deadline.
PUSH_HOLD_MS = 1000
GREETING = [{"role": "user", "content": "Describe a quiet harbour at dawn in a sentence."}]
CHORES = [{"role": "user", "content": "List three things a lighthouse keeper does."}]


@pytest.fixture(scope="module")
def expected(real_model, real_tokenizer) -> dict[str, str]:
    """The single-process engine's greedy replies, computed once for every backend."""
    return {
        m[0]["content"]: expected_greedy(real_model, real_tokenizer, m, MAX_TOKENS)[0]
        for m in (GREETING, CHORES)
    }


@pytest.fixture(scope="module", params=["shm", "tcp", "nixl"])
def stack(request):
    raw = loopback_config({"prefill": 1, "decode": 2})
    raw["transfer"] = {"backend": request.param, "deadline_s": 20}
    raw["models"][0]["worker"]["fault_injection"] = {"kv_push_hold_ms": PUSH_HOLD_MS}
    # Unsupervised: the killed replica stays dead, so the survivor must take its stream.
    with start_local_stack(parse_config(raw), startup_timeout_s=240, supervise=False) as s:
        yield s


def _workers(stack) -> dict[str, dict]:
    ready = httpx.get(f"{stack.url}/ready", timeout=10).json()
    return {w: info for w, info in ready["workers"].items() if info["alive"]}


def _stats(stack, address: str) -> dict:
    with stack.internal_auth.sync_channel(address) as channel:
        return json.loads(pb_grpc.WorkerStub(channel).Stats(pb.StatsRequest(), timeout=5).json)


def _pushes(stack, status: str) -> float:
    """KV pushes the prefill replica counted with `status`, for the stack's backend."""
    (prefill,) = [i for i in _workers(stack).values() if i["role"] == "prefill"]
    text = httpx.get(f"http://{prefill['metrics_address']}/metrics", timeout=10).text
    backend = stack.config.transfer.backend
    pattern = rf'^splitserve_kv_push_total\{{[^}}]*backend="{backend}"[^}}]*status="{status}"'
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if re.match(pattern, line))  # fmt: skip


def _stream(stack, messages: list[dict], out: dict) -> None:
    body = {"model": DEFAULT_MODEL_ID, "messages": messages, "max_tokens": MAX_TOKENS,
            "temperature": 0, "stream": True}  # fmt: skip
    out.update(text="", errors=[], metadata={})
    with httpx.stream("POST", f"{stack.base_url}/chat/completions", json=body, timeout=180) as r:
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line.removeprefix("data: "))
            out["errors"] += [event["error"]] if "error" in event else []
            out["metadata"].update(event.get("metadata") or {})
            for choice in event.get("choices", []):
                out["text"] += choice["delta"].get("content") or ""


def test_greedy_reply_through_the_backend_equals_the_single_process_engine(stack, expected):
    done_before = _pushes(stack, "done")
    out: dict = {}
    _stream(stack, GREETING, out)
    assert out["errors"] == [] and out["text"] == expected[GREETING[0]["content"]]
    transfer = json.loads(out["metadata"]["transfer"])
    assert (transfer["backend"], transfer["status"]) == (stack.config.transfer.backend, "done")
    assert transfer["bytes"] > 0
    assert _pushes(stack, "done") == done_before + 1


def test_kill_9_of_the_receiver_mid_transfer_loses_nothing(stack, expected):
    decodes = {w: i["address"] for w, i in _workers(stack).items() if i["role"] == "decode"}
    assert len(decodes) == 2
    out: dict = {}
    client = threading.Thread(target=_stream, args=(stack, CHORES, out))
    client.start()

    def receiving() -> str | None:
        return next((w for w, a in decodes.items() if _stats(stack, a)["kv_receiving"]), None)

    assert wait_until(receiving, 30, 0.02), "no push to a decode replica began"
    victim = receiving()
    (name,) = [n for n, p in stack.processes.items() if victim.endswith(f"-{p.pid}")]
    stack.processes[name].kill(signal.SIGKILL)
    client.join(120)

    assert out["errors"] == [] and out["text"] == expected[CHORES[0]["content"]]
    # The first attempt's receiver died; the stream moved and finished on the survivor.
    first, *rest = json.loads(out["metadata"]["attempts"])
    assert victim in first["replica"] and not first["success"]
    assert rest and rest[-1]["success"] and victim not in rest[-1]["replica"]
    # Every block back on the survivors: the prefill's (sent or not) and the decode's.
    survivors = [i["address"] for w, i in _workers(stack).items() if w != victim]

    def idle() -> bool:
        loads = [_stats(stack, a)["load"] for a in survivors]
        return all(load["total_blocks"] == load["free_blocks"] for load in loads)

    assert wait_until(idle, 20, 0.1), [_stats(stack, a)["load"] for a in survivors]
    again: dict = {}
    _stream(stack, [{"role": "user", "content": "Say hi."}], again)
    assert again["errors"] == [] and again["text"]
