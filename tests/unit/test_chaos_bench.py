"""The `bench chaos` report: per-scenario keys and figures from known stream results."""

from __future__ import annotations

from tools.bench.chaos_bench import StreamResult, met_targets, summarize_streams, table_rows


def test_summary_counts_identical_failed_and_the_p99_of_each_streams_longest_stall():
    streams = [
        StreamResult("a", text="one two", gaps_ms=[10.0, 250.0, 12.0]),
        StreamResult("b", text="changed", gaps_ms=[11.0, 13.0]),
        StreamResult("c", text="", error="giving up after 2 migrations"),
    ]
    reference = {"a": "one two", "b": "three four", "c": "five"}
    summary = summarize_streams(streams, reference)
    assert summary["streams"] == 3 and summary["failed"] == 1
    assert summary["identical"] == 1  # a; b differs, c failed
    # Longest gaps of the survivors are 250 and 13: their p99 interpolates between them.
    assert summary["p99_stall_ms"] == round(13.0 + (250.0 - 13.0) * 0.99, 1)
    assert summary["errors"] == ["giving up after 2 migrations"]
    assert "identical" not in summarize_streams(streams, None)  # the calm run has no reference


def test_table_rows_hold_each_figure_beside_its_target():
    calm = {"streams": 2, "failed": 0, "p99_stall_ms": 50.0}
    scenario = {"streams": 2, "identical": 2, "failed": 0, "leaked_blocks": 0}
    result = {
        "scenarios": {
            "kill_decode": {**scenario, "recovery_s": 4.2, "p99_stall_ms": 100.0, "calm": calm}
        }
    }
    result["scenarios"]["drain_decode"] = {
        **scenario, "recovery_s": 3.0, "p99_stall_ms": 80.0, "calm": calm, "handed_over": 1
    }  # fmt: skip
    rows = {name: (ours, ref, ratio) for name, ours, ref, ratio in table_rows(result)}
    assert rows["drain_decode: handed over"] == (1, None, None)
    assert rows["kill_decode: identical / streams"] == (2, 2, None)
    assert rows["kill_decode: leaked blocks"] == (0, 0, None)
    assert rows["kill_decode: p99 stall ms vs calm"] == (100.0, 50.0, 2.0)


def test_kill_coordinator_targets_allow_failures_only_on_the_killed_coordinator():
    good = {"streams": 16, "identical": 8, "on_killed_coordinator": 8, "failed_on_survivors": 0,
            "leaked_blocks": 0, "new_request_s": 0.04}  # fmt: skip
    assert met_targets("kill_coordinator", good)
    assert not met_targets("kill_coordinator", {**good, "failed_on_survivors": 1})
    assert not met_targets("kill_coordinator", {**good, "identical": 7})
    assert not met_targets("kill_coordinator", {**good, "new_request_s": 2.5})
    assert not met_targets("kill_coordinator", {**good, "new_request_s": None})  # never served
    assert not met_targets("kill_decode", good)  # a worker scenario must lose nothing
    rows = table_rows(
        {"scenarios": {"kill_coordinator": {**good, "failed": 8, "recovery_s": 3.1,
         "converged_s": 0.6, "p99_stall_ms": 90.0, "calm": {"p99_stall_ms": 60.0}}}}
    )  # fmt: skip
    by_name = {name: (ours, ref) for name, ours, ref, _ in rows}
    assert by_name["kill_coordinator: new request (s)"] == (0.04, 2.0)
    assert by_name["kill_coordinator: failed on survivors"] == (0, 0)
