"""The hook-side client: sends ``step`` records, picks up ``decision`` replies, never blocks.

This runs inside SGLang's scheduler, on the critical path of every decode step, so it
imports only the standard library, pyzmq, msgpack and :mod:`controller.protocol`, and it
never raises into the caller because of the network: a controller that is down, slow,
restarting or answering garbage only makes :meth:`ControllerClient.poll_decision` return
``None`` (the hook then falls back to SGLang's own policy, DESIGN.md "Decision semantics").

Socket: one DEALER with ``IMMEDIATE`` (nothing is queued for a controller that is not
connected, so a restarted controller never receives a burst of stale steps), a small send
high-water mark (a step that does not fit is dropped and counted: fresh telemetry beats
old), ``LINGER 0`` (closing never waits). ZeroMQ reconnects by itself; the client re-sends
``hello`` when the controller answers ``unknown_instance`` (it restarted) and, as a
safeguard, when decisions stopped for ``stale_ms`` while steps were being sent.

Thread-safety: none. One client belongs to one thread (the scheduler's); ZeroMQ sockets
must not be shared between threads either.
"""

from __future__ import annotations

import os
import time
from typing import Any

import msgpack
import zmq

from controller.protocol import MAX_FRAME_BYTES, Decision, Error, Hello, ProtocolError, Step, Welcome, decode

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
        stale_ms: a decision older than this is not used (``poll_decision`` returns None).
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

        The newest valid decision wins. It is returned while it is younger than ``stale_ms``;
        after that (controller gone or silent) the answer is None until decisions flow again.
        Never blocks, never raises.
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
        if self._depth is None or time.monotonic_ns() - self._decision_ns > self.stale_ns:
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
