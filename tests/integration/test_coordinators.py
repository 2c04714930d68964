"""Two live coordinators sharing one prefill and two decode workers (`splitserve up
--coordinators 2`): both serve, both hold one view of the fleet (the same KV index, so a
conversation started on one is routed by the other to the replica holding it); killing one
leaves the other serving every worker; the restarted one is resynced by the workers'
snapshots and routes like the other again."""

from __future__ import annotations

import signal
import threading
import time

import grpc
import httpx
import pytest

from services.launcher import start_local_stack
from services.launcher.presets import loopback_config
from shared.config.schema import parse_config
from shared.modelfile.default import DEFAULT_MODEL_ID
from shared.proto_gen import kvtransfer_pb2 as kv_pb
from shared.proto_gen import kvtransfer_pb2_grpc as kv_grpc
from shared.proto_gen import worker_pb2 as pb
from shared.proto_gen import worker_pb2_grpc as pb_grpc
from tests.waiting import wait_until
from tools.bench import chaos_bench
from tools.bench.chaos_bench import ChaosBenchPlan

pytestmark = pytest.mark.real_model

WORKERS = 3
TOPICS = ("a lighthouse keeper", "a fox in the snow", "a clockmaker", "a river boat")


@pytest.fixture(scope="module")
def stack():
    raw = loopback_config({"prefill": 1, "decode": 2})
    raw["coordinator"]["replicas"] = 2
    with start_local_stack(parse_config(raw), startup_timeout_s=240) as running:
        assert wait_until(lambda: all(_serving(running, u) for u in running.coordinator_urls), 30)
        yield running


def _ready(url: str) -> dict:
    try:
        return httpx.get(f"{url}/ready", timeout=5).json()
    except (httpx.HTTPError, ValueError):
        return {"ready": False, "workers": {}}


