"""The thread governor against a simulated machine: each step's efficiency depends on the thread count in use and
on whether a neighbour holds a core; with the kernel's load counters simulated too, and those counters' reader."""

from __future__ import annotations

import os
import time

import pytest

from tokenmill.worker.cpu_load import CpuLoad, read_busy_s
from tokenmill.worker.thread_governor import ThreadGovernor

# efficiency (bound / wall time) of a decode step: (threads, neighbour busy) -> efficiency
QUIET = {2: 0.90, 1: 0.60}
BUSY = {2: 0.25, 1: 0.55}  # the 2-thread step waits for the starved thread


class Machine:
    def __init__(self, max_threads: int = 2) -> None:
        self.threads = max_threads
        self.calls: list[int] = []
        self.governor = ThreadGovernor(max_threads, self.set_threads)

    def set_threads(self, n: int) -> None:
        self.threads = n
        self.calls.append(n)

    def run(self, num_steps: int, table: dict[int, float], kind: str = "decode") -> list[int]:
        used = []
        for _ in range(num_steps):
            used.append(self.threads)
            self.governor.observe(kind, bound_s=table[self.threads] * 0.01, step_s=0.01)
        return used


def test_a_quiet_machine_keeps_every_thread_and_probes_rarely() -> None:
    m = Machine()
    used = m.run(5000, QUIET)
    assert m.governor.num_threads == 2 and m.governor.num_switches == 0
    assert used.count(1) / len(used) < 0.03  # the probes' cost
    assert used[-200:].count(1) <= m.governor.probe_steps  # backed off: at most one probe in the last 200


def test_a_busy_neighbour_drops_a_thread_quickly_and_its_leaving_restores_it() -> None:
    m = Machine()
    m.run(600, QUIET)
    used = m.run(400, BUSY)
    first_one = used.index(1)
    assert first_one <= 10  # the collapse is seen in a few steps
    assert m.governor.num_threads == 1 and used[30:].count(1) / len(used[30:]) > 0.95
    after = m.run(1200, QUIET)
    assert m.governor.num_threads == 2 and after[-100:].count(2) >= 100 - m.governor.probe_steps


def test_only_decode_steps_decide() -> None:
    m = Machine()
    m.run(500, BUSY, kind="prefill")
    assert m.calls == [] and m.governor.num_threads == 2


def test_more_cores_probe_one_fewer() -> None:
    m = Machine(max_threads=4)
    table = {4: 0.3, 3: 0.8}
    m.run(100, {4: 0.9, 3: 0.7})
    m.run(100, table)
    assert m.governor.num_threads == 3 and set(m.calls) <= {3, 4}


def test_one_thread_has_nothing_to_govern() -> None:
    with pytest.raises(ValueError, match="at least 2"):
        ThreadGovernor(1, lambda n: None)


def test_a_plainly_slower_probe_ends_early_and_a_close_one_runs_whole() -> None:
    m = Machine()
    g = m.governor
    first = g.probe_every  # the first probe starts after this many decode steps
    used = m.run(first + 3, QUIET)
    assert used[first:] == [1, 1, 2]  # two steps at one thread, then back
    assert g.num_threads == 2 and g.probe_every == 2 * first  # kept, and the next probe later
    m = Machine()
    g = m.governor
    m.run(50, QUIET)
    used = m.run(40, BUSY)  # collapsed, one thread wins
    assert g.num_threads == 1
    used = m.run(2 * g.max_probe_every, BUSY)
    probes = [i for i in range(1, len(used)) if used[i] == 2 and used[i - 1] == 1]
    assert probes and all(used[i + 1] == 1 for i in probes)  # a step into the collapse ends each probe
    m = Machine()
    g = m.governor
    close = {2: 0.90, 1: 0.85}  # one thread fewer nearly as fast: the whole probe decides
    used = m.run(first + 20, close)
    assert used[first : first + g.probe_steps + 1] == [1] * g.probe_steps + [2]
    assert g.num_threads == 2


def test_a_probe_into_a_collapse_backs_off_four_times() -> None:
    """Beside a busy neighbour each probe back to two threads costs a collapsed step: the next comes four times as
    far off (its own step counted in the gap), up to the longest interval, where a merely slower probe doubles it."""
    m = Machine()
    g = m.governor
    m.run(50, QUIET)
    m.run(40, BUSY)
    assert g.num_threads == 1
    used = m.run(3 * g.max_probe_every, BUSY)
    probes = [i for i in range(1, len(used)) if used[i] == 2 and used[i - 1] == 1]
    gaps = [b - a for a, b in zip(probes, probes[1:], strict=False)]
    assert gaps[:2] == [4 * g.min_probe_every + 1, g.max_probe_every + 1], gaps


