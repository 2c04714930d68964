"""The fp32 GEMM call choice: every call it may choose computes x @ W.T, with the same bits wherever
the weight was loaded from; the choice is measured once per weight shape and row count on a
machine, kept for the process, shared with the machine's other processes through a file, and
what is not measured (or not small) goes through `linear`."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.model import fp32_gemm
from engine.model.linear import Linear


@pytest.fixture
def fresh_choices(monkeypatch, tmp_path):
    """This process has chosen nothing, and the machine's choices file is a new one."""
    monkeypatch.setattr(fp32_gemm, "PROCESS_CHOICES", fp32_gemm.GemmCallChoices())
    path = tmp_path / "routes.json"
    monkeypatch.setattr(fp32_gemm, "choices_path", lambda threads: path)
    return path


def _fake_timing(monkeypatch, seconds: dict[str, float]) -> list[int]:
    """Each call takes the given time on every weight; returns a counter of passes timed."""
    passes = [0]

    def fake_pass(call, weights, xs):
        passes[0] += 1
        calls = {**fp32_gemm._calls(2), **fp32_gemm._calls(1)}
        name = next(n for n, c in calls.items() if c is call)
        slowest = max(seconds.values()) + 1.0  # a call the test does not price never wins
        return {(w.shape[0], w.shape[1]): seconds.get(name, slowest) for w in weights}

    monkeypatch.setattr(fp32_gemm, "_pass_seconds", fake_pass)
    return passes


def test_every_call_computes_the_same_product():
    torch.manual_seed(0)
    w = torch.randn(96, 64)
    for rows in (1, 2, 3, 8, 16):
        x = torch.randn(rows, 64)
        want = F.linear(x, w)
        for name, call in fp32_gemm._calls(rows).items():
            got = call(x, w)
            assert got.shape == want.shape and got.is_contiguous(), name
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_every_call_gives_the_same_bits_wherever_the_weight_was_loaded():
    # A weight read from a file can start 4 bytes past an aligned address; MKL computes other
    # bits for it. Aligned at load, it gives exactly what the same weight in fresh memory does.
    torch.manual_seed(4)
    w = torch.randn(384, 576)
    buffer = torch.empty(w.numel() + 32)
    offset = next(i for i in range(1, 32) if (buffer.data_ptr() + 4 * i) % 64 != 0)
    from_file = buffer[offset : offset + w.numel()].view_as(w)
    from_file.copy_(w)
    assert from_file.data_ptr() % 64 != 0
    loaded = Linear(from_file, "fp32")
    fresh = Linear(w.clone(), "fp32")
    assert loaded.fp32 is not None and loaded.fp32.data_ptr() % fp32_gemm.ALIGNMENT == 0
    assert torch.equal(loaded.fp32, w)
    for rows in range(1, 6):
        x = torch.randn(rows, 576)
        for name, call in fp32_gemm._calls(rows).items():
            assert torch.equal(call(x, loaded.fp32), call(x, fresh.fp32)), (name, rows)
        assert torch.equal(loaded(x), fresh(x)), rows


@pytest.mark.parametrize("inputs", [576, 100])  # 100: a tail past the last whole vector
def test_the_native_calls_compute_each_row_as_it_would_alone(inputs):
    """Both native fp32 loops (register tiles of six rows and two outputs; one output at a
    time over a single weight stream) give every row the bits it gets alone, and the same
    bits as each other: a verify step's rows never depend on their step-mates or on which
    loop this machine measured faster."""
    native = fp32_gemm._native_call()
    if native is None:
        pytest.skip("the native library cannot be built here (no compiler)")
    streamed = fp32_gemm._native_call(streamed=True)
    assert streamed is not None
    torch.manual_seed(5)
    w = fp32_gemm.aligned(torch.randn(131, inputs))  # an odd output count: a lone last output
    for rows in (2, 3, 5, 6, 7, 8, 9, 13, 16):
        x = torch.randn(rows, inputs)
        together = native(x, w)
        alone = torch.cat([native(x[r : r + 1], w) for r in range(rows)])
        assert torch.equal(together, alone), rows
        assert torch.equal(streamed(x, w), together), rows
        torch.testing.assert_close(together, F.linear(x, w), rtol=1e-5, atol=1e-4)


