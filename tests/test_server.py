"""The live service: error replies per code, fuzz at a live process, restart, kill -9 recording.

Servers run as real ``controller serve`` processes on ``ipc://`` (or in-process on
``inproc://`` where a test needs to look inside); peers are real ZeroMQ DEALER sockets.
"""

from __future__ import annotations

import math
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
import zmq

from controller.features import FEATURIZER_VERSION, Featurizer
from controller.protocol import ERROR_CODES, MAX_FRAME_BYTES, Hello, Step, pack, parse_step
from controller.registry import make_factory
from controller.service import ServeConfig, Server
from controller.traces import iter_records, load_traces
from sglang_hook.client import ControllerClient

DEPTHS = (0, 1, 2, 3, 4, 5)


# --------------------------------------------------------------------------- helpers


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def scrape_metrics(port: int) -> dict[str, float]:
    """The server's Prometheus text endpoint as {sample name with labels: value}."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return {
        ln.rsplit(" ", 1)[0]: float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines() if ln and ln[0] != "#"
    }


class ServerProcess:
    """``controller serve`` in a subprocess; waits until it answers a hello."""

    def __init__(self, endpoint: str, policy: str = "builtin:static:2", *extra: str, log: Path | None = None):
        self.endpoint = endpoint
        self.log_path = log
        out = open(log, "wb") if log else subprocess.DEVNULL  # noqa: SIM115 — closed in stop()
        self._out = out
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "controller.cli", "serve", "--policy", policy, "--bind", endpoint, *extra],
            stdout=out,
            stderr=out,
        )
        self.wait_ready()

    def wait_ready(self, timeout_s: float = 30.0) -> None:
        ctx = zmq.Context.instance()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.endpoint)
        deadline = time.monotonic() + timeout_s
        try:
            while time.monotonic() < deadline:
                assert self.proc.poll() is None, f"server exited with {self.proc.returncode}"
                sock.send(pack(Hello("probe", DEPTHS).to_wire()))
                if sock.poll(200):
                    reply = msgpack.unpackb(sock.recv())
                    assert reply["t"] == "welcome"
                    return
            raise AssertionError("server did not answer within the timeout")
        finally:
            sock.close(0)

    @property
    def rss_kib(self) -> int:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
        raise AssertionError("no VmRSS")

    def stop(self, sig: int = signal.SIGTERM) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            rc = self.proc.wait(timeout=15)
        finally:
            if self._out is not subprocess.DEVNULL:
                self._out.close()  # type: ignore[union-attr]
        return rc


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    return tmp_path


def ipc(tmp: Path, name: str = "ctl") -> str:
    return f"ipc://{tmp}/{name}.sock"


class Peer:
    """A raw DEALER that speaks the protocol lock-step (send, then wait for the reply)."""

    def __init__(self, endpoint: str, ctx: zmq.Context | None = None) -> None:  # type: ignore[type-arg]
        self.sock = (ctx or zmq.Context.instance()).socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)

    def send(self, *frames: bytes) -> None:
        self.sock.send_multipart(list(frames))

    def recv(self, timeout_ms: int = 5000) -> dict[str, Any]:
        assert self.sock.poll(timeout_ms), "no reply"
        return msgpack.unpackb(self.sock.recv(), raw=False)

    def ask(self, wire: dict[str, Any] | bytes, timeout_ms: int = 5000) -> dict[str, Any]:
        self.send(wire if isinstance(wire, bytes) else pack(wire))
        return self.recv(timeout_ms)

    def close(self) -> None:
        self.sock.close(0)


def step_wire(instance: str, seq: int, depth: int = 2, bs: int = 4, **over: Any) -> dict[str, Any]:
    accept = [min(i % 3, depth) for i in range(bs)] if depth else []
    wire = Step(
        instance, seq, depth, bs, 1, accept, 9000 + 100 * depth, 700 * bs, 0.3, 0, 10**9 + seq
    ).to_wire()
    wire.update(over)
    return wire


class ClosedLoop:
    """A deterministic fake replica: each step runs with the depth last decided for it.

    Acceptance and step time depend on the depth and a seeded RNG, so a policy with state
    (goodput) gives a decision sequence that any disturbance of that state would change.
    """

    def __init__(self, instance: str, seed: int = 0) -> None:
        self.instance = instance
        self.rng = random.Random(seed)
        self.depth = 0
        self.seq = 0

    def next_step(self) -> dict[str, Any]:
        rng, d = self.rng, self.depth
        bs = rng.randint(1, 48)
        accept = [min(d, int(rng.expovariate(0.6))) for _ in range(bs)] if d else []
        step = Step(
            self.instance,
            self.seq,
            d,
            bs,
            rng.randint(0, 10),
            accept,
            int(8000 * (1 + 0.02 * bs * (d + 1) / 4) + rng.randint(0, 300)),
            bs * rng.randint(100, 4000),
            rng.random(),
            rng.choice((0, 0, 0, 512)),
            10**9 + self.seq * 10_000,
        )
        self.seq += 1
        return step.to_wire()

    def apply(self, depth: int) -> None:
        self.depth = depth


def expected_decisions(policy: str, instance: str, n: int, seed: int) -> list[int]:
    """What a correct server must answer for ``n`` closed-loop steps, computed in-process."""
    featurizer = Featurizer(DEPTHS)
    pol = make_factory(policy)(DEPTHS)
    loop = ClosedLoop(instance, seed)
    out = []
    for _ in range(n):
        step = parse_step(loop.next_step())
        depth = DEPTHS[pol.act(featurizer.update(step), step)]
        loop.apply(depth)
        out.append(depth)
    return out


# --------------------------------------------------------------------------- in-process: every code


@contextmanager
def serving_inproc(policy: str, bind: str = "inproc://svc") -> Iterator[tuple[Server, Peer]]:
    """A Server for ``policy`` draining on a thread, and a Peer talking to it, in one process."""
    ctx = zmq.Context()
    server = Server(ServeConfig(policy=policy, bind=bind), context=ctx)
    peer = Peer(bind, ctx)
    stop = threading.Event()

    def loop() -> None:
        while not stop.is_set():
            if server._sock.poll(20):
                server.drain()

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    try:
        yield server, peer
    finally:
        stop.set()
        thread.join()
        peer.close()
        server.close()
        ctx.term()


@pytest.fixture
def inproc_server() -> Iterator[tuple[Server, Peer]]:
    with serving_inproc("builtin:static:2") as pair:
        yield pair


def _bad_inputs() -> list[tuple[str, bytes | tuple[bytes, ...], str]]:
    ok = step_wire("a", 100)
    cases: list[tuple[str, bytes | tuple[bytes, ...], str]] = [
        ("random bytes", b"\xc1\xff\x00garbage", "bad_msgpack"),
        ("truncated msgpack", pack(ok)[:-3], "bad_msgpack"),
        ("empty frame", b"", "bad_msgpack"),
        ("two frames", (pack(ok), pack(ok)), "bad_msgpack"),
        ("not a map", msgpack.packb([1, 2, 3]), "not_a_map"),
        ("int keys", msgpack.packb({1: 2}), "not_a_map"),
        ("over 64 KiB", pack({"t": "step", "v": 1, "pad": "x" * MAX_FRAME_BYTES}), "too_large"),
        ("no v", pack({k: v for k, v in ok.items() if k != "v"}), "bad_version"),
        ("v = 2", pack({**ok, "v": 2}), "bad_version"),
        ("v = True", pack({**ok, "v": True}), "bad_version"),
        ("unknown t", pack({**ok, "t": "stepp"}), "unknown_type"),
        ("t not a string", pack({**ok, "t": 5}), "unknown_type"),
        (
            "decision sent to controller",
            pack({"t": "decision", "v": 1, "instance": "a", "seq": 1, "depth": 1}),
            "wrong_direction",
        ),
        (
            "welcome sent to controller",
            pack({"t": "welcome", "v": 1, "policy": "x", "features": 1}),
            "wrong_direction",
        ),
        ("NaN kv", pack({**ok, "kv_usage": math.nan}), "bad_field"),
        ("kv above 1", pack({**ok, "kv_usage": 1.5}), "bad_field"),
        ("negative waiting", pack({**ok, "waiting": -1}), "bad_field"),
        ("huge step_us", pack({**ok, "step_us": 2**62}), "bad_field"),
        ("float seq", pack({**ok, "seq": 101.0}), "bad_field"),
        ("bool bs", pack({**ok, "bs": True}), "bad_field"),
        ("string ctx", pack({**ok, "ctx_tokens": "many"}), "bad_field"),
        ("missing ts_ns", pack({k: v for k, v in ok.items() if k != "ts_ns"}), "bad_field"),
        ("empty instance", pack({**ok, "instance": ""}), "bad_field"),
        ("accept longer than bs", pack({**ok, "accept": [0] * 5}), "bad_accept"),
        ("accept above depth", pack({**ok, "accept": [0, 0, 0, 3]}), "bad_accept"),
        ("accept negative", pack({**ok, "accept": [0, 0, 0, -1]}), "bad_accept"),
        ("accept not a list", pack({**ok, "accept": 4}), "bad_accept"),
        ("accept at depth 0", pack({**ok, "depth": 0}), "bad_accept"),
        ("depth not allowed", pack(step_wire("a", 101, depth=7, bs=4)), "bad_depth"),
        ("seq not increasing", pack(step_wire("a", 99)), "stale_seq"),
        ("step before hello", pack(step_wire("nobody", 1)), "unknown_instance"),
        ("hello with unsorted depths", pack({**Hello("b", (0, 1)).to_wire(), "depths": [2, 1]}), "bad_field"),
        ("hello depth unservable", pack(Hello("b", (0, 1)).to_wire()), "bad_field"),  # static:2 needs 2
    ]
    return cases


def test_every_bad_input_gets_its_error_code_and_a_count(inproc_server: tuple[Server, Peer]) -> None:
    server, peer = inproc_server
    assert peer.ask(Hello("a", DEPTHS).to_wire())["t"] == "welcome"
    assert peer.ask(step_wire("a", 100))["depth"] == 2
    before = dict(server.stats.errors)
    for name, frame, code in _bad_inputs():
        if isinstance(frame, tuple):
            peer.send(*frame)
            reply = peer.recv()
        else:
            reply = peer.ask(frame)
        assert reply["t"] == "error" and reply["v"] == 1, name
        assert reply["code"] == code, (name, reply)
        assert isinstance(reply["msg"], str) and reply["msg"], name
    expected: dict[str, int] = {}
    for _, _, code in _bad_inputs():
        expected[code] = expected.get(code, 0) + 1
    got = {c: n - before.get(c, 0) for c, n in server.stats.errors.items() if n - before.get(c, 0)}
    assert got == expected
    # Nothing changed for the instance: the next seq after 100 is still accepted.
    reply = peer.ask(step_wire("a", 101))
    assert reply == {"t": "decision", "v": 1, "instance": "a", "seq": 101, "depth": 2}
    # The server counts a step after sending its decision (off the hook's critical path), on
    # its own thread: once the next message is answered, that bookkeeping is done.
    assert peer.ask(b"\xc1")["code"] == "bad_msgpack"
    assert server.stats.steps == 2


def test_unknown_keys_are_ignored_and_when_hello_restarts_a_session(
    inproc_server: tuple[Server, Peer],
) -> None:
    server, peer = inproc_server
    welcome = peer.ask({**Hello("a", DEPTHS).to_wire(), "future": [1, {"x": 2}]})
    assert welcome == {"t": "welcome", "v": 1, "policy": "static:2", "features": FEATURIZER_VERSION}
    assert peer.ask({**step_wire("a", 5), "extra": "ok"})["t"] == "decision"
    assert peer.ask(step_wire("a", 5))["code"] == "stale_seq"
    # The same socket repeating its hello keeps the session (seq must still increase).
    assert peer.ask(Hello("a", DEPTHS).to_wire())["t"] == "welcome"
    assert peer.ask(step_wire("a", 5))["code"] == "stale_seq"
    assert server._sessions["a"].featurizer.steps == 1
    # Other depths, or another socket (a restarted hook), start a fresh session.
    assert peer.ask(Hello("a", DEPTHS[:-1]).to_wire())["t"] == "welcome"
    assert peer.ask(step_wire("a", 0))["seq"] == 0
    other = Peer("inproc://svc", peer.sock.context)
    try:
        assert other.ask(Hello("a", DEPTHS[:-1]).to_wire())["t"] == "welcome"
        assert other.ask(step_wire("a", 0))["seq"] == 0
        assert server._sessions["a"].featurizer.steps == 1
    finally:
        other.close()


def test_a_zip_of_an_older_featurizer_version_is_served_with_its_own_observation() -> None:
    """The policy of the H200 calls (Featurizer version 2) still serves after the upgrade to 3:
    the welcome names the version its instance's observations are computed with."""
    zip_path = Path(__file__).resolve().parents[1] / "bench/results/h200/ppo2/ppo.zip"
    with serving_inproc(str(zip_path), "inproc://old") as (server, peer):
        welcome = peer.ask(Hello("a", (0, 1, 3, 5)).to_wire())
        assert welcome["t"] == "welcome" and welcome["features"] == 2 != FEATURIZER_VERSION
        assert server._sessions["a"].featurizer.version == 2
        reply = peer.ask(step_wire("a", 1, depth=3))
        assert reply["t"] == "decision" and reply["depth"] in (0, 1, 3, 5)


