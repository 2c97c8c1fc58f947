"""One controller at a time on a hook server's endpoint: stop the current one, start the next, wait.

The hook server (``sglang_hook.launch_server --spec-controller ENDPOINT``) keeps one DEALER
socket to ``ENDPOINT`` for its whole life; ZeroMQ reconnects it to whatever binds there next.
A new controller does not know the hook's instance, so the hook's next step is answered
``unknown_instance`` and the hook says hello again (``sglang_hook/client.py``). Until then,
and while no controller runs, the hook uses its fallback depth (``--spec-fallback``, 0 in
``offswitch.Server``): never permanently, since every unanswered step re-arms the hello.

So a swap is: SIGTERM the running controller (its trace files are flushed and closed), start
the next one with its own log, wait until it logs ``serving`` (bound, policy loaded and
compiled), then ``poke`` the hook (a short request on the device, a step in the tests) until
the controller logs the hook's hello, then poke once more so that decisions flow before
anything is timed.

Policy names, as ``summary.csv`` writes them, map to what runs (:func:`resolve`):

  ``static:K``, any builtin name       ``controller serve --policy builtin:NAME``
  ``ppo``, ``ppo-retrained``           ``controller serve --policy`` the zip in :data:`NAMED_ZIPS`
  ``goodput-fit``                      ``serve_goodput_fit.py --sim`` the fit in :data:`NAMED_SIMS`
                                       (``NAME=goodput-fit:SIM_JSON`` for another fit)
  ``NAME=SPEC``                        ``controller serve --policy SPEC`` under the name NAME
  ``PATH.zip``                         ``controller serve --policy PATH.zip`` named by its stem
  ``scripted:SCHEDULE``                ``scripted_controller.py --schedule SCHEDULE`` (an
                                       instrument, not a policy: acceptance and resume stages)

Stdlib only: it runs in the benchmark's own process under the device image's python3; the
controller runs as a child under ``python`` with ``env`` (the carried packages on its path).
"""

from __future__ import annotations

import gzip
import io
import os
import re
import signal
import subprocess
import sys
import tarfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent

# Policy names that stand for a PPO zip in the repository (paths relative to its root).
NAMED_ZIPS = {
    "ppo": "agents/bundled/h200-llama8b/ppo.zip",  # trained in the simulator, no testbed trace
    "ppo-retrained": "bench/results/realgpu/ppo-retrained/ppo.zip",  # `controller train --traces` (REALGPU.md)
    # The same, on the H100 calls' traces (bench/results/realgpu/h100/): an H100's policy.
    "ppo-retrained-h100": "bench/results/realgpu/h100/ppo-retrained/ppo.zip",
    # On the drawn-length calls M-U's hook records, today's fit (drawn/ppo-retrained/README.md).
    "ppo-retrained-mu": "bench/results/realgpu/h100/drawn/ppo-retrained/ppo.zip",
}

# Policy names that stand for goodput with a fitted latency model (a sim.json in the repository).
NAMED_SIMS = {
    "goodput-fit": "bench/results/realgpu/ppo-retrained/sim.json",  # fitted to the testbed's traces
}
GOODPUT_FIT = "goodput-fit:"  # spec prefix: serve_goodput_fit.py --sim PATH


@dataclass(frozen=True)
class PolicySpec:
    """A policy as the benchmark names it (``name``) and what the controller is given (``spec``)."""

    name: str
    spec: str

    @property
    def scripted(self) -> bool:
        return self.spec.startswith("scripted:")

    @property
    def slug(self) -> str:
        """``name`` as a file name: letters, digits, ``.``, ``_`` and ``-`` only."""
        return re.sub(r"[^A-Za-z0-9._-]", "-", self.name)


def resolve(name: str, repo: Path = REPO) -> PolicySpec:
    """The :class:`PolicySpec` of a policy name (module docstring); never fails: ``controller
    serve`` itself refuses an unknown builtin or a missing zip, and the swap reports why."""
    if "=" in name:
        short, spec = name.split("=", 1)
        return PolicySpec(short, spec)
    if name in NAMED_ZIPS:
        return PolicySpec(name, str(repo / NAMED_ZIPS[name]))
    if name in NAMED_SIMS:
        return PolicySpec(name, GOODPUT_FIT + str(repo / NAMED_SIMS[name]))
    if name.endswith(".zip"):
        return PolicySpec(Path(name).stem, name)
    if name.startswith("scripted:"):
        return PolicySpec(name, name)
    return PolicySpec(name, f"builtin:{name}")


