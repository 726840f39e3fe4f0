"""The thread governor against a simulated machine: each step's efficiency depends on the thread count in use and
on whether a neighbour holds a core."""

from __future__ import annotations

import pytest

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
