"""`controller serve` and `controller traces` mistakes: one line on stderr, exit 2, no traceback."""

from __future__ import annotations

import socket
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from controller.protocol import Hello, Step
from controller.traces import TraceWriter


def run_cli(*args: str, timeout_s: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "controller.cli", *args], capture_output=True, text=True, timeout=timeout_s
    )


def assert_one_line_error(proc: subprocess.CompletedProcess[str], *needles: str) -> None:
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    assert lines[0].startswith("controller "), lines[0]
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])


@pytest.fixture
def busy_tcp_port() -> Iterator[int]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield int(s.getsockname()[1])


def test_missing_policy_file(tmp_path: Path) -> None:
    proc = run_cli("serve", "--policy", str(tmp_path / "nope.zip"), "--bind", f"ipc://{tmp_path}/a.sock")
    assert_one_line_error(proc, "nope.zip", "does not exist")


def test_corrupt_policy_file(tmp_path: Path) -> None:
    bad = tmp_path / "ppo.zip"
    bad.write_bytes(b"PK\x03\x04 this is not really a zip")
    proc = run_cli("serve", "--policy", str(bad), "--bind", f"ipc://{tmp_path}/a.sock")
    assert_one_line_error(proc, "ppo.zip")


def test_zip_without_policy_inside(tmp_path: Path) -> None:
    bad = tmp_path / "empty.zip"
    with zipfile.ZipFile(bad, "w") as zf:
        zf.writestr("readme.txt", "hello")
    proc = run_cli("serve", "--policy", str(bad), "--bind", f"ipc://{tmp_path}/a.sock")
    assert_one_line_error(proc, "empty.zip")


def test_policy_is_a_folder(tmp_path: Path) -> None:
    proc = run_cli("serve", "--policy", str(tmp_path), "--bind", f"ipc://{tmp_path}/a.sock")
    assert_one_line_error(proc, "not a file")


def test_unknown_builtin(tmp_path: Path) -> None:
    proc = run_cli("serve", "--policy", "builtin:nonesuch", "--bind", f"ipc://{tmp_path}/a.sock")
    assert_one_line_error(proc, "unknown builtin", "static:")


def test_builtin_static_needs_an_integer(tmp_path: Path) -> None:
    proc = run_cli("serve", "--policy", "builtin:static:x", "--bind", f"ipc://{tmp_path}/a.sock")
    assert_one_line_error(proc, "integer")


@pytest.mark.parametrize(
    ("endpoint", "needle"),
    [
        ("nonsense", "bad endpoint"),
        ("udp://127.0.0.1:5000", "not ipc or tcp"),
        ("tcp://127.0.0.1", "PORT"),
        ("tcp://127.0.0.1:99999", "PORT"),
        ("ipc:///no/such/folder/x.sock", "does not exist"),
        ("tcp://0.0.0.0:5555", "without encryption"),
        ("tcp://*:5555", "without encryption"),
        ("tcp://10.1.2.3:5555", "without encryption"),
    ],
)
def test_bad_endpoint(endpoint: str, needle: str) -> None:
    assert_one_line_error(run_cli("serve", "--policy", "builtin:static:2", "--bind", endpoint), needle)


def test_tcp_address_in_use(busy_tcp_port: int) -> None:
    proc = run_cli("serve", "--policy", "builtin:static:2", "--bind", f"tcp://127.0.0.1:{busy_tcp_port}")
    assert_one_line_error(proc, "in use")


def test_ipc_address_in_use_by_a_live_server(tmp_path: Path) -> None:
    path = tmp_path / "live.sock"
    with socket.socket(socket.AF_UNIX) as live:
        live.bind(str(path))
        live.listen()
        proc = run_cli("serve", "--policy", "builtin:static:2", "--bind", f"ipc://{path}")
    assert_one_line_error(proc, "in use")


def test_metrics_port_in_use(tmp_path: Path, busy_tcp_port: int) -> None:
    proc = run_cli(
        "serve", "--policy", "builtin:static:2", "--bind", f"ipc://{tmp_path}/m.sock", "--metrics-port",
        str(busy_tcp_port),
    )  # fmt: skip
    assert_one_line_error(proc, "metrics", str(busy_tcp_port))