@dataclass
class Swap:
    """What one swap did: whether the new controller is live, and how long each part took."""

    policy: str
    live: bool = False
    why: str = ""
    start_s: float = 0.0  # until the controller logged "serving" (bound, policy ready)
    hello_s: float = 0.0  # until the hook's hello reached it
    pokes: int = 0
    log: str = ""
    stopped: dict[str, object] = field(default_factory=dict)


class ControllerSwap:
    """Runs one controller process at a time on ``endpoint``; :meth:`use` swaps it.

    Args:
        endpoint: the hook's ``--spec-controller`` endpoint.
        logs: folder for each controller process's log (one file per start) and the scripted
            controller's record, ``logs/scripted_<label>.jsonl``.
        records: folder for traces: ``records/<policy>/`` per policy name (``--record``).
        env: the controller's environment (its ``PYTHONPATH`` must reach the repository).
        poke: makes the hook send steps (a short request to its server).
        python: the interpreter that runs the controller.
        label: names the log files (the hook server's label).
        on_stop: called each time a controller has exited, before the next one starts (its
            trace files are closed then: e.g. pack them).
    """

    def __init__(
        self,
        endpoint: str,
        logs: Path,
        records: Path,
        env: dict[str, str],
        poke: Callable[[], object],
        python: str = sys.executable,
        label: str = "hook",
        on_stop: Callable[[], object] | None = None,
    ) -> None:
        self.endpoint = endpoint
        self.logs = logs
        self.records = records
        self.env = env
        self.poke = poke
        self.python = python
        self.label = label
        self.on_stop = on_stop
        self.current: PolicySpec | None = None
        self.live = False  # the hook's hello reached the running controller
        self.history: list[Swap] = []
        self._proc: subprocess.Popen[bytes] | None = None
        self._log: Path | None = None
        self._fh: object = None
        self._n = 0

    def argv(self, policy: PolicySpec) -> list[str]:
        if policy.scripted:
            record = self.logs / f"scripted_{self.label}.jsonl"
            return [self.python, str(HERE / "scripted_controller.py"), "--bind", self.endpoint,
                    "--schedule", policy.spec[len("scripted:"):], "--record", str(record)]  # fmt: skip
        if policy.spec.startswith(GOODPUT_FIT):
            return [self.python, str(HERE / "serve_goodput_fit.py"), "--sim", policy.spec[len(GOODPUT_FIT):],
                    "--bind", self.endpoint, "--record", str(self.records / policy.slug)]  # fmt: skip
        return [self.python, "-m", "controller.cli", "serve", "--policy", policy.spec, "--bind", self.endpoint,
                "--record", str(self.records / policy.slug)]  # fmt: skip

    def use(
        self, policy: PolicySpec | str, start_timeout_s: float = 120.0, hello_timeout_s: float = 30.0
    ) -> Swap:
        """Stop the running controller, start ``policy`` on the endpoint, wait until it is live.

        A policy already running is kept (no restart). Returns a :class:`Swap` whose ``live`` says
        whether the hook's hello reached the new controller; when not, ``why`` says what
        happened and the hook runs at its fallback depth.
        """
        if isinstance(policy, str):
            policy = resolve(policy)
        if self.current == policy and self.live and self._proc is not None and self._proc.poll() is None:
            return Swap(policy.name, live=True, why="already running")
        swap = Swap(policy.name)
        swap.stopped = self.stop()
        self._n += 1
        self._log = self.logs / f"controller_{self.label}_{self._n:03d}_{policy.slug}.log"
        swap.log = self._log.name
        self.logs.mkdir(parents=True, exist_ok=True)
        self.records.mkdir(parents=True, exist_ok=True)
        self._fh = open(self._log, "wb")  # noqa: SIM115  (closed in stop)
        tic = time.monotonic()
        self._proc = subprocess.Popen(
            self.argv(policy), env=self.env, stdout=self._fh, stderr=subprocess.STDOUT,  # type: ignore[arg-type]
            start_new_session=True,
        )  # fmt: skip
        self.current = policy
        # Both controllers print "serving " once bound and ready.
        if not self._wait(swap, ("serving ",), start_timeout_s, "not serving", lambda: time.sleep(0.05)):
            return self._done(swap)
        swap.start_s = round(time.monotonic() - tic, 2)
        hello_tic = time.monotonic()

        def poke() -> None:
            self.poke()
            swap.pokes += 1

        if not self._wait(
            swap, ("hello from", "hello again from"), hello_timeout_s, "no hello from the hook", poke
        ):
            return self._done(swap)
        swap.hello_s = round(time.monotonic() - hello_tic, 2)
        self.poke()  # decisions now flow: the first one answered a step, not a hello
        swap.pokes += 1
        swap.live = self.live = True
        swap.why = "live"
        return self._done(swap)

    def _wait(
        self, swap: Swap, needles: tuple[str, ...], timeout_s: float, what: str, between: Callable[[], object]
    ) -> bool:
        """Until the controller's log says one of ``needles``: ``between()`` meanwhile. False,
        with ``swap.why`` set, when the controller exits or ``timeout_s`` passes first."""
        assert self._proc is not None
        tic = time.monotonic()
        while not self._said(*needles):
            if self._proc.poll() is not None:
                swap.why = f"exited rc={self._proc.returncode}: {self._tail()}"
                return False
            if time.monotonic() - tic > timeout_s:
                swap.why = f"{what} after {timeout_s:.0f} s: {self._tail()}"
                return False
            between()
        return True

    def _done(self, swap: Swap) -> Swap:
        self.history.append(swap)
        return swap

    def _said(self, *needles: str) -> bool:
        assert self._log is not None
        text = self._log.read_text(errors="replace")
        return any(n in text for n in needles)

    def _tail(self, n: int = 600) -> str:
        if self._log is None or not self._log.exists():
            return ""
        return self._log.read_text(errors="replace")[-n:].strip()

    def stop(self) -> dict[str, object]:
        """SIGTERM the running controller (SIGKILL after 15 s); what its log says it served."""
        proc, self._proc = self._proc, None
        self.live = False
        if proc is None:
            return {}
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGTERM)
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
            except ProcessLookupError:
                pass
        if self._fh is not None:
            self._fh.close()  # type: ignore[attr-defined]
            self._fh = None
        out: dict[str, object] = {"policy": self.current.name if self.current else "", "rc": proc.returncode}
        m = re.search(r"stopped after (\d+) steps from (\d+) frames; errors (.*)", self._tail(4000))
        if m:
            out.update(steps=int(m.group(1)), frames=int(m.group(2)), errors=m.group(3).strip())
        self.current = None
        if self.on_stop is not None:
            self.on_stop()
        return out


