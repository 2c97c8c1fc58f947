"""The actuator: SGLang's adaptive policy object, wrapped so the controller's depth wins when fresh.

SGLang's ``AdaptiveController`` asks ``self.params.get_steps_for_batch(bs)`` before every decode
launch and feeds ``self.params.on_verify_complete(...)`` after every verify. Replacing
``params`` with :class:`ControlledParams` is the whole actuator:

- ``get_steps_for_batch`` answers the depth every TP rank *received* (see :class:`TpSync`),
  or, when there is none, a fixed fallback depth or SGLang's own policy;
- ``on_verify_complete`` always feeds SGLang's policy (so its EMA is warm for the fallback) but
  only lets it switch the runtime state while it is in charge;
- everything else delegates.

TP consistency (invariant: every rank applies the same depth at the same step): only the
entry rank talks to the controller. It puts a :class:`DepthSync` marker into the request list
that SGLang already broadcasts from TP rank 0 at the top of every scheduler iteration, and
every rank — the entry rank included — applies exactly the marker it got out of that
broadcast. The decision is sticky between markers, so a marker is only sent when it changes.
Staleness is judged once, on the entry rank, so ranks cannot disagree about it either. A
replica of one rank has nothing to broadcast to: it hands its marker straight to itself
(:meth:`TpSync.apply_here`).

Nothing here raises into SGLang: an exception is logged once and SGLang's own answer is used.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger("sglang_hook")

_logged: set[str] = set()


def log_once(key: str, msg: str, *args: Any, level: int = logging.WARNING, exc: bool = False) -> None:
    """Log ``msg`` the first time ``key`` is seen in this process."""
    if key in _logged:
        return
    _logged.add(key)
    logger.log(level, msg, *args, exc_info=exc)


@dataclass(frozen=True, slots=True)
class DepthSync:
    """The entry rank's decision, riding SGLang's request broadcast to every TP rank.

    Attributes:
        depth: the depth to apply from now on, or ``None`` = no fresh decision (fall back).
        seq: increasing per entry rank; lets tests and logs tell markers apart.
    """

    depth: int | None
    seq: int


@dataclass(slots=True)
class Counters:
    """Per-process counters (plain ints: read by tests, logs and the benchmark)."""

    controller_steps: int = 0  # decode launches that used the controller's depth
    fallback_steps: int = 0  # decode launches that used the fallback
    invalid_depth: int = 0  # decisions ignored: depth not a runtime state SGLang built
    syncs_sent: int = 0  # DepthSync markers put into the broadcast (entry rank)
    syncs_applied: int = 0  # DepthSync markers taken out of the broadcast (every rank)
    hook_errors: int = 0  # exceptions caught inside the hook


@dataclass(slots=True)
class ActuatorState:
    """What one scheduler process applies. Shared by :class:`TpSync` and :class:`ControlledParams`.

    Attributes:
        applied: the depth every rank applies now (``None`` = fallback). Written only by
            :meth:`TpSync.take`, i.e. only from what came out of the broadcast (or, on a
            replica of one rank, from :meth:`TpSync.apply_here`, which calls it). Invariant:
            once ``valid`` is known, ``applied`` is ``None`` or one of ``valid``, so the
            actuator's per-step calls need not check it again.
        valid: the depths SGLang built runtime states for; ``None`` until a params object is
            wrapped (e.g. a server without speculation).
    """

    applied: int | None = None
    valid: frozenset[int] | None = None
    counters: Counters = field(default_factory=Counters)


class TpSync:
    """Moves the entry rank's decision into every rank's :class:`ActuatorState`, via the broadcast."""

    def __init__(self, state: ActuatorState, fallback_desc: str = "SGLang's adaptive policy") -> None:
        self.state = state
        self.fallback_desc = fallback_desc
        self._last_sent: int | None = None
        self._sent_any = False
        self._seq = 0
        # The shortcut for the entry rank's hot path: offering ``last_desired`` again returns
        # None and changes nothing while ``repeat_is_noop`` (a refused depth is counted anew
        # each time, so repeating it is not a no-op).
        self.last_desired: int | None = None
        self.repeat_is_noop = False

    def offer(self, desired: int | None) -> DepthSync | None:
        """Entry rank, before the broadcast: the marker to append, or ``None`` if nothing changed.

        ``desired`` is the controller's fresh depth or ``None``. A depth SGLang has no runtime
        state for is ignored, counted, and treated as no decision.
        """
        valid = self.state.valid
        self.last_desired = desired
        self.repeat_is_noop = desired is None or valid is None or desired in valid
        if desired is not None and valid is not None and desired not in valid:
            self.state.counters.invalid_depth += 1
            log_once(
                f"invalid-{desired}",
                "spec controller: depth %d is not one of SGLang's runtime states %s; ignored",
                desired,
                sorted(valid),
            )
            desired = None
        if self._sent_any and desired == self._last_sent:
            return None
        if desired is None:
            logger.warning("spec controller: no fresh decision; falling back to %s", self.fallback_desc)
        elif self._last_sent is None:
            logger.info("spec controller: decisions flowing; applying depth %d", desired)
        self._sent_any = True
        self._last_sent = desired
        self._seq += 1
        self.state.counters.syncs_sent += 1
        return DepthSync(depth=desired, seq=self._seq)

    def apply_here(self, desired: int | None) -> None:
        """A replica of one rank: :meth:`offer` and :meth:`take` with the broadcast left out."""
        marker = self.offer(desired)
        if marker is not None:
            self.take([marker])

    def take(self, reqs: list[Any] | None) -> list[Any] | None:
        """Every rank, after the broadcast: apply the last marker and return the list without markers."""
        if not reqs:
            return reqs
        markers = [r for r in reqs if type(r) is DepthSync]
        if not markers:
            return reqs
        state = self.state
        depth = markers[-1].depth
        valid = state.valid
        if depth is not None and valid is not None and depth not in valid:
            # The entry rank never sends one (offer() refuses it); a rank applies None rather
            # than hand SGLang a depth it has no runtime state for.
            state.counters.invalid_depth += 1
            depth = None
        state.applied = depth
        state.counters.syncs_applied += len(markers)
        return [r for r in reqs if type(r) is not DepthSync]


SGLANG_PARAMS_LOGGER = "sglang.srt.speculative.adaptive_spec_params"
SGLANG_WORKER_LOGGER = "sglang.srt.speculative.eagle_worker_v2"
# SGLang's lines about its own rule's moves and about every runtime-state switch: while the hook
# holds the depth the first are moves never made, the second one line per switch, which a
# controller can make every step (519 lines in a 2-minute H200 run); its trace records them.
SGLANG_QUIET_LINES = ("Adaptive spec params updated", "Switch adaptive runtime state")


class QuietWhileControlled(logging.Filter):
    """Drops SGLang's :data:`SGLANG_QUIET_LINES` while its rule is not in charge.

    The actuator keeps feeding SGLang's rule so its EMA is warm for the fallback; the rule then
    logs a switch it never makes (531 lines in one H200 run). Filters run only for records that
    are emitted, so steps without a log line pay nothing.
    """

    def __init__(self, state: ActuatorState, fixed_fallback: bool) -> None:
        super().__init__()
        self._state = state
        self._fixed = fixed_fallback

    def filter(self, record: logging.LogRecord) -> bool:
        if self._state.applied is None and not self._fixed:
            return True  # SGLang's rule is in charge: its switches are real
        return not str(record.msg).startswith(SGLANG_QUIET_LINES)


_quieted: list[QuietWhileControlled] = []


def quiet_sglang_rule(state: ActuatorState, fixed_fallback: bool) -> QuietWhileControlled:
    """Install :class:`QuietWhileControlled` on SGLang's params and worker loggers, once per process."""
    if not _quieted:
        flt = QuietWhileControlled(state, fixed_fallback)
        for name in (SGLANG_PARAMS_LOGGER, SGLANG_WORKER_LOGGER):
            logging.getLogger(name).addFilter(flt)
        _quieted.append(flt)
    return _quieted[0]


