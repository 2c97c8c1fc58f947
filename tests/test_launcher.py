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
    for args in (
        (),
        ("--spec-controller", "ipc:///tmp/x.sock", "--spec-depths", "3,1"),
        ("--spec-controller", "ipc:///tmp/x.sock", "--spec-client-thread", "maybe"),
    ):
        out = run(*args, "--model-path", "/nonexistent")
        assert out.returncode == 2, out
        assert len(out.stderr.strip().splitlines()) == 1 and "Traceback" not in out.stderr, out.stderr


def test_client_tick_from_the_environment_is_checked_and_carried(tmp_path, monkeypatch) -> None:
    from controller.errors import ConfigError
    from sglang_hook.config import ENV_CLIENT_TICK_MS, HookConfig
    from sglang_hook.launch_server import plan

    base = ["--spec-controller", "ipc:///tmp/x.sock", "--model-path", "/m"]
    assert plan(base, str(tmp_path / "a.json")).config.client_tick_ms == 1
    monkeypatch.setenv(ENV_CLIENT_TICK_MS, "0")
    config = plan(base, str(tmp_path / "b.json")).config
    assert config.client_tick_ms == 0 and HookConfig.from_env(config.to_env()) == config
    for bad in ("fast", "-1", "100000"):
        monkeypatch.setenv(ENV_CLIENT_TICK_MS, bad)
        try:
            plan(base, str(tmp_path / "c.json"))
        except ConfigError as exc:
            assert ENV_CLIENT_TICK_MS in str(exc)
        else:
            raise AssertionError(f"{bad!r} accepted")


def test_client_thread_flag_reaches_the_schedulers_environment(tmp_path) -> None:
    from sglang_hook.config import HookConfig
    from sglang_hook.launch_server import plan

    base = ["--spec-controller", "ipc:///tmp/x.sock", "--model-path", "/m"]
    default = plan(base, str(tmp_path / "a.json")).config
    on = plan([*base, "--spec-client-thread", "on"], str(tmp_path / "b.json")).config
    off = plan([*base, "--spec-client-thread=off"], str(tmp_path / "c.json")).config
    auto = plan([*base, "--spec-client-thread", "AUTO"], str(tmp_path / "d.json")).config
    assert default.client_thread is None and auto.client_thread is None
    assert on.client_thread is True and off.client_thread is False
    # What the scheduler processes read back is what the flag said.
    for config in (default, on, off):
        assert HookConfig.from_env(config.to_env()) == config


def test_off_switch_flags_reach_the_schedulers_environment(tmp_path) -> None:
    from controller.errors import ConfigError
    from sglang_hook.launch_server import plan
    from sglang_hook.off_switch import OffConfig

    base = ["--spec-controller", "ipc:///tmp/x.sock", "--model-path", "/m"]
    assert plan(base, str(tmp_path / "a.json")).off == OffConfig(plain=True, draft="kv")
    p = plan([*base, "--spec-off-path", "sglang", "--spec-off-draft=skip"], str(tmp_path / "b.json"))
    assert p.off == OffConfig(plain=False, draft="skip")
    assert OffConfig.from_env(p.off.to_env()) == p.off
    assert plan([*base, "--spec-off-draft", "keep"], str(tmp_path / "d.json")).off.draft == "keep"
    for bad in (["--spec-off-path", "fast"], ["--spec-off-draft", "maybe"]):
        try:
            plan([*base, *bad], str(tmp_path / "c.json"))
        except ConfigError as exc:
            assert bad[0] in str(exc)
        else:
            raise AssertionError(f"{bad} accepted")


def test_speculation_starts_at_the_deepest_depth(tmp_path) -> None:
    from sglang_hook.launch_server import plan

    argv = ["--spec-controller", "ipc:///tmp/x.sock", "--spec-depths", "0,1,3,5", "--model-path", "/m",
            "--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", "/d"]  # fmt: skip
    sglang = plan(argv, str(tmp_path / "a.json")).sglang_argv
    assert sglang[sglang.index("--speculative-num-steps") + 1] == "5"
    assert sglang[sglang.index("--speculative-num-draft-tokens") + 1] == "6"
