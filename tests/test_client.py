"""The hook-side client: never blocks, never raises, latest valid decision wins, re-hello."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
import zmq

from controller.protocol import Hello, Step, pack
from controller.service import ServeConfig, Server
from sglang_hook.client import ClientThread, ControllerClient

DEPTHS = (0, 1, 2, 3)


def make_step(seq: int, instance: str = "r1") -> Step:
    return Step(instance, seq, 2, 3, 0, [0, 1, 2], 10_000, 3000, 0.1, 0, time.monotonic_ns())


class FakeController:
    """A raw ROUTER standing in for the controller where a test must craft its replies."""

    def __init__(self, endpoint: str) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(endpoint)
        self.peer: bytes | None = None

    def recv(self, timeout_ms: int = 3000) -> dict[str, Any]:
        assert self.sock.poll(timeout_ms), "nothing from the client"
        self.peer, frame = self.sock.recv_multipart()
        return msgpack.unpackb(frame)

    def reply(self, wire: dict[str, Any] | bytes) -> None:
        assert self.peer is not None
        self.sock.send_multipart([self.peer, wire if isinstance(wire, bytes) else pack(wire)])

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()


@pytest.fixture
def fake(tmp_path: Path) -> Iterator[tuple[FakeController, str]]:
    endpoint = f"ipc://{tmp_path}/fake.sock"
    ctl = FakeController(endpoint)
    yield ctl, endpoint
    ctl.close()


def connected(endpoint: str, ctl: FakeController, **kw: Any) -> ControllerClient:
    """A client whose hello reached the fake controller."""
    client = ControllerClient(endpoint, Hello("r1", DEPTHS), **kw)
    deadline = time.monotonic() + 5
    while client.counters["hellos"] == 0 and time.monotonic() < deadline:
        client.send_step(make_step(0))  # retries the hello once the connection is up
        time.sleep(0.01)
    assert ctl.recv()["t"] == "hello"
    while ctl.sock.poll(50):  # steps sent while connecting
        ctl.recv()
    return client


def decision(seq: int, depth: int, instance: str = "r1") -> dict[str, Any]:
    return {"t": "decision", "v": 1, "instance": instance, "seq": seq, "depth": depth}


def wait_poll(client: ControllerClient, want: int | None, timeout_s: float = 3.0) -> int | None:
    deadline = time.monotonic() + timeout_s
    got = client.poll_decision()
    while got != want and time.monotonic() < deadline:
        time.sleep(0.002)
        got = client.poll_decision()
    return got


def test_latest_valid_decision_wins_and_invalid_ones_are_counted(fake: tuple[FakeController, str]) -> None:
    ctl, endpoint = fake
    client = connected(endpoint, ctl)
    try:
        assert client.poll_decision() is None
        ctl.reply(decision(1, 2))
        ctl.reply(decision(2, 9))  # depth not in hello.depths: ignored
        ctl.reply(decision(3, 1, instance="someone-else"))
        ctl.reply(b"\xc1 not msgpack")
        ctl.reply({"t": "decision", "v": 2, "instance": "r1", "seq": 4, "depth": 3})
        ctl.reply({"t": "decision", "v": 1, "instance": "r1", "seq": 5, "depth": "3"})
        time.sleep(0.05)
        assert client.poll_decision() == 2
        assert client.counters["decisions"] == 1 and client.counters["invalid"] == 5
        ctl.reply(decision(6, 3))
        ctl.reply(decision(7, 0))
        assert wait_poll(client, 0) == 0  # newest wins, depth 0 is a real answer
        ctl.reply({"t": "welcome", "v": 1, "policy": "p", "features": 3})
        deadline = time.monotonic() + 3
        while client.counters["welcomes"] == 0 and time.monotonic() < deadline:
            assert client.poll_decision() == 0
        assert client.policy == "p" and client.features == 3
    finally:
        client.close()


def test_a_decision_goes_stale_once_a_step_waits_stale_ms_for_an_answer(
    fake: tuple[FakeController, str],
) -> None:
    ctl, endpoint = fake
    client = connected(endpoint, ctl, stale_ms=60)
    try:
        ctl.reply(decision(1, 3))
        assert wait_poll(client, 3) == 3
        time.sleep(0.1)
        assert client.poll_decision() == 3  # idle: no step waits for an answer, the decision holds
        client.send_step(make_step(1))
        assert client.poll_decision() == 3  # just sent
        time.sleep(0.1)
        assert client.poll_decision() is None  # the hook falls back to SGLang's own policy
        assert client.fresh_depth() is None and client.depth == 3
        ctl.reply(decision(2, 1))
        assert wait_poll(client, 1) == 1  # and comes back as soon as decisions flow again
        time.sleep(0.1)
        assert client.fresh_depth() == 1  # the answer restarted the clock; nothing was sent since
    finally:
        client.close()
    assert client.fresh_depth() is None  # closed


def test_unknown_instance_makes_the_client_say_hello_again(fake: tuple[FakeController, str]) -> None:
    ctl, endpoint = fake
    client = connected(endpoint, ctl)
    try:
        client.send_step(make_step(1))
        assert ctl.recv()["t"] == "step"
        ctl.reply({"t": "error", "v": 1, "code": "unknown_instance", "msg": "who?"})
        wait_poll(client, -1, 0.1)
        assert ctl.recv() == Hello("r1", DEPTHS).to_wire()
        assert client.errors == {"unknown_instance": 1} and client.counters["hellos"] == 2
        ctl.reply({"t": "error", "v": 1, "code": "bad_accept", "msg": ""})
        wait_poll(client, -1, 0.1)
        assert client.errors == {"unknown_instance": 1, "bad_accept": 1}
        assert not ctl.sock.poll(50)  # other errors do not trigger a hello
    finally:
        client.close()


def test_silence_for_stale_ms_while_sending_triggers_a_hello(fake: tuple[FakeController, str]) -> None:
    ctl, endpoint = fake
    client = connected(endpoint, ctl, stale_ms=50)
    try:
        got = []
        deadline = time.monotonic() + 0.5
        seq = 1
        while time.monotonic() < deadline:
            client.send_step(make_step(seq))
            seq += 1
            time.sleep(0.005)
            while ctl.sock.poll(0):
                got.append(ctl.recv()["t"])
        hellos = got.count("hello")
        assert 3 <= hellos <= 11, got  # about one per stale_ms, not one per step
    finally:
        client.close()


def test_send_never_blocks_without_a_controller(tmp_path: Path) -> None:
    client = ControllerClient(f"ipc://{tmp_path}/nobody.sock", Hello("r1", DEPTHS))
    try:
        t0 = time.perf_counter()
        for seq in range(5000):
            client.send_step(make_step(seq))
            assert client.poll_decision() is None
        assert time.perf_counter() - t0 < 5.0
        assert client.counters["sent"] == 0 and client.counters["dropped"] == 5000
    finally:
        client.close()


def test_full_queue_drops_and_counts_instead_of_blocking(fake: tuple[FakeController, str]) -> None:
    ctl, endpoint = fake
    client = connected(endpoint, ctl, sndhwm=4)
    try:
        ctl.sock.setsockopt(zmq.RCVHWM, 4)
        before = dict(client.counters)
        for seq in range(1, 20_001):  # the fake never reads: queues fill up, then drops
            client.send_step(make_step(seq))
        sent = client.counters["sent"] - before["sent"]
        dropped = client.counters["dropped"] - before["dropped"]
        assert dropped > 0 and sent + dropped == 20_000
    finally:
        client.close()


def test_malformed_record_is_dropped_not_raised(fake: tuple[FakeController, str]) -> None:
    ctl, endpoint = fake
    client = connected(endpoint, ctl)
    try:
        dropped = client.counters["dropped"]
        bad = make_step(1)
        bad.accept = [object()]  # type: ignore[list-item]
        client.send_step(bad)
        huge = make_step(2)
        huge.bs, huge.accept = 20_000, [2**31] * 20_000  # 100 KB: over 64 KiB on the wire
        client.send_step(huge)
        assert client.counters["dropped"] - dropped == 2
        client.send_step(make_step(3))
        assert ctl.recv()["seq"] == 3
    finally:
        client.close()


def test_close_is_idempotent_and_later_calls_are_harmless(fake: tuple[FakeController, str]) -> None:
    ctl, endpoint = fake
    client = connected(endpoint, ctl)
    client.close()
    client.close()
    client.send_step(make_step(5))
    assert client.poll_decision() is None


def test_bad_endpoint_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="cannot connect"):
        ControllerClient("nonsense", Hello("r1", DEPTHS))


def test_against_the_real_server_with_a_shared_context() -> None:
    ctx = zmq.Context()
    server = Server(ServeConfig(policy="builtin:static:3", bind="inproc://client-test"), context=ctx)
    stop = threading.Event()

    def loop() -> None:
        while not stop.is_set():
            if server._sock.poll(10):
                server.drain()

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    client = ControllerClient("inproc://client-test", Hello("r1", DEPTHS), context=ctx)
    try:
        seq, got = 0, None
        deadline = time.monotonic() + 5
        while got != 3 and time.monotonic() < deadline:
            client.send_step(make_step(seq))
            seq += 1
            time.sleep(0.002)
            got = client.poll_decision()
        assert got == 3
        assert client.policy == "static:3" and client.counters["welcomes"] == 1
        assert client.errors == {}
    finally:
        client.close()
        stop.set()
        thread.join()
        server.close()
        ctx.term()


def test_curve_encrypted_connection(tmp_path: Path) -> None:
    if not zmq.has("curve"):
        pytest.skip("libzmq without CURVE")
    public, secret = zmq.curve_keypair()
    key_file = tmp_path / "server.key"
    key_file.write_bytes(secret)
    endpoint = f"ipc://{tmp_path}/curve.sock"
    server = Server(
        ServeConfig(policy="builtin:static:1", bind=endpoint, curve_secret_key_file=str(key_file))
    )
    plain = ControllerClient(endpoint, Hello("plain", DEPTHS))
    secure = ControllerClient(endpoint, Hello("secure", DEPTHS), curve_server_key=public)
    try:
        seq = 0
        deadline = time.monotonic() + 5
        while secure.poll_decision() != 1 and time.monotonic() < deadline:
            for c in (plain, secure):
                c.send_step(make_step(seq, c.instance))
            seq += 1
            server.drain()
            time.sleep(0.005)
        assert secure.poll_decision() == 1
        assert plain.poll_decision() is None and "plain" not in server.instances
    finally:
        plain.close()
        secure.close()
        server.close()


# --------------------------------------------------------------------------- ClientThread


def test_client_thread_delivers_decisions_in_order(fake: tuple[FakeController, str]) -> None:
    ctl, endpoint = fake
    with ClientThread(connected(endpoint, ctl)) as thread:
        for seq in range(1, 6):
            thread.submit(make_step(seq))
            got = ctl.recv()
            assert (got["t"], got["seq"]) == ("step", seq)  # each record, in order
            ctl.reply(decision(seq, seq % 4))
            deadline = time.monotonic() + 3
            while thread.decisions < seq and time.monotonic() < deadline:
                time.sleep(0.001)
            assert (thread.decisions, thread.depth) == (seq, seq % 4)
        assert thread.dropped == thread.errors == 0


def test_client_thread_judges_freshness_on_its_own_thread(fake: tuple[FakeController, str]) -> None:
    """The caller reads ``fresh_depth``; the sender thread turns it to None when records go unanswered."""
    ctl, endpoint = fake
    thread = ClientThread(connected(endpoint, ctl, stale_ms=60), tick_ms=1)
    try:
        thread.submit(make_step(1))
        assert ctl.recv()["seq"] == 1
        ctl.reply(decision(1, 3))
        deadline = time.monotonic() + 3
        while thread.fresh_depth != 3 and time.monotonic() < deadline:
            time.sleep(0.001)
        assert thread.fresh_depth == 3
        t0, seq = time.monotonic(), 2
        while thread.fresh_depth == 3 and time.monotonic() - t0 < 3:  # no more answers
            thread.submit(make_step(seq))
            seq += 1
            time.sleep(0.005)
        assert thread.fresh_depth is None and thread.depth == 3
        assert 0.055 <= time.monotonic() - t0 < 1.0
    finally:
        thread.close()
    assert thread.fresh_depth is None


def test_submit_never_blocks_while_the_client_thread_is_stuck(
    fake: tuple[FakeController, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stuck sender (GIL-starved, a slow syscall) costs telemetry, never the caller's time."""
    ctl, endpoint = fake
    release = threading.Event()
    original = ControllerClient.send_step

    def stuck(self: ControllerClient, step: Step) -> None:
        release.wait(10)
        original(self, step)

    client = connected(endpoint, ctl)
    monkeypatch.setattr(ControllerClient, "send_step", stuck)
    thread = ClientThread(client, maxlen=8)  # below the client's SNDHWM (16)
    try:
        t0 = time.monotonic()
        for seq in range(1, 1001):
            thread.submit(make_step(seq))
        assert time.monotonic() - t0 < 1.0  # 1000 hand-overs while nothing is sent
        assert len(thread._queue) == 8
        assert 1000 - 8 - 1 <= thread.dropped <= 1000 - 8  # the stuck one was popped, or not yet
        release.set()
        seqs = [ctl.recv()["seq"]]  # whatever the stuck call held, then the queue
        while ctl.sock.poll(300):
            got = ctl.recv()
            if got["t"] == "step":  # (a hello may come first: no decisions for stale_ms)
                seqs.append(got["seq"])
        assert seqs == sorted(seqs) and seqs[-1] == 1000, seqs  # the newest records survive
    finally:
        release.set()
        thread.close()


