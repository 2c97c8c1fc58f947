"""``python -m sglang_hook.launch_server``: SGLang's server with the speculation controller wired in.

Usage::

    python -m sglang_hook.launch_server --spec-controller ipc:///tmp/spec-controller.sock \\
        [--spec-depths 0,1,2,3,5] [--spec-fallback sglang|K] [--spec-stale-ms 200] \\
        [--spec-instance NAME] [--spec-client-thread auto|on|off] <any sglang.launch_server arguments>

What it does, in order:

1. takes its own ``--spec-*`` flags out of the command line (SGLang's parser refuses unknown
   flags) and validates them;
2. hands them to SGLang's scheduler processes through environment variables (they are
   spawned, so only the environment reaches them; the plugin reads it there);
3. when speculation is on (``--speculative-algorithm``), adds ``--speculative-adaptive`` and a
   generated ``--speculative-adaptive-config`` whose one entry lists exactly the depths, so
   SGLang pre-builds one runtime state per depth;
4. refuses, with one line and exit status 2, what SGLang's adaptive mode cannot do — using
   SGLang's own ``adaptive_unsupported_reason`` (SGLang itself would only warn and silently
   run without adaptive mode, i.e. without our actuator) — and what the hook cannot do
   (attention DP, pipeline parallelism);
5. tells the scheduler processes when each replica is one process (TP and PP size 1): the
   decision is then applied where it is read, without riding the request broadcast;
6. starts SGLang's own server in this process.

Without ``--speculative-algorithm`` the server runs as usual and the hook still streams a step
record (depth 0) per decode step, so traces can be recorded from any SGLang server.
"""

from __future__ import annotations

import atexit
import dataclasses
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass

from controller.errors import ConfigError
from controller.protocol import DEFAULT_DEPTHS
from sglang_hook.config import (
    DEFAULT_CLIENT_TICK_MS,
    DEFAULT_STALE_MS,
    ENV_CLIENT_TICK_MS,
    FALLBACK_SGLANG,
    HookConfig,
    parse_auto_on_off,
    parse_depths,
    parse_fallback,
    parse_stale_ms,
    parse_tick_ms,
)
from sglang_hook.off_switch import ENV_OFF_DRAFT, ENV_OFF_PATH, OffConfig

PROG = "sglang_hook.launch_server"
PLUGIN_NAME = "spec_controller"

OWN_FLAGS = (
    "--spec-controller",
    "--spec-depths",
    "--spec-fallback",
    "--spec-stale-ms",
    "--spec-instance",
    "--spec-client-thread",
    "--spec-off-path",
    "--spec-off-draft",
)


class Refused(ConfigError):
    """A configuration the hook or SGLang's adaptive mode cannot serve."""


@dataclass(frozen=True, slots=True)
class Plan:
    """What the launcher will do: the hook config and SGLang's final argument list."""

    config: HookConfig
    sglang_argv: list[str]
    speculative: bool
    adaptive_config: dict[str, dict[str, list[int]]] | None
    off: OffConfig = OffConfig()


def split_argv(argv: Sequence[str]) -> tuple[dict[str, str], list[str]]:
    """Separate ``--spec-*`` flags (``--flag V`` or ``--flag=V``) from SGLang's arguments."""
    own: dict[str, str] = {}
    rest: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        name, eq, value = arg.partition("=")
        if name in OWN_FLAGS:
            if not eq:
                if i + 1 >= len(argv) or argv[i + 1].startswith("--"):
                    raise ConfigError(f"{name} needs a value")
                value = argv[i + 1]
                i += 1
            if name in own:
                raise ConfigError(f"{name} given twice")
            own[name] = value
        elif name.startswith("--spec-") and not name.startswith("--speculative"):
            raise ConfigError(f"unknown flag {name} (the launcher's own flags are {', '.join(OWN_FLAGS)})")
        else:
            rest.append(arg)
        i += 1
    return own, rest


def _flag_value(argv: Sequence[str], flag: str) -> str | None:
    for i, arg in enumerate(argv):
        name, eq, value = arg.partition("=")
        if name == flag:
            if eq:
                return value
            return argv[i + 1] if i + 1 < len(argv) else ""
    return None


def _has_flag(argv: Sequence[str], flag: str) -> bool:
    return any(arg.partition("=")[0] == flag for arg in argv)


