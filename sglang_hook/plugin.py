"""The SGLang plugin (entry point ``sglang.srt.plugins: spec_controller``).

:func:`register` only registers AROUND hooks with SGLang's ``HookRegistry``; SGLang applies
them in every process that calls ``load_plugins()``. The hooks fire only where their targets
run — the scheduler processes — and build their state there lazily (:class:`HookRuntime`).

Hooks (see :mod:`sglang_hook.compat` for the exact targets):

- ``AdaptiveController.__init__``: wrap ``.params`` with the actuator (every TP rank).
- ``SchedulerRequestReceiver._broadcast_reqs_across_ranks``: the entry rank reads the newest
  decision and adds a :class:`~sglang_hook.actuator.DepthSync` marker to the request broadcast
  when it changes; every rank applies the marker it received. Not hooked where the launcher
  saw one process per replica (TP and PP size 1): there the entry rank applies the decision
  right after its step record (``HookRuntime.direct``).
- ``Scheduler.process_batch_result``: after each decode result, the entry rank builds one
  ``step`` record and hands it to the client; prefill batches add to ``prefill_tokens``.
- ``Scheduler.on_idle``: the next decode's ``step_us`` is timed from its own launch.

The scheduler thread reads only what must be read at the step (a few attributes and
references SGLang never writes into) and hands them to the client, which builds the ``Step``.
By default the scheduler thread does it all, one socket visit per record
(:class:`sglang_hook.client.InlineClient`). With ``--spec-client-thread on`` the client is a
thread of its own (:class:`sglang_hook.client.ClientThread`): it builds, sends and drains, and
the scheduler only queues; but it needs the GIL for that, which a scheduler bound by its
launches misses (``HookConfig.client_thread``).

Every hook catches every exception, logs it once, and lets SGLang continue as if the hook
were absent: a scheduler exception would SIGQUIT the server.
"""

from __future__ import annotations

import logging
import socket
import time
from typing import Any

from controller.errors import ConfigError
from controller.protocol import MAX_STEP_US, Hello, Step
from sglang_hook import compat, off_switch
from sglang_hook.actuator import ActuatorState, DepthSync, TpSync, log_once, wrap_controller_params
from sglang_hook.config import HookConfig
from sglang_hook.profiler import HookProfiler

logger = logging.getLogger("sglang_hook")

# Without the client thread, the top of a scheduler iteration drains the controller's replies
# only when the last drain (each record drains before it is sent) is older than this: a
# fresher record cannot have its decision back yet. Long prefills and idle gaps still drain
# (staleness must see decisions that came in meanwhile).
POLL_AFTER_NS = 1_000_000
# Without speculation no decision is ever applied: the inline client then drains the replies
# (welcomes, errors that ask for a new hello) at most this often, and each record is one send.
NO_SPEC_DRAIN_NS = 50_000_000


