"""Step-latency model: named physical terms per kernel, fitted to profile CSVs and traces.

One forward pass of the target over ``B`` sequences with ``q`` new tokens each and
``C = Σ ctx`` tokens already cached, ``L = C / B`` per sequence (all times in µs)::

    target(B, q, C) = t_fix + gemm(w, f, N) + tok·N + layers·attn(B, q, L)      N = B·q new tokens
    gemm(w, f, N)   = (w^p + (f·N)^p)^(1/p)      weights read once per pass  vs  compute per token

Attention, per layer, per kernel ``k`` (the decode kernel at q = 1; at q > 1 the faster of
the split-KV verify kernel and the decode kernel run with q query rows, as the profiled
target chose per shape)::

    attn_k(B, q, L) = (fix_k + seq_k·B + L·(kv1_k·B1 + kv_k·(B − B1))) · [split: 1 + qrel·(q − 2)]
    B1 = B / (1 + (B / wave_seqs)^s)^(1/s)        the sequences of the first wave (smooth min(B, wave_seqs))
    attn_dec(B, 1, L) = fix + seq·B + ((L·(kv1·B1 + kv·(B − B1)))⁴ + (walk·L)⁴)^(1/4)      decode, q = 1

Why this form: a decode attention kernel runs one thread block per (sequence, KV head). Up to
``wave_seqs = SMs / KV heads`` sequences (16.5 on an H200 with 8 KV heads) fit in the first
wave, which reads the KV at ``kv1`` per token (near the copy bandwidth, latency-bound at
small batch); every sequence beyond it queues for a later wave and streams at the sustained
rate ``kv`` (about half the copy bandwidth on the H200 profile). So the cost per cached token
depends on how many sequences share the GPU, not only on the context: the same 64k cached
tokens cost 2.2 ms as 16 sequences of 4096 and 3.6 ms as 64 of 1024. One linear KV term
fitted over both regimes under-priced long-context large-batch decode by 13-23%. ``wave_seqs``
and the sharpness ``s`` are declared from the hardware, not fitted: with one context length
in the fit, C and B move together and the split could not be learned.

The decode kernel's ``walk`` (``dec_walk_us_per_tok``) is one sequence's walk through its own
cached tokens, one tile after another: a floor set by memory latency, not bandwidth, which a
few sequences on their own SMs do not raise. SGLang's triton decode on the H100 testbed (call
AQ, ``bench/results/realgpu/h100/longctx/``) cost about 0.38 µs per cached token per sequence
at 4k-32k tokens, the same at batch 1 and 4 and only 1.14-1.17× that at 5-8, where the
bandwidth term grows with the batch: no kv1 fits both a batch of 1 and one of 8 at 32k. The
smooth maximum keeps the bandwidth term wherever it is the larger; 0 (every profile-built
deployment) leaves the decode as before, bit for bit. The maximum is a 4-norm, not a 2-norm:
where walk and stream are equal the kernel costs about 1.2× either, not 1.4× (call AS's depth-0
steps on the H100: 32k tokens a sequence at batch 1, 8 and 9 took 18.7, 19.9 and 21.5 ms, where
one sequence's walk alone takes about 15.6 ms of it and 8 or 9 sequences' stream about as much).

The draft head is the same kind of pass, ``d_layers`` of the target's layers wide::

    draft(B, q, C) = d_fix + [fc]·d_fc + gemm(d_w, d_f, N) + d_tok·N + d_layers·attn(B, q, L)

One engine step at depth ``k`` (SGLang EAGLE-3, chain drafts, ``topk = 1``)::

    k > 0:  oh + oh_req·B + oh_spec + Σ_{i=1..k} draft(B, 1, C) [first with fc]
            + target(B, k + 1, C) + ver + draft(B, k + 1, C) + ext [draft extend after verify]
    k = 0, off_path "plain":   oh + oh_req·B + target(B, 1, C) + off_extend·(draft(B, 1, C) + ext)
    k = 0, off_path "verify":  oh + oh_req·B + oh_spec + target(B, 1, C) + ver + v0_fix + v0_seq·B
                               + draft(B, 1, C) + ext
    ver = verify_seq_us·B + verify_ctx_us_per_tok·(C / B)·⌈B / ext_wave_seqs⌉,  ext = ver · d_layers / layers

``ver`` is SGLang's own cost of a pass through its extend-attention kernel (the triton backend
verifies that way: one 128-row query tile per request and query head, however few rows are
real, looping over the request's prefix), on top of the profiled pass; the draft extends run
the same kernel over the draft's ``d_layers``. ``verify_seq_us`` is its cost per request
(fitted to the real H200 server's k > 0 steps, about 145 µs per request at ~320 cached tokens
per sequence). ``verify_ctx_us_per_tok`` is its loop over the prefix: each (request, query
head) block walks its own request's cached tokens one tile after another. The blocks of up to
``ext_wave_seqs`` requests run side by side (one block per SM: 132 SMs / 32 query heads), so
the pass lasts as long as one request's loop, ``L = C / B`` tokens, and each further wave of
requests adds another, whole: ``L·⌈B / ext_wave_seqs⌉`` (at 32k tokens a sequence on the H100,
call AS: one loop at batch 1-3, two at 5-8, three at 9). On the H100 testbed
a drafted step at batch 1-4 grew by 2.1-2.3 µs per cached token per sequence at every depth
1-5 (the depth-0 decode by 0.3), about 5.6 at batch 15 and 9-11 at 24; a bs = 1 step at depth
3 took 8.3 ms at ~380 tokens and 10.0-10.5 ms at 1,200-1,500. Fitted to traces
(``env.fit.fit_step_latency``) where the drafted steps' contexts differ enough to tell it from
``oh_spec_us``. Both 0 (the profile's plain PyTorch passes, the seed deployment) leave every
step as before, bit for bit.

``off_path`` is how the deployment runs depth 0: ``"plain"`` is the off switch
(``sglang_hook/off_switch.py``: the target's plain decode), whose depth-0 step pays the share
``off_extend`` of the drafter's one-token extend, one of :data:`OFF_EXTEND` by what the drafter
does at depth 0 (``--spec-off-draft``): 1 ``keep`` (the whole extend; measured 0.87-0.97x a
plain server on the H200), 0 ``skip`` (0.95-1.00x), and for ``kv`` (keys and values only, the
default) the share its measured cost has of ``keep``'s, about 0.1 on the H100 (0.93-1.05x);
``"verify"`` is SGLang's own depth 0 (a width-1 verify through the extend-attention kernel,
one real query row per 128-row tile, plus the draft extend: measured 0.72x a plain server at
C = 1 and 0.40x at C = 64-128; ``v0_fix``/``v0_seq`` carry that kernel's extra cost).
Switching depth costs nothing of its own (measured: a 0→3→0 round trip is within noise).

Prefill of ``P`` prompt tokens between two decode steps adds
``t_fix + pf_scale·(gemm(w, f, P) + tok·P) + layers·(fix_dec + pf_pair·A) + pf_attn·P`` (chunked,
one pass), with ``A = Σ n·(c + (n + 1)/2)`` over the admitted prompts (``n`` tokens prefilled
after ``c`` cached): each new token attends to the prefix and to the prompt before it, so a
prompt's attention is quadratic in its length. On the H100 testbed a cold 32k prompt took about
2.63 s (call AQ's time to first token), where its GEMMs at the device's peak take under 0.5 s;
``pf_pair`` (per token pair per layer) carries the rest and is 0 (none) unless declared. The
fit to traces never sees it (the hook records decode steps; a prompt prefilled while nothing
decodes leaves no record), nor does it see ``f`` where every step's GEMM is bound by the weight
read: ``f_floor_us_per_tok`` (declared: 2 × the target's parameters / the device's peak
FLOP/s) keeps a fitted ``f`` physical. Then the admission's own cost ``max(0, admit + admit_seq·B − admit_hide·T)``, ``T`` the step it
joins without it (fitted to traces, :func:`env.fit.fit_admission`; 0 in the profile-built
deployments): SGLang's overlap scheduler prepares an admission while the GPU runs a step, so a
longer step hides more of it.

Every pass formula is written once, as compiled scalar kernels (:func:`_target_pass`,
:func:`_draft_pass`, :func:`_attn_pass`) over the coefficient array of :func:`step_coeffs`;
the engine's step, the fit to traces, the fit to profiles and :func:`predict_component_ms`
all evaluate those kernels (over arrays through one compiled loop). Past the fitted range
the model is linear in batch, in tokens and in cached context (no polynomial blow-up).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from typing import Any

import numpy as np

from controller._jit import maybe_njit
from env.errors import FitError

PROFILE_COLUMNS = ("component", "batch", "q", "ctx", "median_ms")
KNOWN_COMPONENTS = (
    "target",
    "target_gemm",
    "target_attn_fa2",
    "target_attn_split",
    "draft",
    "draft_nofc",
)
OFF_PATHS = ("plain", "verify")
# What a depth-0 step pays of the drafter's one-token extend, by ``--spec-off-draft``: kv's
# share is its measured cost over keep's on the H100 (bench/results/realgpu/h100/offswitch-kv).
# kv owes its updates and stores 16 steps in one pass; side by side with skip (call B, C = 1-64)
# its time per output token was -1.7% to +1.9% of skip's (mean +0.3%), where keep's cost about
# 6-7% of a plain server's throughput more than skip; so about a tenth, inside the noise.
OFF_EXTEND = {"keep": 1.0, "kv": 0.1, "skip": 0.0}
# Weights of the profile fit's log residuals per component: whole passes (what steps are made
# of) count fully; the GEMM-only and attention-only decompositions pin the terms apart.
COMPONENT_WEIGHT = {
    "target": 1.0,
    "draft": 1.0,
    "draft_nofc": 1.0,
    "target_gemm": 0.5,
    "target_attn_fa2": 0.5,
    "target_attn_split": 0.5,
}


def kv_floor_us_per_tok(kv_bytes_per_token: float, layers: float, copy_tb_s: float) -> float:
    """One token of one layer's KV (``kv_bytes_per_token / layers`` bytes) copied at ``copy_tb_s``
    TB/s, µs: no kernel reads the KV cache faster than the device copies memory, so a lower
    bound for every per-token attention coefficient (``LatencyParams.kv_floor_us_per_tok``)."""
    return kv_bytes_per_token / layers / (copy_tb_s * 1e12) * 1e6


H200_COPY_TB_S = 4.24
"""The H200's memory copy bandwidth as the profile probed it (TB/s)."""
# The 8B target on the H200: 8 KV heads x 128 x K and V x bf16 = 4096 bytes per token and layer.
H200_8B_KV_FLOOR_US_PER_TOK = kv_floor_us_per_tok(32 * 4096, 32, H200_COPY_TB_S)


