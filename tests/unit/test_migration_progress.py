"""The pure parts of migration and cancellation: what a continuation asks for, the
conversation-affinity LRU, the worker's cancelled-request memory, the fault knob's schema."""

from __future__ import annotations

import pytest

from services.coordinator.affinity import ConversationAffinity
from services.coordinator.migration import ReplicaLost, StreamProgress
from services.worker.runtime import CancelledRequests
from shared.config.schema import ConfigError, parse_config
from shared.sampling.params import SamplingParams


def progress(max_tokens: int = 10, limit: int = 2) -> StreamProgress:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, seed=7, stop=("x",))
    return StreamProgress("r1", [1, 2, 3], params, limit)


def test_first_attempt_is_the_request_itself():
    p = progress()
    assert p.attempt_request_id() == "r1"
    assert p.attempt_prompt() == [1, 2, 3]
    assert p.attempt_params() is p.params


def test_continuation_carries_streamed_tokens_and_the_rest_of_the_budget():
    p = progress(max_tokens=10)
    p.streamed.extend([9, 8, 7, 6])
    m = p.record("P0->D0", "P0->D1", "UNAVAILABLE: gone")
    assert (m.after_tokens, p.attempt) == (4, 1)
    assert p.attempt_request_id() == "r1~m1"
    assert p.attempt_prompt() == [1, 2, 3, 9, 8, 7, 6]
    params = p.attempt_params()
    assert params.max_tokens == 6  # prompt + output still ends where the original would
    assert (params.seed, params.stop, params.temperature) == (7, ("x",), 0.0)
    assert p.metadata() == [
        {"from": "P0->D0", "to": "P0->D1", "after_tokens": 4, "reason": "UNAVAILABLE: gone"}
    ]


def test_limit_and_give_up_message():
    p = progress(limit=1)
    assert p.can_migrate
    p.record("a", "b", "x")
    assert not p.can_migrate
    message = p.give_up_message(ReplicaLost("D1", "CANCELLED: boom"))
    assert message.endswith("migrated 1 times; giving up")
    assert "D1" in message and "CANCELLED: boom" in message


def test_affinity_keys_by_user_and_leading_block():
    a = ConversationAffinity(block_size=4, capacity=2)
    turn1, turn2 = [1, 2, 3, 4, 5], [1, 2, 3, 4, 5, 6, 7, 8]
    a.remember("alice", turn1, "D0")
    assert a.previous("alice", turn2) == "D0"  # the next turn of the same conversation
    assert a.previous("bob", turn2) is None  # another user with the same system prompt
    assert a.previous("alice", [9, 2, 3, 4, 5]) is None  # another conversation
    assert a.previous(None, turn2) is None  # anonymous: no key
    a.remember("alice", [1, 2, 3], "D1")  # shorter than a block: not remembered
    assert len(a) == 1


def test_affinity_is_a_bounded_lru():
    a = ConversationAffinity(block_size=1, capacity=2)
    a.remember("u", [1], "D0")
    a.remember("u", [2], "D1")
    assert a.previous("u", [1]) == "D0"  # touch: [2] is now the oldest
    a.remember("u", [3], "D2")
    assert a.previous("u", [2]) is None
    assert (a.previous("u", [1]), a.previous("u", [3])) == ("D0", "D2")
    with pytest.raises(ValueError):
        ConversationAffinity(block_size=1, capacity=0)


def test_cancelled_requests_expire_and_stay_bounded():
    c = CancelledRequests(ttl_s=10.0, capacity=2)
    c.add("a", now=0.0)  # long expired by the time we ask
    assert "a" not in c
    c.add("b")
    c.add("c")
    c.add("d")  # over capacity: the oldest goes
    assert "b" not in c and "c" in c and "d" in c


def test_fault_injection_is_off_by_default_and_validated():
    worker = parse_config({}).models[0].worker
    assert worker.fault_injection.first_token_delay_ms == 0
    assert not worker.fault_injection.active
    cfg = parse_config({"models": [{"worker": {"fault_injection": {"first_token_delay_ms": 250}}}]})
    faults = cfg.models[0].worker.fault_injection
    assert faults.active and faults.first_token_delay_s == 0.25
    with pytest.raises(ConfigError, match="first_token_delay_ms"):
        parse_config({"models": [{"worker": {"fault_injection": {"first_token_delay_ms": -1}}}]})
    with pytest.raises(ConfigError, match="fault_injection"):
        parse_config({"models": [{"worker": {"fault_injection": {"delay": 1}}}]})