def plan(argv: Sequence[str], config_path: str) -> Plan:
    """Validate the command line and build SGLang's arguments (no SGLang import; fast checks).

    Args:
        argv: the launcher's arguments (without the program name).
        config_path: where the generated adaptive config will be written.

    Raises:
        ConfigError: a bad ``--spec-*`` flag.
        Refused: a configuration the hook cannot serve.
    """
    own, rest = split_argv(argv)
    if "--spec-controller" not in own:
        raise ConfigError("--spec-controller ENDPOINT is required (e.g. ipc:///tmp/spec-controller.sock)")
    config = HookConfig(
        endpoint=own["--spec-controller"],
        depths=parse_depths(own["--spec-depths"]) if "--spec-depths" in own else DEFAULT_DEPTHS,
        fallback_depth=parse_fallback(own.get("--spec-fallback", FALLBACK_SGLANG)),
        stale_ms=parse_stale_ms(own.get("--spec-stale-ms", str(DEFAULT_STALE_MS))),
        instance=own.get("--spec-instance", ""),
        client_thread=parse_auto_on_off(own.get("--spec-client-thread", "auto"), "--spec-client-thread"),
        # A tuning knob without a flag: checked here so a bad value stops the launch, not the hook.
        client_tick_ms=parse_tick_ms(os.environ.get(ENV_CLIENT_TICK_MS, str(DEFAULT_CLIENT_TICK_MS))),
    )
    try:
        off = OffConfig.from_env(
            {ENV_OFF_PATH: own.get("--spec-off-path", "plain"), ENV_OFF_DRAFT: own.get("--spec-off-draft", "kv")}
        )
    except ValueError as exc:
        msg = str(exc).replace(ENV_OFF_PATH, "--spec-off-path").replace(ENV_OFF_DRAFT, "--spec-off-draft")
        raise ConfigError(msg) from None
    if _has_flag(rest, "--enable-dp-attention"):
        raise Refused(
            "--enable-dp-attention is not supported: SGLang's adaptive mode does not synchronise "
            "depths across attention-DP ranks"
        )
    pp = _flag_value(rest, "--pp-size") or _flag_value(rest, "--pipeline-parallel-size")
    if pp not in (None, "1"):
        raise Refused("--pp-size > 1 is not supported: the decision rides the tensor-parallel broadcast only")

    algo = _flag_value(rest, "--speculative-algorithm")
    if algo is None:
        if _has_flag(rest, "--speculative-adaptive") or _has_flag(rest, "--speculative-adaptive-config"):
            raise Refused("--speculative-adaptive needs --speculative-algorithm EAGLE or EAGLE3")
        return Plan(config, rest, speculative=False, adaptive_config=None, off=off)

    if algo.upper() not in ("EAGLE", "EAGLE3"):
        raise Refused(f"--speculative-algorithm {algo}: SGLang's adaptive mode serves only EAGLE and EAGLE3")
    if _has_flag(rest, "--speculative-adaptive-config"):
        raise Refused("--speculative-adaptive-config is generated from --spec-depths; do not pass it")
    topk = _flag_value(rest, "--speculative-eagle-topk")
    if topk is not None and topk != "1":
        raise Refused(f"--speculative-eagle-topk {topk}: SGLang's adaptive mode needs topk 1")
    steps = _flag_value(rest, "--speculative-num-steps")
    if steps is not None and (not steps.isdigit() or int(steps) not in config.depths):
        raise Refused(f"--speculative-num-steps {steps} is not one of --spec-depths {list(config.depths)}")
    if config.fallback_depth is not None and config.fallback_depth not in config.depths:
        raise Refused(f"--spec-fallback {config.fallback_depth} is not one of --spec-depths")

    extra: list[str] = []
    if not _has_flag(rest, "--speculative-adaptive"):
        extra.append("--speculative-adaptive")
    extra += ["--speculative-adaptive-config", config_path]
    if topk is None:
        extra += ["--speculative-eagle-topk", "1"]
    if steps is None:
        # Start at the deepest depth: SGLang 0.5.17 sizes a logits buffer shared by every depth's
        # CUDA graphs from the starting depth, so a deeper depth's graphs fail to capture
        # ("shared logits buffer holds 32 rows but caller needs 64"). Stated explicitly because
        # 0.5.17 would otherwise auto-pick a depth that need not be one of ours.
        start = config.depths[-1]
        extra += ["--speculative-num-steps", str(start)]
        if not _has_flag(rest, "--speculative-num-draft-tokens"):
            extra += ["--speculative-num-draft-tokens", str(start + 1)]
    # One integer key routes every batch size to the same candidate list.
    adaptive = {"1": {"candidate_steps": list(config.depths)}}
    return Plan(config, rest + extra, speculative=True, adaptive_config=adaptive, off=off)


def _refuse_instead_of_disabling() -> None:
    """Make SGLang's "adaptive unsupported → warn and disable" path raise :class:`Refused`."""
    from sglang.srt.arg_groups import speculative_hook
    from sglang.srt.speculative.adaptive_spec_params import adaptive_unsupported_reason

    original = speculative_hook._maybe_disable_adaptive

    def refuse(server_args):  # type: ignore[no-untyped-def]
        reason = adaptive_unsupported_reason(server_args)
        if reason is not None:
            raise Refused(f"SGLang's adaptive speculation cannot run here: {reason}")
        return original(server_args)

    speculative_hook._maybe_disable_adaptive = refuse