def test_a_lasting_slowdown_no_count_cures_is_probed_once_not_every_few_steps() -> None:
    """The count chosen beside a neighbour slows to half (the neighbour now also takes the memory's bandwidth), and
    more threads stay worse: the collapse is probed, then the slower steps become the usual ones. Were the slow
    steps kept out of the usual efficiency, every three of them would probe into the neighbour's core again."""
    m = Machine()
    g = m.governor
    m.run(50, QUIET)
    m.run(40, BUSY)
    assert g.num_threads == 1
    probes_before = g.num_probes
    used = m.run(400, {2: 0.25, 1: 0.30})
    assert g.num_threads == 1
    assert g.num_probes - probes_before <= 3, g.num_probes - probes_before
    assert used.count(2) <= 3 * g.probe_steps


def test_spikes_in_the_steps_do_not_raise_the_usual_efficiency() -> None:
    """Real steps scatter (speculative verifications, the memory's changing speed): one step in four at 2.5x the
    usual efficiency must not make the usual steps look collapsed."""
    m = Machine()
    g = m.governor
    spikes = [1.0, 1.0, 1.0, 2.5]
    used = []
    for i in range(3000):
        used.append(m.threads)
        g.observe("decode", bound_s=QUIET[m.threads] * spikes[i % 4] * 0.01, step_s=0.01)
    assert g.num_threads == 2 and g.num_switches == 0
    assert used.count(1) / len(used) < 0.03


def test_a_prompt_during_a_probe_runs_at_the_chosen_count() -> None:
    m = Machine()
    g = m.governor
    close = {2: 0.90, 1: 0.85}  # a probe that runs its whole length
    m.run(g.probe_every, close)  # the first probe starts after the last of these steps
    assert g._probing == 1 and m.threads == 1
    decode_counts = []
    for kind in ("prefill", "decode", "mixed", "decode", "prefill"):
        g.begin_step(kind)
        if kind == "decode":
            decode_counts.append(m.threads)
        else:
            assert m.threads == 2  # the chosen count, not the probe's
        g.observe(kind, bound_s=close[m.threads] * 0.01, step_s=0.01)
    assert decode_counts == [1, 1]  # the probe resumes on decode steps and counts only them
    for _ in range(g.probe_steps - 2):
        g.begin_step("decode")
        g.observe("decode", bound_s=close[m.threads] * 0.01, step_s=0.01)
    assert g._probing is None and g.num_threads == 2 and m.threads == 2


class Counters:
    """A CpuLoad's inputs on the simulated machine: each decode step takes 10 ms; the neighbour, while there, keeps
    one core busy; this process keeps `threads` cores busy."""

    def __init__(self, machine: Machine) -> None:
        self.machine, self.neighbour = machine, False
        self.now_s = self.busy_s = self.own_s = 0.0
        self.phantom = 0.0  # load the counters show that takes no core of this machine's
        self.hidden = False  # the neighbour's load missing from the counters (another guest of the host)

    def step(self) -> None:
        self.now_s += 0.01
        self.own_s += 0.01 * self.machine.threads
        self.busy_s += 0.01 * (self.machine.threads + (self.neighbour and not self.hidden) + self.phantom)


def machine_with_counters(readable: bool = True) -> tuple[Machine, Counters]:
    """The counters readable at the start, and after it as `readable` says."""
    m = Machine()
    c = Counters(m)
    started = [False]

    def read_busy() -> float:
        if started[0] and not readable:
            raise OSError("no counters")
        return c.busy_s

    load = CpuLoad(frozenset({0, 1}), read_busy, own_cpu_s=lambda: c.own_s, clock=lambda: c.now_s)
    started[0] = True
    m.governor = ThreadGovernor(2, m.set_threads, load=load)
    return m, c


def run_counted(m: Machine, c: Counters, num_steps: int, neighbour: bool) -> list[int]:
    c.neighbour = neighbour
    table = BUSY if neighbour else QUIET
    used = []
    for _ in range(num_steps):
        used.append(m.threads)
        c.step()
        m.governor.observe("decode", bound_s=table[m.threads] * 0.01, step_s=0.01)
    return used


def run_prompts(m: Machine, c: Counters, num_steps: int, neighbour: bool) -> list[int]:
    """Steps with prompt tokens alone (prefills of one token each): the count each forward ran at."""
    c.neighbour = neighbour
    used = []
    for _ in range(num_steps):
        m.governor.begin_step("prefill")
        used.append(m.threads)
        c.step()
        m.governor.observe("prefill", bound_s=0.005, step_s=0.01)
    return used