def test_the_streamed_native_call_is_offered_for_a_few_rows_only():
    if fp32_gemm._native_call() is None:
        pytest.skip("the native library cannot be built here (no compiler)")
    assert "native-streamed" not in fp32_gemm._calls(1)  # one row: the same loop as native
    assert "native-streamed" in fp32_gemm._calls(2)
    assert "native-streamed" in fp32_gemm._calls(fp32_gemm.STREAMED_MAX_ROWS)
    assert "native-streamed" not in fp32_gemm._calls(fp32_gemm.STREAMED_MAX_ROWS + 1)


def test_the_streamed_native_call_is_chosen_where_it_is_fastest(fresh_choices, monkeypatch):
    if fp32_gemm._native_call() is None:
        pytest.skip("the native library cannot be built here (no compiler)")
    torch.manual_seed(8)
    layer = Linear(torch.randn(48, 32), "fp32")
    timing = {"linear": 4.0, "weight-stationary": 3.0, "native": 2.0, "native-streamed": 1.0}
    _fake_timing(monkeypatch, timing)
    x = torch.randn(3, 32)
    torch.testing.assert_close(layer(x), F.linear(x, layer.fp32), rtol=1e-5, atol=1e-5)
    assert (
        fp32_gemm.PROCESS_CHOICES.chosen[(48, 32, 3, torch.get_num_threads())] == "native-streamed"
    )
    assert '"native-streamed"' in fresh_choices.read_text()  # shared with other processes


def test_the_native_call_is_chosen_where_it_is_fastest(fresh_choices, monkeypatch):
    if fp32_gemm._native_call() is None:
        pytest.skip("the native library cannot be built here (no compiler)")
    torch.manual_seed(6)
    layer = Linear(torch.randn(48, 32), "fp32")
    _fake_timing(monkeypatch, {"linear": 3.0, "weight-stationary": 2.0, "native": 1.0})
    x = torch.randn(4, 32)
    torch.testing.assert_close(layer(x), F.linear(x, layer.fp32), rtol=1e-5, atol=1e-5)
    assert fp32_gemm.PROCESS_CHOICES.chosen[(48, 32, 4, torch.get_num_threads())] == "native"


def test_a_batch_verify_step_takes_its_buckets_choice_measured_once(fresh_choices, monkeypatch):
    """Past SMALL_ROWS, row counts share their bucket's route: 17 and 20 rows (a batch's
    verify step) are served by what was measured at 24, once; past the last bucket, linear."""
    torch.manual_seed(7)
    layer = Linear(torch.randn(48, 32), "fp32")
    passes = _fake_timing(monkeypatch, {"linear": 3.0, "weight-stationary": 2.0, "native": 1.0})
    assert fp32_gemm.choice_rows(16) == 16 and fp32_gemm.choice_rows(17) == 24
    assert fp32_gemm.choice_rows(fp32_gemm.ROW_BUCKETS[-1]) == fp32_gemm.ROW_BUCKETS[-1]
    assert fp32_gemm.choice_rows(fp32_gemm.ROW_BUCKETS[-1] + 1) is None
    threads = torch.get_num_threads()
    for rows in (17, 20, 24):
        x = torch.randn(rows, 32)
        torch.testing.assert_close(layer(x), F.linear(x, layer.fp32), rtol=1e-5, atol=1e-5)
    measured = passes[0]
    assert measured > 0 and (24, threads) in fp32_gemm.PROCESS_CHOICES.settled
    assert not any(r in (17, 20) for _, _, r, _ in fp32_gemm.PROCESS_CHOICES.chosen)
    expected = "native" if fp32_gemm._native_call() is not None else "weight-stationary"
    assert fp32_gemm.PROCESS_CHOICES.chosen[(48, 32, 24, threads)] == expected
    layer(torch.randn(22, 32))
    assert passes[0] == measured  # the bucket is settled: nothing timed again
    fp32_gemm.settle(30)  # 1..16 one by one, then the buckets 24 (settled) and 32
    assert {r for r, t in fp32_gemm.PROCESS_CHOICES.settled if t == threads} == {
        *range(1, 17),
        24,
        32,
    }


def test_an_aligned_weight_is_not_copied():
    w = torch.randn(16, 8)
    assert w.data_ptr() % fp32_gemm.ALIGNMENT == 0
    assert fp32_gemm.aligned(w) is w