def test_sessions_are_capped_least_recently_active_evicted(tmp_path: Path) -> None:
    ctx = zmq.Context()
    server = Server(ServeConfig(policy="builtin:static:2", bind="inproc://cap", max_instances=3), context=ctx)
    peer = Peer("inproc://cap", ctx)
    try:

        def ask(wire: dict[str, Any]) -> dict[str, Any]:
            peer.send(pack(wire))
            server.drain()
            return peer.recv()

        for name in "abc":
            assert ask(Hello(name, DEPTHS).to_wire())["t"] == "welcome"
        assert ask(step_wire("a", 1))["t"] == "decision"  # b is now the least recently active
        assert ask(Hello("d", DEPTHS).to_wire())["t"] == "welcome"
        assert sorted(server.instances) == ["a", "c", "d"]
        assert server.stats.evicted == 1 and server.stats.instances == 3
        assert ask(step_wire("b", 2))["code"] == "unknown_instance"
        assert ask(step_wire("a", 2))["t"] == "decision"
    finally:
        peer.close()
        server.close()
        ctx.term()


# --------------------------------------------------------------------------- live process: fuzz


def _mutations(rng: random.Random, valid: list[bytes]) -> Iterator[tuple[bytes, ...]]:
    """An endless stream of hostile messages; none is a valid message of the good instance."""
    junk_values: list[Any] = [
        None,
        True,
        -1,
        -(2**63),
        2**64 - 1,
        1e308,
        -0.0,
        math.nan,
        math.inf,
        "x" * 300,
        b"\x00",
        [],
        {},
        [[[]]],
    ]
    keys = [
        "t",
        "v",
        "instance",
        "seq",
        "depth",
        "bs",
        "waiting",
        "accept",
        "step_us",
        "ctx_tokens",
        "kv_usage",
        "prefill_tokens",
        "ts_ns",
        "depths",
        "tp",
    ]
    fz_seq = 0
    while True:
        kind = rng.randrange(12)
        base = rng.choice(valid)
        if kind == 0:
            yield (rng.randbytes(rng.randrange(0, 200)),)
        elif kind == 1:
            yield (base[: rng.randrange(len(base))],)
        elif kind == 2:
            b = bytearray(base)
            for _ in range(rng.randint(1, 4)):
                b[rng.randrange(len(b))] = rng.randrange(256)
            yield (bytes(b),)
        elif kind == 3:
            wire = msgpack.unpackb(base)
            wire[rng.choice(keys)] = rng.choice(junk_values)
            yield (msgpack.packb(wire),)
        elif kind == 4:
            wire = msgpack.unpackb(base)
            wire.pop(rng.choice(keys), None)
            yield (msgpack.packb(wire),)
        elif kind == 5:
            wire = step_wire(f"fz{rng.randrange(50)}", rng.randrange(100), depth=3, bs=3)
            wire["accept"] = [rng.randint(-1, 5) for _ in range(rng.choice((2, 3, 4, 50)))]
            yield (msgpack.packb(wire),)
        elif kind == 6:
            yield (
                msgpack.packb(
                    {
                        "t": rng.choice(("stepp", "", "decision", "error", "welcome", 7)),
                        "v": rng.choice((1, 2, 0, "1")),
                    }
                ),
            )
        elif kind == 7 and rng.random() < 0.02:
            yield (b"\x92" + rng.randbytes(MAX_FRAME_BYTES + rng.randrange(1, 5000)),)
        elif kind == 8:
            fz_seq += 1  # valid traffic of other instances, incl. steps before their hello
            name = f"fz{rng.randrange(50)}"
            if rng.random() < 0.3:
                yield (pack(Hello(name, tuple(sorted(rng.sample(range(9), rng.randint(1, 5))))).to_wire()),)
            else:
                yield (pack(step_wire(name, fz_seq, depth=rng.choice((0, 2)), bs=rng.randint(1, 9))),)
        elif kind == 9:
            yield tuple(rng.choice(valid) for _ in range(rng.randint(2, 3)))
        elif kind == 10:
            yield (msgpack.packb(rng.choice([1, "s", [1], None, 1.5, {"v": 1}, {"t": "step"}])),)
        else:
            # Deeply nested or wide containers: msgpack's own limits must hold.
            yield (b"\x91" * rng.randrange(1, 3000) + b"\xc0",)


