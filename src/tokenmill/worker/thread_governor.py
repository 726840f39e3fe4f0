"""How many threads a forward uses, chosen from the steps' own speed. Torch-free: the engine applies the count.

A decode step splits each matmul into one share per thread and waits for the last share (a prefill's matmuls go in
small units the threads take as they come free, ``csrc/work_units.h``, so a slowed thread costs a prefill only the
share it does not take). When another process holds one of the cores, the thread on it runs a fraction of the time
and every decode step waits for it: on 2 cores the 135M decoded at 35.7 tokens/s with 2 threads against 122.7 with 1
(AMD EPYC family 26). The governor compares the steps' efficiency (their roofline bound over their wall time,
``tokenmill.measure.roofline``, so a big step and a small one compare) at the thread count in use and at one fewer:
every ``probe_every`` decode steps it runs
``probe_steps`` steps at the other count and keeps whichever was faster by more than ``margin``. A count that
keeps winning is probed more rarely (the interval doubles up to ``max_probe_every``), so on a quiet machine the
probes cost about ``probe_steps / max_probe_every`` of the steps at the slower count; a sudden slowdown (a decode
step at less than ``collapse`` of the count's usual efficiency, ``collapse_steps`` times in a row) probes at once.
The usual efficiency is the median of the chosen count's last ``usual_steps`` decode steps, slow ones included:
real steps scatter (a speculative verification, the memory's changing speed), and a figure that left the slow
steps out would only rise, until ordinary steps read as collapsed and probed every few steps (seen beside a
neighbour on an AMD EPYC family 26, 2026-12-07: a probe back into its core every three steps, half the one-thread
rate).
A probe that cannot win ends early, keeping the count: its first ``probe_abort_steps`` steps all below
``abort_below`` of the chosen count's efficiency, or one below ``collapse`` of it; a probe that ended in a collapse
puts the next one four times as far off (``collapse_backoff``; a merely slower one doubles the interval), since each
probe back into a busy neighbour's core costs a step several times a one-thread step's. On a quiet machine one thread
fewer is plainly slower (the 1.5B's 16-row decode steps took 0.26 s at one thread against 0.15 s at two: six such
steps a probe cost 3-4% of a short run), and beside a busy neighbour every probe back to two threads is a step that
waits for the starved one. Switching still takes the whole probe. The first probe comes after
``first_probe_after`` decode steps: an engine that starts beside a busy neighbour has no quiet steps to see a
collapse against.
Where the kernel's counters can be read (``worker/cpu_load.py``), a periodic probe back to more threads waits while
other processes hold the cores those threads would need (less than half a core free per added thread): beside a
busy neighbour it would run a step that waits for a starved thread, and the counters say so for free; so does a
slowdown at the lowered count, which more threads cannot cure while their cores are taken. A periodic probe waits at
most ``max_deferral`` decode steps past its time; if that probe wins anyway, the counters misled (a host's load seen
from inside a container) and the governor stops reading them. Before the first probe, a reading of at least
``neighbour_cores`` while every thread runs starts it at once (a neighbour spinning on one of 2 cores read 0.3-1.0
cores beside two threads, a quiet machine 0.0-0.14): an engine started beside a busy neighbour then spends one
reading's window, not ``first_probe_after`` steps, waiting for the starved thread.
A step with prompt tokens in it always runs at the chosen count: a probe pauses for it (``begin_step``), so a
prompt that arrives during a probe does not wait on the count under trial. Only decode steps decide, so a run of
prompt steps alone (prefills of one token each) would keep a count chosen beside a neighbour long after it left:
where the counters saw the cores taken while the count was lowered, a prompt step whose reading shows them free
again (at most a quarter of a core taken per thread to add) returns to every thread at once, and the decode steps
judge that count afresh. An engine out of work ends a probe without a verdict (``idle``): torch's count is
process-wide, and the trial's must not outlast the work.
"""

from __future__ import annotations

import statistics
from collections import Counter, deque
from collections.abc import Callable

from tokenmill.worker.cpu_load import CpuLoad