def test_prompt_steps_return_to_every_thread_once_the_counters_see_the_neighbour_gone() -> None:
    """Only decode steps decide; prompt steps alone must not keep a count that a neighbour who has left forced."""
    m, c = machine_with_counters()
    g = m.governor
    run_counted(m, c, 50, neighbour=False)
    run_counted(m, c, 40, neighbour=True)
    assert g.num_threads == 1
    assert run_prompts(m, c, 60, neighbour=True) == [1] * 60  # the neighbour stays: so does the count
    after = run_prompts(m, c, 30, neighbour=False)
    assert after[-1] == 2 and after.index(2) <= 12 and g.num_returns == 1  # within a reading's window
    assert g.num_threads == 2 and m.threads == 2
    # the decode steps judge the count afresh: the neighbour back, they lower it again
    used = run_counted(m, c, 3 * g.min_probe_every, neighbour=True)
    assert g.num_threads == 1 and used[-g.min_probe_every :].count(1) == g.min_probe_every


def test_prompt_steps_keep_a_count_lowered_where_the_counters_saw_nothing() -> None:
    """A neighbour the counters do not show (another guest): when its leaving cannot be read, prompt steps keep the
    count, and the decode steps' probes alone bring the threads back."""
    m, c = machine_with_counters()
    g = m.governor
    c.hidden = True
    run_counted(m, c, 50, neighbour=False)
    run_counted(m, c, 40, neighbour=True)
    assert g.num_threads == 1
    assert run_prompts(m, c, 60, neighbour=False) == [1] * 60 and g.num_returns == 0
    run_counted(m, c, g.max_probe_every, neighbour=False)
    assert g.num_threads == 2


def test_an_engine_out_of_work_ends_a_probe_at_the_chosen_count() -> None:
    m = Machine()
    g = m.governor
    m.run(g.probe_every, QUIET)  # the first probe starts after the last of these steps
    assert g._probing == 1 and m.threads == 1
    g.idle()
    assert g._probing is None and m.threads == 2 and g.num_threads == 2
    g.idle()  # nothing in flight: nothing to do
    assert m.calls == [1, 2]