@pytest.mark.slow
def test_fuzz_10000_frames_at_a_live_server(workdir: Path) -> None:
    endpoint = ipc(workdir)
    port = free_port()
    server = ServerProcess(
        endpoint,
        "builtin:goodput",
        "--metrics-port",
        str(port),
        "--max-instances",
        "64",
        "--record",
        str(workdir / "runs"),
        log=workdir / "server.log",
    )
    rng = random.Random(1234)
    n_good = 400
    expected = expected_decisions("builtin:goodput", "good-instance", n_good, seed=7)
    good, fuzz = Peer(endpoint), Peer(endpoint)
    raw_path = endpoint[len("ipc://") :]
    try:
        assert good.ask(Hello("good-instance", DEPTHS).to_wire())["t"] == "welcome"
        loop = ClosedLoop("good-instance", seed=7)
        valid = [pack(loop.next_step()) for _ in range(3)] + [pack(Hello("fzh", (0, 2)).to_wire())]
        valid = [
            msgpack.packb({**msgpack.unpackb(v), "instance": "fz-" + str(i)}) for i, v in enumerate(valid)
        ]
        loop = ClosedLoop("good-instance", seed=7)
        stream = _mutations(rng, valid)
        sent = replies = 0
        errors: dict[str, int] = {}
        rss_start = 0
        got = []
        for i in range(n_good):
            wire = loop.next_step()
            reply = good.ask(wire)
            assert reply["t"] == "decision" and reply["seq"] == wire["seq"], reply
            got.append(reply["depth"])
            loop.apply(reply["depth"])
            for _ in range(26):
                fuzz.send(*next(stream))
                sent += 1
                r = fuzz.recv()  # exactly one reply per message, whatever it held
                replies += 1
                assert r["t"] in ("error", "welcome", "decision"), r
                if r["t"] == "error":
                    errors[r["code"]] = errors.get(r["code"], 0) + 1
                    assert r["code"] in ERROR_CODES and r["code"] != "internal", r
            if i % 50 == 0:  # garbage below the ZeroMQ layer: not even a ZMTP greeting
                with socket.socket(socket.AF_UNIX) as raw:
                    try:
                        raw.connect(raw_path)
                        raw.sendall(rng.randbytes(rng.randrange(1, 300)))
                    except OSError:
                        pass  # ZeroMQ may hang up first: that is fine too
            if i == 40:
                rss_start = server.rss_kib
        assert not fuzz.sock.poll(100)  # and no more than one
        assert sent >= 10_000
        assert replies == sent
        assert got == expected, "the fuzz changed what the well-behaved instance got"
        rss_end = server.rss_kib
        assert rss_end - rss_start < 40 * 1024, (rss_start, rss_end)
        metrics = scrape_metrics(port)
        counted = {
            name.split('"')[1]: int(value)
            for name, value in metrics.items()
            if name.startswith("specdepth_errors_total{") and value
        }
        # Raw garbage not starting with 0xFF reads as a ZMTP/1.0 peer to libzmq, so a few of
        # those connections yield a message too (refused and counted like any other).
        assert all(counted.get(code, 0) >= n for code, n in errors.items()), (counted, errors)
        assert sum(counted.values()) - sum(errors.values()) <= n_good // 50, (counted, errors)
        assert f'specdepth_decisions_total{{depth="{expected[-1]}"}}' in metrics
    finally:
        good.close()
        fuzz.close()
        assert server.stop() == 0, (workdir / "server.log").read_text()[-3000:]
    # The good instance's trace is intact and holds exactly what it sent and got.
    frame = load_traces(workdir / "runs")
    mine = frame[frame["instance"] == "good-instance"]
    assert list(mine[mine["t"] == "step"]["seq"]) == list(range(n_good))
    assert list(mine[mine["t"] == "decision"]["depth"]) == expected


