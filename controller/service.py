"""``controller serve``: one ROUTER socket, any number of SGLang replicas, one decision per step.

Per message, in this order (the hook is waiting on the first half):

1. receive → decode → validate → featurize (one :class:`~controller.features.Featurizer` per
   instance) → policy (one :class:`~controller.policy.Policy` per instance) → send ``decision``;
2. then record (``--record DIR``, see :mod:`controller.traces`) and count (metrics).

Bad input never stops the server and never touches another instance's state: every refused
frame gets the documented ``error`` reply (:mod:`controller.protocol`) and a count in
``specdepth_errors_total{code}``; a frame over 64 KiB gets ``too_large``, and a peer that sends
a message over 1 MiB is disconnected by ZeroMQ itself (``MAXMSGSIZE``) before it is buffered. Memory stays bounded: at most ``max_instances`` sessions
are kept (the least recently active one is evicted for a new ``hello``; its hook simply gets
``unknown_instance`` and says ``hello`` again).

Sessions: every ``hello`` is answered by ``welcome``. A ``hello`` from a new socket (a
restarted hook: ZeroMQ routing id) or with other depths starts a fresh session — new
Featurizer and policy state, ``seq`` may start over; the same socket repeating the same
``hello`` (the client does so when decisions stopped for ``stale_ms``) keeps the session. The recording of an instance goes
to one file per session of the server process (a re-``hello`` continues the same file).

Waiting: between messages the serving thread sleeps on the socket, but by default it polls
without sleeping around the moment each instance's next step is due, and warms the path first
(``--poll hybrid``, :mod:`controller.polling`); ``--poll block`` only sleeps.

Recording flush policy: records are handed to the OS whenever the socket has been drained,
and at the latest every :data:`FLUSH_EVERY` messages, so a ``kill -9`` loses at most the
burst being handled (whatever was flushed reads back; see :mod:`controller.traces`).

Security: the socket binds ``ipc://`` or a loopback ``tcp://`` address; any other address
needs ``--curve-secret-key-file`` (ZeroMQ CURVE encryption; hooks then need the server's
public key). The service never unpickles: frames are msgpack, policies are read by
:mod:`controller.ppo_policy` with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import argparse
import errno
import ipaddress
import logging
import os
import select
import signal
import socket
import time
from array import array
from bisect import bisect_left
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import zmq

from controller.baselines import StaticPolicy
from controller.cpus import usable_cpus
from controller.errors import ConfigError, ControllerError, PolicyLoadError
from controller.features import Featurizer, featurizer_for, featurizer_version_of
from controller.features import warm_up as warm_up_featurizer
from controller.metrics import LATENCY_BUCKETS_NS, ServiceStats
from controller.objective import THROUGHPUT
from controller.policy import FusedPolicy, Policy, PolicyFactory, ServingFactory
from controller.polling import Cadence, SpinPlanner
from controller.protocol import (
    DEFAULT_ENDPOINT,
    MAX_DEPTH,
    PROTOCOL_VERSION,
    TO_HOOK,
    Error,
    ProtocolError,
    Welcome,
    check_step,
    decision_encoder,
    encode,
    parse_hello,
    read_step,
    unpack,
)
from controller.registry import make_factory
from controller.traces import TraceWriter, add_rx

log = logging.getLogger("controller.service")

FLUSH_EVERY = 256  # messages handled between two trace flushes under sustained load
POLL_MS = 100  # how often the loop wakes up to notice a stop request when idle
# Plain ints: pyzmq's flags are IntFlag members, and `int & IntFlag` builds a new enum member
# (about 1 µs per message in the old drain loop).
_NOBLOCK, _RCVMORE = int(zmq.NOBLOCK), int(zmq.RCVMORE)
_EVENTS, _POLLIN = int(zmq.EVENTS), int(zmq.POLLIN)
_SEND_MORE = int(zmq.NOBLOCK) | int(zmq.SNDMORE)
# pyzmq's own send, without the Python layer of zmq.Socket.send (routing_id/group/list
# handling this server never uses): ≈0.5 µs less per call, two calls per decision.
_zsend = zmq.backend.Socket.send


@dataclass(frozen=True)
class ServeConfig:
    """Everything ``controller serve`` needs.

    Attributes:
        policy: ``builtin:NAME`` or the path of a PPO zip.
        bind: the ROUTER endpoint (``ipc://PATH``, ``tcp://127.0.0.1:PORT``; ``PORT`` may be
            ``*`` for a free one).
        record: trace folder, or None for no recording.
        metrics_port: Prometheus text endpoint on ``127.0.0.1:PORT``, or None.
        max_instances: sessions kept at once; the least recently active is evicted beyond.
        curve_secret_key_file: a file holding the server's Z85 CURVE secret key (40 chars);
            required for a non-loopback ``tcp://`` bind.
        trace_flush_bytes: pending trace bytes that force a flush between drains.
        latency_log: write every decision latency (ns, int64 little-endian) here at exit,
            for ``bench/``; None in production.
        poll: how the serving thread waits for the next message. ``"hybrid"``: sleep on the
            socket, but poll it without sleeping around the moment each instance's next step
            is due (:mod:`controller.polling`), within ``spin_budget``; it falls back to
            ``"block"`` where the process has fewer than 2 CPUs (a spinning thread would
            starve ZeroMQ's I/O thread). ``"block"``: sleep on the socket until a message
            comes.
        spin_budget: the most time ``"hybrid"`` polls without sleeping, as a fraction of one
            core averaged over a second.
        prewarm: with ``"hybrid"``, when a window opens after a sleep, first run the
            instance's path on its last record, on the side (decode, validate, Featurizer and
            policy on a scratch Featurizer), so that the record finds it warm.
        busy_poll_us: after each message, keep polling the socket without sleeping for this
            long before waiting as ``poll`` says (0 = wait at once). With a value longer than a
            decode step the serving thread never sleeps while steps flow, at the price of up
            to one busy core. An idle server still sleeps. Needs a second core for ZeroMQ's
            I/O thread, which the polling thread would otherwise starve.
    """

    policy: str
    bind: str = DEFAULT_ENDPOINT
    record: str | None = None
    metrics_port: int | None = None
    max_instances: int = 1024
    curve_secret_key_file: str | None = None
    trace_flush_bytes: int = 1 << 16
    latency_log: str | None = None
    poll: str = "hybrid"
    spin_budget: float = 0.5
    prewarm: bool = True
    busy_poll_us: int = 0


POLL_MODES = ("hybrid", "block")
MAX_BUSY_POLL_US = 1_000_000  # `--busy-poll-us` above a second is a busy core, not a latency knob


# --------------------------------------------------------------------------- endpoint checks


def check_endpoint(endpoint: str, curve: bool) -> None:
    """Refuse endpoints that cannot work or would be exposed without CURVE.

    Raises:
        ConfigError: unknown transport, malformed address, a non-loopback ``tcp://`` address
            without CURVE keys, or an ``ipc://`` socket another live process is serving.
    """
    scheme, sep, rest = endpoint.partition("://")
    if not sep or not rest:
        raise ConfigError(f"bad endpoint {endpoint!r}: expected ipc://PATH or tcp://127.0.0.1:PORT")
    if scheme == "inproc":
        return
    if scheme == "ipc":
        _check_ipc(rest, endpoint)
        return
    if scheme != "tcp":
        raise ConfigError(f"bad endpoint {endpoint!r}: transport {scheme!r} is not ipc or tcp")
    host, colon, port = rest.rpartition(":")
    if not colon or not host or not (port == "*" or (port.isdigit() and 0 < int(port) < 65536)):
        raise ConfigError(f"bad endpoint {endpoint!r}: expected tcp://HOST:PORT with PORT in 1..65535 or *")
    if not curve and not _is_loopback(host.strip("[]")):
        raise ConfigError(
            f"refusing to bind {endpoint!r} without encryption: bind ipc:// or tcp://127.0.0.1:PORT, "
            "or give --curve-secret-key-file to serve other hosts"
        )


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a name, an interface or '*': may reach other hosts


def _check_ipc(path: str, endpoint: str) -> None:
    if path.startswith("@"):
        return  # Linux abstract namespace: ZeroMQ reports a clash itself
    if len(path.encode()) > 107:
        raise ConfigError(f"bad endpoint {endpoint!r}: ipc path longer than 107 bytes")
    folder = os.path.dirname(path) or "."
    if not os.path.isdir(folder):
        raise ConfigError(f"bad endpoint {endpoint!r}: folder {folder!r} does not exist")
    if not os.path.exists(path):
        return
    # ZeroMQ silently replaces an existing ipc socket file, stealing a live server's address;
    # probe it first: a refused connection means a stale file from a dead server.
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.settimeout(0.5)
        probe.connect(path)
    except OSError as exc:
        if exc.errno in (errno.ECONNREFUSED, errno.ENOENT):
            return
        raise ConfigError(f"cannot bind {endpoint!r}: {exc.strerror or exc}") from None
    finally:
        probe.close()
    raise ConfigError(f"cannot bind {endpoint!r}: address in use (another controller is serving it)")


# --------------------------------------------------------------------------- sessions


class _Session:
    """One instance's live state."""

    __slots__ = (
        "instance",
        "depths",
        "featurizer",
        "policy",
        "fused",
        "last_seq",
        "writer",
        "active",
        "ident",
        "encode_decision",
        "cadence",
        "last_frame",
        "scratch",
    )

    def __init__(
        self, instance: str, depths: tuple[int, ...], policy: Policy, writer: TraceWriter | None
    ) -> None:
        self.instance = instance
        self.depths = depths
        self.featurizer = featurizer_for(policy, depths)
        self.policy = policy
        # The policy's fused Featurizer + policy kernel, if it has one (PPOPolicy.fused).
        self.fused: Callable[..., int] | None = policy.fused if isinstance(policy, FusedPolicy) else None
        self.last_seq: int | None = None
        self.writer = writer
        self.active = 0
        self.ident = b""  # ZeroMQ routing id of the socket that said hello
        self.encode_decision = decision_encoder(instance)  # (seq, depth) -> the decision frame
        self.cadence = Cadence(self)  # when its steps come, for hybrid polling
        self.last_frame = b""  # its last step record, to warm the path before the next one
        self.scratch: Featurizer | None = None  # a Featurizer for warming, never for decisions


