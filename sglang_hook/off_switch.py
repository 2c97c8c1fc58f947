"""The off switch: at depth 0 an EAGLE-3 server runs the target's plain decode, not a verify.

SGLang (0.5.17, 0.5.23) implements ``speculative_num_steps == 0`` as speculation with nothing
drafted: a one-node tree goes through the target's TARGET_VERIFY path. With the triton backend
that is the extend-attention kernel (128-row tiles per request and head, one real query row)
and a CUDA graph captured for verify; on the H200 it delivered 0.34-0.36x a plain server's
throughput at 64 concurrent requests. No choice of depth could bring the plain server back.

This module makes depth 0 a plain decode without forking SGLang, through two AROUND hooks:

- ``EAGLEWorkerV2.build_adaptive_runtime_state`` (startup, once per depth): for the depth-0
  runtime state, the target's graph runner is a :class:`PlainDecodeGraphRunner` — SGLang's own
  ``DecodeCudaGraphRunner`` captured in DECODE mode (the split-KV decode kernels, SGLang's
  decode CUDA graphs) for every batch size the verify graphs had. It still returns the
  target's auxiliary hidden states, which the drafter's extend reads.
- ``eagle_prepare_for_verify`` (every depth-0 step): SGLang assigns the step's KV slot exactly
  as for a verify (its own code runs first), then the forward batch is rebuilt by SGLang's
  ``ForwardBatch.init_new`` in DECODE mode — sequence lengths counting the new token, no
  ``spec_info`` — and loaded into the plain graph. Everything after the forward is SGLang's
  verify bookkeeping, unchanged: a one-token "tree" accepts its root and samples the bonus
  token from the same logits a plain decode samples from, so greedy outputs are identical.

A third hook fixes a 0.5.17 bug that made the drafter's extend run eagerly at every adaptive
depth but the starting one (:func:`draft_extend_width_hook`).

What runs after the target forward at depth 0 is chosen by ``SPECDEPTH_OFF_DRAFT``:

- ``keep``: the drafter's one-token extend runs every step (SGLang's own, with its
  own CUDA graph), so its KV cache and next proposal stay current and turning drafting back on
  loses nothing (the failure to rule out is a drafter left stale while off: TensorRT-LLM
  #16888). Its cost is the drafter's whole layer and LM head per step: about 6% of an 8B
  target's weight reads, 3-13% of a plain server's throughput measured on the H200.
- ``kv`` (default): only the drafter's keys and values for the new position are computed and stored
  (:func:`draft_extend_hook`, AROUND ``EagleDraftWorker._draft_extend_for_decode``): embedding,
  fc, the two norms, the qkv projection and RoPE, from the verify's own outputs; no attention,
  MLP or LM head, and none of SGLang's extend preparation or proposal kernels. An EAGLE-3
  layer's keys and values at a position depend only on that position's token and the target's
  hidden states, never on the drafter's earlier outputs, so the drafter's cache stays exact.
  What is not current is its next proposal: SGLang's skip stub (zeros) is left. So drafting
  resumes warm (:class:`WarmResume`; ``SPECDEPTH_OFF_RESUME=cold`` turns it off): when a
  depth above 0 follows depth 0, one more depth-0 step runs first, with SGLang's whole extend,
  whose proposal the first drafted step drafts from. Cold, that step drafted from the zeros and
  accepted nothing (0 of 628 first draft tokens on the H100 testbed), and a policy that learns
  acceptance from the records read each resume as a failed probe. Single-layer EAGLE-3 drafters on a
  plain MHA KV pool, greedy drafting only; anything else runs ``keep``. The update is owed and
  16 steps are stored in one pass (:class:`PendingKV`), always before a draft or a prefill
  touches the drafter's cache. Measured on an H100 (random target, a drafter that never
  accepts): 0.969 / 0.979 / 0.976 / 0.936x a plain server at 1 / 4 / 16 / 64 requests in one
  call and 0.951 / 0.928 / 0.972 / 1.047x in another (spread per repetition 3-15%); storing each
  step at once ran 2-4% slower side by side; keep 0.87-0.94x.
  A depth-0 prefill's drafter extend also stores keys and values only
  (:func:`draft_prefill_hook`; ``SPECDEPTH_OFF_PREFILL=sglang`` keeps SGLang's whole extend
  there). Its lengths reach the GPU without a wait (:func:`to_device_async`). Measured on an
  H100 (prefill graphs on, drawn output lengths, 3 interleaved repetitions, SGLang's prefill
  extend beside it): 0.977 / 0.979 / 0.978 / 0.964 / 0.973x a plain server at 1 / 4 / 16 / 64 /
  128 requests against 0.977 / 0.973 / 0.966 / 0.950 / 0.967x, per repetition 0.990-1.039x
  of it; its first 10 prefills stored exactly SGLang's keys and values.
- ``skip``: SGLang's ``SGLANG_SPEC_SKIP_ZERO_STEP_DRAFT_EXTEND``: nothing runs, but the
  drafter's KV misses every position decoded while off, for the rest of those requests.

Invariants:
- Only depth 0 changes: a state or a step with ``draft_token_num != 1`` goes to SGLang as is.
- ``kv`` writes exactly the drafter KV entries SGLang's extend would write (same slots, same
  modules, same order of operations) and leaves the zeroed proposal of SGLang's own skip stub;
  every other field of the step is SGLang's.
- The DECODE forward runs only through a graph captured in DECODE mode (or eagerly); a
  TARGET_VERIFY graph is never replayed with a DECODE batch. If the plain graph cannot be
  built, depth 0 keeps SGLang's verify path (logged once).
- Nothing raises into SGLang: any failure while preparing the plain step falls back to SGLang's
  own verify of that step, run eagerly, and is counted in :data:`COUNTERS`.

Imports nothing from SGLang at module import (the hook's lean-import rule); the SGLang classes
are subclassed on first use.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

from controller.protocol import WarmResume

logger = logging.getLogger("sglang_hook")

ENV_OFF_PATH = "SPECDEPTH_OFF_PATH"  # "plain" (default) or "sglang": SGLang's own depth 0
ENV_OFF_DRAFT = "SPECDEPTH_OFF_DRAFT"  # "kv" (default), "keep" or "skip"
OFF_DRAFTS = ("keep", "kv", "skip")
SGLANG_SKIP_ENV = "SGLANG_SPEC_SKIP_ZERO_STEP_DRAFT_EXTEND"
# A diagnostic for the GPU benchmarks: under ``kv``, the first N depth-0 steps of each scheduler
# also run SGLang's whole extend over the slots just written and log how far apart they are.
ENV_OFF_DRAFT_CHECK = "SPECDEPTH_OFF_DRAFT_CHECK"
# Under ``kv``, how many depth-0 steps' drafter updates may be owed and stored in one pass (1:
# each step stores its own), and how many rows (requests x steps) the owed inputs may hold.
ENV_OFF_DRAFT_DEFER = "SPECDEPTH_OFF_DRAFT_DEFER"
DEFER_STEPS = 16
DEFER_ROWS = 1024
# Under ``kv``, a depth-0 prefill's drafter extend stores keys and values only too unless this
# is "sglang" (SGLang's whole extend, for comparison); "kv" is the default.
ENV_OFF_PREFILL = "SPECDEPTH_OFF_PREFILL"
# Under ``kv``, "warm" (default): drafting resumes after one more depth-0 step that runs
# SGLang's whole extend (:class:`WarmResume`); "cold": it drafts at once from the zeroed stub.
ENV_OFF_RESUME = "SPECDEPTH_OFF_RESUME"

WORKER = "sglang.srt.speculative.eagle_worker_v2"
BUILD_STATE = WORKER + ".EAGLEWorkerV2.build_adaptive_runtime_state"
# run_eagle_verify calls the name bound in eagle_worker_common, so that is the one to wrap.
PREPARE_VERIFY = "sglang.srt.speculative.eagle_worker_common.eagle_prepare_for_verify"
PLAIN_MARK = "specdepth_plain_decode"
# On a draft worker, once checked: "" when the KV-only update runs there, else why it cannot.
KV_VERDICT_MARK = "specdepth_kv_verdict"
# The drafter's extend after each verify; at depth 0 with ``kv`` the KV-only update replaces it.
DRAFT_EXTEND = WORKER + ".EagleDraftWorker._draft_extend_for_decode"
# The draft worker's other two uses of the drafter's cache: owed depth-0 updates go first.
DRAFT = WORKER + ".EagleDraftWorker.draft"
DRAFT_PREFILL = WORKER + ".EagleDraftWorker._draft_extend_for_prefill"
# The width the drafter's extend graphs are captured at, as the graph runner looks it up.
DRAFT_EXTEND_WIDTH = "sglang.srt.speculative.eagle_draft_extend_cuda_graph_runner.resolve_num_tokens_per_req"


@dataclass(slots=True)
class OffCounters:
    """Per-process counters (read by tests and logs)."""

    plain_states: int = 0  # depth-0 runtime states built with a plain decode graph
    plain_steps: int = 0  # depth-0 steps run as a plain decode
    graph_steps: int = 0  # ... of which replayed a CUDA graph
    verify_fallbacks: int = 0  # depth-0 steps that went through SGLang's verify instead
    kv_steps: int = 0  # depth-0 steps whose drafter extend only stored keys and values
    kv_fallbacks: int = 0  # ... that ran SGLang's whole extend instead (unsupported or failed)
    errors: int = 0  # exceptions caught here
    # ENV_OFF_DRAFT_CHECK: steps compared, those stored bit for bit alike, the largest differences
    kv_checked: int = 0
    kv_identical: int = 0
    kv_max_dk: float = 0.0
    kv_max_dv: float = 0.0
    kv_flushes: int = 0  # passes that stored owed depth-0 steps (ENV_OFF_DRAFT_DEFER)
    kv_deferred_steps: int = 0  # ... and the steps they stored
    # ENV_OFF_DRAFT_CHECK, after the steps above: passes whose rows were also computed one step at
    # a time, those alike bit for bit, the largest difference (batching may change GEMM rounding)
    kv_batch_checked: int = 0
    kv_batch_identical: int = 0
    kv_batch_max_d: float = 0.0
    kv_prefills: int = 0  # ENV_OFF_PREFILL: depth-0 prefills whose drafter extend stored keys and values only
    kv_prefill_checked: int = 0  # ... compared with SGLang's extend of the same prefill
    kv_prefill_identical: int = 0
    kv_prefill_max_d: float = 0.0
    warm_extends: int = 0  # depth-0 steps WarmResume inserted, whose drafter extend was SGLang's whole one


COUNTERS = OffCounters()
COUNTERS_LOG_S = 10.0  # at most one counters line per this many seconds (log_counters_if_changed)
_COUNTERS_LOG = SimpleNamespace(last=None, at=-COUNTERS_LOG_S)


def counters_summary() -> str:
    """One line of :data:`COUNTERS`: how depth 0 ran in this process so far."""
    c = COUNTERS
    return (
        f"{c.plain_steps} depth-0 steps as plain decodes ({c.graph_steps} through a CUDA graph), "
        f"{c.verify_fallbacks} as SGLang's verify; {c.kv_steps} KV-only drafter updates "
        f"({c.kv_fallbacks} whole extends instead), {c.kv_prefills} KV-only prefills, "
        f"{c.warm_extends} warm-resume extends; {c.errors} errors"
    )


def log_counters_if_changed(now: float | None = None) -> bool:
    """Log :func:`counters_summary` at INFO if the counters changed since the last line (and are
    not all 0: a server that never ran depth 0) and :data:`COUNTERS_LOG_S` has passed; returns
    whether it logged.

    The hook calls this when its scheduler goes idle after work, so a server's log says, between
    a benchmark's points, whether its depth-0 steps ran as plain decodes through a graph or fell
    back (nothing else reports these counters outside the process).
    """
    now = time.monotonic() if now is None else now
    state = tuple(getattr(COUNTERS, f) for f in OffCounters.__slots__)
    if not any(state) or state == _COUNTERS_LOG.last or now - _COUNTERS_LOG.at < COUNTERS_LOG_S:
        return False
    _COUNTERS_LOG.last, _COUNTERS_LOG.at = state, now
    logger.info("spec controller: off switch so far: %s", counters_summary())
    return True


RESUME = WarmResume()  # the warm resume's state in this process (install() enables it under kv)
_logged: set[str] = set()
_plain_cls: dict[int, type] = {}


def _log_once(key: str, level: int, msg: str, *args: Any, exc: bool = False) -> None:
    if key not in _logged:
        _logged.add(key)
        logger.log(level, msg, *args, exc_info=exc)


@dataclass(frozen=True, slots=True)
class OffConfig:
    """How depth 0 runs.

    Attributes:
        plain: depth 0 as a plain decode (this module); ``False`` = SGLang's own depth 0.
        draft: what the drafter does at depth 0, one of :data:`OFF_DRAFTS` (module docstring).
    """

    plain: bool = True
    draft: str = "kv"

    def __post_init__(self) -> None:
        if self.draft not in OFF_DRAFTS:
            raise ValueError(f"{ENV_OFF_DRAFT}={self.draft!r}: expected {', '.join(OFF_DRAFTS[:-1])} or {OFF_DRAFTS[-1]}")

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> OffConfig:
        """Read :data:`ENV_OFF_PATH` and :data:`ENV_OFF_DRAFT`; unknown values raise ``ValueError``."""
        env = dict(os.environ) if env is None else env
        path = env.get(ENV_OFF_PATH, "plain")
        if path not in ("plain", "sglang"):
            raise ValueError(f"{ENV_OFF_PATH}={path!r}: expected plain or sglang")
        return cls(plain=path == "plain", draft=env.get(ENV_OFF_DRAFT, "kv"))

    def to_env(self) -> dict[str, str]:
        """The variables :meth:`from_env` reads back (the launcher hands them to the schedulers)."""
        return {ENV_OFF_PATH: "plain" if self.plain else "sglang", ENV_OFF_DRAFT: self.draft}


def plain_runner_class(base: type) -> type:
    """SGLang's decode graph runner ``base``, captured in DECODE mode inside a speculative server.

    ``DecodeCudaGraphRunner`` picks TARGET_VERIFY whenever its model runner speculates, and
    captures the server's hidden-state mode (none, by default). For the plain path it must
    capture DECODE with no ``spec_info`` and keep the full hidden states (the EAGLE-3 target's
    auxiliary layers, which the drafter's extend reads). Both are decided inside SGLang's
    ``__init__``, so the model runner is shown as non-speculative for the construction alone
    and the hidden-state mode is pinned.
    """
    cached = _plain_cls.get(id(base))
    if cached is not None:
        return cached
    from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    class PlainDecodeGraphRunner(base):  # type: ignore[misc, valid-type]
        specdepth_plain_decode = True

        def __init__(self, model_runner: Any, *args: Any, **kwargs: Any) -> None:
            kwargs["speculative_num_steps"] = 0
            kwargs["speculative_num_draft_tokens"] = 1
            saved = model_runner.spec_algorithm
            model_runner.spec_algorithm = SpeculativeAlgorithm.NONE
            try:
                super().__init__(model_runner, *args, **kwargs)
            finally:
                model_runner.spec_algorithm = saved

        def can_run_graph(self, forward_batch: Any) -> bool:
            # SGLang's model runner asks again before replaying. A verify batch (the fallback
            # after a failed plain step) passes the width check at one token per request, and
            # replaying these DECODE graphs with its lengths would attend without the new token.
            if not forward_batch.forward_mode.is_decode():
                return False
            return bool(super().can_run_graph(forward_batch))

        @property  # type: ignore[override]
        def return_hidden_states_mode(self) -> Any:
            return CaptureHiddenMode.FULL

        @return_hidden_states_mode.setter
        def return_hidden_states_mode(self, value: Any) -> None:
            pass  # SGLang's BaseRunner assigns the server's mode; the drafter needs FULL

    _plain_cls[id(base)] = PlainDecodeGraphRunner
    return PlainDecodeGraphRunner


def is_plain(graph_runner: Any) -> bool:
    """Whether ``graph_runner`` replays DECODE-mode graphs built by :func:`plain_runner_class`."""
    return bool(getattr(graph_runner, PLAIN_MARK, False))


def _speculates_eagle(worker: Any) -> bool:
    algo: Any = getattr(worker, "speculative_algorithm", None)
    try:
        return bool(algo.is_eagle()) and not bool(algo.is_standalone())
    except Exception:
        return False


def build_state_hook(original: Any, worker: Any, speculative_num_steps: int, *args: Any, **kwargs: Any) -> Any:
    """AROUND ``EAGLEWorkerV2.build_adaptive_runtime_state``: depth 0 gets a plain decode graph."""
    if speculative_num_steps != 0 or not _speculates_eagle(worker):
        return original(worker, speculative_num_steps, *args, **kwargs)
    import importlib

    module = importlib.import_module(WORKER)
    name = "DecodeCudaGraphRunner"  # the module global build_adaptive_runtime_state constructs
    base = getattr(module, name, None)
    if base is None:
        _log_once("no-runner", logging.WARNING, "spec controller: no DecodeCudaGraphRunner; depth 0 stays a verify")
        return original(worker, speculative_num_steps, *args, **kwargs)
    try:
        setattr(module, name, plain_runner_class(base))
        state = original(worker, speculative_num_steps, *args, **kwargs)
    except Exception:
        COUNTERS.errors += 1
        _log_once("build", logging.ERROR, "spec controller: plain decode graphs failed; depth 0 stays a verify", exc=True)
        setattr(module, name, base)
        return original(worker, speculative_num_steps, *args, **kwargs)
    finally:
        setattr(module, name, base)
    COUNTERS.plain_states += 1
    graph = getattr(state, "target_graph_runner", None)
    logger.info(
        "spec controller: depth 0 runs as a plain decode (%s)",
        f"CUDA graphs for batch sizes {getattr(graph, 'capture_bs', '?')}" if graph is not None else "eager",
    )
    return state


def decode_forward_batch(batch: Any, model_runner: Any) -> Any:
    """SGLang's DECODE ``ForwardBatch`` for a depth-0 step whose KV slot the verify prepare assigned.

    Spec v2 keeps ``batch.seq_lens`` as the length before this step's token; a decode counts it.
    The batch is changed only for the ``init_new`` call and restored after it.
    """
    from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardBatch, ForwardMode

    saved = (batch.forward_mode, batch.seq_lens, batch.seq_lens_cpu, batch.seq_lens_sum, batch.orig_seq_lens, batch.spec_info)
    bs = len(batch.seq_lens)
    try:
        batch.forward_mode = ForwardMode.DECODE
        batch.seq_lens = saved[1] + 1
        batch.seq_lens_cpu = None if saved[2] is None else saved[2] + 1
        batch.seq_lens_sum = None if saved[3] is None else saved[3] + bs
        batch.orig_seq_lens = None if saved[4] is None else saved[4] + 1
        batch.spec_info = None
        return ForwardBatch.init_new(
            batch,
            model_runner,
            capture_hidden_mode=CaptureHiddenMode.FULL,
            return_hidden_states_before_norm=False,
        )
    finally:
        (
            batch.forward_mode,
            batch.seq_lens,
            batch.seq_lens_cpu,
            batch.seq_lens_sum,
            batch.orig_seq_lens,
            batch.spec_info,
        ) = saved


def prepare_verify_hook(
    original: Any, verify_input: Any, req_to_token_pool: Any, batch: Any, target_worker: Any, *args: Any, **kwargs: Any
) -> Any:
    """AROUND ``eagle_prepare_for_verify``: a depth-0 step becomes a DECODE forward batch."""
    if getattr(verify_input, "draft_token_num", None) != 1 or batch.forward_mode.is_idle():
        return original(verify_input, req_to_token_pool, batch, target_worker, *args, **kwargs)
    runner = target_worker.model_runner
    graph = runner.decode_cuda_graph_runner
    if graph is not None and not is_plain(graph):
        COUNTERS.verify_fallbacks += 1  # depth 0 without a plain graph: SGLang's verify
        return original(verify_input, req_to_token_pool, batch, target_worker, *args, **kwargs)
    # SGLang's own prepare assigns the KV slot and input ids; it must not load its TARGET_VERIFY
    # batch into the plain graph, so it sees no graph runner.
    runner.decode_cuda_graph_runner = None
    try:
        verify_fb, _ = original(verify_input, req_to_token_pool, batch, target_worker, *args, **kwargs)
    finally:
        runner.decode_cuda_graph_runner = graph
    try:
        fb = decode_forward_batch(batch, runner)
        can_graph = bool(graph is not None and graph.can_run_graph(fb))
        if can_graph:
            graph.load_batch(fb)
            fb.mark_forward_metadata_ready()
    except Exception:
        COUNTERS.errors += 1
        COUNTERS.verify_fallbacks += 1
        _log_once("prepare", logging.ERROR, "spec controller: plain decode step failed; verifying instead", exc=True)
        return verify_fb, False  # SGLang's verify batch, run eagerly: correct, slower
    COUNTERS.plain_steps += 1
    COUNTERS.graph_steps += can_graph
    if COUNTERS.plain_steps == 1:
        logger.info("spec controller: first depth-0 step ran as a plain decode (bs %d, CUDA graph %s)", len(batch.seq_lens), can_graph)
    return fb, can_graph


def draft_extend_width_hook(original: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND the draft-extend graph runner's ``resolve_num_tokens_per_req``: each depth's width.

    SGLang 0.5.17 sizes the drafter's extend graphs from the startup ``server_args``, so every
    adaptive depth but the starting one captures graphs of the wrong width, and its extend runs
    eagerly (about 80 launches and a host-side stall each step, seen on the H200 at depth 0).
    Its runtime context already carries the depth being captured (the state builder overrides
    it), which is what 0.5.23 reads; this answers from there too.
    """
    if kwargs.get("phase") == "draft_extend":
        try:
            from sglang.srt.runtime_context import get_spec

            return int(get_spec().speculative_num_draft_tokens)
        except Exception:
            COUNTERS.errors += 1
            _log_once("width", logging.WARNING, "spec controller: draft-extend width unknown; SGLang's own", exc=True)
    return original(*args, **kwargs)


def kv_only_unsupported(model: Any, pool: Any) -> str:
    """Why :func:`draft_kv_only` cannot stand in for this drafter's extend ("" = it can).

    The keys and values of a drafter layer depend on nothing but the step's inputs only for
    the first (input) layer of an EAGLE-3 head; deeper layers read the first one's attention
    output. The write goes through the pool's own ``set_kv_buffer``, which for pools that
    translate slots (SWA, hybrid, unified) needs the attention backend's per-step metadata.
    """
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if inner is None or layers is None or not hasattr(inner, "fc"):
        return f"not an EAGLE-3 drafter ({type(model).__name__})"
    if len(layers) != 1 or not getattr(layers[0], "is_input_layer", True):
        return f"{len(layers)} drafter layers (one supported)"
    if getattr(inner, "is_mrope_enabled", False):
        return "M-RoPE drafter"
    if type(pool).__name__ != "MHATokenToKVPool":
        return f"KV pool {type(pool).__name__} (MHATokenToKVPool supported)"
    return ""


def _cat(parts: list[Any]) -> Any:
    """``torch.cat(parts, dim=-1)`` through tensor methods: the same values, copied once."""
    width = sum(int(t.shape[-1]) for t in parts)
    out = parts[0].new_empty((*parts[0].shape[:-1], width))
    at = 0
    for t in parts:
        out[..., at : at + t.shape[-1]] = t
        at += t.shape[-1]
    return out


def draft_kv(model: Any, input_ids: Any, positions: Any, hidden: Any) -> tuple[Any, Any, Any]:
    """An EAGLE-3 drafter's keys and values for one extend, and nothing else: ``(attn, k, v)``.

    The steps of SGLang's ``llama_eagle3.LlamaModel.forward`` and of its input decoder layer up
    to the attention, through the drafter's own modules: the token embedding; the target's
    auxiliary hidden states through the optional norms and ``fc``; both normed and joined; the
    attention's qkv projection and RoPE (``forward_prepare_native``, which SGLang's own layer
    calls). Tensor methods only (:func:`_cat` is ``torch.cat``), so the tests can hand it any
    tensors.
    """
    inner = model.model
    layer = inner.layers[0]
    embeds = inner.embed_tokens(input_ids)
    if hidden.shape[-1] != embeds.shape[-1]:
        if getattr(inner, "input_norm", None) is not None:
            hidden = inner.input_norm(hidden)
        if getattr(inner, "fc_norm", None) is not None:
            chunks = hidden.chunk(inner.num_aux_hidden_states, dim=-1)
            hidden = _cat([norm(chunk) for norm, chunk in zip(inner.fc_norm, chunks)])
        hidden = inner.fc(hidden)
    joined = _cat([layer.input_layernorm(embeds), layer.hidden_norm(hidden)])
    attn = layer.self_attn
    _, k, v = attn.forward_prepare_native(positions, joined)
    radix = attn.attn
    return radix, k.view(-1, radix.tp_k_head_num, radix.qk_head_dim), v.view(-1, radix.tp_v_head_num, radix.v_head_dim)


def store_kv(pool: Any, radix: Any, loc: Any, k: Any, v: Any) -> None:
    """The write SGLang's attention backends make before attending."""
    if radix.k_scale is None:
        pool.set_kv_buffer(radix, loc, k, v)
    else:  # the backends hand scaled pools clones: the pool may scale in place
        pool.set_kv_buffer(radix, loc, k.clone(), v.clone(), radix.k_scale, radix.v_scale)


def draft_kv_only(model: Any, pool: Any, input_ids: Any, positions: Any, hidden: Any, out_cache_loc: Any) -> None:
    """Store an EAGLE-3 drafter's keys and values for one extend (:func:`draft_kv`, :func:`store_kv`)."""
    radix, k, v = draft_kv(model, input_ids, positions, hidden)
    store_kv(pool, radix, out_cache_loc, k, v)


class PendingKV:
    """Depth-0 steps whose drafter keys and values are owed, stored later in one pass.

    A step's update is two weight-bound GEMMs (the drafter's fc and qkv projection) and a dozen
    small kernels; owed for up to ``max_steps`` steps, the GEMMs read their weights once for all
    of them. Each step's inputs are copied here (the target's hidden states live in graph
    buffers the next step overwrites).

    Invariants (kept by the hooks, not by this class):
    - everything owed is stored before anything reads or writes the drafter's cache: a draft
      (depth > 0), a prefill's extend, SGLang's own extend;
    - the owed steps are written in step order, one write per step, so a slot freed and
      reallocated while owed ends with its latest owner's keys and values.
    """

    def __init__(self, max_steps: int, max_rows: int) -> None:
        self.max_steps, self.max_rows = max_steps, max_rows
        self.bufs: tuple[Any, Any, Any, Any] | None = None  # ids, positions, hidden, slots
        self.spans: list[tuple[int, int]] = []  # (first row, rows) of each owed step
        self.used = 0

    def fits(self, rows: int) -> bool:
        return self.used + rows <= self.max_rows

    def add(self, ids: Any, positions: Any, hidden: Any, loc: Any) -> None:
        n = int(ids.shape[0])
        if self.bufs is None or self.bufs[2].shape[-1] != hidden.shape[-1] or self.bufs[2].dtype != hidden.dtype:
            if self.used:  # the hook stores what is owed, then runs SGLang's extend
                raise ValueError("hidden states of another shape while updates are owed")
            rows = self.max_rows
            self.bufs = (
                positions.new_empty((rows,)).long(), positions.new_empty((rows,)).long(),
                hidden.new_empty((rows, hidden.shape[-1])), loc.new_empty((rows,)),
            )  # fmt: skip
        at = self.used
        for buf, src in zip(self.bufs, (ids, positions, hidden, loc)):
            buf[at : at + n].copy_(src)
        self.spans.append((at, n))
        self.used += n

    def full(self) -> bool:
        return len(self.spans) >= self.max_steps

    def take(self) -> tuple[Any, Any, Any, Any, list[tuple[int, int]]]:
        """The owed rows and their steps; nothing is owed after."""
        assert self.bufs is not None
        u, spans = self.used, self.spans
        self.spans, self.used = [], 0
        ids, positions, hidden, loc = (b[:u] for b in self.bufs)
        return ids, positions, hidden, loc, spans


PENDING_MARK = "specdepth_pending_kv"  # a draft worker's PendingKV


def flush_kv(worker: Any) -> None:
    """Store every depth-0 update ``worker`` owes (nothing when none is owed)."""
    pending: PendingKV | None = getattr(worker, PENDING_MARK, None)
    if pending is None or not pending.spans:
        return
    ids, positions, hidden, loc, spans = pending.take()
    runner = worker.draft_runner
    radix, k, v = draft_kv(runner.model, ids, positions, hidden)
    for start, n in spans:
        store_kv(runner.token_to_kv_pool, radix, loc[start : start + n], k[start : start + n], v[start : start + n])
    c = COUNTERS
    c.kv_flushes += 1
    c.kv_deferred_steps += len(spans)
    if c.kv_batch_checked < _CHECK.batches and len(spans) > 1:
        same, worst = True, 0.0
        for start, n in spans:
            _, k1, v1 = draft_kv(runner.model, ids[start : start + n], positions[start : start + n], hidden[start : start + n])
            for one, many in ((k1, k[start : start + n]), (v1, v[start : start + n])):
                same = same and bool(one.equal(many))
                worst = max(worst, float((one.float() - many.float()).abs().max()))
        c.kv_batch_checked += 1
        c.kv_batch_identical += int(same)
        c.kv_batch_max_d = max(c.kv_batch_max_d, worst)
        if c.kv_batch_checked in (1, _CHECK.batches):
            logger.info(
                "spec controller: kv batch check %d passes (%d steps in the last), %d identical to one step at a "
                "time, max |d| %.3g", c.kv_batch_checked, len(spans), c.kv_batch_identical, c.kv_batch_max_d,
            )  # fmt: skip


def kv_step_inputs(batch: Any, batch_result: Any) -> tuple[Any, Any, Any, Any]:
    """The drafter extend's inputs at depth 0, as SGLang's ``prepare_for_draft_extend`` makes them.

    One token per request: the token the verify just sampled, at the position the verify wrote
    (spec v2's ``batch.seq_lens`` is the length before this step), into the slot the verify
    assigned, with the target's auxiliary hidden states at that position. Returns
    ``(input_ids, positions, hidden, out_cache_loc)`` as the step holds them (SGLang casts ids and
    positions to int64 for the extend; so do the callers).
    """
    ids = batch_result.next_token_ids
    positions = batch.seq_lens
    hidden = batch_result.logits_output.hidden_states
    loc = batch.out_cache_loc
    bs = int(positions.shape[0])
    if not (int(ids.shape[0]) == int(hidden.shape[0]) == int(loc.shape[0]) == bs):
        raise ValueError(f"not one token per request: ids {tuple(ids.shape)}, hidden {tuple(hidden.shape)}, "
                         f"slots {tuple(loc.shape)}, batch {bs}")  # fmt: skip
    return ids, positions, hidden, loc


def stub_proposal(worker: Any, batch: Any, batch_result: Any) -> None:
    """Leave the zeroed next proposal of SGLang's own skip stub, by running that stub.

    The overlap scheduler's future map stashes these fields every step; at depth 0 nothing reads
    them, and the first step after drafting resumes drafts from them (rejected: one step lost).
    The stub is a method of the speculative worker that owns this draft worker; it reads only
    the depth-independent ``topk``, ``device`` and ``draft_worker`` from it.
    """
    from sglang.srt.speculative.eagle_worker_v2 import EAGLEWorkerV2

    owner = SimpleNamespace(topk=worker.topk, device=batch.seq_lens.device, draft_worker=worker)
    EAGLEWorkerV2._stub_skipped_draft_extend(owner, batch, batch_result)


def kv_verdict(worker: Any) -> str:
    """Whether :func:`draft_extend_hook` can store keys and values only on this draft worker
    ("" = it can), checked once per worker: the drafter and its pool do not change."""
    why = getattr(worker, KV_VERDICT_MARK, None)
    if why is not None:
        return str(why)
    try:
        runner = worker.draft_runner
        why = kv_only_unsupported(runner.model, runner.token_to_kv_pool)
        if not why and int(getattr(worker, "topk", 0) or 0) < 1:
            why = "no topk on the draft worker"
        if not why and getattr(worker, "seed_dsa_topk_from_draft_extend", False):
            why = "the extend seeds a DSA top-k"
        if not why:
            from sglang.srt.runtime_context import get_spec

            if getattr(get_spec(), "speculative_use_rejection_sampling", False):
                why = "rejection sampling reads the drafter's probabilities"
    except Exception as exc:  # SGLang's worker changed shape: never raise into the scheduler
        COUNTERS.errors += 1
        why = f"{type(exc).__name__}: {exc}"
    setattr(worker, KV_VERDICT_MARK, why)
    if why:
        COUNTERS.kv_fallbacks += 1
        _log_once("kv-unsupported", logging.WARNING, "spec controller: --spec-off-draft kv unsupported here (%s); keep", why)
    return why


def _against_sglang(worker: Any, loc: Any, run_sglang: Any) -> tuple[Any, bool, float, float, float]:
    """What the KV-only update stored at ``loc`` against what SGLang's extend stores there: the
    slots are read, cleared (an extend that wrote elsewhere cannot pass), SGLang's extend runs
    (``run_sglang()``) and the slots are read again. Returns SGLang's result, whether the two
    are identical, the largest key and value differences and the largest key stored.

    Synchronises with the GPU; a benchmark turns the checks on for its warm-up only."""
    runner = worker.draft_runner
    radix = runner.model.model.layers[0].self_attn.attn
    k_buf, v_buf = runner.token_to_kv_pool.get_kv_buffer(radix.layer_id)
    ours_k, ours_v = k_buf[loc].float(), v_buf[loc].float()
    k_buf[loc] = 0
    v_buf[loc] = 0
    out = run_sglang()
    theirs_k, theirs_v = k_buf[loc].float(), v_buf[loc].float()
    same = bool(ours_k.equal(theirs_k)) and bool(ours_v.equal(theirs_v))
    dk, dv = float((ours_k - theirs_k).abs().max()), float((ours_v - theirs_v).abs().max())
    return out, same, dk, dv, float(theirs_k.abs().max())


def _check_kv(original: Any, worker: Any, batch: Any, batch_result: Any, loc: Any) -> None:
    """``ENV_OFF_DRAFT_CHECK``: SGLang's whole extend of the same step, over the same slots
    (:func:`_against_sglang`): how far apart? SGLang's extend also leaves its own proposal, as
    ``keep`` would."""
    _, same, dk, dv, k_max = _against_sglang(worker, loc, lambda: original(worker, batch, batch_result))
    c = COUNTERS
    c.kv_checked += 1
    c.kv_identical += int(same)
    c.kv_max_dk = max(c.kv_max_dk, dk)
    c.kv_max_dv = max(c.kv_max_dv, dv)
    if c.kv_checked in (1, 10, 100) or c.kv_checked == _CHECK.steps:
        logger.info(
            "spec controller: kv check %d steps, %d identical, max |dk| %.3g (|k| up to %.3g), max |dv| %.3g",
            c.kv_checked, c.kv_identical, c.kv_max_dk, k_max, c.kv_max_dv,
        )  # fmt: skip


def to_device_async(values: list[int], like: Any) -> Any:
    """``values`` as a tensor of ``like``'s dtype on ``like``'s device, without the scheduler
    waiting for the GPU.

    ``like.new_tensor(values)`` copies from pageable memory, and such a copy synchronizes the
    stream: the scheduler waits for every kernel queued before it. On an H100 at 64 requests
    that wait was the scheduler's largest item under the KV-only prefill (36 µs per output
    token; depth 0 fell to 0.91x plain, against 0.97x with SGLang's prefill extend). From pinned memory
    the copy is queued on the stream like a kernel.
    """
    host = like.new_tensor(values, device="cpu")
    if host.device == like.device:  # a batch on the CPU (the tests)
        return host
    return host.pin_memory().to(like.device, non_blocking=True)


def prefill_inputs(batch: Any, hidden: Any, next_token_ids: Any) -> tuple[Any, Any, Any, Any]:
    """A prefill's drafter-extend inputs, as SGLang's ``_draft_extend_for_prefill`` makes them.

    Each request's prompt tokens shifted left by one, its last position taking SGLang's own
    tail token (the sampled token, or the next prompt token of a chunk that is not the last:
    ``_eagle_prefill_tail_tokens``); positions from each request's cached prefix on; the slots
    the target's prefill wrote; the target's aux hidden states of every token. Tensor methods
    only; the per-request lengths go to the device once, without a wait
    (:func:`to_device_async`). Returns ``(ids, positions, hidden, slots)``; raises
    ``ValueError`` for a batch of another shape.
    """
    from sglang.srt.speculative.eagle_utils import _eagle_prefill_tail_tokens

    lens_list, prefix_list = batch.extend_lens, batch.prefix_lens
    if not isinstance(lens_list, (list, tuple)) or not isinstance(prefix_list, (list, tuple)):
        raise ValueError("extend lengths not on the host")
    n = int(sum(lens_list))
    ids, loc = batch.input_ids, batch.out_cache_loc
    if not lens_list or min(lens_list) < 1 or not (int(ids.shape[0]) == int(hidden.shape[0]) == int(loc.shape[0]) == n):
        raise ValueError(f"extend of {n} tokens: ids {tuple(ids.shape)}, hidden {tuple(hidden.shape)}, slots {tuple(loc.shape)}")
    tail = _eagle_prefill_tail_tokens(batch, next_token_ids)
    both = to_device_async([*lens_list, *prefix_list], batch.seq_lens)
    lens, prefix = both[: len(lens_list)], both[len(lens_list) :]
    ends = lens.cumsum(0)
    shifted = ids.new_empty(ids.shape)
    shifted[:-1] = ids[1:]
    shifted[ends - 1] = tail.to(ids.dtype)
    positions = (lens.new_ones(n).cumsum(0) - 1) + (prefix - (ends - lens)).repeat_interleave(lens, output_size=n)
    return shifted, positions, hidden, loc


def prefill_stub(worker: Any, batch: Any, next_token_ids: Any) -> Any:
    """The ``EagleDraftInput`` a prefill's extend returns, with SGLang's zeroed proposal
    (:func:`stub_proposal`) in place of the drafter's: the next step drafts nothing at depth 0,
    and the first draft after a resume is rejected (one step lost)."""
    from sglang.srt.speculative.eagle_info import EagleDraftInput

    nxt = SimpleNamespace(topk_p=None, topk_index=None, hidden_states=None)
    stub_proposal(worker, batch, SimpleNamespace(next_draft_input=nxt))
    return EagleDraftInput(
        topk_p=nxt.topk_p, topk_index=nxt.topk_index, hidden_states=nxt.hidden_states,
        bonus_tokens=next_token_ids, num_tokens_per_req=1, num_tokens_for_logprob_per_req=1,
    )  # fmt: skip


PREFILL_OFF_MARK = "specdepth_kv_prefill_failed"  # set on a draft worker whose KV-only prefill failed


# ENV_OFF_DRAFT_CHECK and ENV_OFF_DRAFT_DEFER, read at install: steps compared with SGLang's
# extend (each stored at once), then passes of owed steps compared with one step at a time.
_CHECK = SimpleNamespace(steps=0, batches=0, prefills=0)
_DEFER = SimpleNamespace(steps=DEFER_STEPS, rows=DEFER_ROWS)
_PREFILL = SimpleNamespace(kv=True)  # ENV_OFF_PREFILL != "sglang", read at install


def _flush_or_drop(worker: Any) -> None:
    """:func:`flush_kv`, never raising: on failure the owed steps are dropped (the drafter's
    cache misses them, as under ``skip``) and ``kv`` is off for that worker."""
    try:
        flush_kv(worker)
    except Exception:
        COUNTERS.errors += 1
        setattr(worker, KV_VERDICT_MARK, "storing owed steps failed")
        setattr(worker, PENDING_MARK, None)
        _log_once("kv-flush", logging.ERROR, "spec controller: storing owed drafter KV failed; whole extends from now on", exc=True)


def draft_extend_hook(original: Any, worker: Any, batch: Any, batch_result: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND ``EagleDraftWorker._draft_extend_for_decode``: at depth 0, keys and values only.

    In place of SGLang's extend (its preparation, the drafter's forward, the proposal from its
    logits), the step's drafter keys and values are computed from the verify's outputs
    (:func:`kv_step_inputs`, :func:`draft_kv`) and the zeroed proposal of SGLang's skip stub is
    left (:func:`stub_proposal`). The update is owed (:class:`PendingKV`) and stored with the
    next ones, every ``ENV_OFF_DRAFT_DEFER`` steps or before anything touches the drafter's
    cache; the first ``ENV_OFF_DRAFT_CHECK`` steps store at once and are checked. Anything this
    does not cover (another depth, an idle batch, extra arguments such as 0.5.23's
    ``kv_loc_plan``, a drafter :func:`kv_verdict` refuses) runs SGLang's extend, after what is
    owed is stored; a failure runs it too, and ``kv`` is off for that worker. So does a
    launch :class:`WarmResume` inserted: drafting resumes from its proposal.
    """
    whole, RESUME.whole_extend = RESUME.whole_extend, False
    if whole or getattr(worker, "speculative_num_steps", None) != 0 or batch.forward_mode.is_idle():
        _flush_or_drop(worker)
        COUNTERS.warm_extends += whole
        return original(worker, batch, batch_result, *args, **kwargs)
    if args or any(v is not None for v in kwargs.values()) or kv_verdict(worker):
        # SGLang's whole extend at depth 0 here, and at every depth-0 step like it: the proposals
        # stay current, so a resume needs no inserted step.
        RESUME.enabled = False
        _flush_or_drop(worker)
        return original(worker, batch, batch_result, *args, **kwargs)
    checking = COUNTERS.kv_checked < _CHECK.steps
    try:
        ids, positions, hidden, loc = kv_step_inputs(batch, batch_result)
        pending: PendingKV | None = getattr(worker, PENDING_MARK, None)
        n = int(ids.shape[0])
        if checking or _DEFER.steps <= 1 or n > _DEFER.rows:
            flush_kv(worker)
            runner = worker.draft_runner
            draft_kv_only(runner.model, runner.token_to_kv_pool, ids.long(), positions.long(), hidden, loc)
        else:
            if pending is None:
                pending = PendingKV(_DEFER.steps, _DEFER.rows)
                setattr(worker, PENDING_MARK, pending)
            if not pending.fits(n):
                flush_kv(worker)
            pending.add(ids, positions, hidden, loc)
            if pending.full():
                flush_kv(worker)
        stub_proposal(worker, batch, batch_result)
    except Exception:
        COUNTERS.errors += 1
        COUNTERS.kv_fallbacks += 1
        _flush_or_drop(worker)  # what earlier steps owe is still theirs to store
        setattr(worker, KV_VERDICT_MARK, "the update failed")
        _log_once("kv", logging.ERROR, "spec controller: drafter KV-only update failed; whole extends from now on", exc=True)
        return original(worker, batch, batch_result)
    COUNTERS.kv_steps += 1
    if COUNTERS.kv_steps == 1:
        logger.info("spec controller: depth 0 stores the drafter's keys and values only (bs %d)", len(batch.seq_lens))
    if checking:
        try:
            _check_kv(original, worker, batch, batch_result, loc)
        except Exception:
            COUNTERS.errors += 1
            _CHECK.steps = 0
            _log_once("kv-check", logging.ERROR, "spec controller: kv check failed; no more checks", exc=True)
    return None


def flush_first_hook(original: Any, worker: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND the draft worker's ``draft``: it reads the drafter's cache, so what depth 0 owes
    is stored first."""
    _flush_or_drop(worker)
    return original(worker, *args, **kwargs)


def draft_prefill_hook(
    original: Any, worker: Any, batch: Any, hidden: Any, next_token_ids: Any, *args: Any, **kwargs: Any
) -> Any:
    """AROUND ``EagleDraftWorker._draft_extend_for_prefill``: what depth 0 owes is stored first
    (the prefill writes the drafter's cache); then at depth 0 (unless ``ENV_OFF_PREFILL=sglang``) the
    prefill's drafter extend stores keys and values only (:func:`prefill_inputs`,
    :func:`draft_kv`) and returns SGLang's zeroed proposal (:func:`prefill_stub`), leaving the
    batch as SGLang's extend leaves it. Anything else, and any failure, runs SGLang's extend, as
    does a prefill between a step :class:`WarmResume` inserted and the drafted step after it."""
    _flush_or_drop(worker)

    def sglangs() -> Any:  # SGLang's extend of this prefill, called as SGLang called it
        return original(worker, batch, hidden, next_token_ids, *args, **kwargs)

    if (
        not _PREFILL.kv
        or getattr(worker, "speculative_num_steps", None) != 0
        or batch.forward_mode.is_idle()
        or any(a is not None for a in args)  # 0.5.17 passes mm_input_embeds, None for text
        or any(v is not None for v in kwargs.values())
        or getattr(worker, PREFILL_OFF_MARK, False)
        or RESUME.last < 0  # after a step WarmResume inserted the next decode drafts: a real proposal
        or kv_verdict(worker)
    ):
        return sglangs()
    checking = COUNTERS.kv_prefill_checked < _CHECK.prefills
    try:
        ids, positions, hidden_in, loc = prefill_inputs(batch, hidden, next_token_ids)
        runner = worker.draft_runner
        draft_kv_only(runner.model, runner.token_to_kv_pool, ids.long(), positions, hidden_in, loc)
        out = prefill_stub(worker, batch, next_token_ids)
    except Exception:
        COUNTERS.errors += 1
        setattr(worker, PREFILL_OFF_MARK, True)
        _log_once("kv-prefill", logging.ERROR, "spec controller: KV-only prefill failed; SGLang's from now on", exc=True)
        return sglangs()
    COUNTERS.kv_prefills += 1
    if checking:  # SGLang's extend of the same prefill over the cleared slots; its result is kept
        try:
            return _check_prefill(sglangs, worker, loc)
        except Exception:
            COUNTERS.errors += 1
            _CHECK.prefills = 0
            _log_once("kv-prefill-check", logging.ERROR, "spec controller: kv prefill check failed; no more", exc=True)
            return sglangs()
    from sglang.srt.speculative.eagle_info import EagleDraftExtendInput

    batch.input_ids = ids  # as SGLang's extend leaves the batch
    batch.spec_info = EagleDraftExtendInput(hidden_states=hidden, num_tokens_per_req=1, num_tokens_for_logprob_per_req=1)
    return out


def _check_prefill(run_sglang: Any, worker: Any, loc: Any) -> Any:
    """``ENV_OFF_DRAFT_CHECK`` for ``ENV_OFF_PREFILL``: the stored keys and values against what
    SGLang's extend of the same prefill (``run_sglang()``) stores in the same slots
    (:func:`_against_sglang`)."""
    out, same, dk, dv, _ = _against_sglang(worker, loc, run_sglang)
    c = COUNTERS
    c.kv_prefill_checked += 1
    c.kv_prefill_identical += int(same)
    c.kv_prefill_max_d = max(c.kv_prefill_max_d, dk, dv)
    if c.kv_prefill_checked in (1, _CHECK.prefills):
        logger.info(
            "spec controller: kv prefill check %d prefills (%d tokens in the last), %d identical, max |d| %.3g",
            c.kv_prefill_checked, int(loc.shape[0]), c.kv_prefill_identical, c.kv_prefill_max_d,
        )  # fmt: skip
    return out


HOOKS = ((BUILD_STATE, build_state_hook), (PREPARE_VERIFY, prepare_verify_hook))


def _env_int(name: str, default: int) -> int:
    """A whole number from the environment; anything else is logged and ``default`` used."""
    text = os.environ.get(name, "").strip()
    try:
        return int(text) if text else default
    except ValueError:
        logger.warning("spec controller: %s=%r is not a whole number; using %d", name, text, default)
        return default


def _env_choice(name: str, choices: tuple[str, ...]) -> str:
    """One of ``choices`` from the environment, the first when unset; anything else is logged
    and the first used."""
    text = os.environ.get(name, "").strip()
    if text and text not in choices:
        logger.warning("spec controller: %s=%r is not one of %s; using %s", name, text, ", ".join(choices), choices[0])
    return text if text in choices else choices[0]


def install(register: Any, config: OffConfig) -> None:
    """Register the off switch's hooks through ``register(target, fn)`` (SGLang's AROUND hooks).

    With ``skip`` the drafter's extend is left out at depth 0 through SGLang's own switch,
    which scheduler children read from the environment they inherit; with ``kv`` it is
    replaced by the KV-only update (:func:`draft_extend_hook`).
    """
    register(DRAFT_EXTEND_WIDTH, draft_extend_width_hook)  # every depth, whatever the off path
    RESUME.enabled = False  # only kv leaves stub proposals that a resume would draft from
    if not config.plain:
        return
    if config.draft == "skip":
        os.environ[SGLANG_SKIP_ENV] = "1"
    if config.draft == "kv":
        _CHECK.steps = _env_int(ENV_OFF_DRAFT_CHECK, 0)
        _CHECK.batches = _CHECK.prefills = _CHECK.steps // 6
        _DEFER.steps = max(1, _env_int(ENV_OFF_DRAFT_DEFER, DEFER_STEPS))
        _PREFILL.kv = _env_choice(ENV_OFF_PREFILL, ("kv", "sglang")) == "kv"
        RESUME.enabled = _env_choice(ENV_OFF_RESUME, ("warm", "cold")) == "warm"
        register(DRAFT_EXTEND, draft_extend_hook)
        register(DRAFT, flush_first_hook)
        register(DRAFT_PREFILL, draft_prefill_hook)
    for target, fn in HOOKS:
        register(target, fn)