def test_choices_are_settled_once_per_row_count_over_registered_weights(fresh_choices):
    torch.manual_seed(1)
    layer = Linear(torch.randn(80, 48), "fp32")  # registers its weight
    x = torch.randn(3, 48)
    torch.testing.assert_close(layer(x), F.linear(x, layer.fp32), rtol=1e-5, atol=1e-5)
    threads = torch.get_num_threads()
    key = (80, 48, 3, threads)
    assert fp32_gemm.PROCESS_CHOICES.chosen[key] in fp32_gemm._calls(3)
    assert (3, threads) in fp32_gemm.PROCESS_CHOICES.settled
    assert f"80x48, 3 rows, {threads} threads" in fp32_gemm.chosen_calls()
    # The single-row call that pairs the row is offered for one row only.
    assert "paired" in fp32_gemm._calls(1) and "paired" not in fp32_gemm._calls(3)


def test_the_faster_call_is_kept_and_shared_with_the_machines_other_processes(
    fresh_choices, monkeypatch
):
    torch.manual_seed(2)
    layer = Linear(torch.randn(40, 24), "fp32")
    _fake_timing(monkeypatch, {"linear": 3.0, "weight-stationary": 1.0, "paired": 2.0})
    x = torch.randn(1, 24)
    torch.testing.assert_close(layer(x), F.linear(x, layer.fp32), rtol=1e-5, atol=1e-5)
    threads = torch.get_num_threads()
    assert fp32_gemm.PROCESS_CHOICES.chosen[(40, 24, 1, threads)] == "weight-stationary"
    # Another process on this machine: it reads the choice instead of timing its own.
    other = fp32_gemm.GemmCallChoices()
    other.weights = fp32_gemm.PROCESS_CHOICES.weights
    monkeypatch.setattr(fp32_gemm, "PROCESS_CHOICES", other)
    passes = _fake_timing(monkeypatch, {"linear": 1.0, "weight-stationary": 3.0, "paired": 2.0})
    layer(x)
    assert passes[0] == 0
    assert fp32_gemm.PROCESS_CHOICES.chosen[(40, 24, 1, threads)] == "weight-stationary"


def test_a_call_once_chosen_is_never_changed(fresh_choices, monkeypatch):
    torch.manual_seed(3)
    first = Linear(torch.randn(72, 40), "fp32")
    _fake_timing(monkeypatch, {"linear": 3.0, "weight-stationary": 1.0, "paired": 2.0})
    x = torch.randn(2, 40)
    first(x)
    threads = torch.get_num_threads()
    assert (2, threads) in fp32_gemm.PROCESS_CHOICES.settled
    # A shape nothing chose a route for: settled again, and now `linear` times faster; the
    # new shape takes it, the old one keeps its route (its products keep their bits).
    second = Linear(torch.randn(56, 40), "fp32")
    assert (2, threads) not in fp32_gemm.PROCESS_CHOICES.settled
    _fake_timing(monkeypatch, {"linear": 1.0, "weight-stationary": 3.0, "paired": 2.0})
    torch.testing.assert_close(second(x), F.linear(x, second.fp32), rtol=1e-5, atol=1e-5)
    assert fp32_gemm.PROCESS_CHOICES.chosen[(56, 40, 2, threads)] == "linear"
    assert fp32_gemm.PROCESS_CHOICES.chosen[(72, 40, 2, threads)] == "weight-stationary"


