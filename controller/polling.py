"""Hybrid polling: sleep between steps, poll without sleeping just before the next one is due.

A serving thread that sleeps in ``recv`` between decode steps (one per ~7 ms per instance) wakes
on a cold core: on the lent GPU hosts serve's own path then took ~4x its hot time (decide
30.5 µs against 7.8, message -> decision 112 µs against 37 with a thread that never sleeps;
a probe on the GPU host, in git history under ``bench/results/h200/call29/``). Never sleeping costs a core while steps flow. Each
instance's steps come at a cadence, though, so the server can predict when the next record of
each one is due and poll without sleeping only around that moment, as Linux's hybrid polling of
block devices does for I/O completions. Polling alone wakes the core but not what the path
needs (its code, the policy's weights): when a window opens after a sleep the serve loop also
runs the path once on the instance's last record, on the side (``Server._warm``).

Per instance a :class:`Cadence` keeps the time of its last record, the gap between records
(EWMA, 1/8) and that gap's mean deviation. After each record the :class:`SpinPlanner` queues a
window ``[due - lead, due + lead]`` with ``due = last + gap`` and
``lead = LEAD_MIN_NS + 2 * deviation`` (at most ``LEAD_MAX_NS``). The serve loop asks
:meth:`SpinPlanner.plan` what to do whenever the socket is empty: poll until a window's end, or
sleep until the next window opens.

Invariants:

- No sleep delays a message: sleeping is a wait on the socket, which a message ends at once. A
  record that comes outside its window is answered exactly as without hybrid polling. The one
  wait it adds: a record that comes while its window's warming runs (the path once, cold:
  ~45 µs on the GPU host) is read when the warming ends.
- Spinning is bounded three ways: only inside a window (at most ``2 * LEAD_MAX_NS`` per record
  expected); at most ``budget`` of one core averaged over :data:`BUDGET_WINDOW_NS` (a token
  bucket); and never for an instance whose records come further apart than
  :data:`GAP_MAX_NS`. An idle server sleeps.
- A window belongs to the record it was predicted from: a newer record of the same instance
  makes it stale, so an instance costs at most one window per record.
- The queue holds at most one live window per instance; stale ones are dropped as they reach
  its head, and all at once when it grows past twice its last live size (a flood).
"""

from __future__ import annotations

import heapq
import itertools

LEAD_MIN_NS = 100_000  # covers a timer wake-up (≤ 50 µs of slack) and the wake of a cold core
LEAD_MAX_NS = 1_000_000
GAP_MAX_NS = 100_000_000  # records further apart than 100 ms: sleeping costs them nothing
BUDGET_WINDOW_NS = 1_000_000_000  # the spin budget is averaged over one second
_PRUNE_MIN = 1024


class Cadence:
    """When one instance's records come: the last one, the gap between them, its deviation."""

    __slots__ = ("last_ns", "gap_ns", "dev_ns", "owner")

    def __init__(self, owner: object = None) -> None:
        self.last_ns = 0
        self.gap_ns = 0
        self.dev_ns = 0
        self.owner = owner  # whose steps these are (the serve loop's session)


class SpinPlanner:
    """Windows around each instance's next record, and a CPU budget for polling in them.

    Args:
        budget: the most polling without sleeping, as a fraction of one core averaged over
            :data:`BUDGET_WINDOW_NS` (0 < budget ≤ 1).
        idle_ns: the longest sleep :meth:`plan` asks for (the serve loop's stop check).
    """

    def __init__(self, budget: float, idle_ns: int) -> None:
        if not 0 < budget <= 1:
            raise ValueError(f"spin budget {budget}: must be in (0, 1]")
        self.budget = budget
        self.idle_ns = idle_ns
        self._capacity = budget * BUDGET_WINDOW_NS
        self._tokens = self._capacity
        self._refilled = 0
        # (start, tie-break, end, the record's time, its Cadence); tuples compare fast.
        self._queue: list[tuple[int, int, int, int, Cadence]] = []
        self._count = itertools.count()
        self._prune_at = _PRUNE_MIN

    def note(self, cadence: Cadence, rx_ns: int) -> None:
        """A record of ``cadence``'s instance arrived at ``rx_ns``: expect the next one."""
        last = cadence.last_ns
        cadence.last_ns = rx_ns
        if not last:
            return
        seen = rx_ns - last
        gap = cadence.gap_ns
        if not gap:
            if seen > GAP_MAX_NS:
                return
            cadence.gap_ns = gap = seen
            cadence.dev_ns = seen >> 2
        else:
            # Clipped so that one pause (a prefill, an idle spell) moves the gap by at most an
            # eighth of itself instead of teaching a cadence that is not there.
            d = max(-gap, min(seen - gap, gap))
            cadence.gap_ns = gap = gap + (d >> 3)
            cadence.dev_ns += (abs(d) - cadence.dev_ns) >> 3
        if gap > GAP_MAX_NS:
            return
        lead = min(LEAD_MIN_NS + 2 * cadence.dev_ns, LEAD_MAX_NS)
        due = rx_ns + gap
        queue = self._queue
        heapq.heappush(queue, (due - lead, next(self._count), due + lead, rx_ns, cadence))
        if len(queue) >= self._prune_at:
            queue[:] = [w for w in queue if w[4].last_ns == w[3]]
            heapq.heapify(queue)
            self._prune_at = max(_PRUNE_MIN, 2 * len(queue))

    def plan(self, now: int) -> tuple[bool, int, Cadence | None]:
        """What to do with an empty socket at ``now``: ``(spin, until, cadence)``.

        ``spin`` True: poll without sleeping until ``until``, for the next step of
        ``cadence`` (a window is open and the budget allows); False: sleep on the socket
        until ``until`` at most.
        """
        queue = self._queue
        while queue:
            start, _, end, rx_ns, cadence = queue[0]
            if end <= now or cadence.last_ns != rx_ns:  # over, or its record already came
                heapq.heappop(queue)
                continue
            if start > now:
                return False, min(start, now + self.idle_ns), None
            tokens = min(self._capacity, self._tokens + (now - self._refilled) * self.budget)
            self._tokens, self._refilled = tokens, now
            # Over budget: sleep through this window (it is dropped when it ends).
            return tokens > 0, end, cadence
        return False, now + self.idle_ns, None

    def spent(self, ns: int) -> None:
        """Charge ``ns`` of polling without sleeping to the budget."""
        self._tokens -= ns

    @property
    def pending(self) -> int:
        """Windows queued, stale ones included (for tests)."""
        return len(self._queue)