@dataclass(frozen=True)
class LatencyParams:
    """Coefficients of the step-latency model (module docstring; µs, per-token terms µs/token,
    attention terms per layer).

    Declared, not fitted (hardware and shape): ``p``, ``layers``, ``wave_seqs``,
    ``wave_sharpness``, ``d_layers``. ``rel_se`` holds a relative standard error per fitted
    coefficient (same names), used by domain randomization; missing names mean 0.
    """

    t_fix_us: float = 1280.0
    w_us: float = 4000.0
    f_us_per_tok: float = 24.0
    p: float = 2.0
    tok_us_per_tok: float = 0.5
    layers: float = 32.0
    wave_seqs: float = 16.5
    wave_sharpness: float = 8.0
    dec_fix_us: float = 11.5
    dec_seq_us: float = 0.0
    dec_kv1_us_per_tok: float = 0.0011
    dec_kv_us_per_tok: float = 0.0018
    split_fix_us: float = 27.0
    split_seq_us: float = 0.4
    split_kv1_us_per_tok: float = 0.001
    split_kv_us_per_tok: float = 0.0022
    split_q_rel: float = 0.008
    mq_fix_us: float = 10.0
    mq_seq_us: float = 0.2
    mq_kv1_us_per_tok: float = 0.0045
    mq_kv_us_per_tok: float = 0.009
    d_fix_us: float = 50.0
    d_fc_us: float = 28.0
    d_w_us: float = 270.0
    d_f_us_per_tok: float = 2.3
    d_tok_us_per_tok: float = 0.15
    d_layers: float = 1.0
    oh_us: float = 300.0
    oh_spec_us: float = 200.0
    oh_req_us: float = 2.0
    off_path: str = "plain"
    off_extend: float = 1.0
    v0_fix_us: float = 0.0
    v0_seq_us: float = 0.0
    verify_seq_us: float = 0.0
    # SGLang's extend-attention loop over a request's prefix, per cached token per sequence
    # (module docstring): fitted to traces, 0 in the profile-built deployments.
    verify_ctx_us_per_tok: float = 0.0
    # The decode kernel's walk through one sequence's cached tokens, per token per layer (module
    # docstring): fitted to traces whose decode contexts spread, 0 in the profile-built deployments.
    dec_walk_us_per_tok: float = 0.0
    ext_wave_seqs: float = 4.125  # ... whose blocks run side by side: SMs / query heads (declared)
    pf_attn_us_per_tok: float = 0.02
    pf_scale: float = 1.0
    # A prompt's causal attention, per (prefilled token × token it attends) per layer (module
    # docstring): 0 (not priced) unless declared from a measurement.
    pf_pair_us: float = 0.0
    # The least ``f_us_per_tok`` a fit may give (declared: 2 × parameters / peak FLOP/s; 0: none).
    f_floor_us_per_tok: float = 0.0
    # The least per-token KV coefficient (``*_kv*_us_per_tok``) a fit to traces may give
    # (declared: one token of one layer's KV over the device's copy bandwidth; 0: none).
    kv_floor_us_per_tok: float = 0.0
    # A step that admits requests, beyond its prefill pass: fitted to traces (env.fit), 0 in the
    # profile-built deployments. On the H100 testbed (prefix-cached prompts, eager prefills) an
    # admission cost the speculative server 40-90 ms against a 7-10 ms decode step.
    admit_us: float = 0.0
    admit_seq_us: float = 0.0  # ... per request already running
    # ... less this many µs per µs of the step it joins (at most all of it): SGLang's overlap
    # scheduler prepares an admission while the GPU runs the step, so a longer step hides more
    # of it (H100 testbed: 9-16 ms beside 7-8 ms depth-0 steps, 1-2 ms beside 25 ms depth-3 ones).
    admit_hide: float = 0.0
    jitter: float = 0.01
    rel_se: dict[str, float] | None = None

    def __post_init__(self) -> None:
        if self.off_path not in OFF_PATHS:
            raise FitError(f"latency params: off_path must be one of {', '.join(OFF_PATHS)}, got {self.off_path!r}")
        # Files written before the kv mode say true/false (keep/skip).
        object.__setattr__(self, "off_extend", float(self.off_extend))
        if not 0.0 <= self.off_extend <= 1.0:
            raise FitError(f"latency params: off_extend must be in [0, 1], got {self.off_extend}")

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_dict(cls, d: dict) -> LatencyParams:
        names = {f.name for f in fields(cls)}
        unknown = set(d) - names
        if unknown:
            raise FitError(f"latency params: unknown keys {sorted(unknown)}")
        return cls(**d)

    def perturb(self, rng: np.random.Generator, scale: float = 1.0) -> LatencyParams:
        """A draw around these coefficients: each × exp(N(0, (scale·rel_se)²))."""
        if scale <= 0.0 or not self.rel_se:
            return self
        changes: dict[str, Any] = {}
        for name, se in sorted(self.rel_se.items()):
            if se > 0.0 and name not in DECLARED and name != "jitter":
                changes[name] = float(getattr(self, name) * math.exp(rng.normal(0.0, scale * se)))
        return replace(self, **changes)