HELP = f"""usage: python -m {PROG} --spec-controller ENDPOINT [--spec-depths LIST]
       [--spec-fallback sglang|K] [--spec-stale-ms MS] [--spec-instance NAME]
       [--spec-client-thread auto|on|off] [--spec-off-path plain|sglang]
       [--spec-off-draft kv|keep|skip] <sglang args>

SGLang's server with the speculation controller's hook wired in: after every decode step the
entry rank streams a step record to the controller and applies the draft depth it answers at
the next step, on every tensor-parallel rank alike. The hook never waits for the controller.

hook options (everything else goes to sglang.launch_server unchanged):
  --spec-controller ENDPOINT  the controller's ZeroMQ endpoint, e.g.
                              ipc:///tmp/spec-controller.sock or tcp://127.0.0.1:5555 (required)
  --spec-depths LIST          allowed draft depths, comma-separated, 0 = no speculation
                              (default: {",".join(map(str, DEFAULT_DEPTHS))}); SGLang pre-builds one runtime state each
  --spec-fallback sglang|K    what runs while no fresh decision exists: SGLang's own adaptive
                              rule, or a fixed depth K from the list (default: {FALLBACK_SGLANG})
  --spec-stale-ms MS          fall back once steps went unanswered this long (default: {DEFAULT_STALE_MS:g})
  --spec-instance NAME        the replica's name in the controller's traces (default: derived
                              from the host and port)
  --spec-client-thread auto|on|off
                              on: a thread of its own talks to the controller, and the
                              scheduler thread only hands records over (less time on it, but
                              the thread takes the GIL from a scheduler bound by its
                              launches); off: the scheduler thread sends and drains itself;
                              auto (default): off (see docs/hook.md "Cost")
  --spec-off-path plain|sglang
                              what depth 0 runs: plain (default) = the target's plain decode
                              with decode CUDA graphs (the off switch); sglang = SGLang's own
                              depth 0, a one-token verify (0.40x a plain server's throughput
                              at 64-128 requests on the H200)
  --spec-off-draft kv|keep|skip
                              what the drafter does at depth 0: kv (default) only stores its
                              keys and values, 16 steps in one pass (SPECDEPTH_OFF_DRAFT_DEFER),
                              so its cache stays exact; drafting resumes after one more
                              depth-0 step with the whole extend (SPECDEPTH_OFF_RESUME=cold:
                              at once, losing that step's drafts) (0.93-1.05x a plain server
                              at C=1-128 on an H100, against 0.87-0.94x for keep); keep
                              runs its whole one-token extend; skip runs nothing, and the
                              drafter misses the positions decoded while off

With --speculative-algorithm EAGLE/EAGLE3 the launcher adds --speculative-adaptive and a
generated --speculative-adaptive-config listing the depths, and refuses (exit 2) what SGLang's
adaptive mode cannot do (other algorithms, topk != 1, attention DP, ...). Without speculation the
hook still streams depth-0 telemetry, so traces can be recorded from any SGLang server.
SGLang's own options: python -m sglang.launch_server --help"""


def main(argv: Sequence[str] | None = None) -> int:
    """Run the launcher; returns the exit status (2 = refused or bad flag)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if "-h" in argv or "--help" in argv:
        print(HELP)
        return 0
    tmp_dir = tempfile.mkdtemp(prefix="specdepth-")
    atexit.register(shutil.rmtree, tmp_dir, True)
    config_path = os.path.join(tmp_dir, "adaptive.json")
    try:
        p = plan(argv, config_path)
    except ConfigError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    if p.adaptive_config is not None:
        with open(config_path, "w") as f:
            json.dump(p.adaptive_config, f)

    os.environ.update(p.config.to_env())
    os.environ.update(p.off.to_env())
    plugins = os.environ.get("SGLANG_PLUGINS", "")
    if plugins and PLUGIN_NAME not in {x.strip() for x in plugins.split(",")}:
        os.environ["SGLANG_PLUGINS"] = f"{plugins},{PLUGIN_NAME}"

    from sglang.launch_server import run_server
    from sglang.srt.plugins import load_plugins
    from sglang.srt.server_args import prepare_server_args
    from sglang.srt.utils import kill_process_tree

    from sglang_hook import compat

    load_plugins()
    try:
        if p.speculative:
            _refuse_instead_of_disabling()
        server_args = prepare_server_args(p.sglang_argv)
        compat.resolve_server_args(server_args)
        if p.speculative and not compat.resolved_arg(server_args, "speculative_adaptive"):
            raise Refused("SGLang turned --speculative-adaptive off for this configuration")
        if compat.single_rank(server_args):
            # Read by the scheduler processes, which start after this: no broadcast to hook.
            os.environ.update(dataclasses.replace(p.config, single_rank=True).to_env())
    except (ConfigError, ValueError) as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    try:
        run_server(server_args)
    finally:
        kill_process_tree(os.getpid(), include_parent=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