class Server:
    """The controller service. Build it, then :meth:`serve_forever` until :meth:`stop`.

    Args:
        config: see :class:`ServeConfig`.
        factory: a ready policy factory (tests, benches); default: ``make_factory(config.policy)``.
        context: a ZeroMQ context to share (``inproc://`` peers need the same one); by default
            the server makes, and at close terminates, its own.

    Raises:
        PolicyLoadError: the policy spec cannot be served.
        ConfigError: the endpoint, record folder or keys cannot be used.
    """

    def __init__(
        self,
        config: ServeConfig,
        factory: PolicyFactory | None = None,
        context: zmq.Context | None = None,  # type: ignore[type-arg]
    ) -> None:
        self.config = config
        if config.poll not in POLL_MODES:
            raise ConfigError(f"poll {config.poll!r}: must be one of {', '.join(POLL_MODES)}")
        if not 0 < config.spin_budget <= 1:
            raise ConfigError(f"spin budget {config.spin_budget}: must be in (0, 1]")
        self.factory = factory if factory is not None else load_policy(config.policy)
        if isinstance(self.factory, ServingFactory):
            self.factory.prepare_serving()  # e.g. compile a PPO zip's fused kernel now, not at the first step
        # Before binding: a hook that connects must get its first decision at full speed, not
        # after numba compiled (or loaded) the Featurizer on that first step.
        warm_up_featurizer()
        self.stats = ServiceStats()
        # What the served policy maximises (a PPO zip's objective; builtins: throughput).
        self.objective = str(getattr(self.factory, "objective", THROUGHPUT))
        self.stats.policy = str(getattr(self.factory, "name", config.policy))
        self.stats.objective = self.objective
        # How the loop waits; `poll_mode` says what this process does, after the CPU check.
        self.poll_mode = config.poll
        self._planner: SpinPlanner | None = None
        if config.poll == "hybrid":
            cpus = usable_cpus()
            if cpus < 2:
                self.poll_mode = "block"
                log.info(
                    "hybrid polling off: %.3g CPUs usable, ZeroMQ's I/O thread needs one of its own", cpus
                )
            else:
                self._planner = SpinPlanner(config.spin_budget, POLL_MS * 1_000_000)
        self._sessions: dict[str, _Session] = {}
        self._dirty: set[TraceWriter] = set()
        self._tick = 0
        self._stop = False
        self._latencies: array[int] | None = array("q") if config.latency_log else None
        self._record = Path(config.record) if config.record else None
        if self._record is not None:
            _check_record_dir(self._record)
        secret = _read_curve_key(config.curve_secret_key_file) if config.curve_secret_key_file else None
        check_endpoint(config.bind, curve=secret is not None)
        self._own_context = context is None
        self._ctx = zmq.Context() if context is None else context
        sock = self._ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 10_000)
        sock.setsockopt(zmq.RCVHWM, 10_000)
        sock.setsockopt(zmq.MAXMSGSIZE, 1 << 20)  # a peer sending more is disconnected by ZeroMQ
        if secret is not None:
            sock.curve_secretkey = secret
            sock.curve_publickey = zmq.curve_public(secret)
            sock.curve_server = True
        try:
            sock.bind(config.bind)
        except zmq.ZMQError as exc:
            sock.close(0)
            if self._own_context:
                self._ctx.term()
            raise ConfigError(f"cannot bind {config.bind!r}: {exc.strerror}") from None
        self._sock = sock
        self.endpoint: str = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._metrics_server: Any = None
        if config.metrics_port is not None:
            from controller.metrics import start_metrics_server

            try:
                self._metrics_server = start_metrics_server(self.stats, config.metrics_port)
            except OSError as exc:
                self.close()
                raise ConfigError(
                    f"cannot serve metrics on 127.0.0.1:{config.metrics_port}: {exc.strerror or exc}"
                ) from None

    # ------------------------------------------------------------------ loop

    def stop(self) -> None:
        """Ask :meth:`serve_forever` to return (safe from a signal handler)."""
        self._stop = True

    def serve_forever(self) -> None:
        """Serve until :meth:`stop`; then flush and close everything."""
        try:
            if self._planner is not None:
                self._serve_hybrid(self._planner)
            else:
                self._serve_blocking()
        finally:
            self.close()

    def _serve_blocking(self) -> None:
        sock = self._sock
        # A blocking recv with a timeout instead of poll() then recv(): it returns as soon as
        # a message is queued, so a busy loop never pays for a poll (≈3 µs) or a readiness
        # check (EVENTS, ≈2 µs: it reads ZeroMQ's command mailbox with a syscall).
        sock.setsockopt(zmq.RCVTIMEO, POLL_MS)
        recv, receive = sock.recv, self._receive
        spin_ns = self.config.busy_poll_us * 1000
        while not self._stop:
            try:
                ident = recv()
            except zmq.Again:  # idle for POLL_MS: look at _stop again
                continue
            receive(ident)
            if self._dirty:
                # Recording: the socket must be drained before the flush (the crash-safety
                # contract); without recording, the blocking recv above is the next check.
                self.drain()
            if spin_ns:
                self._busy_poll(spin_ns)

    def _serve_hybrid(self, planner: SpinPlanner) -> None:
        """Sleep on the socket, but poll it without sleeping while a step is due (see ``poll``)."""
        sock, drain, clock, stats = self._sock, self.drain, time.monotonic_ns, self.stats
        # Integer options: getsockopt returns int (its type says int | bytes for all options).
        getsockopt = cast("Callable[[int], int]", sock.getsockopt)
        wait = _fd_waiter(getsockopt(zmq.FD))
        spin_ns = self.config.busy_poll_us * 1000
        prewarm, slept = self.config.prewarm, True
        while not self._stop:
            if drain():  # handled messages (and flushed traces): look again before waiting
                if spin_ns:
                    self._busy_poll(spin_ns)
                continue
            now = clock()
            spin, until, cadence = planner.plan(now)
            if spin:
                if slept and prewarm and cadence is not None:
                    self._warm(cadence.owner)
                slept = False
                t = now
                while not self._stop and t < until and not drain():
                    t = clock()
                planner.spent(t - now)  # the warming included: it is CPU spent on a guess too
                stats.spin_ns += t - now
                continue
            # Sleep until a message comes or `until`. ZeroMQ's FD only says that the socket's
            # state may have changed, and only after EVENTS has been read: read it first.
            if not getsockopt(_EVENTS) & _POLLIN:
                wait(max(until - now, 0))
                slept = True

    def _warm(self, session: Any) -> None:
        """Run a session's path on its last record, off to the side, before its next one is due.

        After a sleep of a few ms the core has lost what the path needs (code, the policy's
        weights) and runs it ~3x slower; this pays that once, before the record comes. It
        decodes and validates the last frame again, runs the fused kernel on a scratch
        Featurizer and packs a decision, none of which touches the session's state."""
        if type(session) is not _Session or not session.last_frame:
            return
        try:
            frame = session.last_frame
            step, accept_u8 = read_step(unpack(frame), frame)
            if session.scratch is None:
                session.scratch = featurizer_for(session.policy, session.depths)
            if session.fused is not None:
                session.scratch.update_with(step, session.fused, accept_u8)
            else:
                session.scratch.update(step, accept_u8)
            session.encode_decision(step.seq, session.depths[0])
        except Exception:  # warming is an optimisation: never let it cost a decision
            session.last_frame = b""

    def _busy_poll(self, spin_ns: int) -> None:
        """:meth:`drain` without sleeping until nothing came for ``spin_ns`` (``busy_poll_us``)."""
        clock = time.monotonic_ns
        until = clock() + spin_ns
        while not self._stop:
            if self.drain():
                until = clock() + spin_ns
            elif clock() >= until:
                return

    def drain(self, limit: int = FLUSH_EVERY) -> int:
        """Handle up to ``limit`` pending messages without blocking, then flush traces."""
        recv, receive = self._sock.recv, self._receive
        n = 0
        while n < limit:
            # recv until EAGAIN: one exception per burst (≈4 µs) is cheaper than a readiness
            # check per message (EVENTS, ≈2 µs each) once bursts hold more than two messages.
            try:
                ident = recv(_NOBLOCK)
            except zmq.Again:
                break
            receive(ident)
            n += 1
        if self._dirty:
            self._flush()
        return n

    def _receive(self, ident: bytes) -> None:
        """Read the rest of the ROUTER message that ``ident`` starts, then handle it."""
        sock = self._sock
        body = sock.recv(_NOBLOCK)  # a ROUTER message is atomic: identity, then ≥ 1 frame
        extra = 0
        while sock.getsockopt(_RCVMORE):
            sock.recv(_NOBLOCK)
            extra += 1
        self._dispatch(ident, body, extra, time.monotonic_ns())  # received: the whole message is read

    def handle(self, frames: list[bytes], rx_ns: int) -> None:
        """Handle one ROUTER message ``[identity, frame...]``; never raises."""
        self._dispatch(frames[0], frames[1] if len(frames) > 1 else b"", max(len(frames) - 2, 0), rx_ns)

    def _dispatch(self, ident: bytes, frame: bytes, extra: int, rx_ns: int) -> None:
        self.stats.frames += 1
        try:
            if extra:
                raise ProtocolError("bad_msgpack", f"a message must be one frame, got {extra + 1}")
            wire = unpack(frame)
            t = wire.get("t")
            if t == "step":
                self._on_step(ident, frame, wire, rx_ns)
            elif t == "hello":
                self._on_hello(ident, frame, wire, rx_ns)
            elif type(t) is str and t in TO_HOOK:
                raise ProtocolError("wrong_direction", f"{t!r} is sent by the controller, not to it")
            else:
                raise ProtocolError("unknown_type", f"unknown message type {str(t)[:40]!r}")
        except ProtocolError as exc:
            self._reply_error(ident, exc.code, exc.msg)
        except Exception as exc:  # a bug on a valid message: report it, keep serving everyone
            log.exception("internal error handling a message")
            self._reply_error(ident, "internal", f"{type(exc).__name__}: {str(exc)[:200]}")

    def _on_step(self, ident: bytes, frame: bytes, wire: dict[str, Any], rx_ns: int) -> None:
        step, accept_u8 = read_step(wire, frame)
        session = self._sessions.get(step.instance)
        if session is None:
            raise ProtocolError("unknown_instance", f"no hello from {step.instance[:40]!r}; send hello")
        depths, last_seq, seq = session.depths, session.last_seq, step.seq
        if step.depth not in depths or (last_seq is not None and seq <= last_seq):
            check_step(step, depths, last_seq)  # raises the precise error
        session.last_seq = seq
        fused = session.fused
        if fused is None:
            action = session.policy.act(session.featurizer.update(step, accept_u8), step)
        else:  # the same state and action in one compiled call (~1 µs less)
            action = session.featurizer.update_with(step, fused, accept_u8)
        if not 0 <= action < len(depths):
            raise RuntimeError(
                f"policy {self.factory.name} answered action {action} for {len(depths)} depths"
            )
        depth = depths[action]
        payload = session.encode_decision(seq, depth)
        sock = self._sock
        try:
            # ROUTER without ROUTER_MANDATORY drops what it cannot route instead of blocking or
            # failing; NOBLOCK guards the rest.
            _zsend(sock, ident, _SEND_MORE)
            _zsend(sock, payload, _NOBLOCK)
        except zmq.ZMQError:
            self.stats.replies_dropped += 1
        # Off the hook's critical path from here on: plain int updates, inlined (ServiceStats
        # documents the fields; a method call each would cost more than the update).
        tx_ns = time.monotonic_ns()
        stats = self.stats
        latency_ns = tx_ns - rx_ns
        stats.latency_counts[bisect_left(LATENCY_BUCKETS_NS, latency_ns)] += 1
        stats.latency_sum_ns += latency_ns
        if self._latencies is not None:
            self._latencies.append(latency_ns)
        stats.steps += 1
        decisions = stats.decisions
        decisions[depth] = decisions.get(depth, 0) + 1
        self._tick += 1
        session.active = self._tick
        session.last_frame = frame
        if self._planner is not None:
            self._planner.note(session.cadence, rx_ns)
        writer = session.writer
        if writer is not None:
            try:
                writer.write_frame(frame, rx_ns)
                writer.write_bytes(add_rx(payload, tx_ns))
            except OSError as exc:
                self._drop_writer(session, exc)
            else:
                self._dirty.add(writer)

    def _on_hello(self, ident: bytes, frame: bytes, wire: dict[str, Any], rx_ns: int) -> None:
        hello = parse_hello(wire)
        try:
            policy = self.factory(hello.depths)
        except ControllerError as exc:  # e.g. a PPO zip trained for other depths
            if len(hello.depths) > 1:
                raise ProtocolError("bad_field", f"depths {list(hello.depths)} not servable: {exc}") from None
            # One allowed depth (a server without speculation) leaves nothing to decide: answer
            # it and record its telemetry whatever the policy, so any server can be traced.
            policy = StaticPolicy(hello.depths[0], hello.depths)
        session = self._sessions.get(hello.instance)
        if session is None:
            if len(self._sessions) >= self.config.max_instances:
                self._evict()
            session = _Session(hello.instance, hello.depths, policy, self._open_writer(hello.instance))
            self._sessions[hello.instance] = session
            log.info(
                "hello from %r: depths %s, engine %r, tp %d",
                hello.instance,
                list(hello.depths),
                hello.engine,
                hello.tp,
            )
        elif session.ident == ident and session.depths == hello.depths:
            # The same hook socket repeating itself (it thought it lost us): keep what the
            # Featurizer and policy learned, and its seq.
            pass
        else:  # another socket (a restarted hook) or other depths: a fresh session
            session.depths = hello.depths
            session.featurizer = featurizer_for(policy, hello.depths)
            session.policy = policy
            session.fused = policy.fused if isinstance(policy, FusedPolicy) else None
            session.last_seq = None
            # The last record and the scratch Featurizer were for the old depths: warming must
            # not run the new kernel on them.
            session.last_frame, session.scratch = b"", None
            policy.reset()
            log.info("hello again from %r: session restarted, depths %s", hello.instance, list(hello.depths))
        session.ident = ident
        self._tick += 1
        session.active = self._tick
        self._send(ident, encode(Welcome(self.factory.name, session.featurizer.version)))
        self.stats.hellos += 1
        self.stats.instances = len(self._sessions)
        if session.writer is not None:
            try:
                session.writer.write_frame(frame, rx_ns)
            except OSError as exc:
                self._drop_writer(session, exc)
            else:
                self._dirty.add(session.writer)

    def _send(self, ident: bytes, payload: bytes) -> None:
        sock = self._sock
        try:
            # As in _on_step (which inlines this): two send() calls cost ~1.5 µs less than
            # send_multipart.
            _zsend(sock, ident, _SEND_MORE)
            _zsend(sock, payload, _NOBLOCK)
        except zmq.ZMQError:
            self.stats.replies_dropped += 1

    def _reply_error(self, ident: bytes, code: str, msg: str) -> None:
        self.stats.count_error(code)
        log.debug("error %s: %s", code, msg)
        self._send(ident, encode(Error(code, msg[:1024])))

    # ------------------------------------------------------------------ sessions and files

    def _evict(self) -> None:
        oldest = min(self._sessions.values(), key=lambda s: s.active)
        del self._sessions[oldest.instance]
        self.stats.evicted += 1
        if oldest.writer is not None:
            self._dirty.discard(oldest.writer)
            try:
                oldest.writer.close()
            except OSError:
                pass
        log.info("evicted the least recently active instance %r (max_instances reached)", oldest.instance)

    def _open_writer(self, instance: str) -> TraceWriter | None:
        if self._record is None:
            return None
        try:
            return TraceWriter(self._record, instance, flush_bytes=self.config.trace_flush_bytes)
        except ControllerError as exc:
            log.error("not recording %r: %s", instance, exc)
            return None

    def _drop_writer(self, session: _Session, exc: OSError) -> None:
        log.error("stopped recording %r: %s", session.instance, exc.strerror or exc)
        if session.writer is not None:
            self._dirty.discard(session.writer)
            try:
                session.writer.close()
            except OSError:
                pass
        session.writer = None

    def _flush(self) -> None:
        for writer in list(self._dirty):
            try:
                writer.flush()
            except OSError as exc:
                for session in self._sessions.values():
                    if session.writer is writer:
                        self._drop_writer(session, exc)
        self._dirty.clear()

    def close(self) -> None:
        """Flush and close trace files, the socket and the metrics endpoint. Idempotent."""
        for session in self._sessions.values():
            if session.writer is not None:
                try:
                    session.writer.close()
                except OSError as exc:
                    log.error("closing the trace of %r: %s", session.instance, exc)
                session.writer = None
        self._dirty.clear()
        if self._latencies is not None and self.config.latency_log:
            with open(self.config.latency_log, "wb") as f:
                self._latencies.tofile(f)
            self._latencies = None
        if self._metrics_server is not None:
            self._metrics_server.shutdown()
            self._metrics_server.server_close()
            self._metrics_server = None
        if not self._sock.closed:
            self._sock.close(0)
            if self._own_context:
                self._ctx.term()
            if self.endpoint.startswith("ipc://") and not self.endpoint.startswith("ipc://@"):
                try:  # ZeroMQ leaves the socket file behind; it was ours (see _check_ipc)
                    os.unlink(self.endpoint[len("ipc://") :])
                except OSError:
                    pass

    @property
    def instances(self) -> list[str]:
        """Instances with a live session."""
        return list(self._sessions)