DECLARED = (
    "p", "layers", "wave_seqs", "wave_sharpness", "d_layers", "ext_wave_seqs", "pf_pair_us", "f_floor_us_per_tok",
    "kv_floor_us_per_tok",
)  # fmt: skip
"""Coefficients set from the hardware and the model's shape, never fitted."""

# --------------------------------------------------------------------------- the coefficient array
#
# Every kernel below reads its coefficients from one float64 array laid out as STEP_COEFFS
# (``off_path`` as off_verify 0.0/1.0, ``off_extend`` as the share 0.0-1.0); the index constants are
# compile-time globals for numba. tests/test_fit.py checks them against the tuple.

STEP_COEFFS = (
    "t_fix_us", "w_us", "f_us_per_tok", "p", "tok_us_per_tok", "layers",
    "wave_seqs", "wave_sharpness",
    "dec_fix_us", "dec_seq_us", "dec_kv1_us_per_tok", "dec_kv_us_per_tok",
    "split_fix_us", "split_seq_us", "split_kv1_us_per_tok", "split_kv_us_per_tok", "split_q_rel",
    "mq_fix_us", "mq_seq_us", "mq_kv1_us_per_tok", "mq_kv_us_per_tok",
    "d_fix_us", "d_fc_us", "d_w_us", "d_f_us_per_tok", "d_tok_us_per_tok", "d_layers",
    "oh_us", "oh_spec_us", "oh_req_us",
    "off_verify", "off_extend", "v0_fix_us", "v0_seq_us",
    "pf_attn_us_per_tok", "pf_scale", "verify_seq_us", "admit_us", "admit_seq_us", "admit_hide",
    "verify_ctx_us_per_tok", "ext_wave_seqs", "dec_walk_us_per_tok", "pf_pair_us",
)  # fmt: skip
(
    I_T_FIX, I_W, I_F, I_P, I_TOK, I_LAYERS,
    I_WAVE, I_SHARP,
    I_DEC, I_SPLIT, I_MQ,  # first index of each kernel's (fix, seq, kv1, kv)
    I_D_FIX, I_D_FC, I_D_W, I_D_F, I_D_TOK, I_D_LAYERS,
    I_OH, I_OH_SPEC, I_OH_REQ,
    I_OFF_VERIFY, I_OFF_EXTEND, I_V0_FIX, I_V0_SEQ,
    I_PF_ATTN, I_PF_SCALE, I_VER_SEQ, I_ADMIT, I_ADMIT_SEQ, I_ADMIT_HIDE,
    I_VER_CTX, I_EXT_WAVE, I_DEC_WALK, I_PF_PAIR,
) = (0, 1, 2, 3, 4, 5, 6, 7, 8, 12, 17, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40, 41, 42, 43)  # fmt: skip
I_SPLIT_Q = I_SPLIT + 4