def test_an_unwritable_cache_still_chooses(fresh_choices, monkeypatch, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setattr(fp32_gemm, "choices_path", lambda threads: blocker / "routes.json")
    layer = Linear(torch.randn(32, 16), "fp32")
    x = torch.randn(2, 16)
    torch.testing.assert_close(layer(x), F.linear(x, layer.fp32), rtol=1e-5, atol=1e-5)
    assert (32, 16, 2, torch.get_num_threads()) in fp32_gemm.PROCESS_CHOICES.chosen


def test_large_batches_and_unregistered_weights_take_linear(fresh_choices):
    w = torch.randn(16, 8)  # never registered: no route for its shape
    x = torch.randn(2, 8)
    torch.testing.assert_close(fp32_gemm.fp32_linear(x, w), F.linear(x, w))
    assert (16, 8, 2, torch.get_num_threads()) not in fp32_gemm.PROCESS_CHOICES.chosen
    big = torch.randn(fp32_gemm.ROW_BUCKETS[-1] + 1, 8)
    torch.testing.assert_close(fp32_gemm.fp32_linear(big, w), F.linear(big, w))


def test_a_worker_chooses_for_every_row_count_before_it_serves(
    fresh_choices, monkeypatch, tmp_path
):
    """A decode replica's first verify step of a new batch size must not stall a live stream
    to time the GEMM calls: the runtime settles every count a step can have at start."""
    from engine.model.tiny import tiny_checkpoint, write_hf_folder
    from services.worker.runtime import WorkerRuntime
    from shared.config.schema import parse_config

    passes = _fake_timing(monkeypatch, {"linear": 1.0, "weight-stationary": 2.0, "native": 3.0})
    folder = write_hf_folder(tiny_checkpoint(seed=0), tmp_path / "tiny")
    config = parse_config(
        {
            "transfer": {"backend": "tcp"},
            "models": [
                {
                    "id": "tiny",
                    "path": str(folder),
                    "weights": "fp32",
                    "pools": {"prefill": 1, "decode": 1},
                    "worker": {"kv_cache_bytes": 4 << 20, "host_cache_bytes": 0, "threads": 1},
                }
            ],
        }
    )
    runtime = WorkerRuntime(config, "tiny", "decode", 0)
    try:
        threads = torch.get_num_threads()
        settled = {r for r, t in fp32_gemm.PROCESS_CHOICES.settled if t == threads}
        assert settled == {*range(1, fp32_gemm.SMALL_ROWS + 1), *fp32_gemm.ROW_BUCKETS}
        assert passes[0] > 0 and fresh_choices.is_file()  # measured once, kept for the machine
    finally:
        runtime.transfer.close()


def _contended_timing(monkeypatch, contended_rounds: int) -> list[int]:
    """Timing where the first `contended_rounds` rounds are preempted (and in them linear
    looks fastest); quiet rounds time weight-stationary fastest. Returns passes timed."""
    passes = [0]
    switches = [0]
    per_round = len(fp32_gemm._calls(2))

    def fake_pass(call, weights, xs):
        round_ = passes[0] // per_round
        passes[0] += 1
        name = next(n for n, c in fp32_gemm._calls(2).items() if c is call)
        if round_ < contended_rounds:
            switches[0] += 500  # another process's threads had the cores
            seconds = 1.0 if name == "linear" else 3.0
        else:
            seconds = 1.0 if name == "weight-stationary" else 2.0
        return {(w.shape[0], w.shape[1]): seconds for w in weights}

    monkeypatch.setattr(fp32_gemm, "_pass_seconds", fake_pass)
    monkeypatch.setattr(fp32_gemm, "_preemptions", lambda: switches[0])
    return passes


def test_a_preempted_round_does_not_count(fresh_choices, monkeypatch):
    """A round that other processes preempted is timed again: the route comes from quiet
    rounds only, and is what the machine's file then holds."""
    torch.manual_seed(11)
    layer = Linear(torch.randn(56, 24), "fp32")
    passes = _contended_timing(monkeypatch, contended_rounds=2)
    layer(torch.randn(2, 24))
    per_round = len(fp32_gemm._calls(2))
    assert passes[0] == per_round * (2 + fp32_gemm._ROUNDS)
    assert (
        fp32_gemm.PROCESS_CHOICES.chosen[(56, 24, 2, torch.get_num_threads())]
        == "weight-stationary"
    )
    assert '"weight-stationary"' in fresh_choices.read_text()


def test_a_machine_never_quiet_gets_the_best_of_every_round_and_a_warning(
    fresh_choices, monkeypatch, caplog
):
    torch.manual_seed(12)
    layer = Linear(torch.randn(56, 24), "fp32")
    passes = _contended_timing(monkeypatch, contended_rounds=10**6)
    with caplog.at_level("WARNING", logger=fp32_gemm.__name__):
        layer(torch.randn(2, 24))
    assert passes[0] == len(fp32_gemm._calls(2)) * fp32_gemm._MAX_ROUNDS
    assert fp32_gemm.PROCESS_CHOICES.chosen[(56, 24, 2, torch.get_num_threads())] == "linear"
    assert "preempted" in caplog.text
