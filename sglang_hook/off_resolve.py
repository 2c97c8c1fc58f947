"""Depth 0 without waiting for the GPU: the next step's sequence lengths known on the host.

SGLang's speculative scheduler (spec v2, overlap on) does not know how many drafts a verify
accepted, so before it launches a step it reads the lengths the previous step published back
from the GPU: ``FutureMap.resolve_seq_lens_cpu`` copies them to the host and **synchronizes**
(0.5.17 and 0.5.23 alike, for every attention backend that wants host lengths: triton does).
The host therefore starts preparing step N+1 only once step N's verify has finished, and the
GPU idles while it does. A plain server knows each length is one more than before and launches
N+1 behind N. On an H100 at 64 requests the depth-0 server's GPU idled 1.8 ms a step against
0.6 ms on a plain server (call AL, ``bench/results/realgpu/h100/offswitch-kv/profiles-al.json``).

At depth 0 the hook's plain decode accepts exactly one token per request (a one-node tree
accepts its root), so the lengths it publishes are the step's host lengths plus one. This
module keeps them on the host (:class:`HostLens`, indexed like SGLang's future map, by
request-pool slot) and answers the next resolve from there, without the copy and the wait:

- ``EAGLEWorkerV2.forward_batch_generation`` (AROUND, :func:`forward_hook`): after a step,
  record what it published. A prefill publishes the batch's lengths; a depth-0 step that ran
  as a plain decode (:func:`plain_step_ran`, called by the off switch) publishes them plus one;
  anything else (a drafted step, SGLang's own depth 0, a fallback, an exception) forgets its
  slots, so the next resolve of them is SGLang's.
- ``FutureMap.publish`` (AROUND, :func:`publish_hook`): a publish from anywhere but inside
  that forward (PD disaggregation's prebuilt batches) clears everything: lengths are answered
  only for slots whose last publish was seen and understood here.
- ``FutureMap.resolve_seq_lens_cpu`` (AROUND, :func:`resolve_hook`): when every slot of the
  batch is known, SGLang's GPU-side steps run as SGLang runs them (the stream waits for the
  publish event, the device lengths are gathered) and the host lengths come from here; the
  host does not wait. Otherwise, and under SGLang's debug asserts, SGLang's own resolve runs.

``SPECDEPTH_OFF_RESOLVE=sglang`` keeps SGLang's resolve everywhere. ``SPECDEPTH_OFF_RESOLVE_CHECK=N``
also runs SGLang's resolve for the first N answered here and compares the lengths: any
difference turns this off for the rest of the process and is logged as an error.

Invariants:
- An answer is given only for slots whose last publish went through :func:`forward_hook` and
  was a prefill or a plain depth-0 step; every other publish forgets or clears.
- The device-side work of the resolve is SGLang's: the same event wait, the same gather.
- Nothing raises into SGLang: a failure here falls back to SGLang's resolve (logged once).

Imports nothing from SGLang or torch (the hook's lean-import rule): host tensors are made with
the methods of the tensors SGLang hands in.
"""

from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger("sglang_hook")

ENV_OFF_RESOLVE = "SPECDEPTH_OFF_RESOLVE"  # "host" (default) or "sglang"
ENV_OFF_RESOLVE_CHECK = "SPECDEPTH_OFF_RESOLVE_CHECK"  # answers also checked against SGLang's

FORWARD = "sglang.srt.speculative.eagle_worker_v2.EAGLEWorkerV2.forward_batch_generation"
FUTURE_MAP = "sglang.srt.managers.overlap_utils.FutureMap"
PUBLISH = FUTURE_MAP + ".publish"
RESOLVE = FUTURE_MAP + ".resolve_seq_lens_cpu"


@dataclass(slots=True)
class ResolveCounters:
    """Per-process counters (read by tests and logs)."""

    answered: int = 0  # resolves answered from the host lengths
    sglang: int = 0  # resolves left to SGLang (a slot unknown, or the path not taken)
    cleared: int = 0  # publishes seen outside a forward: everything forgotten
    checked: int = 0  # answers compared with SGLang's resolve
    mismatches: int = 0  # ... that differed (the path is then off)
    errors: int = 0


class HostLens:
    """The lengths each request-pool slot last published, where known; -1 where not.

    A host tensor grown on demand; its dtype is that of the first lengths recorded.
    """

    def __init__(self) -> None:
        self.lens: Any = None

    def _fit(self, slots: Any, like: Any) -> None:
        top = int(slots.max()) + 1 if len(slots) else 0
        if self.lens is None:
            self.lens = like.new_full((max(top, 256),), -1)
        elif top > len(self.lens):
            grown = self.lens.new_full((max(top, 2 * len(self.lens)),), -1)
            grown[: len(self.lens)] = self.lens
            self.lens = grown

    def record(self, slots: Any, lens: Any) -> None:
        """``slots`` (host int tensor) published ``lens`` (host int tensor, same length)."""
        self._fit(slots, lens)
        self.lens[slots] = lens.to(self.lens.dtype)

    def forget(self, slots: Any) -> None:
        if self.lens is not None and len(slots):
            self.lens[slots[slots < len(self.lens)]] = -1

    def clear(self) -> None:
        if self.lens is not None:
            self.lens.fill_(-1)

    def lookup(self, slots: Any) -> Any:
        """The lengths of ``slots`` (a copy), or None unless every one is known."""
        if self.lens is None or not len(slots) or int(slots.max()) >= len(self.lens):
            return None
        got = self.lens[slots]
        return None if bool((got < 0).any()) else got


@dataclass(slots=True)
class _State:
    enabled: bool = False
    check: int = 0  # answers still to compare with SGLang's
    in_forward: bool = False
    plain: bool = False  # the step inside the current forward ran as a plain decode