_COEFF_CACHE: dict[int, tuple[LatencyParams, np.ndarray]] = {}
_COEFF_CACHE_SIZE = 16


def _coeff_value(lp: LatencyParams, name: str) -> float:
    if name == "off_verify":
        return 1.0 if lp.off_path == "verify" else 0.0
    return float(getattr(lp, name))


def step_coeffs(lp: LatencyParams) -> np.ndarray:
    """``lp``'s :data:`STEP_COEFFS` as a float64 array (the form the compiled kernels take).

    The last few arrays are cached by identity (params are frozen), so calling
    :func:`step_time_us` in a loop does not rebuild it each time.
    """
    hit = _COEFF_CACHE.get(id(lp))
    if hit is not None and hit[0] is lp:
        return hit[1]
    c = np.array([_coeff_value(lp, name) for name in STEP_COEFFS], dtype=np.float64)
    if len(_COEFF_CACHE) >= _COEFF_CACHE_SIZE:
        del _COEFF_CACHE[next(iter(_COEFF_CACHE))]
    _COEFF_CACHE[id(lp)] = (lp, c)
    return c


# --------------------------------------------------------------------------- the pass kernels


def _gemm(w_us: Any, f_us_per_tok: Any, p: Any, n_tokens: Any) -> Any:
    """The GEMM term: a smooth max (sharpness ``p``) of reading the weights once and computing
    ``n_tokens`` new tokens. Scalars or numpy arrays; :data:`_gemm_kernel` is its compiled form."""
    return (w_us**p + (f_us_per_tok * n_tokens) ** p) ** (1.0 / p)


_gemm_kernel = maybe_njit(_gemm)


@maybe_njit
def _wave(c: np.ndarray, b: float, seqs: float) -> float:
    """The sequences of one wave of a kernel that runs ``seqs`` of them side by side: the
    smooth min(b, seqs), sharpness ``wave_sharpness`` (module docstring)."""
    s = c[I_SHARP]
    return b / (1.0 + (b / seqs) ** s) ** (1.0 / s)


@maybe_njit
def _attn_layer(c: np.ndarray, k: int, b: float, ctx_per_seq: float) -> float:
    """One layer of attention kernel ``k`` (index of its fix, seq, kv1, kv) over ``b`` sequences
    of ``ctx_per_seq`` cached tokens: the first wave's sequences at kv1, the rest at kv."""
    first = _wave(c, b, c[I_WAVE])
    return c[k] + c[k + 1] * b + ctx_per_seq * (c[k + 2] * first + c[k + 3] * (b - first))


WALK_P = 4.0
"""The norm of the smooth maximum of the decode kernel's walk and stream (module docstring)."""


@maybe_njit
def _attn_pass(c: np.ndarray, b: float, q: float, ctx_tokens: float, kernel: int) -> float:
    """Attention of one layer over ``b`` sequences × ``q`` new tokens, ``ctx_tokens`` cached in all.

    ``kernel``: 0 the faster (as the profiled target and SGLang's backend choose), 1 the
    decode kernel (q query rows: re-reads the KV per row group), 2 the split-KV verify kernel.
    """
    if b <= 0.0:
        return 0.0
    ctx = ctx_tokens / b
    if q <= 1.0 and kernel != 2:
        stream = _attn_layer(c, I_DEC, b, ctx)
        if c[I_DEC_WALK] <= 0.0:
            return stream
        fix = c[I_DEC] + c[I_DEC + 1] * b  # the smooth max of streaming all and walking one
        return fix + ((stream - fix) ** WALK_P + (c[I_DEC_WALK] * ctx) ** WALK_P) ** (1.0 / WALK_P)
    split = _attn_layer(c, I_SPLIT, b, ctx) * (1.0 + c[I_SPLIT_Q] * (q - 2.0))
    if kernel == 2:
        return split
    mq = _attn_layer(c, I_MQ, b, ctx)
    if kernel == 1:
        return mq
    return min(split, mq)