def test_the_counters_keep_probes_out_of_a_neighbours_core_until_it_leaves() -> None:
    m, c = machine_with_counters()
    g = m.governor
    run_counted(m, c, 50, neighbour=False)
    run_counted(m, c, 40, neighbour=True)
    assert g.num_threads == 1  # the collapse found as before
    used = run_counted(m, c, 3 * g.max_probe_every, neighbour=True)
    # no probe back, where the governor without counters probes after 4 x 32 steps and then every 512
    assert 2 not in used and g.num_probes_deferred > 2 * g.max_probe_every
    assert g.decode_steps_at[1] + g.decode_steps_at[2] == 50 + 40 + len(used)  # every decode step tallied
    after = run_counted(m, c, 2 * g.min_probe_every, neighbour=False)
    assert (
        g.num_threads == 2 and 2 in after[: g.min_probe_every // 2]
    )  # probed back within the first readings


def test_a_slowdown_at_the_lowered_count_waits_while_the_counters_see_the_cores_taken() -> None:
    """Beside the neighbour the lowered count's steps slow further; a probe back to more threads would wait for a
    starved thread, and the counters say so: no probe, the slowdown counted as deferred."""
    m, c = machine_with_counters()
    g = m.governor
    run_counted(m, c, 50, neighbour=False)
    run_counted(m, c, 40, neighbour=True)
    assert g.num_threads == 1
    deferred = g.num_probes_deferred
    c.neighbour = True
    used = []
    for i in range(200):  # every 10th step at a tenth of the usual efficiency, three in a row at a time
        used.append(m.threads)
        c.step()
        slow = i % 10 < 3
        m.governor.observe("decode", bound_s=BUSY[m.threads] * (0.1 if slow else 1.0) * 0.01, step_s=0.01)
    assert 2 not in used and g.num_probes_deferred > deferred


def test_an_engine_started_beside_a_neighbour_probes_at_the_first_reading() -> None:
    """No quiet steps to see a collapse against: without counters the first probe waits first_probe_after decode
    steps; with them it starts at the first reading (here every 3 steps)."""
    firsts = []
    for readable in (True, False):
        m, c = machine_with_counters(readable)
        m.governor._load.min_window_s = 0.03  # type: ignore[union-attr]
        used = run_counted(m, c, 40, neighbour=True)
        assert m.governor.num_threads == 1
        firsts.append(used.index(1))
    assert firsts[0] <= 4 and firsts[1] == 8  # the default first_probe_after
    m, c = machine_with_counters()
    m.governor._load.min_window_s = 0.03  # type: ignore[union-attr]
    used = run_counted(m, c, 40, neighbour=False)
    assert used.index(1) == 8  # a quiet machine's counters start nothing early


def test_counters_that_mislead_delay_a_probe_once_then_go_unread() -> None:
    """A reading that says the cores are taken while they are not (a host's load seen from a container): the probe
    back waits max_deferral steps, wins, and the governor stops reading the counters."""
    m, c = machine_with_counters()
    g = m.governor
    g.max_deferral = 300
    run_counted(m, c, 50, neighbour=False)
    run_counted(m, c, 40, neighbour=True)
    assert g.num_threads == 1
    c.phantom = 40.0  # from here on every reading says the cores are taken
    used = run_counted(m, c, g.min_probe_every + g.max_deferral + 20, neighbour=False)
    assert 2 not in used[: g.max_deferral] and used[-1] == 2 and g.num_threads == 2
    assert g._load is None  # misled once: unread from now on


def test_without_counters_the_probes_are_the_timings_alone() -> None:
    m, c = machine_with_counters(readable=False)
    g = m.governor
    run_counted(m, c, 50, neighbour=False)
    run_counted(m, c, 40, neighbour=True)
    used = run_counted(m, c, 3 * g.max_probe_every, neighbour=True)
    probes = [i for i in range(1, len(used)) if used[i] == 2 and used[i - 1] == 1]
    assert len(probes) >= 2 and g.num_probes_deferred == 0


def test_the_load_is_the_cores_busy_time_less_this_process(tmp_path) -> None:
    hz = os.sysconf("SC_CLK_TCK")
    stat = tmp_path / "stat"

    def write(cpu0: list[int], cpu1: list[int]) -> None:
        total = [a + b for a, b in zip(cpu0, cpu1, strict=True)]
        lines = [" ".join(map(str, ["cpu", *total])), " ".join(map(str, ["cpu0", *cpu0]))]
        stat.write_text("\n".join([*lines, " ".join(map(str, ["cpu1", *cpu1])), "intr 1 2 3", ""]))

    # user nice system idle iowait irq softirq steal guest guest_nice
    write([100, 0, 20, 900, 5, 1, 1, 3, 0, 0], [50, 10, 10, 950, 0, 0, 0, 0, 0, 0])
    assert read_busy_s(frozenset({0, 1}), str(stat)) == pytest.approx((125 + 70) / hz)
    assert read_busy_s(frozenset({1}), str(stat)) == pytest.approx(70 / hz)
    with pytest.raises(ValueError, match="no counters for CPUs \\[2\\]"):
        read_busy_s(frozenset({1, 2}), str(stat))
    now, own = [0.0], [0.0]
    load = CpuLoad(
        frozenset({0, 1}), lambda: read_busy_s(frozenset({0, 1}), str(stat)), lambda: own[0], lambda: now[0]
    )
    now[0] = 0.05
    assert load.other_cores() is None  # shorter than the window
    # one second later: both cores 1.5 s busier, this process ran 0.5 s of it
    write([100 + hz, 0, 20, 900, 5, 1, 1, 3, 0, 0], [50 + hz // 2, 10, 10, 950 + hz // 2, 0, 0, 0, 0, 0, 0])
    now[0], own[0] = 1.0, 0.5
    assert load.other_cores() == pytest.approx((hz + hz // 2) / hz - 0.5)
    now[0], own[0] = 2.0, 1.5  # nothing busier, yet this process ran: never below 0
    assert load.other_cores() == 0.0
    # a window of 0.1 s whose counters moved by 4.5 s (ticks counted late): never more than every CPU
    write(
        [100 + 3 * hz, 0, 20, 900, 5, 1, 1, 3, 0, 0], [50 + 3 * hz, 10, 10, 950 + hz // 2, 0, 0, 0, 0, 0, 0]
    )
    now[0] = 2.1
    assert load.other_cores() == 2.0
    stat.unlink()
    now[0] = 3.0
    assert load.other_cores() is None  # the counters gone


def test_this_process_has_a_reading_on_linux() -> None:
    load = CpuLoad.of_this_process()
    if not os.path.exists("/proc/stat"):
        assert load is None
        return
    assert load is not None and load.num_cpus == len(os.sched_getaffinity(0))
    time.sleep(load.min_window_s)
    reading = load.other_cores()
    assert reading is not None and 0.0 <= reading <= load.num_cpus + 0.5