class ThreadGovernor:
    def __init__(
        self,
        max_threads: int,
        set_threads: Callable[[int], None],
        probe_every: int = 32,
        max_probe_every: int = 512,
        probe_steps: int = 6,
        margin: float = 0.10,
        collapse: float = 0.6,
        collapse_steps: int = 3,
        probe_abort_steps: int = 2,
        abort_below: float = 0.8,
        first_probe_after: int = 8,
        collapse_backoff: int = 4,
        load: CpuLoad | None = None,
        max_deferral: int = 4096,
        neighbour_cores: float = 0.4,
        usual_steps: int = 16,
    ) -> None:
        if max_threads < 2:
            raise ValueError(f"a thread governor needs at least 2 threads, got {max_threads}")
        self.max_threads, self._set_threads = max_threads, set_threads
        self.num_threads = max_threads  # the chosen count
        self._applied = max_threads  # the count last set
        # the first probe comes early (an engine started beside a busy neighbour has no collapse to see), the next
        # ones twice as far apart each time the count wins, from probe_every again after a switch
        self.probe_every, self.min_probe_every, self.max_probe_every = (
            first_probe_after,
            probe_every,
            max_probe_every,
        )
        self.probe_steps, self.margin = probe_steps, margin
        self.collapse, self.collapse_steps = collapse, collapse_steps
        self.probe_abort_steps, self.abort_below = probe_abort_steps, abort_below
        self.collapse_backoff = collapse_backoff
        self._load, self.max_deferral, self.neighbour_cores = load, max_deferral, neighbour_cores
        self.num_probes = 0
        self.num_probes_deferred = 0  # decode steps a due probe waited for taken cores
        self.decode_steps_at: Counter[int] = Counter()  # decode steps run at each thread count
        self._recent: deque[float] = deque(maxlen=probe_steps)  # efficiencies at the chosen count
        self._probe: list[float] = []  # efficiencies at the probed count, while probing
        self._probing: int | None = None  # the count being probed
        self._since_probe = 0
        self._num_slow = 0
        # the chosen count's last decode steps' efficiencies, slow ones included: their median is the usual one
        self._usual: deque[float] = deque(maxlen=usual_steps)
        self.num_switches = 0
        self.num_returns = 0  # returns to every thread that the counters decided, at prompt steps
        self._lowered_beside_neighbour = False  # the counters saw the cores taken while the count was lowered

    def begin_step(self, kind: str) -> None:
        """Called before a step's forward with its kind (``roofline.step_kind``): a probe runs on decode steps
        alone, and any other step runs at the chosen count."""
        if self._probing is not None:
            self._apply(self._probing if kind == "decode" else self.num_threads)
        elif kind != "decode" and self._neighbour_left():
            self._return_to_every_thread()

    def idle(self) -> None:
        """The engine has no work left: a probe in flight ends without a verdict, at the chosen count."""
        if self._probing is not None:
            self._probing, self._probe = None, []
            self._apply(self.num_threads)

    def _read_load(self) -> float | None:
        """The counters' reading (None without them); at a lowered count, one that shows the cores taken is
        remembered for :meth:`_neighbour_left`."""
        if self._load is None:
            return None
        other = self._load.other_cores()
        if other is not None and self.num_threads < self.max_threads and self._cores_taken():
            self._lowered_beside_neighbour = True
        return other

    def _neighbour_left(self) -> bool:
        """The counters saw the cores taken while the count was lowered, and their reading now shows them free: at
        most a quarter of a core taken per thread the return would add."""
        added = self.max_threads - self.num_threads
        other = self._read_load() if added > 0 else None
        if other is None or self._load is None:
            return False
        return (
            self._lowered_beside_neighbour and other <= self._load.num_cpus - self.max_threads + 0.25 * added
        )

    def _return_to_every_thread(self) -> None:
        """Every thread again, judged afresh by the decode steps to come (a probe of one fewer comes early)."""
        self.num_threads, self.num_switches, self.num_returns = (
            self.max_threads,
            self.num_switches + 1,
            self.num_returns + 1,
        )
        self._lowered_beside_neighbour = False
        self._recent.clear()
        self._usual.clear()
        self._num_slow, self._since_probe = 0, 0
        self.probe_every = self.min_probe_every
        self._apply(self.num_threads)

    @property
    def applied(self) -> int:
        """The count this governor last set: what its engine's next forward should run at."""
        return self._applied

    def _apply(self, num_threads: int) -> None:
        if num_threads != self._applied:
            self._applied = num_threads
            self._set_threads(num_threads)

    def observe(self, kind: str, bound_s: float, step_s: float) -> None:
        """One step's kind (``roofline.step_kind``), roofline bound and wall time. Only decode steps decide: their
        cost is the weights' bytes, the same at every batch size, so their efficiencies compare."""
        if kind != "decode" or step_s <= 0 or bound_s <= 0:
            return
        efficiency = bound_s / step_s
        self.decode_steps_at[self._applied] += 1
        self._read_load()  # every window: a reading then covers the last one, not all since a probe
        if self._probing is not None:
            self._probe.append(efficiency)
            if len(self._probe) >= self.probe_steps or self._plainly_slower():
                self._decide()
            return
        slow = bool(self._usual) and efficiency < self.collapse * statistics.median(self._usual)
        self._num_slow = self._num_slow + 1 if slow else 0
        self._usual.append(efficiency)
        self._recent.append(efficiency)
        self._since_probe += 1
        if self._num_slow >= self.collapse_steps and self._cores_taken():
            self._num_slow = 0  # more threads would wait for the taken cores: nothing to probe
            self.num_probes_deferred += 1
        elif self._num_slow >= self.collapse_steps:  # compare with the slow steps alone: they are the present
            self._recent = deque(list(self._recent)[-self.collapse_steps :], maxlen=self.probe_steps)
            self._start_probe()
        elif self._neighbour_before_first_probe():
            self._start_probe()
        elif self._since_probe >= self.probe_every and len(self._recent) == self._recent.maxlen:
            if self._cores_taken() and self._since_probe < self.probe_every + self.max_deferral:
                self.num_probes_deferred += 1
            else:
                self._start_probe()

    def _neighbour_before_first_probe(self) -> bool:
        """No probe yet, every thread running, and the counters show another process holding a share of a core."""
        if self.num_probes or self.num_threads != self.max_threads or self._load is None:
            return False
        other = self._load.other_cores()
        return other is not None and other >= self.neighbour_cores

    def _cores_taken(self) -> bool:
        """A probe to more threads would find the cores they need taken: other processes' last reading leaves less
        than half a core free per added thread."""
        added = self._other() - self.num_threads
        if added <= 0 or self._load is None:
            return False
        other = self._load.other_cores()
        return other is not None and self._load.num_cpus - self.num_threads - other < 0.5 * added

    def _plainly_slower(self) -> bool:
        """The probe cannot win, so it ends: its first ``probe_abort_steps`` steps all below ``abort_below`` of the
        chosen count's efficiency, or its steps so far below ``collapse`` of it (a probe into a busy neighbour's
        core: every step it runs costs several)."""
        ratio = self._best_probe_ratio()
        early = len(self._probe) >= self.probe_abort_steps
        return ratio is not None and (ratio < self.collapse or (early and ratio < self.abort_below))

    def _collapsed(self) -> bool:
        """The probe's steps so far all below ``collapse`` of the chosen count's efficiency."""
        ratio = self._best_probe_ratio()
        return ratio is not None and ratio < self.collapse

    def _best_probe_ratio(self) -> float | None:
        """The probe's best step so far over the chosen count's usual efficiency; None with nothing to compare."""
        if not self._recent or not self._probe:
            return None
        return max(self._probe) / statistics.median(self._recent)

    def _other(self) -> int:
        return self.num_threads - 1 if self.num_threads == self.max_threads else self.max_threads

    def _start_probe(self) -> None:
        self._probing, self._probe, self._num_slow = self._other(), [], 0
        self.num_probes += 1
        self._apply(self._probing)

    def _decide(self) -> None:
        assert self._probing is not None
        current = statistics.median(self._recent) if self._recent else 0.0
        probed = statistics.median(self._probe)
        if probed > current * (1 + self.margin):
            if self._probing > self.num_threads and self._cores_taken():
                self._load = None  # more threads won where the counters said their cores were taken
            self.num_threads, self.num_switches = self._probing, self.num_switches + 1
            self._recent = deque(self._probe[-self.probe_steps :], maxlen=self.probe_steps)
            self._usual = deque(self._probe, maxlen=self._usual.maxlen)
            self.probe_every = self.min_probe_every
        else:
            backoff = self.collapse_backoff if self._collapsed() else 2
            self.probe_every = min(self.max_probe_every, backoff * self.probe_every)
        self._probing, self._probe, self._since_probe = None, [], 0
        self._lowered_beside_neighbour = False  # until a reading at the chosen count says otherwise
        self._apply(self.num_threads)