def _fd_waiter(fd: int) -> Callable[[int], object]:
    """A wait for ``fd`` to become readable, at most ``timeout_ns``: select() for its µs
    timeouts (poll() and epoll() take ms), poll() for a descriptor select() cannot hold."""
    if fd < 1024:  # FD_SETSIZE
        fds = [fd]
        return lambda timeout_ns: select.select(fds, (), (), timeout_ns / 1e9)
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    return lambda timeout_ns: poller.poll(-(-timeout_ns // 1_000_000))


def load_policy(spec: str) -> PolicyFactory:
    """Resolve ``--policy`` (PolicyLoadError with a reason if it cannot be served)."""
    if not spec.startswith("builtin:"):
        path = Path(spec)
        if not path.exists():
            raise PolicyLoadError(
                f"policy file {spec!r} does not exist (or use builtin:NAME, e.g. builtin:static:3)"
            )
        if not path.is_file():
            raise PolicyLoadError(f"policy {spec!r} is not a file")
    try:
        factory = make_factory(spec)
    except ImportError as exc:  # PPO zip support needs numpy + torch (the serve extra)
        raise PolicyLoadError(f"cannot load {spec!r}: {exc} (install specdepth[serve])") from None
    if spec.startswith("builtin:"):
        # Builtins adapt to each hello's depths, so a bad argument (builtin:static:x) would
        # only show at the first hello: build one now for every depth the protocol allows.
        try:
            factory(tuple(range(MAX_DEPTH + 1)))
        except ControllerError:
            raise
        except Exception as exc:
            raise PolicyLoadError(f"{spec}: cannot be built: {type(exc).__name__}: {exc}") from None
    return factory


def _check_record_dir(folder: Path) -> None:
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"cannot create record folder {str(folder)!r}: {exc.strerror or exc}") from None
    if not os.access(folder, os.W_OK | os.X_OK):
        raise ConfigError(f"record folder {str(folder)!r} is not writable")


def _read_curve_key(path: str) -> bytes:
    try:
        key = Path(path).read_bytes().strip()
    except OSError as exc:
        raise ConfigError(f"cannot read CURVE key {path!r}: {exc.strerror or exc}") from None
    if len(key) != 40:
        raise ConfigError(f"CURVE key file {path!r} must hold one 40-character Z85 secret key")
    if not zmq.has("curve"):
        raise ConfigError("this libzmq was built without CURVE support")
    return key


# --------------------------------------------------------------------------- CLI


def register(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add ``controller serve``."""
    p = subparsers.add_parser(
        "serve",
        help="serve a policy to SGLang replicas over ZeroMQ",
        description=(
            "Serve a speculation policy: every SGLang replica (hook) connects, says hello, streams "
            "one step record per decode step, and gets one decision (the next draft depth) per step. "
            "Stop with SIGTERM or Ctrl-C; trace files are flushed and closed."
        ),
    )
    p.add_argument(
        "--policy",
        required=True,
        metavar="SPEC",
        help="a PPO zip written by `controller train`, or builtin:NAME: builtin:static:3 (always depth 3; any "
        "static:K), vllm-dsd, trtllm-schedule, sglang-adaptive, sglang-adaptive-all, goodput, bandit. "
        "A zip serves the objective it was trained for (`controller train --objective`: throughput "
        "or slo:TPOT_MS); the startup log line and the specdepth_policy_info metric name it",
    )
    p.add_argument(
        "--bind",
        default=DEFAULT_ENDPOINT,
        metavar="ENDPOINT",
        help=f"ZeroMQ endpoint of the ROUTER socket (default {DEFAULT_ENDPOINT}); tcp://127.0.0.1:PORT also works; "
        "a non-loopback address needs --curve-secret-key-file",
    )
    p.add_argument(
        "--record",
        metavar="DIR",
        help="append every hello, step and decision to DIR/<instance>-<start>.msgpack (read with "
        "`controller traces summarize DIR`)",
    )
    p.add_argument(
        "--metrics-port",
        type=int,
        metavar="N",
        help="serve Prometheus metrics on http://127.0.0.1:N/metrics",
    )
    p.add_argument(
        "--max-instances",
        type=int,
        default=1024,
        metavar="N",
        help="instance sessions kept at once; beyond, the least recently active one is forgotten "
        "(its hook re-sends hello) (default 1024)",
    )
    p.add_argument(
        "--curve-secret-key-file",
        metavar="FILE",
        help="file with this server's Z85 CURVE secret key: encrypts the socket, required to bind "
        "a non-loopback address",
    )
    p.add_argument(
        "--log-level",
        default="info",
        choices=("debug", "info", "warning", "error"),
        help="log verbosity on stderr (default info; debug logs every refused frame)",
    )
    p.add_argument(
        "--poll",
        default="hybrid",
        choices=POLL_MODES,
        help="how the serving thread waits for messages. hybrid (default): it sleeps, but polls without "
        "sleeping from just before each instance's next step is due (learned from the gaps between "
        "its steps) until it comes, within --spin-budget; where fewer than 2 CPUs are usable it "
        "blocks instead. block: it sleeps until a message comes, and wakes on a cold core",
    )
    p.add_argument(
        "--spin-budget",
        type=float,
        default=0.5,
        metavar="FRACTION",
        help="the most CPU hybrid polling may spend on coming steps (polling without sleeping, warming the "
        "path), as a fraction of one core averaged over a second (default 0.5; on the H200 host it "
        "took 0-0.05 more than --poll block with one instance at one step per 7 ms, 0.07-0.09 with 8)",
    )
    p.add_argument(
        "--busy-poll-us",
        type=int,
        default=0,
        metavar="US",
        help="after each message, poll for the next one without sleeping for US microseconds "
        "(e.g. 20000, longer than a decode step): decisions come back sooner because the serving "
        "thread stays awake while steps flow, at the cost of up to one busy core; an idle server "
        "still sleeps. Give the process two cores or more: on one, the polling thread starves "
        f"ZeroMQ's I/O thread (default 0: sleep at once; at most {MAX_BUSY_POLL_US})",
    )
    p.add_argument(
        "--latency-log",
        metavar="FILE",
        help="at exit, write every decision latency in ns (int64) to FILE (for bench/)",
    )
    p.set_defaults(func=_cmd_serve)


def _cmd_serve(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if args.metrics_port is not None and not 0 < args.metrics_port < 65536:
        raise ConfigError(f"--metrics-port {args.metrics_port} is not a port number (1..65535)")
    if args.max_instances < 1:
        raise ConfigError("--max-instances must be at least 1")
    if not 0 < args.spin_budget <= 1:
        raise ConfigError(f"--spin-budget {args.spin_budget}: must be in (0, 1]")
    if not 0 <= args.busy_poll_us <= MAX_BUSY_POLL_US:
        raise ConfigError(f"--busy-poll-us {args.busy_poll_us}: must be in 0..{MAX_BUSY_POLL_US}")
    config = ServeConfig(
        policy=args.policy,
        bind=args.bind,
        record=args.record,
        metrics_port=args.metrics_port,
        max_instances=args.max_instances,
        curve_secret_key_file=args.curve_secret_key_file,
        latency_log=args.latency_log,
        poll=args.poll,
        spin_budget=args.spin_budget,
        busy_poll_us=args.busy_poll_us,
    )
    server = Server(config)

    def _on_signal(signum: int, _frame: Any) -> None:
        server.stop()

    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    log.info(
        "serving %s (objective %s) on %s (protocol v%d, features v%d), %s polling%s%s%s",
        server.factory.name,
        server.objective,
        server.endpoint,
        PROTOCOL_VERSION,
        featurizer_version_of(server.factory),  # a PPO zip's own; builtins the current one
        server.poll_mode,
        f", recording to {config.record}" if config.record else "",
        f", metrics on 127.0.0.1:{config.metrics_port}" if config.metrics_port else "",
        f", busy poll {config.busy_poll_us} µs" if config.busy_poll_us else "",
    )
    server.serve_forever()
    s = server.stats
    log.info(
        "stopped after %d steps from %d frames; errors %s",
        s.steps,
        s.frames,
        {k: v for k, v in s.errors.items() if v},
    )
    return 0
