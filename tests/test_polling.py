"""Hybrid polling's planner against simulated step streams (controller/polling.py).

The serve loop is replayed on a simulated clock: between messages it asks the planner what to
do, then either sleeps until a message or ``until`` (a message during the sleep is answered
cold), or polls until ``until`` (a message during the poll is answered hot, and the time spent
is charged).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

import pytest

from controller.cpus import usable_cpus
from controller.polling import GAP_MAX_NS, LEAD_MAX_NS, Cadence, SpinPlanner

MS = 1_000_000
HANDLE_NS = 20_000  # a message's handling time


@dataclass
class Replay:
    hot: int = 0  # messages that came while the loop polled (or was busy)
    cold: int = 0  # messages that came while it slept
    spin_ns: int = 0
    wall_ns: int = 0

    @property
    def hot_share(self) -> float:
        return self.hot / max(self.hot + self.cold, 1)

    @property
    def spin_share(self) -> float:
        return self.spin_ns / max(self.wall_ns, 1)


def replay(planner: SpinPlanner, arrivals: list[tuple[int, Cadence]], until_ns: int | None = None) -> Replay:
    """The serve loop on a simulated clock; ``arrivals`` sorted by time."""
    out = Replay()
    now = arrivals[0][0]
    for at, cadence in arrivals:
        hot = now >= at  # busy when it came: no sleep in between
        while now < at:
            spin, until, _ = planner.plan(now)
            assert until > now, "the planner must move time on"
            if spin:
                end = min(at, until)
                planner.spent(end - now)
                out.spin_ns += end - now
                now = end
                hot = now == at
            else:
                now = min(at, until)
                hot = False
        out.hot += hot
        out.cold += not hot
        planner.note(cadence, at)
        now = max(now, at) + HANDLE_NS
    if until_ns is not None:  # what it does after the last message
        while now < until_ns:
            spin, until, _ = planner.plan(now)
            end = min(until, until_ns)
            if spin:
                planner.spent(end - now)
                out.spin_ns += end - now
            now = end
    out.wall_ns = now - arrivals[0][0]
    return out


def periodic(n: int, gap_ns: int, jitter_ns: int, phase_ns: int, rng: random.Random) -> list[int]:
    return [phase_ns + k * gap_ns + rng.randint(-jitter_ns, jitter_ns) for k in range(n)]


def test_steps_at_a_decode_cadence_come_while_it_polls_and_cost_a_few_percent() -> None:
    rng = random.Random(0)
    cadence = Cadence()
    times = periodic(2000, 7 * MS, 50_000, 0, rng)
    out = replay(SpinPlanner(0.5, 100 * MS), [(t, cadence) for t in times])
    assert out.hot_share > 0.95, out
    # Each window is ~2 x (100 µs + 2 x deviation) wide and the step comes in its middle.
    assert out.spin_share < 0.06, out
    assert 6.9 * MS < cadence.gap_ns < 7.1 * MS


def test_eight_instances_out_of_phase_each_get_their_window() -> None:
    rng = random.Random(1)
    arrivals = []
    for _ in range(8):
        cadence = Cadence()
        gap = rng.randint(5 * MS, 9 * MS)
        arrivals += [(t, cadence) for t in periodic(500, gap, 30_000, rng.randint(0, gap), rng)]
    arrivals.sort(key=lambda a: a[0])
    out = replay(SpinPlanner(0.5, 100 * MS), arrivals)
    assert out.hot_share > 0.9, out
    assert out.spin_share < 0.4, out


@pytest.mark.parametrize("budget", [0.1, 0.25, 0.5])
def test_the_budget_caps_polling_under_lock_step_traffic(budget: float) -> None:
    # One message every 80 µs: a window is always open, so only the budget limits polling.
    cadence = Cadence()
    times = [k * 80_000 for k in range(100_000)]  # 8 s
    out = replay(SpinPlanner(budget, 100 * MS), [(t, cadence) for t in times])
    allowed = budget * out.wall_ns + budget * 1e9 + LEAD_MAX_NS  # the rate, a full bucket, one overdraw
    assert out.spin_ns <= allowed, (out, allowed)
    assert out.spin_ns >= 0.8 * budget * out.wall_ns, out  # and it does use what it may


def test_an_idle_server_sleeps() -> None:
    cadence = Cadence()
    times = [k * 7 * MS for k in range(100)]
    planner = SpinPlanner(0.5, 100 * MS)
    busy = replay(planner, [(t, cadence) for t in times])
    idle = replay(planner, [(times[-1], Cadence())], until_ns=times[-1] + 10_000 * MS)
    # After the last step at most its one window is polled; then it sleeps for 10 s.
    assert idle.spin_ns <= 2 * LEAD_MAX_NS, idle
    assert planner.pending == 0
    assert busy.spin_ns > 0


def test_slow_streams_are_never_polled_for() -> None:
    cadence = Cadence()
    times = [k * (GAP_MAX_NS + MS) for k in range(20)]
    out = replay(SpinPlanner(0.5, 100 * MS), [(t, cadence) for t in times])
    assert out.spin_ns == 0 and out.cold == len(times) - 1  # the first one finds it awake


def test_a_step_that_came_early_retires_its_window() -> None:
    planner = SpinPlanner(0.5, 100 * MS)
    cadence = Cadence()
    for t in (0, 7 * MS, 14 * MS):
        planner.note(cadence, t)
    spin, until, _ = planner.plan(15 * MS)
    assert not spin and until < 21 * MS  # sleeps until the window around 21 ms opens
    planner.note(cadence, 16 * MS)  # it came 5 ms early
    # Its window (21 ms ± 1 ms) would be open at 20.5 ms; it is gone, and the next one, after
    # the gap learned a little from the early step, opens later.
    spin, until, _ = planner.plan(20_500_000)
    assert not spin and until > 21 * MS


def test_a_pause_barely_moves_the_learned_gap() -> None:
    planner = SpinPlanner(0.5, 100 * MS)
    cadence = Cadence()
    t = 0
    for _ in range(50):
        planner.note(cadence, t)
        t += 7 * MS
    t += 60 * MS  # a long prefill, say
    planner.note(cadence, t)
    assert cadence.gap_ns <= 7 * MS * 9 // 8


def test_the_window_queue_stays_bounded_under_a_flood() -> None:
    planner = SpinPlanner(0.5, 100 * MS)
    cadences = [Cadence() for _ in range(8)]
    for k in range(200_000):  # no plan() between them: the loop is draining a flood
        planner.note(cadences[k % 8], k * 1000 + 1)
    assert planner.pending <= 2 * 1024


def test_budget_out_of_range_is_refused() -> None:
    for bad in (0.0, -0.1, 1.5):
        with pytest.raises(ValueError):
            SpinPlanner(bad, MS)


def test_usable_cpus_is_at_most_the_affinity() -> None:
    import os

    assert 0 < usable_cpus() <= len(os.sched_getaffinity(0))


def test_cgroup_quotas_are_read_in_cpus(tmp_path: Path) -> None:
    from controller.cpus import _read_quota

    (tmp_path / "cpu.max").write_text("150000 100000\n")
    assert _read_quota(tmp_path, "cpu.max") == 1.5
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert _read_quota(tmp_path, "cpu.max") is None  # no quota
    (tmp_path / "cpu.cfs_quota_us").write_text("-1\n")
    (tmp_path / "cpu.cfs_period_us").write_text("100000\n")
    assert _read_quota(tmp_path, "cpu.cfs_quota_us") is None
    (tmp_path / "cpu.cfs_quota_us").write_text("200000\n")
    assert _read_quota(tmp_path, "cpu.cfs_quota_us") == 2.0
    (tmp_path / "cpu.max").write_text("garbage\n")
    assert _read_quota(tmp_path, "cpu.max") is None  # unreadable: no quota assumed
    assert _read_quota(tmp_path / "missing", "cpu.max") is None
