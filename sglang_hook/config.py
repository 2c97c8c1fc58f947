"""The hook's configuration: parsed once by the launcher, handed to scheduler children by environment.

SGLang spawns its scheduler processes, so nothing set in the launcher's Python objects reaches
them; environment variables do. :class:`HookConfig` round-trips through :meth:`HookConfig.to_env`
and :meth:`HookConfig.from_env`, and every value is validated on both sides so a hand-edited
environment fails the same way as a bad flag.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

from controller.errors import ConfigError
from controller.protocol import DEFAULT_DEPTHS, MAX_DEPTH, MAX_DEPTHS, MAX_INSTANCE_CHARS

ENV_ENDPOINT = "SPECDEPTH_CONTROLLER"
ENV_DEPTHS = "SPECDEPTH_DEPTHS"
ENV_FALLBACK = "SPECDEPTH_FALLBACK"
ENV_STALE_MS = "SPECDEPTH_STALE_MS"
ENV_INSTANCE = "SPECDEPTH_INSTANCE"
ENV_CLIENT_THREAD = "SPECDEPTH_CLIENT_THREAD"
ENV_CLIENT_TICK_MS = "SPECDEPTH_CLIENT_TICK_MS"
ENV_SINGLE_RANK = "SPECDEPTH_SINGLE_RANK"

DEFAULT_STALE_MS = 200.0
# The client thread looks at its queue every this many ms while records flow, so handing a
# record over is a bare append (on the H200: 1.6 µs against 4.6 µs for a wake per record, the
# same step times, a record sent ~0.4 ms later, far inside a decode step). 0 = wake per record.
DEFAULT_CLIENT_TICK_MS = 1
MAX_CLIENT_TICK_MS = 1000
FALLBACK_SGLANG = "sglang"

_ENDPOINT_RE = re.compile(r"^(ipc://.+|tcp://[^\s:]+:\d{1,5}|inproc://.+)$")


@dataclass(frozen=True, slots=True)
class HookConfig:
    """What the hook needs in every scheduler process.

    Attributes:
        endpoint: the controller's ZeroMQ endpoint (``ipc://...`` or ``tcp://host:port``).
        depths: the allowed draft depths, strictly increasing, 0 = no speculation.
        fallback_depth: the depth used when no fresh decision exists; ``None`` delegates to
            SGLang's own adaptive policy.
        stale_ms: once a step has waited this long for its decision, fall back (until decisions flow again).
        instance: replica name sent in ``hello``; empty = derived from host and port.
        client_thread: the controller's socket on a thread of its own, so the scheduler
            thread only hands records over (40-60 µs less on it per step at p50 on the H200
            host); ``False`` = the scheduler thread sends and drains itself; ``None``
            (default, ``auto``) = inline, as ``False``. The thread needs the GIL to build,
            pack and drain, and wakes every ``client_tick_ms``: on an H100 an EAGLE-3 server
            held at depth 0, whose scheduler is bound by its launches, ran 1.6-4.4% slower
            with it than inline, in 7 of 9 interleaved repetitions, the time lost in the
            admissions (``bench/results/realgpu/h100/offswitch-kv/README.md``, call AI).
        client_tick_ms: with the client thread, how often it looks at its queue while records
            flow (the scheduler's hand-over is then a bare append); 0 = the scheduler wakes it
            for every record.
        single_rank: set by the launcher when each replica's scheduler is one process (TP and
            PP size 1): the entry rank applies a decision where it reads it, after its step
            record, and the request broadcast is not hooked at all (one hook less on every
            scheduler iteration). ``False`` (the default, and what a hand-wired deployment
            gets) rides the broadcast, which is right for any number of ranks.
    """

    endpoint: str
    depths: tuple[int, ...] = DEFAULT_DEPTHS
    fallback_depth: int | None = None
    stale_ms: float = DEFAULT_STALE_MS
    instance: str = ""
    client_thread: bool | None = None
    client_tick_ms: int = DEFAULT_CLIENT_TICK_MS
    single_rank: bool = False

    def __post_init__(self) -> None:
        if not _ENDPOINT_RE.match(self.endpoint):
            raise ConfigError(f"--spec-controller {self.endpoint!r}: expected ipc://PATH or tcp://HOST:PORT")
        check_depths(self.depths)
        if self.fallback_depth is not None and self.fallback_depth not in self.depths:
            raise ConfigError(
                f"--spec-fallback {self.fallback_depth}: not one of --spec-depths {list(self.depths)}"
            )
        if not (self.stale_ms > 0.0 and self.stale_ms < 3_600_000.0):
            raise ConfigError(f"--spec-stale-ms {self.stale_ms}: must be a number in (0, 3600000)")
        if len(self.instance) > MAX_INSTANCE_CHARS:
            raise ConfigError(f"instance name longer than {MAX_INSTANCE_CHARS} characters")
        if not (type(self.client_tick_ms) is int and 0 <= self.client_tick_ms <= MAX_CLIENT_TICK_MS):
            raise ConfigError(
                f"{ENV_CLIENT_TICK_MS} {self.client_tick_ms!r}: must be an integer in 0..{MAX_CLIENT_TICK_MS}"
            )

    def to_env(self) -> dict[str, str]:
        """The environment variables that carry this config to SGLang's child processes."""
        env = {
            ENV_ENDPOINT: self.endpoint,
            ENV_DEPTHS: ",".join(str(d) for d in self.depths),
            ENV_FALLBACK: FALLBACK_SGLANG if self.fallback_depth is None else str(self.fallback_depth),
            ENV_STALE_MS: repr(self.stale_ms),
        }
        if self.instance:
            env[ENV_INSTANCE] = self.instance
        if self.client_thread is not None:
            env[ENV_CLIENT_THREAD] = "on" if self.client_thread else "off"
        if self.client_tick_ms != DEFAULT_CLIENT_TICK_MS:
            env[ENV_CLIENT_TICK_MS] = str(self.client_tick_ms)
        if self.single_rank:
            env[ENV_SINGLE_RANK] = "1"
        return env

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> HookConfig | None:
        """The config the launcher left in the environment, or ``None`` when the hook is not enabled.

        Raises:
            ConfigError: the variables are present but invalid.
        """
        env = os.environ if environ is None else environ
        endpoint = env.get(ENV_ENDPOINT, "").strip()
        if not endpoint:
            return None
        return cls(
            endpoint=endpoint,
            depths=parse_depths(env.get(ENV_DEPTHS, ",".join(map(str, DEFAULT_DEPTHS)))),
            fallback_depth=parse_fallback(env.get(ENV_FALLBACK, FALLBACK_SGLANG)),
            stale_ms=parse_stale_ms(env.get(ENV_STALE_MS, str(DEFAULT_STALE_MS))),
            instance=env.get(ENV_INSTANCE, ""),
            client_thread=parse_auto_on_off(env.get(ENV_CLIENT_THREAD, "auto"), "--spec-client-thread"),
            client_tick_ms=parse_tick_ms(env.get(ENV_CLIENT_TICK_MS, str(DEFAULT_CLIENT_TICK_MS))),
            single_rank=bool(parse_auto_on_off(env.get(ENV_SINGLE_RANK, "0"), ENV_SINGLE_RANK)),
        )


