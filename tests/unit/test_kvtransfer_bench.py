"""The transfer bench runs end to end between two processes and reports what it says."""

from __future__ import annotations

from tools.bench.transfer_bench import format_report, run_transfer_bench
from tools.bench.transfer_peer import alarm_after


def test_bench_reports_backend_and_memcpy_figures():
    with alarm_after(120):
        report = run_transfer_bench(sizes_mib=(1, 4), backends=("tcp",), repeats=1)
    assert report["memcpy_gb_s"] > 0
    tcp = report["backends"]["tcp"]
    assert set(tcp) == {"gb_s_1mib", "gb_s_4mib"}
    assert all(v > 0 for v in tcp.values())
    assert "ratio_best_same_host_vs_memcpy_64mib" not in report  # 64 MiB was not measured
    text = format_report(report)
    assert "memcpy" in text and "tcp" in text