@maybe_njit
def _target_pass(c: np.ndarray, b: float, q: float, ctx_tokens: float) -> float:
    """One target forward: ``b`` sequences × ``q`` new tokens, ``ctx_tokens`` cached in all, µs."""
    n = b * q
    gemm = _gemm_kernel(c[I_W], c[I_F], c[I_P], n)
    return c[I_T_FIX] + gemm + c[I_TOK] * n + c[I_LAYERS] * _attn_pass(c, b, q, ctx_tokens, 0)


@maybe_njit
def _draft_pass(c: np.ndarray, b: float, q: float, ctx_tokens: float, fc: bool) -> float:
    """One draft-head forward (``fc``: the first draft step, which runs the 3→1 fusion), µs."""
    n = b * q
    t = c[I_D_FIX] + _gemm_kernel(c[I_D_W], c[I_D_F], c[I_P], n) + c[I_D_TOK] * n
    t += c[I_D_LAYERS] * _attn_pass(c, b, q, ctx_tokens, 0)
    if fc:
        t += c[I_D_FC]
    return t


@maybe_njit
def _with_prefill(c: np.ndarray, t: float, prefill_tokens: float, prefill_pairs: float, b: float) -> float:
    """``t`` plus the prefill of ``prefill_tokens`` prompt tokens (none: ``t``): one chunked pass
    whose attention covers ``prefill_pairs`` token pairs (module docstring), and the admission's
    own cost with ``b`` requests running."""
    if prefill_tokens > 0:
        pf = float(prefill_tokens)
        t += c[I_T_FIX] + c[I_PF_SCALE] * (_gemm_kernel(c[I_W], c[I_F], c[I_P], pf) + c[I_TOK] * pf)
        t += c[I_LAYERS] * c[I_DEC] + c[I_PF_ATTN] * pf
        if c[I_PF_PAIR] != 0.0:  # exactly t without it (every deployment that does not declare it)
            t += c[I_LAYERS] * c[I_PF_PAIR] * prefill_pairs
        t += c[I_ADMIT] + c[I_ADMIT_SEQ] * b  # exactly t when both are 0 (the bundled deployments)
    return t


@maybe_njit
def _extend_kernel(c: np.ndarray, b: float, ctx_tokens: float) -> float:
    """SGLang's own cost of one target pass through its extend-attention kernel, ``ver`` of the
    module docstring: per request, and its loop over each request's prefix, which the requests
    of one wave (``ext_wave_seqs``) run side by side: one request's loop per whole wave."""
    if b <= 0.0:
        return 0.0
    # Whole waves: a request's blocks run its whole prefix loop, so a fifth request beside
    # four costs a second loop (AS's depth-3 steps at 32k: 77 ms at batch 1-3, 142-145 at 5-8,
    # 212 at 9), not a quarter of one.
    waves = math.ceil(b / c[I_EXT_WAVE] - 1e-9)
    return c[I_VER_SEQ] * b + c[I_VER_CTX] * (ctx_tokens / b) * waves


@maybe_njit
def _extend_seq(c: np.ndarray, b: float, ctx_tokens: float) -> float:
    """The draft extend's share of :func:`_extend_kernel`: the same extend-attention tiles per
    request and head, over the draft's ``d_layers`` instead of the target's ``layers``."""
    return _extend_kernel(c, b, ctx_tokens) * c[I_D_LAYERS] / c[I_LAYERS]


# --------------------------------------------------------------------------- one engine step
#
# The step formula of the module docstring, written once: :func:`step_time_kernel` (plain Python
# that numba compiles). The simulator's hot path, the oracle, the goodput baseline and the fit
# to traces (:func:`step_times_us`, the same kernel over arrays) all evaluate it, so every
# consumer gets the same float for the same step. The order of its operations is part of the
# simulator's definition (episodes are reproduced bit for bit): change it knowingly.


@maybe_njit
def step_time_kernel(
    c: np.ndarray, bs: int, depth: int, ctx_tokens: float, prefill_tokens: float, prefill_pairs: float
) -> float:
    """One engine step at ``depth`` (module docstring), µs, over :func:`step_coeffs` ``c``;
    ``prefill_pairs`` as :func:`prefill_pairs` counts them for the step's admissions.

    Compiled when numba is installed, and callable from other kernels of this module.
    """
    b = float(bs)
    t0 = c[I_OH] + c[I_OH_REQ] * b
    t = _with_prefill(c, t0, prefill_tokens, prefill_pairs, b)
    pf = t - t0  # the prefill pass and the admission's own cost (0 without a prefill)
    if depth > 0:
        q = depth + 1.0
        t += c[I_OH_SPEC]
        t += depth * _draft_pass(c, b, 1.0, ctx_tokens, False) + c[I_D_FC]  # k draft steps, the first with fc
        t += _target_pass(c, b, q, ctx_tokens) + _extend_kernel(c, b, ctx_tokens)  # the verify pass
        t += _draft_pass(c, b, q, ctx_tokens, False) + _extend_seq(c, b, ctx_tokens)  # the draft extend
    else:
        t += _target_pass(c, b, 1.0, ctx_tokens)
        if c[I_OFF_VERIFY] != 0.0:  # SGLang's own depth 0: a width-1 verify and the draft extend
            t += (
                c[I_OH_SPEC] + _extend_kernel(c, b, ctx_tokens) + c[I_V0_FIX] + c[I_V0_SEQ] * b
                + _draft_pass(c, b, 1.0, ctx_tokens, False)
            )  # fmt: skip
            t += _extend_seq(c, b, ctx_tokens)
        elif c[I_OFF_EXTEND] != 0.0:  # the off switch: its share of the drafter's one-token extend
            t += c[I_OFF_EXTEND] * (_draft_pass(c, b, 1.0, ctx_tokens, False) + _extend_seq(c, b, ctx_tokens))
    if pf > 0.0 and c[I_ADMIT_HIDE] != 0.0:  # the part of the admission the step hides
        t -= min(c[I_ADMIT] + c[I_ADMIT_SEQ] * b, c[I_ADMIT_HIDE] * (t - pf))
    return float(t)