# --------------------------------------------------------------------------- restart and kill -9


@pytest.mark.slow
def test_controller_restart_client_says_hello_again_and_decisions_resume(workdir: Path) -> None:
    endpoint = ipc(workdir)
    first = ServerProcess(endpoint, "builtin:static:2")
    client = ControllerClient(endpoint, Hello("r0", DEPTHS), stale_ms=200)
    seq = 0

    def run_until(depth: int, timeout_s: float) -> bool:
        nonlocal seq
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            client.send_step(_step("r0", seq))
            seq += 1
            time.sleep(0.002)
            if client.poll_decision() == depth:
                return True
        return False

    second = None
    try:
        assert run_until(2, 10)
        assert first.stop(signal.SIGKILL) == -signal.SIGKILL  # stale ipc file left behind
        t0 = time.monotonic()
        while time.monotonic() - t0 < 0.5:
            run_until(-1, 0.05)
        assert client.poll_decision() is None  # decisions went stale: the hook falls back
        second = ServerProcess(endpoint, "builtin:static:3")
        assert run_until(3, 15), client.stats()
        assert client.errors.get("unknown_instance", 0) >= 1 or client.counters["hellos"] >= 2
        assert client.counters["hellos"] >= 2
    finally:
        client.close()
        if second is not None:
            assert second.stop() == 0