def test_bad_curve_key_file(tmp_path: Path) -> None:
    key = tmp_path / "k"
    key.write_text("short")
    proc = run_cli(
        "serve",
        "--policy",
        "builtin:static:2",
        "--bind",
        "tcp://0.0.0.0:0",
        "--curve-secret-key-file",
        str(key),
    )
    assert_one_line_error(proc, "40-character")


def test_record_folder_not_creatable(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    proc = run_cli(
        "serve",
        "--policy",
        "builtin:static:2",
        "--bind",
        f"ipc://{tmp_path}/r.sock",
        "--record",
        str(blocker / "sub"),
    )
    assert_one_line_error(proc, "record folder")


@pytest.mark.parametrize("value", ["-1", "1000001"])
def test_busy_poll_out_of_range(tmp_path: Path, value: str) -> None:
    proc = run_cli(
        "serve", "--policy", "builtin:static:2", "--bind", f"ipc://{tmp_path}/b.sock", "--busy-poll-us", value
    )
    assert_one_line_error(proc, "--busy-poll-us", value)


@pytest.mark.parametrize("value", ["0", "-0.5", "1.5", "nan"])
def test_spin_budget_out_of_range(tmp_path: Path, value: str) -> None:
    proc = run_cli(
        "serve", "--policy", "builtin:static:2", "--bind", f"ipc://{tmp_path}/b.sock", "--spin-budget", value
    )
    assert_one_line_error(proc, "--spin-budget")


def test_serve_help_explains_every_option() -> None:
    proc = run_cli("serve", "--help")
    assert proc.returncode == 0
    for option in (
        "--policy",
        "--bind",
        "--record",
        "--metrics-port",
        "--max-instances",
        "--log-level",
        "--poll",
        "--spin-budget",
        "--busy-poll-us",
    ):
        assert option in proc.stdout
    assert "builtin:static:3" in proc.stdout


def test_traces_summarize_errors_and_output(tmp_path: Path) -> None:
    assert_one_line_error(run_cli("traces", "summarize", str(tmp_path / "missing")), "does not exist")
    assert_one_line_error(run_cli("traces", "summarize", str(tmp_path)), "no")
    with TraceWriter(tmp_path, "inst-7") as w:
        w.write(Hello("inst-7", (0, 3)).to_wire(), 1)
        for seq in range(4):
            w.write(
                Step("inst-7", seq, 3, 2, 0, [3, 1], 20_000 + seq, 100, 0.5, 0, seq * 10**6).to_wire(),
                2 + seq,
            )
    proc = run_cli("traces", "summarize", str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    assert "instance inst-7: 4 steps" in proc.stdout
    row = next(ln.split() for ln in proc.stdout.splitlines() if ln.strip().startswith("3 "))
    assert row[1] == "4" and row[3] == "2.00"  # 4 steps at depth 3, mean accepted (3+1)/2
    (tmp_path / "junk.msgpack").write_bytes(b"\xc1" * 10)
    assert_one_line_error(run_cli("traces", "summarize", str(tmp_path)), "junk.msgpack", "byte 0")


def test_torn_traces_plain_or_gzipped_are_read_up_to_the_tear_with_one_warning_line_each(
    tmp_path: Path,
) -> None:
    import gzip

    with TraceWriter(tmp_path, "torn", start_ns=1) as w:
        for seq in range(6):
            w.write(Step("torn", seq, 3, 2, 0, [3, 1], 20_000, 100, 0.5, 0, seq).to_wire(), 2 + seq)
    data = w.path.read_bytes()
    w.path.write_bytes(data[:-5])  # plain: the last record torn
    (tmp_path / "cut-2.msgpack.gz").write_bytes(gzip.compress(data)[:-6])  # gzip: the stream cut short
    proc = run_cli("traces", "summarize", str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    warned = proc.stderr.strip().splitlines()
    assert len(warned) == 2 and all(ln.startswith("controller traces: warning: ") for ln in warned), warned
    assert any("torn-1.msgpack" in ln for ln in warned) and any("cut-2.msgpack.gz" in ln for ln in warned)
    assert "instance torn: 11 steps" in proc.stdout  # 5 before the tear + 6 from the cut gzip