COUNTERS = ResolveCounters()
LENS = HostLens()
STATE = _State()
_logged: set[str] = set()


def _log_once(key: str, level: int, msg: str, exc: bool = False) -> None:
    if key not in _logged:
        _logged.add(key)
        logger.log(level, msg, exc_info=exc)


def plain_step_ran() -> None:
    """The off switch ran this forward's depth-0 step as a plain decode: one token per request."""
    STATE.plain = True


def _off(why: str) -> None:
    STATE.enabled = False
    LENS.clear()
    _log_once("off", logging.ERROR, f"spec controller: host sequence lengths off ({why}); SGLang's resolve from now on")


def forward_hook(original: Any, worker: Any, batch: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND ``EAGLEWorkerV2.forward_batch_generation``: record what the step published."""
    if not STATE.enabled:
        return original(worker, batch, *args, **kwargs)
    slots, lens, prefill, decode = None, None, False, False
    try:
        mode = batch.forward_mode
        if not mode.is_idle():
            slots, lens = batch.req_pool_indices_cpu, batch.seq_lens_cpu
            # A mixed batch's decode rows lag on the host (SGLang rebuilds them late): forgotten.
            mixed = bool(getattr(batch, "is_extend_in_batch", False)) or mode.is_mixed()
            prefill = mode.is_extend() and not mixed and getattr(mode, "name", "") == "EXTEND"
            decode = mode.is_decode() and not mixed
    except Exception:
        COUNTERS.errors += 1
        _log_once("forward", logging.WARNING, "spec controller: a step's host lengths unreadable", exc=True)
    STATE.in_forward, STATE.plain = True, False
    done = False
    try:
        out = original(worker, batch, *args, **kwargs)
        done = True
        return out
    finally:
        STATE.in_forward = False
        if slots is not None:
            try:
                if done and lens is not None and prefill:
                    LENS.record(slots, lens)  # spec v2: a prefill publishes the lengths it extended to
                elif done and lens is not None and decode and STATE.plain:
                    LENS.record(slots, lens + 1)
                else:
                    LENS.forget(slots)
            except Exception:
                COUNTERS.errors += 1
                _off("recording failed")
        STATE.plain = False


def publish_hook(original: Any, future_map: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND ``FutureMap.publish``: a publish this module did not see the lengths of clears it."""
    if STATE.enabled and not STATE.in_forward:
        LENS.clear()
        COUNTERS.cleared += 1
    return original(future_map, *args, **kwargs)


def _answerable(future_map: Any, batch: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The host lengths for this resolve, or None where SGLang's resolve must run."""
    if not STATE.enabled or args or kwargs.get("stream_ordered"):
        return None
    spec = getattr(batch, "spec_info", None)
    if spec is None or getattr(spec, "future_indices", None) is None:
        return None  # SGLang's resolve does nothing either
    if (
        not getattr(future_map, "needs_cpu_seq_lens", True)
        or getattr(future_map, "publish_ready", None) is None
        or getattr(future_map, "fwd_prepare_d2h_stream", None) is None
        or getattr(sys.modules.get(type(future_map).__module__), "_DEBUG_ASSERT", True)
        or getattr(sys.modules.get(type(future_map).__module__), "_is_hip", True)
    ):
        return None
    slots = batch.req_pool_indices_cpu
    return None if slots is None else LENS.lookup(slots)


def resolve_hook(original: Any, future_map: Any, batch: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND ``FutureMap.resolve_seq_lens_cpu``: the host lengths, where known, without a wait."""
    try:
        lens = _answerable(future_map, batch, args, kwargs)
    except Exception:
        COUNTERS.errors += 1
        _off("lookup failed")
        lens = None
    if lens is None:
        COUNTERS.sglang += 1
        return original(future_map, batch, *args, **kwargs)
    if STATE.check > 0:
        STATE.check -= 1
        COUNTERS.checked += 1
        out = original(future_map, batch, *args, **kwargs)
        if batch.seq_lens_cpu is None or not bool((batch.seq_lens_cpu == lens).all()):
            COUNTERS.mismatches += 1
            _off(f"host {lens.tolist()[:8]} against SGLang's {getattr(batch.seq_lens_cpu, 'tolist', list)()[:8]}")
        elif STATE.check == 0:
            logger.info("spec controller: host sequence lengths matched SGLang's on %d steps", COUNTERS.checked)
        return out
    # SGLang's device side, as its resolve runs it: the schedule stream waits for the publish
    # (a device-side wait), then gathers the published lengths.
    future_map.publish_ready.wait()
    batch.seq_lens = future_map.new_seq_lens_buf[batch.spec_info.future_indices]
    batch.seq_lens_cpu = lens.to(future_map.new_seq_lens_buf.dtype)
    batch.seq_lens_sum = int(lens.sum())
    COUNTERS.answered += 1
    if COUNTERS.answered == 1:
        logger.info("spec controller: after depth 0 the next step's lengths come from the host, with no wait")
    return None


HOOKS = ((FORWARD, forward_hook), (PUBLISH, publish_hook), (RESOLVE, resolve_hook))


def install(register: Any) -> None:
    """Register the three hooks unless ``SPECDEPTH_OFF_RESOLVE=sglang``."""
    mode = os.environ.get(ENV_OFF_RESOLVE, "host").strip() or "host"
    if mode not in ("host", "sglang"):
        logger.warning("spec controller: %s=%r is not host or sglang; using host", ENV_OFF_RESOLVE, mode)
        mode = "host"
    STATE.enabled = mode == "host"
    if not STATE.enabled:
        return
    try:
        STATE.check = max(0, int(os.environ.get(ENV_OFF_RESOLVE_CHECK, "0") or 0))
    except ValueError:
        STATE.check = 0
    for target, fn in HOOKS:
        register(target, fn)