def _step(instance: str, seq: int) -> Step:
    return Step(instance, seq, 2, 4, 0, [1, 0, 2, 2], 10_000, 4000, 0.2, 0, time.monotonic_ns())


@pytest.mark.slow
def test_kill_9_while_recording_every_flushed_record_reads_back(workdir: Path) -> None:
    endpoint = ipc(workdir)
    runs = workdir / "runs"
    server = ServerProcess(endpoint, "builtin:static:2", "--record", str(runs))
    peer = Peer(endpoint)
    sent = []
    try:
        assert peer.ask(Hello("rec", DEPTHS).to_wire())["t"] == "welcome"
        for seq in range(300):
            wire = step_wire("rec", seq, depth=2, bs=1 + seq % 7)
            sent.append(wire)
            assert peer.ask(wire)["seq"] == seq
        time.sleep(0.3)  # the server drained its socket: everything is flushed
        os.kill(server.proc.pid, signal.SIGKILL)
        server.stop()
    finally:
        peer.close()
    (path,) = [p for p in runs.iterdir() if p.name.startswith("rec-")]
    records = list(iter_records(path))
    steps = [r for r in records if r["t"] == "step"]
    decisions = [r for r in records if r["t"] == "decision"]
    assert records[0]["t"] == "hello" and len(steps) == 300 and len(decisions) == 300
    for got, want in zip(steps, sent):
        rx = got.pop("rx_ns")
        assert got == want and rx > 0
    assert [d["seq"] for d in decisions] == list(range(300))


@pytest.mark.slow
def test_kill_9_mid_stream_leaves_a_readable_prefix(workdir: Path) -> None:
    endpoint = ipc(workdir)
    runs = workdir / "runs"
    server = ServerProcess(endpoint, "builtin:static:2", "--record", str(runs))
    peer = Peer(endpoint)
    acked = 0
    try:
        assert peer.ask(Hello("mid", DEPTHS).to_wire())["t"] == "welcome"
        seq = 0
        deadline = time.monotonic() + 1.5
        while time.monotonic() < deadline:  # keep 32 in flight so the kill lands mid-burst
            for _ in range(32):
                peer.send(pack(step_wire("mid", seq)))
                seq += 1
            for _ in range(32):
                peer.recv()
                acked += 1
        for _ in range(64):
            peer.send(pack(step_wire("mid", seq)))
            seq += 1
        os.kill(server.proc.pid, signal.SIGKILL)
        server.stop()
    finally:
        peer.close()
    (path,) = [p for p in runs.iterdir() if p.name.startswith("mid-")]
    steps = [r["seq"] for r in iter_records(path) if r["t"] == "step"]
    assert steps == list(range(len(steps)))  # a contiguous prefix, nothing hidden
    assert len(steps) >= acked - 256  # at most one unflushed burst (FLUSH_EVERY) lost