class ControlledParams:
    """Wraps SGLang's adaptive params (``AdaptiveSpeculativeParams``) for one worker.

    Args:
        inner: SGLang's own params object; used for graph sizing, the rest of the interface and
            the ``sglang`` fallback.
        state: the process's :class:`ActuatorState`.
        fallback_depth: fixed depth when no decision is fresh; ``None`` = SGLang's policy.
        profiler: benchmark only: ``start()`` → token, ``stop(token)`` around the hook's own work
            in each call (in ``on_verify_complete``: after SGLang's update, which is not the hook's).
        resume: the off switch's ``WarmResume`` (``depth(d)`` → the depth to launch), through
            which every launch's depth goes, whoever chose it; ``None``: launched as chosen.
    """

    def __init__(
        self,
        inner: Any,
        state: ActuatorState,
        fallback_depth: int | None = None,
        profiler: Any = None,
        resume: Any = None,
    ) -> None:
        self._inner = inner
        self._state = state
        self._profiler = profiler
        self._resume = resume
        valid = frozenset(int(s) for s in inner.candidate_steps)
        state.valid = valid
        if state.applied is not None and state.applied not in valid:  # taken before valid was known
            state.applied = None
        if fallback_depth is not None and fallback_depth not in valid:
            log_once(
                "fallback-invalid",
                "spec controller: fallback depth %d has no runtime state (have %s); using SGLang's policy",
                fallback_depth,
                sorted(valid),
            )
            fallback_depth = None
        self._fallback = fallback_depth
        quiet_sglang_rule(state, fallback_depth is not None)

    @property
    def inner(self) -> Any:
        """SGLang's own params object."""
        return self._inner

    @property
    def candidate_steps(self) -> list[int]:
        return self._inner.candidate_steps

    def set_cuda_graph_bs(self, cuda_graph_bs: list[int] | None) -> None:
        self._inner.set_cuda_graph_bs(cuda_graph_bs)

    def cuda_graph_bs_for_step(self, step: int) -> list[int] | None:
        return self._inner.cuda_graph_bs_for_step(step)

    def get_steps_for_batch(self, batch_size: int) -> int:
        """The depth for the decode about to launch: the received decision, else the fallback,
        through ``resume`` (a resume after depth 0 may launch one more depth-0 step first)."""
        prof = self._profiler
        t0 = prof.start() if prof is not None else None
        depth: int | None = None
        try:
            state = self._state
            depth = state.applied  # None or a valid depth (ActuatorState's invariant)
            if depth is not None:
                state.counters.controller_steps += 1
            else:
                state.counters.fallback_steps += 1
                depth = self._fallback
        except Exception:
            depth = None
            self._state.counters.hook_errors += 1
            log_once("get_steps", "spec controller: actuator failed; using SGLang's policy", exc=True)
        finally:
            if prof is not None:
                prof.stop(t0)
        if depth is None:
            depth = self._inner.get_steps_for_batch(batch_size)
        resume = self._resume
        if resume is None:
            return depth
        try:
            return resume.depth(depth)
        except Exception:
            self._state.counters.hook_errors += 1
            log_once("resume", "spec controller: warm resume failed; launching the depth as chosen", exc=True)
            return depth

    def on_verify_complete(self, num_correct_drafts_per_req: list[int], batch_size: int) -> int | None:
        """Feed SGLang's policy; let it switch the runtime state only while it is in charge."""
        new_step = self._inner.on_verify_complete(num_correct_drafts_per_req, batch_size)
        # SGLang's own update above is not the hook's cost; what follows is.
        prof = self._profiler
        t0 = prof.start() if prof is not None else None
        try:
            if new_step is None:  # most steps: SGLang wants no switch, so there is nothing to veto
                return None
            if self._state.applied is not None:
                return None
            if self._fallback is not None:
                return None
        except Exception:
            self._state.counters.hook_errors += 1
            log_once("on_verify", "spec controller: actuator failed; using SGLang's policy", exc=True)
        finally:
            if prof is not None:
                prof.stop(t0)
        return new_step

    def __getattr__(self, name: str) -> Any:
        # Anything else SGLang (or a later version) reads from its params object.
        return getattr(self._inner, name)


def wrap_controller_params(
    controller: Any,
    state: ActuatorState,
    fallback_depth: int | None,
    profiler: Any = None,
    resume: Any = None,
) -> ControlledParams:
    """Replace ``controller.params`` (SGLang's ``AdaptiveController``) by a :class:`ControlledParams`."""
    inner = controller.params
    if isinstance(inner, ControlledParams):
        return inner
    wrapped = ControlledParams(inner, state, fallback_depth, profiler, resume)
    controller.params = wrapped
    return wrapped