@maybe_njit
def step_times_kernel(
    c: np.ndarray, bs: int, depth: int, ctx_tokens: float, prefill_tokens: float, prefill_pairs: float
) -> tuple[float, float]:
    """:func:`step_time_kernel` at ``depth`` and at depth 0 for the same batch, in one call
    (the simulator's step needs both: the reward compares them)."""
    t = step_time_kernel(c, bs, depth, ctx_tokens, prefill_tokens, prefill_pairs)
    return t, (t if depth == 0 else step_time_kernel(c, bs, 0, ctx_tokens, prefill_tokens, prefill_pairs))


@maybe_njit
def _step_time_array(
    c: np.ndarray,
    bs: np.ndarray,
    depth: np.ndarray,
    ctx_tokens: np.ndarray,
    prefill_tokens: np.ndarray,
    prefill_pairs: np.ndarray,
    out: np.ndarray,
) -> None:
    for i in range(len(out)):
        out[i] = step_time_kernel(c, int(bs[i]), int(depth[i]), ctx_tokens[i], prefill_tokens[i], prefill_pairs[i])


_COMPONENT_CODE = {name: i for i, name in enumerate(KNOWN_COMPONENTS)}


@maybe_njit
def _component_array(
    c: np.ndarray, comp: int, b: np.ndarray, q: np.ndarray, ctx_per_seq: np.ndarray, out: np.ndarray
) -> None:
    """µs of one profiled component (index into :data:`KNOWN_COMPONENTS`) for each row."""
    for i in range(len(out)):
        bi, qi = b[i], q[i]
        ctx = bi * ctx_per_seq[i]
        if comp == 0:
            out[i] = _target_pass(c, bi, qi, ctx)
        elif comp == 1:
            out[i] = _gemm_kernel(c[I_W], c[I_F], c[I_P], bi * qi)
        elif comp == 2:
            out[i] = c[I_LAYERS] * _attn_pass(c, bi, qi, ctx, 1)
        elif comp == 3:
            out[i] = c[I_LAYERS] * _attn_pass(c, bi, qi, ctx, 2)
        else:
            out[i] = _draft_pass(c, bi, qi, ctx, comp == 4)


def _component_us(c: np.ndarray, component: str, batch: Any, q: Any, ctx_per_seq: Any) -> np.ndarray:
    code = _COMPONENT_CODE.get(component)
    if code is None:
        raise FitError(f"unknown profile component {component!r}; known: {', '.join(KNOWN_COMPONENTS)}")
    b, qq, ctx = np.broadcast_arrays(*(np.asarray(x, dtype=np.float64) for x in (batch, q, ctx_per_seq)))
    shape = b.shape
    b, qq, ctx = (np.ascontiguousarray(x.ravel()) for x in (b, qq, ctx))
    out = np.empty(len(b), dtype=np.float64)
    _component_array(c, code, b, qq, ctx, out)
    return out.reshape(shape)


# --------------------------------------------------------------------------- evaluation


def predict_component_ms(lp: LatencyParams, component: str, batch, q, ctx) -> np.ndarray:
    """Predict a profile row's ``median_ms`` (``ctx`` per sequence, as in the CSV)."""
    return _component_us(step_coeffs(lp), component, batch, q, ctx) / 1000.0


def gemm_us(lp: LatencyParams, n_tokens: np.ndarray | float) -> np.ndarray | float:
    """GEMM time of a pass over ``n_tokens`` new tokens: smooth max of weight read and compute."""
    return _gemm(lp.w_us, lp.f_us_per_tok, lp.p, n_tokens)


def _per_seq(batch: Any, ctx_tokens: Any) -> np.ndarray:
    b = np.asarray(batch, dtype=np.float64)
    return np.asarray(ctx_tokens, dtype=np.float64) / np.maximum(b, 1.0)


def attn_us(lp: LatencyParams, batch, q, ctx_tokens, kernel: str = "best") -> np.ndarray:
    """Attention time of a target pass (all layers), ``ctx_tokens`` cached in all.

    ``kernel``: ``"split"`` (the split-KV verify kernel), ``"fa2"`` (the decode kernel, which
    re-reads the KV per query row when q > 1) or ``"best"`` (the faster, as the profiled
    target and SGLang's backend selection do).
    """
    if kernel == "best":
        return np.minimum(attn_us(lp, batch, q, ctx_tokens, "fa2"), attn_us(lp, batch, q, ctx_tokens, "split"))
    comp = "target_attn_fa2" if kernel == "fa2" else "target_attn_split"
    out = _component_us(step_coeffs(lp), comp, batch, q, _per_seq(batch, ctx_tokens))
    if kernel == "split":  # the split kernel never runs a plain decode; "best" at q = 1 is fa2
        out = np.where(np.broadcast_to(np.asarray(q), np.shape(out)) > 1, out, np.inf)
    return out


def target_us(lp: LatencyParams, batch, q, ctx_tokens) -> np.ndarray:
    """One target forward: ``batch`` sequences × ``q`` new tokens, ``ctx_tokens`` cached in all."""
    return _component_us(step_coeffs(lp), "target", batch, q, _per_seq(batch, ctx_tokens))


def draft_us(lp: LatencyParams, batch, q, ctx_tokens, fc: bool = False) -> np.ndarray:
    """One draft-head forward (``fc``: the first draft step, which runs the 3→1 fusion)."""
    comp = "draft" if fc else "draft_nofc"
    return _component_us(step_coeffs(lp), comp, batch, q, _per_seq(batch, ctx_tokens))


