"""The hook-side client: sends ``step`` records, picks up ``decision`` replies, never blocks.

This runs inside SGLang's scheduler, on the critical path of every decode step, so it
imports only the standard library, pyzmq, msgpack and :mod:`controller.protocol`, and it
never raises into the caller because of the network: a controller that is down, slow,
restarting or answering garbage only makes :meth:`ControllerClient.poll_decision` return
``None`` (the hook then falls back to SGLang's own policy: "Decision semantics" in
:mod:`controller.protocol`).

Socket: one DEALER with ``IMMEDIATE`` (nothing is queued for a controller that is not
connected, so a restarted controller never receives a burst of stale steps), a small send
high-water mark (a step that does not fit is dropped and counted: fresh telemetry beats
old), ``LINGER 0`` (closing never waits). ZeroMQ reconnects by itself; the client re-sends
``hello`` when the controller answers ``unknown_instance`` (it restarted) and, as a
safeguard, when decisions stopped for ``stale_ms`` while steps were being sent.

Thread-safety: none. One client belongs to one thread; ZeroMQ sockets must not be shared
between threads either. :class:`ClientThread` runs a client on a thread of its own, so that a
caller on a critical path (SGLang's scheduler) only hands records over and reads the newest
decision, and never touches the socket.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import msgpack
import zmq

from controller.protocol import MAX_FRAME_BYTES, Decision, Error, Hello, ProtocolError, Step, Welcome, decode

log = logging.getLogger(__name__)

_MAX_DRAIN = 1024  # frames read per poll_decision call: bounds the time spent there
# Plain ints: pyzmq's constants are enum members, and `int & IntFlag` builds a new member on
# every call (≈1 µs per readiness check here).
_NOBLOCK, _EVENTS, _POLLIN = int(zmq.NOBLOCK), int(zmq.EVENTS), int(zmq.POLLIN)


class ControllerClient:
    """Non-blocking DEALER client of the controller (one per hook process).

    Args:
        endpoint: the controller's ROUTER endpoint, e.g. ``ipc:///tmp/spec-controller.sock``.
        hello: who this instance is and which depths it allows; sent on connect and re-sent
            whenever the controller does not know the instance.
        stale_ms: once a step has gone this long without a decision back, the newest decision
            is no longer used (``poll_decision`` and :meth:`fresh_depth` return None) until
            decisions flow again. Decisions answer steps, so an instance that sends nothing
            (an idle server) keeps its decision however old it is.
        sndhwm: messages queued towards the controller before new steps are dropped.
        context: a ZeroMQ context to use; by default the client makes (and closes) its own.
        curve_server_key: the controller's Z85 CURVE public key, when it serves with
            ``--curve-secret-key-file`` (the client uses a fresh key pair of its own).

    Raises:
        ValueError: ``endpoint`` is not a ZeroMQ endpoint (a configuration mistake, not
            network trouble).

    Attributes:
        counters: ``sent``, ``dropped`` (steps that could not be queued), ``hellos``,
            ``decisions`` (valid decisions received), ``invalid`` (decisions for another
            instance or with a depth not in ``hello.depths``, and frames that are not protocol
            v1), ``welcomes``; ``errors`` maps each ``error`` code received to its count.
        policy: the controller's policy name from its last ``welcome`` ("" before one).
        features: the controller's Featurizer version from its last ``welcome`` (-1 before).
    """

    def __init__(
        self,
        endpoint: str,
        hello: Hello,
        *,
        stale_ms: float = 200.0,
        sndhwm: int = 16,
        context: zmq.Context | None = None,  # type: ignore[type-arg]
        curve_server_key: bytes | None = None,
    ) -> None:
        self.endpoint = endpoint
        self.hello = hello
        self.instance = hello.instance
        self.depths = frozenset(hello.depths)
        self.stale_ns = int(stale_ms * 1e6)
        self._own_context = context is None
        self._ctx = zmq.Context() if context is None else context
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, sndhwm)
        sock.setsockopt(zmq.RCVHWM, 4 * _MAX_DRAIN)
        sock.setsockopt(zmq.IMMEDIATE, 1)
        sock.setsockopt(zmq.RECONNECT_IVL, 50)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
        # A stable routing id across reconnects: the controller keeps this socket's session
        # when it repeats its hello, and tells a restarted hook (a new id) from this one.
        sock.setsockopt(zmq.ROUTING_ID, b"hook-" + os.urandom(8))
        try:
            if curve_server_key is not None:
                public, secret = zmq.curve_keypair()
                sock.curve_serverkey = curve_server_key
                sock.curve_publickey = public
                sock.curve_secretkey = secret
            sock.connect(endpoint)
        except zmq.ZMQError as exc:
            sock.close(0)
            if self._own_context:
                self._ctx.term()
            raise ValueError(f"cannot connect to {endpoint!r}: {exc}") from None
        self._sock = sock
        self._pack = msgpack.Packer(use_bin_type=True).pack  # reused: packb builds one per call
        self._hello_frame = self._pack(hello.to_wire())
        self._need_hello = True
        self._closed = False
        self._depth: int | None = None
        self._decision_ns = 0  # monotonic ns of the newest valid decision
        self._unanswered_ns: int | None = None  # monotonic ns of the oldest step since that decision
        self._last_sent_ns = 0
        self._last_hello_ns = 0
        self.policy = ""
        self.features = -1
        self.counters: dict[str, int] = {
            "sent": 0,
            "dropped": 0,
            "hellos": 0,
            "decisions": 0,
            "invalid": 0,
            "welcomes": 0,
        }
        self.errors: dict[str, int] = {}
        self._send_hello(time.monotonic_ns())

    # ------------------------------------------------------------------ sending

    def _send_hello(self, now_ns: int) -> bool:
        try:
            self._sock.send(self._hello_frame, _NOBLOCK)
        except zmq.ZMQError:  # not connected yet (IMMEDIATE) or queue full: retry with the next step
            self._need_hello = True
            return False
        self._need_hello = False
        self._last_hello_ns = now_ns
        self.counters["hellos"] += 1
        return True

    def send_step(self, step: Step) -> None:
        """Queue one step record for the controller; never blocks, never raises.

        A step that cannot be queued right now (controller not connected, queue full, hello
        not deliverable yet) is dropped and counted in ``counters["dropped"]``.
        """
        if self._closed:
            return
        now = time.monotonic_ns()
        if self._unanswered_ns is None:  # counted whether or not it can be queued: a controller
            self._unanswered_ns = now  # that is down answers nothing either
        # Safeguard beside unknown_instance: steps flowed for stale_ms with no decision back,
        # so the controller may have lost us; a repeated hello is harmless (it restarts the
        # instance's session there).
        if (
            not self._need_hello
            and now - max(self._decision_ns, self._last_hello_ns) > self.stale_ns
            and now - self._last_sent_ns < self.stale_ns
        ):
            self._need_hello = True
        if self._need_hello and not self._send_hello(now):
            self.counters["dropped"] += 1
            return
        try:
            frame = self._pack(step.to_wire())  # the one wire schema: protocol.Step
        except (
            TypeError,
            ValueError,
            OverflowError,
        ):  # a malformed record: drop it, keep the scheduler alive
            self.counters["dropped"] += 1
            return
        if len(frame) > MAX_FRAME_BYTES:
            self.counters["dropped"] += 1
            return
        try:
            self._sock.send(frame, _NOBLOCK)
        except zmq.ZMQError:
            self.counters["dropped"] += 1
            return
        self.counters["sent"] += 1
        self._last_sent_ns = now

    # ------------------------------------------------------------------ receiving

    def poll_decision(self) -> int | None:
        """Read every pending reply; return the depth to use now, or None.

        The newest valid decision wins, as long as it is fresh (:meth:`fresh_depth`). Never
        blocks, never raises.
        """
        if self._closed:
            return None
        sock = self._sock
        try:
            # EVENTS instead of recv-until-EAGAIN: pyzmq's Again exception costs several µs.
            for _ in range(_MAX_DRAIN):
                if not sock.getsockopt(_EVENTS) & _POLLIN:  # type: ignore[operator]  # EVENTS is an int
                    break
                self._handle(sock.recv(_NOBLOCK))
        except zmq.ZMQError:  # the socket became unusable: behave as if nothing came
            pass
        return self.fresh_depth()

    def fresh_depth(self, now_ns: int | None = None) -> int | None:
        """The newest valid decision's depth while it is fresh, else None (replies are not read).

        Stale means: a step was sent (or dropped) more than ``stale_ms`` ago and no decision
        came back since. So a dead or stuck controller is noticed ``stale_ms`` after the first
        step it left unanswered, while an instance that sends no steps keeps its decision.
        """
        if self._closed:
            return None
        since = self._unanswered_ns
        if since is not None:
            if now_ns is None:
                now_ns = time.monotonic_ns()
            if now_ns - since > self.stale_ns:
                return None
        return self._depth

    def _handle(self, frame: bytes) -> None:
        try:
            msg = decode(frame)  # the one protocol module validates both directions
        except ProtocolError:
            self.counters["invalid"] += 1
            return
        if type(msg) is Decision:
            if msg.depth in self.depths and msg.instance == self.instance:
                self._depth = msg.depth
                self._decision_ns = time.monotonic_ns()
                self._unanswered_ns = None
                self.counters["decisions"] += 1
            else:
                self.counters["invalid"] += 1
        elif type(msg) is Error:
            self.errors[msg.code] = self.errors.get(msg.code, 0) + 1
            if msg.code == "unknown_instance":  # the controller restarted: introduce ourselves again
                self._send_hello(time.monotonic_ns())
        elif type(msg) is Welcome:
            self.policy = msg.policy
            self.features = msg.features
            self.counters["welcomes"] += 1
        else:  # a hook-to-controller message sent to us
            self.counters["invalid"] += 1

    def wait(self, timeout_ms: int) -> bool:
        """Block up to ``timeout_ms`` until a reply can be read (True) or not (False).

        Releases the GIL while it waits. Only for a thread of its own (:class:`ClientThread`),
        never on a critical path.
        """
        if self._closed:
            return False
        try:
            return bool(self._sock.poll(int(timeout_ms), zmq.POLLIN))
        except zmq.ZMQError:
            return False

    # ------------------------------------------------------------------ state

    @property
    def depth(self) -> int | None:
        """The newest valid decision's depth regardless of age (None before the first)."""
        return self._depth

    @property
    def decision_age_ms(self) -> float | None:
        """Milliseconds since the newest valid decision arrived (None before the first)."""
        if self._depth is None:
            return None
        return (time.monotonic_ns() - self._decision_ns) / 1e6

    def stats(self) -> dict[str, Any]:
        """A snapshot of the counters, the error counts and the newest decision."""
        return {
            **self.counters,
            "errors": dict(self.errors),
            "depth": self._depth,
            "age_ms": self.decision_age_ms,
        }

    def close(self) -> None:
        """Close the socket (and the context if the client made it). Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            self._sock.close(0)
            if self._own_context:
                self._ctx.term()
        except zmq.ZMQError:
            pass

    def __enter__(self) -> ControllerClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class ClientThread:
    """A :class:`ControllerClient` driven by a thread of its own.

    The caller's thread (SGLang's scheduler) never touches the socket: :meth:`submit` appends
    the record to a bounded queue and wakes the sender thread (one lock release: a futex
    call, no GIL hand-over), and :attr:`depth` / :attr:`decisions` are plain attributes the
    sender thread rebinds. The sender thread sends what is queued, waits up to
    ``reply_wait_ms`` for the reply (without the GIL), and drains every reply into the newest
    decision; with nothing queued it still drains every ``idle_poll_ms`` (welcomes, hellos
    after a controller restart).

    Why a thread: after a GPU step, a visit to ZeroMQ from the scheduler thread costs ~60 µs
    at p50 on the H200 host (cold caches, and syscalls to wake ZeroMQ's I/O thread and to read
    its mailbox); the hand-over costs 1.6 µs ticking, 4.6 µs woken per record. The cost is the
    GIL: the sender thread needs it to build and pack the record and decode the reply, and
    takes it whenever the scheduler releases it around a torch call. On the H200 calls that
    timed it, step times stayed the same; where the scheduler sets the pace (a CPU
    scheduler, an EAGLE-3 server at depth 0 on an H100) the server ran slower, so the
    hook runs it only when asked (``--spec-client-thread on``; ``docs/hook.md`` "Cost").

    Args:
        client: a connected client, handed over: from now on only the sender thread uses it.
        reply_wait_ms: after sending, how long the sender thread waits for the reply before
            it looks at the queue again (a dead controller costs one such wait per wake-up).
        idle_poll_ms: with nothing to send, how often the sender thread drains replies.
        maxlen: records queued before the oldest is dropped (counted in :attr:`dropped`).
        build: turns what :meth:`submit` was given into the :class:`Step` to send, on the
            sender thread (the hook hands over the few values it read from SGLang and lets
            this thread make the record); by default :meth:`submit` is given Steps.
        tick_ms: 0: :meth:`submit` wakes the sender thread for every record (a futex call on
            the caller's thread). Above 0: while records flow, the sender thread looks at the
            queue every ``tick_ms`` by itself (and at once when a reply comes), so
            :meth:`submit` is a bare append; records wait up to ``tick_ms`` before their send.
        park_after: with ``tick_ms``, after this many looks found no record the thread goes
            back to waiting for :meth:`submit` to wake it (an idle server costs no ticks).
        profile: keep the sender thread's CPU time (:attr:`busy_cpu_ns`) and its lag
            (:attr:`last_lag_ns`), for the benchmark.

    Attributes:
        fresh_depth: the depth to apply now: the client's :meth:`ControllerClient.fresh_depth`,
            judged by the sender thread after each of its looks at the queue (every
            ``tick_ms`` while records flow, every ``idle_poll_ms`` when parked), so the caller
            reads one attribute. None after :meth:`close`.
        depth: the newest valid decision's depth, fresh or not (None before the first).
        decisions: valid decisions received so far.
        dropped: records dropped because the queue was full (the sender thread fell behind).
        errors: exceptions caught on the sender thread (each logged once per kind).
        busy_cpu_ns: the sender thread's CPU time spent on records and replies (profile only).
        last_lag_ns: monotonic ns from the newest record's ``ts_ns`` to its send (profile only).

    Only one thread may call :meth:`submit` (the lock release relies on a single producer).
    """

    def __init__(
        self,
        client: ControllerClient,
        *,
        reply_wait_ms: int = 2,
        idle_poll_ms: float = 50.0,
        maxlen: int = 256,
        build: Callable[[Any], Step] | None = None,
        tick_ms: int = 0,
        park_after: int = 64,
        profile: bool = False,
        name: str = "specdepth-client",
    ) -> None:
        self.client = client
        self._build = build
        self._tick_ms = tick_ms
        self._park_after = park_after
        self._parked = True  # the thread waits for submit() to wake it
        self.fresh_depth: int | None = None
        self.depth: int | None = None
        self.decisions = 0
        self.dropped = 0
        self.errors = 0
        self.busy_cpu_ns = 0
        self.last_lag_ns = 0
        self._reply_wait_ms = reply_wait_ms
        self._idle_s = idle_poll_ms / 1000.0
        self._profile = profile
        self._queue: deque[Any] = deque(maxlen=maxlen)
        self._wake = threading.Lock()
        self._wake.acquire()  # held = nothing to do; submit() releases it
        self._stop = False
        self._errors_logged: set[str] = set()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, item: Any) -> None:
        """Queue one record (or what ``build`` makes one from) for the sender thread; never blocks."""
        queue = self._queue
        if len(queue) == queue.maxlen:
            self.dropped += 1
        queue.append(item)
        if not self._parked:  # ticking: it looks at the queue by itself
            return
        wake = self._wake
        if wake.locked():
            try:
                wake.release()
            except RuntimeError:  # close() released it in between
                pass

    def _run(self) -> None:
        client, queue, wake, build = self.client, self._queue, self._wake, self._build
        tick, empty = self._tick_ms, 0
        while not self._stop:
            replied = True
            if self._parked:
                wake.acquire(timeout=self._idle_s)  # returns at once if submit() released it
                if tick and queue:  # records flow again: tick until they stop
                    self._parked = False
            else:
                replied = client.wait(tick)  # without the GIL; returns early when a reply comes
            if self._stop:
                break
            t0 = time.thread_time_ns() if self._profile else 0
            try:
                sent = False
                while queue:
                    item = queue.popleft()
                    step = item if build is None else build(item)
                    client.send_step(step)
                    sent = True
                    if self._profile:
                        self.last_lag_ns = time.monotonic_ns() - step.ts_ns
                if sent and not tick:
                    client.wait(self._reply_wait_ms)
                if replied:  # a tick that saw no reply has nothing to drain
                    self.fresh_depth = client.poll_decision()
                    self.depth = client.depth
                    self.decisions = client.counters["decisions"]
                else:  # nothing came, yet an unanswered step may have gone stale meanwhile
                    self.fresh_depth = client.fresh_depth()
                if tick:
                    empty = 0 if sent else empty + 1
                    if empty >= self._park_after:  # records stopped: wait for submit() to wake us
                        self._parked = True
                        if queue:  # submit() came in between and saw us ticking
                            self._parked = False
            except Exception as exc:  # never let the thread die: the caller would wait for nothing
                self.errors += 1
                kind = type(exc).__name__
                if kind not in self._errors_logged:
                    self._errors_logged.add(kind)
                    log.exception("spec controller: the client thread caught %s; it goes on", kind)
                time.sleep(self._idle_s)  # a persistent fault must not spin
            if self._profile:
                self.busy_cpu_ns += time.thread_time_ns() - t0

    refresh_drains = False
    """:meth:`refresh` does nothing here (a caller on a hot path may skip the call)."""

    def refresh(self) -> None:
        """Nothing to do: the sender thread keeps :attr:`fresh_depth` and the rest current."""

    @property
    def counters(self) -> dict[str, int]:
        """The client's counters plus ``queue_dropped`` and ``thread_errors`` (a snapshot)."""
        return {**self.client.counters, "queue_dropped": self.dropped, "thread_errors": self.errors}

    def close(self, timeout_s: float = 1.0) -> None:
        """Stop the sender thread, then close the client. Idempotent."""
        self._stop = True
        self.fresh_depth = None
        if self._wake.locked():
            try:
                self._wake.release()
            except RuntimeError:
                pass
        self._thread.join(timeout_s)
        if not self._thread.is_alive():  # else it is stuck in a ZeroMQ call: leave its socket to it
            self.client.close()

    def __enter__(self) -> ClientThread:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class InlineClient:
    """:class:`ClientThread`'s interface on the caller's own thread (no extra thread).

    :meth:`submit` drains the replies, then sends the record: one visit to the socket per
    record, on the caller's thread; :meth:`refresh` (the hook calls it at the top of every
    scheduler iteration) drains only when the last drain is ``refresh_after_ns`` old, and
    judges freshness every time. Nothing else in the process competes with the caller for
    the GIL, which on a scheduler bound by its own work costs less than the thread's
    hand-over saves (``docs/hook.md`` "Cost"). The hook's default.

    Args:
        client: a connected client, used from the caller's thread only.
        build: as for :class:`ClientThread`, run on the caller's thread.
        min_drain_ns: drain at most this often (0: at every :meth:`submit`). Draining is most
            of a visit's cost; where no decision is applied (a server without speculation)
            the hook drains only now and then, for welcomes and errors.
        refresh_after_ns: :meth:`refresh` drains only when the last drain is at least this
            old (and ``min_drain_ns``): a fresher drain already read what could have come
            back, so iterations right after a record skip the socket, while long prefills and
            idle gaps still read the decisions that arrived meanwhile.

    Attributes:
        fresh_depth: the depth to apply now (:meth:`ControllerClient.fresh_depth`), as of the
            last :meth:`submit` or :meth:`refresh`.
    """

    def __init__(
        self,
        client: ControllerClient,
        *,
        build: Callable[[Any], Step] | None = None,
        min_drain_ns: int = 0,
        refresh_after_ns: int = 0,
    ) -> None:
        self.client = client
        self._build = build
        self._min_drain_ns = min_drain_ns
        self._refresh_after_ns = max(min_drain_ns, refresh_after_ns)
        # Never drained: the first submit or refresh drains. Not 0: the monotonic clock counts
        # from boot, so on a host up for less than min_drain_ns, 0 would read as "just drained".
        self._drained_ns = -(1 << 62)
        self.fresh_depth: int | None = None
        self.depth: int | None = None
        self.decisions = 0
        self.dropped = 0
        self.errors = 0
        self.busy_cpu_ns = 0  # no thread of its own: always 0
        self.last_lag_ns = 0

    def submit(self, item: Any) -> None:
        """Drain replies into the newest decision, then send the record; never blocks.

        ``item`` is a :class:`Step`, or what ``build`` makes one from (as for :class:`ClientThread`).
        """
        now = time.monotonic_ns()
        if now - self._drained_ns >= self._min_drain_ns:
            self._drain(now)
        self.client.send_step(item if self._build is None else self._build(item))

    refresh_drains = True
    """:meth:`refresh` has work to do: the caller calls it at every iteration top."""

    def refresh(self) -> None:
        """Judge :attr:`fresh_depth` now, draining replies first if the last drain is old enough."""
        now = time.monotonic_ns()
        if now - self._drained_ns >= self._refresh_after_ns:
            self._drain(now)
        else:
            self.fresh_depth = self.client.fresh_depth(now)

    def _drain(self, now: int) -> None:
        self._drained_ns = now
        client = self.client
        self.fresh_depth = client.poll_decision()  # judged as fresh_depth() would be, after the drain
        self.depth = client.depth
        self.decisions = client.counters["decisions"]

    @property
    def counters(self) -> dict[str, int]:
        return {**self.client.counters, "queue_dropped": 0, "thread_errors": 0}

    def close(self, timeout_s: float = 1.0) -> None:
        self.fresh_depth = None
        self.client.close()

    def __enter__(self) -> InlineClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