class HookRuntime:
    """The hook's state in one scheduler process.

    Args:
        config: from the launcher's environment variables.
        ranks: this process's TP/PP/DP ranks; only the entry rank talks to the controller.
    """

    def __init__(self, config: HookConfig, ranks: compat.Ranks) -> None:
        self.config = config
        self.ranks = ranks
        self.is_entry = ranks.is_entry  # a plain attribute: read on every scheduler step
        # One process per replica (the launcher saw TP and PP size 1): the request broadcast is
        # not hooked, and the entry rank applies each decision right after its step record.
        self.direct = config.single_rank and ranks.tp_size == 1 and ranks.pp_size == 1
        if config.single_rank and not self.direct:
            # The broadcast hook is not registered, so decisions cannot reach the other ranks:
            # every rank keeps to the fallback (consistently), rather than the entry rank alone
            # following the controller.
            log_once(
                "single-rank",
                "spec controller: launched for one rank, but this is TP rank %d of %d, PP rank %d of %d; "
                "decisions are not applied",
                ranks.tp_rank,
                ranks.tp_size,
                ranks.pp_rank,
                ranks.pp_size,
            )
        self.state = ActuatorState()
        fallback = (
            "SGLang's adaptive policy" if config.fallback_depth is None else f"depth {config.fallback_depth}"
        )
        self.sync = TpSync(self.state, fallback_desc=fallback)
        self.client: Any = None
        self._client_failed = False
        self._scheduler: Any = None
        self._decode_mode = compat.decode_mode()
        self.instance = ""
        self.hello_depths: tuple[int, ...] = ()
        self.seq = 0
        self.prev_decode_ns: int | None = None
        self.prefill_tokens = 0
        self.skipped_records = 0
        # Benchmark only ($SPECDEPTH_PROFILE_OUT): the hook's own time per step record.
        self.profiler = (
            HookProfiler.from_env(counters=lambda: vars_of(self.state.counters)) if ranks.is_entry else None
        )

    # ------------------------------------------------------------------ entry rank: controller

    def _ensure_client(self, server_args: Any) -> Any:
        if self.client is not None or self._client_failed:
            return self.client
        try:
            from sglang_hook.client import ClientThread, ControllerClient, InlineClient

            spec_on = self.state.valid is not None
            depths = tuple(sorted(self.state.valid)) if spec_on else (0,)  # type: ignore[arg-type]
            if spec_on and depths != self.config.depths:
                log_once(
                    "depths-mismatch",
                    "spec controller: SGLang built runtime states for depths %s, not --spec-depths %s; "
                    "announcing %s",
                    list(depths),
                    list(self.config.depths),
                    list(depths),
                )
            self.hello_depths = depths
            if not spec_on:
                self.sync.fallback_desc = "depth 0 (this server runs without speculation)"
            self.instance = instance_name(self.config, server_args, self.ranks)
            model = str(
                getattr(server_args, "served_model_name", None) or getattr(server_args, "model_path", "")
            )
            hello = Hello(
                instance=self.instance,
                depths=depths,
                engine=f"sglang {compat.sglang_version()}",
                model=model[:1024],
                tp=self.ranks.tp_size,
            )
            client = ControllerClient(self.config.endpoint, hello, stale_ms=self.config.stale_ms)
            thread = self.config.client_thread
            why = f"--spec-client-thread {'on' if thread else 'off'}"
            if thread is None:  # auto: inline (HookConfig.client_thread says why)
                thread, why = False, "auto"
            mode = "on" if thread else "off"
            if thread:
                tick = self.config.client_tick_ms
                if tick:
                    mode += f", tick {tick} ms"
                self.client = ClientThread(
                    client, build=self.build_step, tick_ms=tick, profile=self.profiler is not None
                )
            else:
                # Not longer than a quarter of stale_ms: the client's own safeguard (a hello
                # after stale_ms without decisions) must see the decisions that came back.
                stale_ns = int(self.config.stale_ms * 1e6)
                drain_ns = 0 if spec_on else min(NO_SPEC_DRAIN_NS, stale_ns // 4)
                self.client = InlineClient(
                    client, build=self.build_step, min_drain_ns=drain_ns, refresh_after_ns=POLL_AFTER_NS
                )
            logger.info(
                "spec controller: instance %s -> %s (depths %s, stale %.0f ms, client thread %s (%s)); "
                "decisions applied %s",
                self.instance,
                self.config.endpoint,
                list(depths),
                self.config.stale_ms,
                mode,
                why,
                "after each step record (one rank)" if self.direct else "through the TP broadcast",
            )
        except Exception:
            self._client_failed = True
            self.state.counters.hook_errors += 1
            log_once("client", "spec controller: cannot start the controller client; telemetry off", exc=True)
        return self.client

    def offer(self, receiver: Any) -> DepthSync | None:
        """Entry rank, top of each scheduler iteration: the marker to broadcast, or ``None``.

        ``receiver`` is SGLang's request receiver; its ``server_args`` are read only to start the
        client.

        The depth to apply is the client's ``fresh_depth``: the newest decision unless a step
        has gone unanswered for ``stale_ms`` (``ControllerClient.fresh_depth``; an idle server
        keeps its last decision instead of flapping to the fallback). The client thread judges
        that on its own thread, so here it is one attribute read; the inline client judges it
        in ``refresh()``. ``sync.last_desired`` holds the depth this found (``None``: fall back).

        One frame on purpose: this runs on every scheduler iteration, after a GPU step has
        evicted the caches, where each call and attribute read costs a microsecond or more.
        """
        client = self.client
        if client is None:
            client = self._ensure_client(receiver.server_args)
        depth = None
        if client is not None:
            if client.refresh_drains:
                client.refresh()  # the inline client drains and judges; the thread keeps itself current
            depth = client.fresh_depth
        sync = self.sync
        if sync.repeat_is_noop and depth == sync.last_desired:  # most iterations: nothing changed
            return None
        return sync.offer(depth)

    # ------------------------------------------------------------------ entry rank: telemetry

    def after_batch_result(self, scheduler: Any, batch: Any, result: Any) -> None:
        """After SGLang processed a batch result: one step record per decode (entry rank only).

        The scheduler thread's share of a record, in one frame: after a GPU step every call,
        attribute and object runs from cold caches, so this reads only what must be read at
        the step and allocates only the tuple it hands over (build_step() makes the ``Step``
        from it; with the client thread, on that thread). What it reads from SGLang:

        - ``result.speculative_num_draft_tokens``: the verify width the step ran with; the
          depth is ``width - 1`` (not the worker's, which under overlap scheduling may already
          point at the next step); ``None`` or 1 = no speculation, depth 0;
        - ``result.num_correct_drafts_per_req_cpu``: accepted drafts per request, unclamped and
          not copied: SGLang builds a new list per result and never writes into it;
        - ``batch.seq_lens_sum`` when SGLang summed it, else ``batch.seq_lens_cpu``, which SGLang
          replaces rather than writes into (``seq_lens_cpu + 1``, ``clone()``), so the sum is
          taken later; without either (speculative decoding with an attention backend that
          keeps no CPU mirror: triton, FA3), ``batch.reqs``, whose ``seqlen`` build_step sums:
          SGLang rebinds a batch's request list on filter and merge and never changes it in
          place, so the list is this step's requests;
        - ``len(batch.reqs)``, ``len(scheduler.waiting_queue)``, and ``batch.launch_ts`` for the
          first decode after idle.
        """
        prof = self.profiler
        t0 = None if prof is None else prof.start()
        if batch.forward_mode == self._decode_mode:  # ForwardMode.is_decode() without its call
            now_ns = time.monotonic_ns()
            bs = len(batch.reqs)
            prev = self.prev_decode_ns
            self.prev_decode_ns = now_ns
            if prev is None:
                # First decode after start or idle: time it from its own launch, not the idle gap.
                launch = getattr(batch, "launch_ts", None)
                prev = int(launch * 1e9) if isinstance(launch, float) else now_ns
            step_us = (now_ns - prev) // 1000
            if step_us < 0 or step_us > MAX_STEP_US:
                step_us = 0 if step_us < 0 else MAX_STEP_US
            client = self.client
            if client is None:
                client = self._ensure_client(scheduler.server_args)
            width = result.speculative_num_draft_tokens
            if type(width) is int and width > 1:
                depth = width - 1
                per_req = result.num_correct_drafts_per_req_cpu
                if per_req is not None and len(per_req) != bs:
                    per_req = None
            else:
                depth, per_req = 0, ()
            if bs == 0 or client is None:
                pass
            elif per_req is None or depth not in self.hello_depths:
                self._skip(depth, per_req)
            else:
                ctx = batch.seq_lens_sum
                if type(ctx) is not int:
                    ctx = batch.seq_lens_cpu
                    if ctx is None:  # e.g. EAGLE v2 with triton or FA3: no CPU mirror at all
                        ctx = batch.reqs  # summed by build_step (a loop over bs cold requests)
                self.seq = seq = self.seq + 1
                captured = (
                    seq, depth, bs, len(scheduler.waiting_queue), per_req, step_us, ctx,
                    self.prefill_tokens, now_ns,
                )  # fmt: skip
                self.prefill_tokens = 0
                self._scheduler = scheduler  # build_step reads the KV pool through it
                if prof is None:
                    client.submit(captured)
                else:
                    t1 = time.perf_counter_ns()
                    client.submit(captured)
                    prof.pending_site_ns["send"] += time.perf_counter_ns() - t1
            if self.direct and client is not None:
                # The decision the client holds now (the inline client drained in submit()),
                # applied for the next decode launch, as the broadcast would have at the top of
                # the next iteration. Most steps: unchanged, nothing to do.
                depth = client.fresh_depth
                sync = self.sync
                if not (sync.repeat_is_noop and depth == sync.last_desired):
                    sync.apply_here(depth)
            if prof is not None and t0 is not None:
                prof.end_decode(t0, step_us, bs, self.client, close=self.direct)
        elif batch.forward_mode.is_extend():
            n = getattr(batch, "extend_num_tokens", None)
            if type(n) is int and n > 0:
                self.prefill_tokens += n
            if prof is not None and t0 is not None:
                prof.end_prefill(t0, close=self.direct)

    def _skip(self, depth: int, per_req: Any) -> None:
        self.skipped_records += 1
        if per_req is None:
            log_once("no-accept", "spec controller: SGLang reported no verify results; step not sent")
        else:  # the controller would refuse it (bad_depth); a gap in the trace is more honest
            log_once(
                f"depth-{depth}", "spec controller: step ran at depth %d, not announced; not sent", depth
            )

    def build_step(self, captured: tuple[Any, ...]) -> Step:
        """The step record from what :meth:`after_batch_result` captured (the client calls this).

        With the client thread this runs on that thread, so ``kv_usage`` (and, where SGLang kept
        no sequence lengths on the CPU, each request's length) is read when the record is
        packed, a fraction of a millisecond after the step; everything else is the step's own.
        """
        seq, depth, bs, waiting, per_req, step_us, ctx, prefill, ts_ns = captured
        return Step(
            instance=self.instance,
            seq=seq,
            depth=depth,
            bs=bs,
            waiting=waiting,
            accept=compat.clamp_accept(per_req, depth) if depth else [],
            step_us=step_us,
            ctx_tokens=compat.ctx_total(ctx),
            kv_usage=compat.kv_usage(self._scheduler),
            prefill_tokens=prefill,
            ts_ns=ts_ns,
        )

    def on_idle(self, scheduler: Any) -> None:
        """The scheduler has nothing to run: forget the previous decode; connect if not yet; after
        work, log the off switch's counters if they changed (:func:`off_switch.log_counters_if_changed`).

        Connecting here, while the server waits for its first request, gives ZeroMQ time to
        complete the connection before the first record (a record sent before that is dropped).
        Through the broadcast, the first iteration top did it; a replica of one rank has none.
        """
        busy, self.prev_decode_ns = self.prev_decode_ns is not None, None
        if self.profiler is not None:
            self.profiler.clear_pending()
        if self.is_entry and busy:
            try:
                off_switch.log_counters_if_changed()
            except Exception:  # a log line must never reach the scheduler
                log_once("counters-log", "spec controller: logging the off switch's counters failed")
        if self.is_entry and self.client is None:
            self._ensure_client(scheduler.server_args)


def vars_of(obj: Any) -> dict[str, Any]:
    """Slots dataclass → dict."""
    return {name: getattr(obj, name) for name in obj.__slots__}


def instance_name(config: HookConfig, server_args: Any, ranks: compat.Ranks) -> str:
    """``--spec-instance`` if given, else ``<host>-<port>``; ``-dp<k>`` per data-parallel replica."""
    base = config.instance or f"{socket.gethostname()}-{getattr(server_args, 'port', 0)}"
    if ranks.dp_rank is not None and int(getattr(server_args, "dp_size", 1) or 1) > 1:
        base = f"{base}-dp{ranks.dp_rank}"
    return base[:128]


# --------------------------------------------------------------------------- process state

_runtime: HookRuntime | None = None
_runtime_failed = False


def runtime() -> HookRuntime | None:
    """This process's :class:`HookRuntime`, built on first use inside a scheduler process."""
    global _runtime, _runtime_failed
    if _runtime is not None or _runtime_failed:
        return _runtime
    try:
        config = HookConfig.from_env()
        if config is None:
            _runtime_failed = True
            return None
        _runtime = HookRuntime(config, compat.ranks())
    except Exception:
        _runtime_failed = True
        log_once("runtime", "spec controller: hook disabled (bad configuration or SGLang mismatch)", exc=True)
    return _runtime


def reset_runtime(rt: HookRuntime | None = None) -> None:
    """Tests: install ``rt`` (or nothing) as this process's runtime."""
    global _runtime, _runtime_failed
    _runtime, _runtime_failed = rt, False


# --------------------------------------------------------------------------- hooks


def controller_init_hook(original: Any, controller: Any, *args: Any, **kwargs: Any) -> None:
    """AROUND ``AdaptiveController.__init__``: build SGLang's controller, then wrap its params."""
    original(controller, *args, **kwargs)
    try:
        rt = runtime()
        if rt is not None:
            wrap_controller_params(
                controller, rt.state, rt.config.fallback_depth, profiler=rt.profiler, resume=off_switch.RESUME
            )
    except Exception:
        log_once("wrap", "spec controller: cannot wrap SGLang's adaptive params; SGLang decides", exc=True)


def broadcast_hook(original: Any, receiver: Any, recv_reqs: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND ``_broadcast_reqs_across_ranks``: the decision rides SGLang's request broadcast."""
    rt = _runtime if _runtime is not None else runtime()
    if rt is None:
        return original(receiver, recv_reqs, *args, **kwargs)
    if recv_reqs is not None and rt.is_entry:
        prof, t0 = rt.profiler, None
        if prof is not None:
            prof.close_iteration()
            t0 = prof.start()
        try:
            marker = rt.offer(receiver)
            if marker is not None:
                recv_reqs = [*recv_reqs, marker]  # a copy: never mutate SGLang's list
        except Exception:
            rt.state.counters.hook_errors += 1
            log_once("offer", "spec controller: polling failed; no decision this step", exc=True)
        if prof is not None and t0 is not None:
            prof.stop(t0, "poll")
            prof.pending_polls += 1
    out = original(receiver, recv_reqs, *args, **kwargs)
    if not out:  # most iterations: nothing arrived, no marker either
        return out
    try:
        return rt.sync.take(out)
    except Exception:
        rt.state.counters.hook_errors += 1
        log_once("take", "spec controller: cannot apply the broadcast decision", exc=True)
        return [r for r in out if type(r) is not DepthSync] if out else out


def batch_result_hook(
    original: Any, scheduler: Any, batch: Any, result: Any, *args: Any, **kwargs: Any
) -> Any:
    """AROUND ``Scheduler.process_batch_result``: SGLang first, then the step record."""
    out = original(scheduler, batch, result, *args, **kwargs)
    rt = _runtime if _runtime is not None else runtime()
    if rt is not None and rt.is_entry:
        try:
            rt.after_batch_result(scheduler, batch, result)
        except Exception:
            rt.state.counters.hook_errors += 1
            log_once("record", "spec controller: cannot build the step record; skipped", exc=True)
    return out


def on_idle_hook(original: Any, scheduler: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND ``Scheduler.on_idle``: forget the previous decode time; connect the entry rank early."""
    rt = runtime()
    if rt is not None:
        try:
            rt.on_idle(scheduler)
        except Exception:
            rt.state.counters.hook_errors += 1
            log_once("idle", "spec controller: idle housekeeping failed", exc=True)
    return original(scheduler, *args, **kwargs)


HOOKS = (
    (compat.ADAPTIVE_CONTROLLER_INIT, controller_init_hook),
    (compat.BROADCAST_REQS, broadcast_hook),
    (compat.PROCESS_BATCH_RESULT, batch_result_hook),
    (compat.ON_IDLE, on_idle_hook),
)


def register() -> None:
    """Entry point: register the hooks when the launcher (or the user) configured a controller.

    Without ``SPECDEPTH_CONTROLLER`` in the environment nothing is registered, so installing the
    package changes nothing. Never raises: SGLang logs but tolerates plugin errors, and a broken
    hook must not stop a server.
    """
    try:
        config = HookConfig.from_env()
    except ConfigError as exc:
        logger.error("spec controller: hook not loaded: %s", exc)
        return
    if config is None:
        return
    try:
        from sglang.srt.plugins.hook_registry import HookRegistry, HookType

        for target, fn in HOOKS:
            if config.single_rank and fn is broadcast_hook:
                continue  # decisions are applied after the step record (HookRuntime.direct)
            HookRegistry.register(target, fn, HookType.AROUND)
    except Exception:
        logger.exception("spec controller: hook not loaded")
        return
    try:
        off_switch.install(
            lambda target, fn: HookRegistry.register(target, fn, HookType.AROUND), off_switch.OffConfig.from_env()
        )
    except Exception:
        logger.exception("spec controller: off switch not loaded; depth 0 stays SGLang's verify")