def test_sigterm_closes_trace_files_and_exits_zero(workdir: Path) -> None:
    endpoint = ipc(workdir)
    server = ServerProcess(endpoint, "builtin:static:2", "--record", str(workdir / "runs"))
    peer = Peer(endpoint)
    try:
        peer.ask(Hello("t", DEPTHS).to_wire())
        for seq in range(10):
            peer.ask(step_wire("t", seq))
    finally:
        peer.close()
    assert server.stop(signal.SIGTERM) == 0
    assert not Path(endpoint[len("ipc://") :]).exists()  # the socket file is cleaned up
    frame = load_traces(workdir / "runs")
    assert (frame[frame["instance"] == "t"]["t"] == "step").sum() == 10


def test_metrics_endpoint_counts_steps_decisions_errors_instances(workdir: Path) -> None:
    endpoint = ipc(workdir)
    port = free_port()
    server = ServerProcess(endpoint, "builtin:static:3", "--metrics-port", str(port))
    peer = Peer(endpoint)
    try:
        peer.ask(Hello("m", DEPTHS).to_wire())
        for seq in range(7):
            peer.ask(step_wire("m", seq, depth=3))
        peer.ask(b"\xc1")
        peer.ask(step_wire("ghost", 1))
        values = scrape_metrics(port)
    finally:
        peer.close()
        server.stop()
    assert values["specdepth_steps_received_total"] == 7
    assert values['specdepth_decisions_total{depth="3"}'] == 7
    assert values['specdepth_errors_total{code="bad_msgpack"}'] == 1
    assert values['specdepth_errors_total{code="unknown_instance"}'] == 1
    assert values["specdepth_instances_connected"] == 2  # m and the readiness probe
    assert values["specdepth_decision_latency_seconds_count"] == 7
    assert values['specdepth_decision_latency_seconds_bucket{le="+Inf"}'] == 7


