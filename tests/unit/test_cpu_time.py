"""CPU seconds of other processes from /proc: a busy child's grow by what it burned, an idle
one's barely move, and a pid that is gone gives None rather than a wrong total."""

from __future__ import annotations

import subprocess
import sys
import time

from tools.bench.cpu_time import process_cpu_s, total_cpu_s

BURN = "import time\nend = time.process_time() + {s}\nwhile time.process_time() < end: pass\n"


def test_cpu_seconds_of_a_busy_and_an_idle_child():
    busy = subprocess.Popen([sys.executable, "-c", BURN.format(s=0.6) + "time.sleep(30)"])
    idle = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        deadline = time.monotonic() + 20
        while (process_cpu_s(busy.pid) or 0.0) < 0.6 and time.monotonic() < deadline:
            time.sleep(0.1)
        burned = process_cpu_s(busy.pid)
        assert burned is not None and 0.6 <= burned < 2.0  # plus interpreter start-up
        rested = process_cpu_s(idle.pid)
        assert rested is not None and rested < burned
        assert total_cpu_s([busy.pid, idle.pid]) >= burned
    finally:
        busy.kill()
        idle.kill()
        busy.wait()
        idle.wait()
    assert process_cpu_s(busy.pid) is None  # reaped: no such process
    assert total_cpu_s([idle.pid]) is None
