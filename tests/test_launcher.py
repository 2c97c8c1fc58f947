"""The launcher's own command line: --help explains every hook flag; mistakes are one line, exit 2."""

from __future__ import annotations

import subprocess
import sys

from sglang_hook.launch_server import OWN_FLAGS


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "sglang_hook.launch_server", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_help_explains_every_hook_flag() -> None:
    out = run("--help")
    assert out.returncode == 0, out.stderr
    for flag in OWN_FLAGS:
        assert flag in out.stdout, flag


def test_missing_endpoint_and_bad_depths_are_one_line_exit_2() -> None:
    for args in ((), ("--spec-controller", "ipc:///tmp/x.sock", "--spec-depths", "3,1")):
        out = run(*args, "--model-path", "/nonexistent")
        assert out.returncode == 2, out
        assert len(out.stderr.strip().splitlines()) == 1 and "Traceback" not in out.stderr, out.stderr