def test_client_thread_survives_an_exception_and_goes_on(
    fake: tuple[FakeController, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    ctl, endpoint = fake
    original = ControllerClient.send_step
    calls = 0

    def flaky(self: ControllerClient, step: Step) -> None:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise RuntimeError("a bug on the sender thread")
        original(self, step)

    client = connected(endpoint, ctl)
    monkeypatch.setattr(ControllerClient, "send_step", flaky)
    with ClientThread(client, idle_poll_ms=10) as thread:
        thread.submit(make_step(1))
        thread.submit(make_step(2))  # may ride the failed wake-up's queue
        deadline = time.monotonic() + 3
        while thread.errors == 0 and time.monotonic() < deadline:
            time.sleep(0.001)
        assert thread.errors == 1 and thread._thread.is_alive()
        thread.submit(make_step(3))
        assert ctl.recv()["seq"] in (2, 3)


def test_client_thread_close_is_idempotent_and_joins(tmp_path: Path) -> None:
    client = ControllerClient(f"ipc://{tmp_path}/nobody.sock", Hello("r1", DEPTHS))
    thread = ClientThread(client)
    thread.submit(make_step(1))  # no controller: dropped by the client, counted there
    thread.close()
    thread.close()
    assert not thread._thread.is_alive()
    thread.submit(make_step(2))  # after close: queued, never sent, never raises
    assert client._closed


def test_client_thread_ticking_sends_without_being_woken_and_parks_when_idle(
    fake: tuple[FakeController, str],
) -> None:
    """tick_ms > 0: submit() is a bare append while records flow; idle, the thread parks again."""
    ctl, endpoint = fake
    with ClientThread(connected(endpoint, ctl), tick_ms=1, park_after=5) as thread:
        woken = 0  # submits that had to wake the thread
        base = thread.client.counters["sent"]  # steps sent while connecting
        for seq in range(1, 51):
            woken += thread._parked
            thread.submit(make_step(seq))
            time.sleep(0.0005)
        deadline = time.monotonic() + 5.0
        while thread.client.counters["sent"] < base + 50 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert thread.client.counters["sent"] == base + 50
        assert woken <= 2, "submit() woke a ticking thread"
        time.sleep(0.2)  # idle: 5 empty looks and it parks
        assert thread._parked
        woken += thread._parked
        thread.submit(make_step(51))  # the first record after idle wakes it
        deadline = time.monotonic() + 5.0
        while thread.client.counters["sent"] < base + 51 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert thread.client.counters["sent"] == base + 51 and woken >= 1