def check_depths(depths: tuple[int, ...]) -> None:
    """Raise :class:`ConfigError` unless ``depths`` is what protocol v1 allows in ``hello``."""
    if (
        not 1 <= len(depths) <= MAX_DEPTHS
        or not all(type(d) is int and 0 <= d <= MAX_DEPTH for d in depths)
        or any(a >= b for a, b in zip(depths, depths[1:], strict=False))
    ):
        raise ConfigError(
            f"--spec-depths {','.join(map(str, depths))}: need 1..{MAX_DEPTHS} strictly increasing "
            f"integers in 0..{MAX_DEPTH}"
        )


def parse_depths(text: str) -> tuple[int, ...]:
    """Parse ``"0,1,2,3,5"``. Raises :class:`ConfigError`."""
    try:
        depths = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise ConfigError(
            f"--spec-depths {text!r}: expected comma-separated integers such as 0,1,2,3,5"
        ) from None
    check_depths(depths)
    return depths


def parse_fallback(text: str) -> int | None:
    """Parse ``sglang`` (delegate to SGLang's adaptive policy) or a fixed depth ``K``."""
    text = text.strip()
    if text == FALLBACK_SGLANG:
        return None
    try:
        value = int(text)
    except ValueError:
        raise ConfigError(f"--spec-fallback {text!r}: expected 'sglang' or a depth K") from None
    if not 0 <= value <= MAX_DEPTH:
        raise ConfigError(f"--spec-fallback {value}: depth must be in 0..{MAX_DEPTH}")
    return value


def parse_stale_ms(text: str) -> float:
    """Parse a positive number of milliseconds."""
    try:
        value = float(text)
    except ValueError:
        raise ConfigError(f"--spec-stale-ms {text!r}: expected a number of milliseconds") from None
    if not (value > 0.0 and value < 3_600_000.0):
        raise ConfigError(f"--spec-stale-ms {text!r}: must be in (0, 3600000)")
    return value


def parse_tick_ms(text: str) -> int:
    """Parse the client thread's tick: an integer number of milliseconds, 0 = wake per record."""
    try:
        value = int(text.strip())
    except ValueError:
        raise ConfigError(
            f"{ENV_CLIENT_TICK_MS} {text!r}: expected an integer number of ms (0 = wake per record)"
        ) from None
    if not 0 <= value <= MAX_CLIENT_TICK_MS:
        raise ConfigError(f"{ENV_CLIENT_TICK_MS} {text!r}: must be in 0..{MAX_CLIENT_TICK_MS}")
    return value


def parse_auto_on_off(text: str, flag: str) -> bool | None:
    """Parse ``auto`` (None), ``on`` / ``off`` (also ``1``/``0``, ``true``/``false``).

    Raises:
        ConfigError: anything else.
    """
    value = text.strip().lower()
    if value == "auto":
        return None
    if value in ("on", "1", "true", "yes"):
        return True
    if value in ("off", "0", "false", "no"):
        return False
    raise ConfigError(f"{flag} {text!r}: expected auto, on or off")
