"""How much of this process's cores other processes take, from the kernel's counters (Linux; torch-free).

``/proc/stat`` counts each CPU's busy time since boot, ``time.process_time`` this process's (every thread's) CPU
time; over a window, the cores' busy time less this process's is what other processes ran on them. Beside a
neighbour spinning on one of 2 cores that reads 0.9-1.0 core-equivalents in every 0.1 s window while tokenmill
decodes on one thread, and 0.0-0.1 without it (AMD EPYC family 25 model 17); a reading costs about 35
microseconds. The thread governor (``worker/thread_governor.py``) reads it to skip a probe back to more threads
while the cores those threads would need are taken: such a probe runs a step that waits for a starved thread.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

# /proc/stat's per-CPU columns: user nice system idle iowait irq softirq steal ...; busy is all but idle and iowait
# (steal, time the hypervisor gave another guest, is a core this process could not have either)
_BUSY_COLUMNS = (0, 1, 2, 5, 6, 7)


def read_busy_s(cpus: frozenset[int], stat_path: str = "/proc/stat") -> float:
    """The busy seconds since boot of `cpus`, summed; OSError if the counters cannot be read, ValueError if a
    CPU of `cpus` is not among them."""
    ticks_per_s = os.sysconf("SC_CLK_TCK")
    busy, seen = 0, set()
    with open(stat_path) as f:
        for line in f:
            if not (line.startswith("cpu") and line[3:4].isdigit()):
                continue
            name, *values = line.split()
            cpu = int(name[3:])
            if cpu in cpus:
                columns = [int(v) for v in values]
                busy += sum(columns[i] for i in _BUSY_COLUMNS if i < len(columns))
                seen.add(cpu)
    if seen != cpus:
        raise ValueError(f"{stat_path} has no counters for CPUs {sorted(cpus - seen)}")
    return busy / ticks_per_s


class CpuLoad:
    """Other processes' load on this process's CPUs, in cores, over windows of at least ``min_window_s``."""

    def __init__(
        self,
        cpus: frozenset[int],
        read_busy: Callable[[], float],
        own_cpu_s: Callable[[], float] = time.process_time,
        clock: Callable[[], float] = time.monotonic,
        min_window_s: float = 0.1,
    ) -> None:
        if not cpus:
            raise ValueError("CpuLoad needs at least one CPU")
        self.num_cpus = len(cpus)
        self._read_busy, self._own_cpu_s, self._clock = read_busy, own_cpu_s, clock
        self.min_window_s = min_window_s
        self._last = self._snapshot()
        self._reading: float | None = None  # over the last window

    @classmethod
    def of_this_process(cls) -> CpuLoad | None:
        """The reader for the CPUs this process may run on, or None where the counters cannot be read."""
        try:
            cpus = frozenset(os.sched_getaffinity(0))
            read_busy_s(cpus)
        except (AttributeError, OSError, ValueError):
            return None
        return cls(cpus, lambda: read_busy_s(cpus))

    def _snapshot(self) -> tuple[float, float, float]:
        return self._clock(), self._read_busy(), self._own_cpu_s()

    def other_cores(self) -> float | None:
        """Cores' worth of CPU time other processes took over the last window (never below 0): read anew once
        ``min_window_s`` has passed since the last reading, else that reading again; None before the first reading
        and once the counters stop reading. At most every CPU: the counters move in clock ticks (10 ms each), so a
        window of a few ticks can read more busy time than it lasted."""
        if self._clock() - self._last[0] < self.min_window_s:
            return self._reading
        try:
            now = self._snapshot()
        except (OSError, ValueError):
            self._reading = None
            return None
        (t0, busy0, own0), (t1, busy1, own1) = self._last, now
        self._last = now
        self._reading = min(float(self.num_cpus), max(0.0, ((busy1 - busy0) - (own1 - own0)) / (t1 - t0)))
        return self._reading
