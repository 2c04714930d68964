"""The pure parts of retries and cancellation: what each attempt asks for, the
conversation-affinity LRU, the worker's cancelled-request memory, the fault knob's schema."""

from __future__ import annotations

import pytest

from services.coordinator.attempt.progress import RequestProgress, attempt_request_id
from services.coordinator.generation_backend import GenerationRequest, ReplicaLost
from services.coordinator.route.affinity import ConversationAffinity
from services.worker.runtime import CancelledRequests
from shared.config.schema import ConfigError, parse_config
from shared.sampling.params import SamplingParams


def progress(max_tokens: int = 10) -> RequestProgress:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, seed=7, stop=("x",))
    request = GenerationRequest("r1", "m", [1, 2, 3], params, 1, "default", prompt_logprobs=True)
    return RequestProgress(request)


def test_one_id_scheme_for_every_attempt():
    assert attempt_request_id("r1", 0) == "r1"
    assert [attempt_request_id("r1", n) for n in (1, 2)] == ["r1~1", "r1~2"]


def test_first_attempt_is_the_request_itself():
    p = progress()
    attempt, sub = p.begin("m", "first")
    assert sub.request_id == "r1" and sub.exclude == frozenset()
    assert sub.prompt_token_ids == [1, 2, 3] and sub.prompt_logprobs
    assert sub.params is p.request.params
    assert (attempt.reason, attempt.after_tokens) == ("first", 0)


def test_a_fallback_before_any_token_asks_the_same_of_another_model():
    p = progress()
    p.begin("m", "first")
    attempt, sub = p.begin("other", "fallback")
    assert (sub.request_id, sub.model, sub.prompt_token_ids) == ("r1~1", "other", [1, 2, 3])
    assert sub.prompt_logprobs and sub.params is p.request.params


def test_continuation_carries_streamed_tokens_and_the_rest_of_the_budget():
    p = progress(max_tokens=10)
    p.begin("m", "first")
    p.streamed.extend([9, 8, 7, 6])
    p.exclude.add("D0")
    attempt, sub = p.begin("m", "migration")
    assert (attempt.after_tokens, p.migrations) == (4, 1)
    assert sub.request_id == "r1~1" and sub.exclude == frozenset({"D0"})
    assert sub.prompt_token_ids == [1, 2, 3, 9, 8, 7, 6]
    assert sub.params.max_tokens == 6  # prompt + output still ends where the original would
    assert (sub.params.seed, sub.params.stop, sub.params.temperature) == (7, ("x",), 0.0)
    assert not sub.prompt_logprobs  # the client's prompt was the first attempt's
    assert p.request.prompt_token_ids == [1, 2, 3]  # the client's request is untouched
    assert [a["reason"] for a in p.metadata()] == ["first", "migration"]


def test_give_up_message_counts_the_moves_that_got_a_pair():
    p = progress()
    first, _ = p.begin("m", "first")
    first.replica = "P0->D0"
    moved, _ = p.begin("m", "migration")
    moved.replica = "P0->D1"
    p.begin("m", "migration")  # found no pair
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