def test_latency_log_has_one_entry_per_decision(workdir: Path) -> None:
    endpoint = ipc(workdir)
    log_path = workdir / "lat.bin"
    server = ServerProcess(endpoint, "builtin:static:2", "--latency-log", str(log_path))
    peer = Peer(endpoint)
    try:
        peer.ask(Hello("l", DEPTHS).to_wire())
        for seq in range(25):
            peer.ask(step_wire("l", seq))
    finally:
        peer.close()
    assert server.stop() == 0
    lat = np.fromfile(log_path, dtype=np.int64)
    assert len(lat) == 25 and (lat > 0).all() and (lat < 10**9).all()


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process so far (/proc/PID/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_busy_poll_answers_the_same_records_everything_and_sleeps_when_idle(workdir: Path) -> None:
    """--busy-poll-us: same decisions, same crash-safe trace; the spinning stops when steps do."""
    endpoint = ipc(workdir)
    runs = workdir / "runs"
    server = ServerProcess(endpoint, "builtin:goodput", "--busy-poll-us", "50000", "--record", str(runs))
    peer = Peer(endpoint)
    loop = ClosedLoop("spin", seed=5)
    got = []
    try:
        assert peer.ask(Hello("spin", DEPTHS).to_wire())["t"] == "welcome"
        for _ in range(300):
            depth = peer.ask(loop.next_step())["depth"]
            loop.apply(depth)
            got.append(depth)
        time.sleep(0.3)  # longer than the busy poll: the server is back to a blocking wait
        before = _cpu_s(server.proc.pid)
        time.sleep(1.0)
        idle_cpu = _cpu_s(server.proc.pid) - before
        os.kill(server.proc.pid, signal.SIGKILL)  # everything answered was flushed first
        server.stop()
    finally:
        peer.close()
    assert got == expected_decisions("builtin:goodput", "spin", 300, seed=5)
    assert idle_cpu < 0.3, f"{idle_cpu:.2f} CPU s in 1 s idle: still spinning"
    (path,) = [p for p in runs.iterdir() if p.name.startswith("spin-")]
    records = list(iter_records(path))
    assert sum(r["t"] == "step" for r in records) == 300
    assert [r["depth"] for r in records if r["t"] == "decision"] == got


def test_busy_poll_spins_while_steps_flow_and_stops_on_sigterm(workdir: Path) -> None:
    endpoint = ipc(workdir)
    server = ServerProcess(endpoint, "builtin:static:2", "--busy-poll-us", "1000000")
    peer = Peer(endpoint)
    try:
        peer.ask(Hello("s", DEPTHS).to_wire())
        peer.ask(step_wire("s", 0))
        before = _cpu_s(server.proc.pid)
        time.sleep(0.5)  # inside the busy poll's second: the serving thread polls without sleeping
        busy_cpu = _cpu_s(server.proc.pid) - before
        t0 = time.monotonic()
        assert server.stop(signal.SIGTERM) == 0
        assert time.monotonic() - t0 < 5.0
    finally:
        peer.close()
    assert busy_cpu > 0.2, f"{busy_cpu:.2f} CPU s in 0.5 s: not spinning"


@pytest.mark.parametrize("poll", ["hybrid", "block"])
def test_hybrid_polling_polls_only_around_due_steps(workdir: Path, poll: str) -> None:
    """The default polls without sleeping around each due step, within its budget; same answers."""
    from controller.cpus import usable_cpus
    from controller.polling import LEAD_MAX_NS

    if poll == "hybrid" and usable_cpus() < 2:
        pytest.skip("hybrid polling needs 2 CPUs (it blocks on fewer)")
    endpoint, port = ipc(workdir), free_port()
    runs = workdir / "runs"
    server = ServerProcess(
        endpoint, "builtin:goodput", "--poll", poll, "--metrics-port", str(port), "--record", str(runs)
    )
    peer = Peer(endpoint)
    loop = ClosedLoop("cad", seed=6)
    got = []
    try:
        assert peer.ask(Hello("cad", DEPTHS).to_wire())["t"] == "welcome"
        t0 = time.monotonic()
        for _ in range(200):  # a decode cadence: one step per 5 ms
            time.sleep(0.005)
            depth = peer.ask(loop.next_step())["depth"]
            loop.apply(depth)
            got.append(depth)
        flowing_s = time.monotonic() - t0
        spun_flowing = scrape_metrics(port)["specdepth_spin_seconds_total"]
        time.sleep(0.3)
        spun_after_miss = scrape_metrics(port)["specdepth_spin_seconds_total"]
        spun_miss = spun_after_miss - spun_flowing
        before = _cpu_s(server.proc.pid)
        time.sleep(1.0)
        idle_cpu = _cpu_s(server.proc.pid) - before
        spun_idle = scrape_metrics(port)["specdepth_spin_seconds_total"] - spun_after_miss
        assert server.stop() == 0
    finally:
        peer.close()
    assert got == expected_decisions("builtin:goodput", "cad", 200, seed=6)
    (path,) = [p for p in runs.iterdir() if p.name.startswith("cad-")]
    assert [r["depth"] for r in iter_records(path) if r["t"] == "decision"] == got
    assert idle_cpu < 0.3, f"{idle_cpu:.2f} CPU s in 1 s idle: still spinning"
    # After the last step: the window of the step that did not come (≤ 2 ms, longer only by
    # whatever preempted the spinning thread on a busy box), then no spinning at all. A server
    # that kept polling would show ~0.3 s in the first and ~1 s in the second.
    assert spun_miss <= 10 * LEAD_MAX_NS / 1e9
    assert spun_idle == 0.0
    if poll == "block":
        assert spun_flowing == 0
    else:
        # It did poll before steps, and no more than its budget (half a core) allows.
        assert 0 < spun_flowing <= 0.5 * flowing_s + 0.5, (spun_flowing, flowing_s)


def test_hybrid_polling_blocks_on_one_cpu(workdir: Path) -> None:
    endpoint, port = ipc(workdir), free_port()
    log = workdir / "serve.log"
    cpu = min(os.sched_getaffinity(0))
    args = [
        sys.executable,
        "-m",
        "controller.cli",
        "serve",
        "--policy",
        "builtin:static:2",
        "--bind",
        endpoint,
    ]
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [*args, "--metrics-port", str(port)],
            stdout=out,
            stderr=out,
            preexec_fn=lambda: os.sched_setaffinity(0, {cpu}),
        )
    peer = Peer(endpoint)
    try:
        assert peer.ask(Hello("one", DEPTHS).to_wire(), timeout_ms=30_000)["t"] == "welcome"
        for seq in range(50):
            time.sleep(0.002)
            assert peer.ask(step_wire("one", seq))["depth"] == 2
        assert scrape_metrics(port)["specdepth_spin_seconds_total"] == 0
    finally:
        peer.close()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    text = log.read_text()
    assert "hybrid polling off" in text and "block polling" in text


# --------------------------------------------------------------------------- a real PPO zip


def make_ppo_zip(path: Path, depths: tuple[int, ...] = DEPTHS, seed: int = 0) -> Path:
    """An SB3 PPO zip (2x64 tanh) for the Featurizer's spaces, weights spread so inputs matter."""
    gym = pytest.importorskip("gymnasium")
    torch = pytest.importorskip("torch")
    sb3 = pytest.importorskip("stable_baselines3")
    from controller.ppo_policy import meta_for, write_metadata

    obs_dim = Featurizer(depths).obs_dim

    class SpacesOnly(gym.Env):  # type: ignore[misc]
        observation_space = gym.spaces.Box(-np.inf, np.inf, (obs_dim,), np.float32)
        action_space = gym.spaces.Discrete(len(depths))

        def reset(self, *, seed: int | None = None, options: Any = None) -> Any:
            super().reset(seed=seed)
            return np.zeros(obs_dim, np.float32), {}

        def step(self, action: Any) -> Any:
            return np.zeros(obs_dim, np.float32), 0.0, False, False, {}

    model = sb3.PPO(
        "MlpPolicy", SpacesOnly(), policy_kwargs={"net_arch": [64, 64]}, n_steps=64, seed=seed, device="cpu"
    )
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.policy.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.7)
    model.save(path)
    write_metadata(path, meta_for(depths, (64, 64), "tanh"))
    return path


