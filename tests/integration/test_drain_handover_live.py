"""SIGTERM of a decode worker whose drain grace (0.5 s) is shorter than its streams, on real
processes on loopback: the streams still running when the grace runs out are handed over to
the other decode replica and finish there with the uninterrupted greedy text (no token lost
or doubled), each one's `metadata.attempts` records the move as `drain`, the drained worker
exits, and the survivor holds no KV block once the streams are done."""

from __future__ import annotations

import json
import signal

import pytest

from services.launcher import start_local_stack
from shared.config.schema import parse_config
from shared.proto_gen import worker_pb2 as pb
from shared.proto_gen import worker_pb2_grpc as pb_grpc
from tests.integration.test_local_stack import stack_config
from tests.integration.test_self_healing import Stream, _name_of, _prompts, _ready, _run_all
from tests.waiting import wait_until

pytestmark = pytest.mark.real_model

GRACE_S = 0.5
STREAMS = 6
# Several seconds of decoding each on a small CPU, against a 0.5 s grace once 4 are in.
MAX_TOKENS = 48


@pytest.fixture(scope="module")
def stack():
    raw = stack_config(prefill=1, decode=2)
    raw["worker_drain_grace_s"] = GRACE_S
    # Unsupervised: the drained worker stays gone, so its exit is what the test sees.
    with start_local_stack(parse_config(raw), startup_timeout_s=240, supervise=False) as running:
        yield running


def _held_blocks(stack, address: str) -> int:
    with stack.internal_auth.sync_channel(address) as channel:
        stats = json.loads(pb_grpc.WorkerStub(channel).Stats(pb.StatsRequest(), timeout=5).json)
    return stats["load"]["total_blocks"] - stats["load"]["free_blocks"]


def test_streams_outlasting_the_grace_move_to_the_other_decode_replica(stack):
    prompts = _prompts(STREAMS)
    calm = {s.prompt: s.text for s in _run_all(stack, prompts, max_tokens=MAX_TOKENS)}
    drained: dict[str, str] = {}

    def terminate_a_busy_decode(streams: list[Stream]) -> None:
        busy = next(s.decode for s in streams if s.decode and s.tokens)
        drained["worker_id"], drained["name"] = busy, _name_of(stack, busy)
        stack.processes[drained["name"]].kill(signal.SIGTERM)

    streams = _run_all(stack, prompts, terminate_a_busy_decode, max_tokens=MAX_TOKENS)
    assert [s.errors for s in streams] == [[]] * STREAMS
    assert all(s.finished for s in streams)
    assert [s.text == calm[s.prompt] for s in streams] == [True] * STREAMS

    victim = drained["worker_id"]
    on_victim = [s for s in streams if s.decode == victim]
    moved = [s for s in on_victim if [a["reason"] for a in s.attempts] == ["first", "drain"]]
    assert moved, [[a["reason"] for a in s.attempts] for s in on_victim]
    for s in moved:
        first, handed = s.attempts
        assert first["replica"].endswith(victim) and first["error"] is None
        assert victim not in handed["replica"] and handed["success"]
        assert 4 <= handed["after_tokens"] < MAX_TOKENS

    process = stack.processes[drained["name"]]
    assert process.wait(15) == 0, process.log_tail()  # a drain is a clean exit
    log = (stack.run_dir / f"{drained['name']}.log").read_text()
    assert "drained: every stream finished or was handed over" in log
    (survivor,) = [
        w
        for wid, w in _ready(stack)[1]["workers"].items()
        if w["role"] == "decode" and wid != victim
    ]
    assert wait_until(lambda: _held_blocks(stack, survivor["address"]) == 0, 10)