def _answers(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def _serving(stack, url: str) -> bool:
    """`url`'s coordinator routes to every worker of the stack."""
    workers = _ready(url)["workers"].values()
    return sum(w["alive"] and not w["draining"] for w in workers) == WORKERS


def _view(url: str) -> dict[str, tuple[int, int]]:
    """What a coordinator's index holds per live worker: (last event seq, blocks)."""
    workers = _ready(url)["workers"]
    return {w: (i["kv_event_seq"], i["kv_blocks"]) for w, i in workers.items() if i["alive"]}


def _one_view(stack) -> bool:
    views = [_view(u) for u in stack.coordinator_urls]
    return len(views[0]) == WORKERS and all(v == views[0] for v in views)


def _chat(url: str, messages: list[dict], max_tokens: int = 12) -> tuple[str, str]:
    """(text, decode worker id) of one greedy reply."""
    body = {"model": DEFAULT_MODEL_ID, "messages": messages, "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True}  # fmt: skip
    resp = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    data = resp.json()
    return data["choices"][0]["message"]["content"], data["metadata"]["replica"].rpartition("->")[2]


def _opening(i: int) -> list[dict]:
    text = f"Tell me a long story about {TOPICS[i % len(TOPICS)]}, with many small details."
    return [{"role": "user", "content": text}]


def _next_turn(conversation: list[dict], reply: str, n: int) -> list[dict]:
    return [*conversation, {"role": "assistant", "content": reply},
            {"role": "user", "content": f"Go on ({n})."}]  # fmt: skip


@pytest.fixture(scope="module")
def conversations(stack) -> list[dict]:
    """Four conversations, opened alternately on each coordinator: their messages so far and
    the decode replica that holds them."""
    urls = stack.coordinator_urls
    out = []
    for i in range(len(TOPICS)):
        messages = _opening(i)
        reply, decode = _chat(urls[i % 2], messages)
        out.append({"messages": messages, "reply": reply, "decode": decode, "opened_on": i % 2})
    return out


def test_both_coordinators_serve_alike_and_hold_one_view(stack, conversations):
    a, b = stack.coordinator_urls
    same = _opening(9)
    assert _chat(a, same)[0] == _chat(b, same)[0]  # greedy: the same text whoever serves
    # Every event reached both: the same seq and blocks per worker (within a heartbeat).
    assert wait_until(lambda: _one_view(stack), 5), [_view(u) for u in stack.coordinator_urls]
    # A conversation opened on one coordinator, continued on the other: routed to the replica
    # holding it, by the index the other one's events fed.
    for n, c in enumerate(conversations):
        other = stack.coordinator_urls[1 - c["opened_on"]]
        messages = _next_turn(c["messages"], c["reply"], n)
        reply, decode = _chat(other, messages)
        assert decode == c["decode"], (n, c["decode"], decode)
        c.update(messages=messages, reply=reply)


# Every internal RPC kind a stranger could try: one call per worker service, and the registry.
WORKER_CALLS = {
    "Stats": lambda ch: pb_grpc.WorkerStub(ch).Stats(pb.StatsRequest()),
    "Abort": lambda ch: pb_grpc.WorkerStub(ch).Abort(pb.AbortRequest(request_id="someone's")),
    "Decode": lambda ch: list(pb_grpc.WorkerStub(ch).Decode(pb.DecodeRequest())),
    "Prefill": lambda ch: list(pb_grpc.WorkerStub(ch).Prefill(pb.PrefillRequest())),
}
DECODE_CALLS = {
    "Release": lambda ch: kv_grpc.KvTransferControlStub(ch).Release(kv_pb.ReleaseRequest()),
}
REGISTRY_CALLS = {
    "Heartbeat": lambda ch: pb_grpc.RegistryStub(ch).Heartbeat(pb.HeartbeatRequest()),
}


def _code(address: str, call) -> grpc.StatusCode:
    with grpc.insecure_channel(address) as channel:
        try:
            call(channel)
        except grpc.RpcError as exc:
            return exc.code()
    return grpc.StatusCode.OK


def test_internal_calls_without_the_runs_token_are_refused_by_every_service(stack):
    """`splitserve up` turns internal auth on: a call without the run's token to a worker
    (either role, every service it serves) or to a registry is UNAUTHENTICATED."""
    workers = _ready(stack.url)["workers"]
    codes = {}
    for worker_id, info in workers.items():
        calls = {**WORKER_CALLS, **(DECODE_CALLS if info["role"] == "decode" else {})}
        for name, call in calls.items():
            codes[(worker_id, name)] = _code(info["address"], call)
    for c in stack.coordinators:
        for name, call in REGISTRY_CALLS.items():
            codes[(c.name, name)] = _code(f"{c.host}:{c.registry_port}", call)
    assert len(codes) == 3 * 4 + 2 + 2
    assert set(codes.values()) == {grpc.StatusCode.UNAUTHENTICATED}, codes
    # With the token the same call works; each refusal was logged where it happened.
    with stack.internal_auth.sync_channel(next(iter(workers.values()))["address"]) as channel:
        assert pb_grpc.WorkerStub(channel).Stats(pb.StatsRequest(), timeout=5).json
    for name in ("prefill-0", "decode-0", "decode-1"):
        log = (stack.run_dir / f"{name}.log").read_text()
        assert "refused an unauthenticated call to /splitserve.worker.v1.Worker/Abort" in log


def test_kill_one_the_other_serves_every_worker_and_the_restarted_one_converges(
    stack, conversations
):
    a, b = stack.coordinator_urls
    assert wait_until(lambda: _one_view(stack), 5)
    restarts = stack.supervisor.restarts("coordinator-1")
    killed_at = time.monotonic()
    stack.processes["coordinator-1"].kill(signal.SIGKILL)

    # The survivor: a new request succeeds at once, and past a heartbeat timeout it still
    # routes to every worker (their heartbeats to it never stopped).
    _chat(a, _opening(10), max_tokens=4)
    assert time.monotonic() - killed_at < 2.0
    time.sleep(stack.config.coordinator.heartbeat_timeout_s + 0.5)
    assert _serving(stack, a)
    decodes: set[str] = set()
    lock = threading.Lock()

    def stream(i: int) -> None:
        # Long enough that each stream still decodes when the next leaves the one prefill
        # replica (which serialises them on a loaded machine): the router sees them at once.
        _, decode = _chat(a, _opening(20 + i), max_tokens=48)
        with lock:
            decodes.add(decode)

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert len(decodes) == 2  # concurrent streams spread over both decode replicas

    # The restarted coordinator: every worker registers with it again and sends a snapshot.
    assert wait_until(lambda: stack.supervisor.restarts("coordinator-1") > restarts, 15)
    assert wait_until(lambda: _answers(b), 60, 0.02)
    up_at = time.monotonic()
    assert wait_until(lambda: _serving(stack, b) and _one_view(stack), 10, 0.02)
    converged_s = time.monotonic() - up_at
    # One heartbeat interval (0.5 s here) for each worker to hear "unknown", then a
    # registration and a snapshot each.
    assert converged_s < 2.0, converged_s
    # It routes what it never saw happen (the turns before its restart) like the other one.
    for n, c in enumerate(conversations):
        reply, decode = _chat(b, _next_turn(c["messages"], c["reply"], 100 + n))
        assert decode == c["decode"], (n, c["decode"], decode)


def test_bench_chaos_kill_coordinator_loses_only_the_killed_coordinators_streams(stack):
    # The benchmark's scenario, small: 4 streams over both coordinators, the second killed.
    assert wait_until(lambda: stack.supervisor.is_ready("coordinator-1"), 30)
    assert wait_until(lambda: _one_view(stack), 10)
    spec = ChaosBenchPlan(streams=4, max_tokens=16, prefill=1, coordinators=2, hit_after_tokens=3)
    s = chaos_bench._scenario(stack, spec, "kill_coordinator", WORKERS)
    assert s["on_killed_coordinator"] == 2 and s["failed_on_survivors"] == 0, s
    assert s["identical"] >= 2 and s["leaked_blocks"] == 0, s
    assert s["new_request_s"] is not None and s["new_request_s"] < 2.0, s
    assert s["recovery_s"] is not None and s["converged_s"] < 2.0, s
    assert chaos_bench.met_targets("kill_coordinator", s), s