@pytest.mark.slow
def test_serving_a_ppo_zip_end_to_end(workdir: Path) -> None:
    zip_path = make_ppo_zip(workdir / "ppo.zip")
    endpoint = ipc(workdir)
    server = ServerProcess(endpoint, str(zip_path), log=workdir / "server.log")
    peer = Peer(endpoint)
    try:
        welcome = peer.ask(Hello("p", DEPTHS).to_wire())
        assert welcome["policy"] == "ppo:ppo.zip"
        expected = expected_decisions(str(zip_path), "p", 300, seed=3)
        assert len(set(expected)) > 1  # the policy really depends on its input
        loop = ClosedLoop("p", seed=3)
        got = []
        for _ in range(300):
            reply = peer.ask(loop.next_step())
            got.append(reply["depth"])
            loop.apply(reply["depth"])
        assert got == expected
        # A replica allowing other depths than the zip was trained for is refused, saying why.
        reply = peer.ask(Hello("q", (0, 1, 2)).to_wire())
        assert reply["t"] == "error" and reply["code"] == "bad_field"
        assert "[0, 1, 2]" in reply["msg"] and "[0, 1, 2, 3, 4, 5]" in reply["msg"], reply["msg"]
        # A replica without speculation (one depth) has nothing to decide: it is served depth 0
        # whatever the policy, so its telemetry is still recorded and answered.
        assert peer.ask(Hello("cpu", (0,)).to_wire())["t"] == "welcome"
        replies = [peer.ask(step_wire("cpu", seq, depth=0, accept=[])) for seq in range(5)]
        assert [(r["t"], r["depth"]) for r in replies] == [("decision", 0)] * 5
    finally:
        peer.close()
        assert server.stop() == 0


@pytest.mark.slow
def test_warming_a_session_before_its_step_changes_nothing_it_decides(workdir: Path) -> None:
    """Hybrid polling runs a session's path on its last record before the next is due: no
    state of the session may change (same Featurizer state and decisions as without)."""
    zip_path = make_ppo_zip(workdir / "ppo.zip")
    servers = [Server(ServeConfig(policy=str(zip_path), bind=ipc(workdir, f"w{k}"))) for k in range(2)]
    plain, warmed = servers
    try:
        loop = ClosedLoop("w", seed=4)
        for srv in servers:
            srv.handle([b"id", pack(Hello("w", DEPTHS).to_wire())], 1)
        session = warmed._sessions["w"]
        assert session.fused is not None  # the fused kernel is what warming is for
        for k in range(300):
            frame = pack(loop.next_step())
            for srv in servers:
                srv.handle([b"id", frame], 10 + k)
            warmed._warm(session)
            warmed._warm(session)
            a, b = plain._sessions["w"].featurizer, session.featurizer
            assert np.array_equal(a._state, b._state)
            assert plain.stats.decisions == warmed.stats.decisions
            loop.apply(max(plain.stats.decisions, key=plain.stats.decisions.__getitem__))
        assert session.scratch is not None and session.scratch.steps > 0
        assert len(plain.stats.decisions) > 1  # the decisions depended on the records
        session.last_frame = b"\xc1"  # a warm-up that fails is dropped, silently
        warmed._warm(session)
        assert session.last_frame == b""
        # A restarted session (a new hook socket, other depths) drops what warming kept for
        # the old depths.
        warmed.handle([b"id", frame], 400)
        warmed.handle([b"id2", pack(Hello("w", (0,)).to_wire())], 401)
        assert session.depths == (0,) and session.scratch is None and session.last_frame == b""
        warmed._warm(session)
    finally:
        for srv in servers:
            srv.close()


def test_the_service_imports_no_heavy_modules() -> None:
    # The hook's own lean imports (the client included) are tests/test_layering.py's.
    code = (
        "import sys; before = set(sys.modules); import controller.service; "
        "new = {m.split('.')[0] for m in set(sys.modules) - before}; print(sorted(new))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert not {"torch", "stable_baselines3", "gymnasium", "pandas", "prometheus_client"} & set(eval(out)), (
        out
    )


def test_a_message_over_1_mib_disconnects_only_its_sender(workdir: Path) -> None:
    endpoint = ipc(workdir)
    server = ServerProcess(endpoint, "builtin:static:2")
    good, bad = Peer(endpoint), Peer(endpoint)
    try:
        assert good.ask(Hello("g", DEPTHS).to_wire())["t"] == "welcome"
        bad.send(b"\x92" + b"x" * (2 << 20))
        assert not bad.sock.poll(500)  # no reply: ZeroMQ dropped the connection (MAXMSGSIZE)
        for seq in range(5):
            assert good.ask(step_wire("g", seq))["depth"] == 2
        assert server.proc.poll() is None
    finally:
        good.close()
        bad.close()
        assert server.stop() == 0