class TracePack:
    """Appends each stopped controller's trace files, gzipped and flat, to ``out/traces.tar``
    (``traces2.tar``, ... once one passes 15 MiB: the device tool returns files of 16 MiB at most)."""

    LIMIT = 15 << 20

    def __init__(self, records: Path, out: Path) -> None:
        self.records = records
        self.out = out
        self.done: set[Path] = set()
        self.n = 0

    def add_new(self, under: Path | None = None) -> int:
        """Pack the files under ``under`` (default: ``records``) not packed yet. Call it only
        while no controller writes there: a file packed is never packed again, so one packed
        while its controller still writes loses what comes after. Each server's controllers
        therefore record into a folder of their own (``records/<server>/<policy>/``), and a
        swap packs that folder alone."""
        new = sorted(p for p in (under or self.records).rglob("*.msgpack") if p not in self.done)
        if not new:
            return 0
        tar_path, n = self.out / "traces.tar", 1
        while tar_path.exists() and tar_path.stat().st_size > self.LIMIT:
            n += 1
            tar_path = self.out / f"traces{n}.tar"
        with tarfile.open(tar_path, "a" if tar_path.exists() else "w") as tar:
            for p in new:
                data = gzip.compress(p.read_bytes(), compresslevel=6)
                info = tarfile.TarInfo(f"traces/{p.parent.name}-{p.name}.gz")
                info.size = len(data)
                info.mtime = int(p.stat().st_mtime)
                tar.addfile(info, io.BytesIO(data))
                self.done.add(p)
        self.n += len(new)
        return len(new)