def prefill_pairs(new_tokens: Any, cached_tokens: Any = 0.0) -> Any:
    """The token pairs one prompt's prefill attends (module docstring): each of its
    ``new_tokens`` to the ``cached_tokens`` before it and to itself and the new ones before it
    (none without new tokens). Scalars or numpy arrays."""
    return new_tokens * (cached_tokens + (new_tokens + 1.0) / 2.0)


def step_time_us(
    lp: LatencyParams, bs: int, depth: int, ctx_tokens: float, prefill_tokens: float = 0.0, pairs: float | None = None
) -> float:
    """Expected wall time of one engine step (decode/verify at ``depth`` plus prefill), µs;
    ``pairs``: the prefill's token pairs (:func:`prefill_pairs`; None: one prompt, nothing cached)."""
    if pairs is None:
        pairs = prefill_pairs(float(prefill_tokens))
    return step_time_kernel(step_coeffs(lp), bs, depth, ctx_tokens, prefill_tokens, pairs)


def prefill_us(lp: LatencyParams, prefill_tokens: float, bs: int = 0, cached_tokens: float = 0.0) -> float:
    """Time of prefilling one prompt's ``prefill_tokens`` after ``cached_tokens`` found in the
    cache, between two decode steps of ``bs`` running requests (the admission's cost included), µs."""
    pairs = prefill_pairs(prefill_tokens, cached_tokens)
    return _with_prefill(step_coeffs(lp), 0.0, prefill_tokens, pairs, float(bs))


def step_times_us(
    lp: LatencyParams, bs: Any, depth: Any, ctx_tokens: Any, prefill_tokens: Any, pairs: Any = None
) -> np.ndarray:
    """:func:`step_time_us` of every step of arrays of steps (for fitting to traces). Records
    carry a step's prefilled tokens, not its prompts: ``pairs`` None prices each step's prefill
    as one prompt with nothing cached (exact for one, high for several at once)."""
    if pairs is None:
        pairs = prefill_pairs(np.asarray(prefill_tokens, dtype=np.float64))
    bs, depth, ctx_tokens, prefill_tokens, pairs = (
        np.ascontiguousarray(x, dtype=np.float64) for x in (bs, depth, ctx_tokens, prefill_tokens, pairs)
    )
    out = np.empty(len(bs), dtype=np.float64)
    _step_time_array(step_coeffs(lp), bs, depth, ctx_tokens, prefill_tokens, pairs, out)
    return out


# --------------------------------------------------------------------------- fitting

PASS_NAMES = (
    "t_fix_us", "w_us", "f_us_per_tok", "tok_us_per_tok",
    "dec_fix_us", "dec_seq_us", "dec_kv1_us_per_tok", "dec_kv_us_per_tok",
    "split_fix_us", "split_seq_us", "split_kv1_us_per_tok", "split_kv_us_per_tok", "split_q_rel",
    "mq_fix_us", "mq_seq_us", "mq_kv1_us_per_tok", "mq_kv_us_per_tok",
    "d_fix_us", "d_fc_us", "d_w_us", "d_f_us_per_tok", "d_tok_us_per_tok",
)  # fmt: skip
"""The pass-level coefficients a profile measures (the overheads and depth-0 paths it cannot)."""
KV_NAMES = tuple(n for n in PASS_NAMES if "_kv" in n)


def _rows(df, component: str):
    sub = df[df["component"] == component]
    return (
        sub["batch"].to_numpy(float),
        sub["q"].to_numpy(float),
        sub["ctx"].to_numpy(float),
        sub["median_ms"].to_numpy(float),
    )


PRIOR_WEIGHT = 1e-3  # fit_profile: log-space pull of each pass coefficient towards its base value


def fit_profile(
    df, base: LatencyParams | None = None, kv_floor_us_per_tok: float = H200_8B_KV_FLOOR_US_PER_TOK
) -> tuple[LatencyParams, dict[str, float]]:
    """Fit the pass-level coefficients (:data:`PASS_NAMES`) to profile rows, least squares on log time.

    All components are fitted jointly: ``target`` rows with the ``target_gemm`` and
    ``target_attn_*`` decompositions (which pin the weight-read, compute and KV-read terms
    apart) and the ``draft``/``draft_nofc`` rows, whose attention is the target's per-layer
    attention (one formula, ``d_layers`` wide). The declared terms (:data:`DECLARED`) stay as
    ``base`` has them; every per-token KV coefficient is at least ``kv_floor_us_per_tok`` (the
    copy-bandwidth floor of one layer's KV per token).

    Args:
        df: a DataFrame with :data:`PROFILE_COLUMNS`.
        base: coefficients to keep for terms the rows cannot identify (overheads, prefill,
            depth 0, the declared hardware terms).
        kv_floor_us_per_tok: lower bound of the KV coefficients (µs per token per layer).

    Returns:
        The fitted params (with ``rel_se`` from the Jacobian) and the fitted-row MAPE per
        component.

    Raises:
        FitError: fewer than 6 target rows, or a fit that does not converge.
    """
    from scipy.optimize import least_squares

    base = base or LatencyParams()
    if len(df[df["component"] == "target"]) < 6:
        raise FitError(
            f"profile: {len(df[df['component'] == 'target'])} 'target' rows; at least 6 are needed "
            "to fit the latency model"
        )
    groups = [
        (comp, _COMPONENT_CODE[comp], COMPONENT_WEIGHT[comp], *_rows(df, comp))
        for comp in KNOWN_COMPONENTS
        if (df["component"] == comp).any()
    ]
    c0 = step_coeffs(base).copy()
    idx = np.array([STEP_COEFFS.index(n) for n in PASS_NAMES])
    x0 = np.array([getattr(base, n) for n in PASS_NAMES], dtype=float)
    kv = np.array([n in KV_NAMES for n in PASS_NAMES])
    x0[kv] = np.maximum(x0[kv], kv_floor_us_per_tok * 1.05)
    scale = np.maximum(np.abs(x0), 1e-4)

    def coeffs(z: np.ndarray) -> np.ndarray:
        c = c0.copy()
        c[idx] = z * scale
        return c

    def resid(z: np.ndarray) -> np.ndarray:
        c = coeffs(z)
        parts = []
        for _, code, weight, b, q, ctx, ms in groups:
            out = np.empty(len(b))
            _component_array(c, code, b, q, ctx, out)
            parts.append(weight * np.log(np.maximum(out, 1e-9) / 1000.0 / ms))
        return np.concatenate(parts)

    lo = np.where(kv, kv_floor_us_per_tok, 0.0) / scale
    z0 = np.maximum(x0 / scale, lo * (1 + 1e-6) + 1e-12)

    def resid_prior(z: np.ndarray) -> np.ndarray:
        # Rows from one or two context lengths leave a flat valley (per-sequence against
        # per-token attention cost): without this weak pull towards ``base``, where the
        # optimizer stops in it depends on the SciPy release, and extrapolation with it (held-out
        # verify MAPE 5.4-8.9% at 4096 tokens, against 3.5% here). Too weak to move what the rows
        # identify.
        return np.concatenate([resid(z), PRIOR_WEIGHT * np.log(np.maximum(z, 1e-12) / z0)])

    sol = least_squares(
        resid_prior, z0, bounds=(lo, np.full(len(x0), np.inf)), method="trf", x_scale="jac", max_nfev=4000
    )
    if not np.all(np.isfinite(sol.x)):
        raise FitError("profile: latency fit did not converge (non-finite coefficients)")
    x = sol.x * scale
    fitted: dict[str, Any] = {n: float(v) for n, v in zip(PASS_NAMES, x)}
    lp = replace(base, **fitted)
    lp = replace(lp, rel_se=_rel_se(sol, PASS_NAMES, sol.x))
    return lp, profile_mape(lp, df)


def _rel_se(sol, names: tuple[str, ...], x: np.ndarray) -> dict[str, float]:
    """Relative standard errors from the Gauss-Newton covariance σ²(JᵀJ)⁻¹."""
    j = sol.jac
    dof = max(len(sol.fun) - len(x), 1)
    s2 = float(sol.fun @ sol.fun) / dof
    try:
        cov = np.linalg.pinv(j.T @ j) * s2
    except np.linalg.LinAlgError:
        return {n: 0.0 for n in names}
    se = np.sqrt(np.maximum(np.diag(cov), 0.0))
    out = {}
    for n, s, v in zip(names, se, x):
        # A coefficient at its bound has no meaningful SE; cap the relative spread at 50%.
        out[n] = float(min(s / abs(v), 0.5)) if abs(v) > 1e-12 else 0.0
    return out


def profile_mape(lp: LatencyParams, df) -> dict[str, float]:
    """Mean absolute percentage error of the predicted ``median_ms``, per component present."""
    out: dict[str, float] = {}
    for comp in sorted(set(df["component"])):
        if comp not in KNOWN_COMPONENTS:
            continue
        b, q, c, m = _rows(df, comp)
        pred = predict_component_ms(lp, comp, b, q, c)
        out[comp] = float(np.mean(np.abs(pred - m) / m) * 100.0)
    return out


def profile_errors(lp: LatencyParams, df):
    """Per row of ``df``: ``predicted_ms`` and ``err_pct``, and ``part`` — the component, with
    ``target`` split into ``target decode`` (q = 1) and ``target verify`` (q > 1)."""
    out = df[df["component"].isin(KNOWN_COMPONENTS)].copy()
    pred = np.empty(len(out))
    for comp in set(out["component"]):
        mask = (out["component"] == comp).to_numpy()
        sub = out[mask]
        pred[mask] = predict_component_ms(lp, comp, sub["batch"], sub["q"], sub["ctx"])
    out["predicted_ms"] = pred
    out["err_pct"] = (pred / out["median_ms"].to_numpy() - 1.0) * 100.0
    part = out["component"].astype(str).to_numpy().copy()
    tgt = part == "target"
    part[tgt] = np.where(out["q"].to_numpy()[tgt] > 1, "target verify", "target decode")
    out["part"] = part
    return out


def read_profile(path: str):
    """Read a latency-profile CSV (the format of ``reference/h200_llama8b/latency.csv``).

    Raises:
        FitError: unreadable, empty, missing columns, or non-positive/non-numeric times;
            the message names the file.
    """
    import pandas as pd

    try:
        df = pd.read_csv(path)
    except FileNotFoundError:
        raise FitError(f"{path}: no such profile CSV") from None
    except (pd.errors.EmptyDataError, pd.errors.ParserError, UnicodeDecodeError) as exc:
        raise FitError(f"{path}: not a readable CSV ({type(exc).__name__}: {str(exc)[:120]})") from None
    missing = [c for c in PROFILE_COLUMNS if c not in df.columns]
    if missing:
        raise FitError(f"{path}: missing column(s) {', '.join(missing)}; need {', '.join(PROFILE_COLUMNS)}")
    if len(df) == 0:
        raise FitError(f"{path}: no rows")
    for c in ("batch", "q", "ctx", "median_ms"):
        vals = pd.to_numeric(df[c], errors="coerce")
        bad = vals.isna() | (vals < 0) | ((vals <= 0) if c in ("median_ms", "batch", "q") else False)
        if bad.any():
            row = int(np.argmax(bad.to_numpy())) + 2  # 1-based, after the header
            raise FitError(
                f"{path}: line {row}: column {c!r} must be a positive number, got {df[c].iloc[row - 2]!r}"
            )
        df[c] = vals
    df["component"] = df["component"].astype(str)
    return df
