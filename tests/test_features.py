"""The Featurizer: fixed size, determinism, bounded state, and known values of its estimates."""

from __future__ import annotations

import math
import pickle
import random

import numpy as np
import pytest

from controller.features import (
    ACCEPT_DECAY,
    FAST,
    FEATURIZER_VERSION,
    PRIOR_ACCEPT,
    PRIOR_WEIGHT,
    SLOW,
    STALE_DECAY,
    Featurizer,
    bs_bucket,
    decode_bs,
    decode_ctx,
    encode_bs,
    encode_ctx,
)
from controller.protocol import Step

DEPTHS = (0, 1, 2, 3, 5)


def step(seq: int, depth: int, accept: list[int], bs: int | None = None, **kw: int | float) -> Step:
    bs = len(accept) if bs is None else bs
    fields: dict[str, int | float] = dict(
        waiting=0, step_us=10_000, ctx_tokens=1000 * bs, kv_usage=0.25, prefill_tokens=0
    )
    fields.update(kw)
    return Step(
        "i",
        seq,
        depth,
        bs,
        int(fields["waiting"]),
        accept,
        int(fields["step_us"]),
        int(fields["ctx_tokens"]),
        float(fields["kv_usage"]),
        int(fields["prefill_tokens"]),
        seq * 1000,
    )


def random_stream(n: int, seed: int = 0, depths: tuple[int, ...] = DEPTHS) -> list[Step]:
    rng = random.Random(seed)
    out = []
    for seq in range(n):
        d = rng.choice(depths)
        bs = rng.randint(1, 300)
        accept = [min(d, int(rng.expovariate(0.5))) for _ in range(bs)] if d else []
        out.append(
            step(
                seq,
                d,
                accept,
                bs=bs,
                waiting=rng.randint(0, 50),
                step_us=rng.randint(0, 90_000),
                ctx_tokens=rng.randint(0, 10**7),
                kv_usage=rng.random(),
            )
        )
    return out


def names(f: Featurizer) -> dict[str, int]:
    return {n: i for i, n in enumerate(f.feature_names)}


def test_fixed_size_dtype_and_finite() -> None:
    f = Featurizer(DEPTHS)
    assert f.version == FEATURIZER_VERSION
    assert len(f.feature_names) == f.obs_dim == len(set(f.feature_names))
    assert f.obs_dim == 10 + 2 * len(DEPTHS) + max(DEPTHS) + 3 * len(DEPTHS)
    for s in random_stream(2000):
        obs = f.update(s)
        assert obs.shape == (f.obs_dim,) and obs.dtype == np.float32
        assert np.isfinite(obs).all()


def test_extreme_but_valid_records_stay_finite() -> None:
    f = Featurizer((0, 32))
    for seq, (d, bs) in enumerate([(0, 1), (32, 65536), (0, 65536), (32, 1)]):
        accept = [32] * bs if d else []
        obs = f.update(
            step(seq, d, accept, bs=bs, waiting=2**40, step_us=3_600_000_000, ctx_tokens=2**40, kv_usage=1.0)
        )
        assert np.isfinite(obs).all()
        obs = f.update(step(seq, d, [0] * bs if d else [], bs=bs, step_us=0, ctx_tokens=0, kv_usage=0.0))
        assert np.isfinite(obs).all()


def test_deterministic_and_reset_replays_bit_for_bit() -> None:
    stream = random_stream(500, seed=3)
    a, b = Featurizer(DEPTHS), Featurizer(DEPTHS)
    first = [a.update(s).tobytes() for s in stream]
    assert first == [b.update(s).tobytes() for s in stream]
    a.reset()
    assert first == [a.update(s).tobytes() for s in stream]


def test_accept_bytes_from_the_parser_fold_the_same_as_the_list() -> None:
    """serve hands update_with the bytes that validating accept built (read_step)."""
    from controller.features import _fold

    stream = random_stream(300, seed=4)
    a, b = Featurizer(DEPTHS), Featurizer(DEPTHS)
    for s in stream:
        assert a.update(s).tobytes() == b.update_with(s, _fold, bytes(s.accept)).tobytes()


def test_returned_observations_are_independent_copies() -> None:
    f = Featurizer(DEPTHS)
    o1 = f.update(step(0, 2, [1, 2]))
    keep = o1.copy()
    o1[:] = 99.0  # a caller scribbling on its array must not leak into the next one
    f.update(step(1, 2, [1, 2]))
    o2 = f.update(step(2, 2, [1, 2]))
    assert not np.array_equal(o2, o1) and np.isfinite(o2).all() and keep[0] != 99.0


def test_state_does_not_grow_with_history() -> None:
    f = Featurizer(DEPTHS)
    stream = random_stream(10_100, seed=5)
    for s in stream[:100]:
        f.update(s)
    state = {k: v for k, v in vars(f).items() if k != "_last"}
    size_100 = len(pickle.dumps(state))
    for s in stream[100:]:
        f.update(s)
    state = {k: v for k, v in vars(f).items() if k != "_last"}
    assert len(pickle.dumps(state)) <= size_100 + 64


def test_simple_features_known_values() -> None:
    f = Featurizer(DEPTHS)
    idx = names(f)
    obs = f.update(step(0, 3, [0, 1, 2, 3], waiting=12, ctx_tokens=4 * 2047, kv_usage=0.75, step_us=4000))
    assert obs[idx["bs"]] == pytest.approx(encode_bs(4), rel=1e-6)
    assert obs[idx["waiting"]] == pytest.approx(encode_bs(12), rel=1e-6)
    assert obs[idx["queue_frac"]] == pytest.approx(12 / 16)
    assert obs[idx["ctx_per_req"]] == pytest.approx(encode_ctx(2047), rel=1e-6)
    assert obs[idx["kv_usage"]] == pytest.approx(0.75)
    assert obs[idx["step_ms"]] == pytest.approx(math.log1p(4.0) / math.log1p(1000), rel=1e-6)
    assert [obs[idx[f"depth={d}"]] for d in DEPTHS] == [0, 0, 0, 1, 0]
    assert obs[idx["spec_staleness"]] == 0.0
    assert obs[idx["bs_trend"]] == 0.0  # fast and slow EMAs start equal


def test_the_scales_are_the_documented_ones_and_decode_inverts_encode() -> None:
    """``bs``/``waiting`` read log1p(x)/log1p(256) and ``ctx_per_req`` log1p(x)/log1p(32768)
    (module docstring); decode gives back what was encoded, for numbers and arrays alike."""
    assert encode_bs(0) == 0.0 and encode_ctx(0.0) == 0.0
    assert encode_bs(256) == pytest.approx(1.0, rel=1e-15)
    assert encode_ctx(32768) == pytest.approx(1.0, rel=1e-15)
    assert encode_bs(4) == pytest.approx(math.log(5) / math.log(257), rel=1e-15)
    assert encode_ctx(2047) == pytest.approx(math.log(2048) / math.log(32769), rel=1e-15)
    for n in range(0, 1025):
        assert round(decode_bs(encode_bs(n))) == n
        assert decode_bs(encode_bs(n)) == pytest.approx(n, rel=1e-12, abs=1e-12)
    for tokens in (0.0, 0.5, 1.0, 3.7, 1000.0, 2047.0, 32768.0, 1e6):
        assert decode_ctx(encode_ctx(tokens)) == pytest.approx(tokens, rel=1e-12, abs=1e-12)
    for x in (0.0, 0.3, 0.7, 1.0, 1.125):
        assert encode_bs(decode_bs(x)) == pytest.approx(x, abs=1e-14)
        assert encode_ctx(decode_ctx(x)) == pytest.approx(x, abs=1e-14)
    # Arrays: float64 of the shape given, each entry exactly the number's (float32 in too).
    for fn, x in (
        (encode_bs, np.array([[1, 2], [64, 300]], dtype=np.int64)),
        (encode_ctx, np.array([0.0, 2.5, 1e4], dtype=np.float32)),
        (decode_bs, np.linspace(0.0, 1.125, 145)),
        (decode_ctx, np.linspace(0.0, 1.0, 11)),
    ):
        got = fn(x)
        assert isinstance(got, np.ndarray) and got.dtype == np.float64 and got.shape == x.shape
        assert got.ravel().tolist() == [fn(v) for v in x.ravel().tolist()]


def test_the_observation_uses_the_encode_scales_bit_for_bit() -> None:
    """The Featurizer's ``bs``, ``waiting`` and ``ctx_per_req`` are encode_bs / encode_ctx of
    the record, to the float32 bit, and its ``bs_trend`` starts from encode_bs too."""
    rnd = random.Random(11)
    f = Featurizer(DEPTHS)
    idx = names(f)
    seen = set()
    for seq in range(300):
        bs = rnd.choice((1, 2, 3, 7, 8, 33, 100, 255, 256, 257, 511, 4096))
        waiting = rnd.choice((0, 1, 5, 12, 200, 1000))
        ctx = rnd.randint(0, 40_000) * bs
        obs = f.update(step(seq, 0, [], bs=bs, waiting=waiting, ctx_tokens=ctx))
        assert obs[idx["bs"]] == np.float32(encode_bs(bs)), bs
        assert obs[idx["waiting"]] == np.float32(encode_bs(waiting)), waiting
        assert obs[idx["ctx_per_req"]] == np.float32(encode_ctx(ctx / bs)), (ctx, bs)
        seen.add(bs)
    assert len(seen) > 8
    f = Featurizer(DEPTHS)
    f.update(step(0, 0, [], bs=5))
    obs = f.update(step(1, 0, [], bs=40))
    # fast − slow EMA of the bs feature after one move from 5 to 40 requests
    assert obs[idx["bs_trend"]] == pytest.approx((FAST - SLOW) * (encode_bs(40) - encode_bs(5)), rel=1e-6)


def test_acceptance_per_position_one_batch_known_values() -> None:
    # One step at depth 3, bs 4, accepted drafts [0, 1, 2, 3]:
    #   position 1 reached by 4 requests, accepted by 3 (a >= 1)
    #   position 2 reached by 3 (a >= 1),  accepted by 2 (a >= 2)
    #   position 3 reached by 2 (a >= 2),  accepted by 1 (a >= 3)
    f = Featurizer(DEPTHS)
    idx = names(f)
    obs = f.update(step(0, 3, [0, 1, 2, 3]))
    prior = PRIOR_ACCEPT * PRIOR_WEIGHT
    want = [
        (3 + prior) / (4 + PRIOR_WEIGHT),
        (2 + prior) / (3 + PRIOR_WEIGHT),
        (1 + prior) / (2 + PRIOR_WEIGHT),
    ]
    for i, p in enumerate(want, start=1):
        assert f.accept_prob(i) == pytest.approx(p)
        assert obs[idx[f"p_accept_{i}"]] == pytest.approx(p, rel=1e-6)
    # Positions never reached keep the prior.
    assert obs[idx["p_accept_4"]] == pytest.approx(PRIOR_ACCEPT) and f.accept_prob(5) == pytest.approx(
        PRIOR_ACCEPT
    )
    # Expected tokens per request at depth k: 1 + sum_i prod_{j<=i} p_j, reported / (k + 1).
    p1, p2, p3 = want
    tokens_3 = 1 + p1 + p1 * p2 + p1 * p2 * p3
    assert f.expected_tokens(3) == pytest.approx(tokens_3)
    assert obs[idx["tokens_3"]] == pytest.approx(tokens_3 / 4, rel=1e-6)
    assert obs[idx["tokens_0"]] == pytest.approx(1.0)
    tokens_5 = tokens_3 + p1 * p2 * p3 * PRIOR_ACCEPT + p1 * p2 * p3 * PRIOR_ACCEPT**2
    assert obs[idx["tokens_5"]] == pytest.approx(tokens_5 / 6, rel=1e-6)


def test_acceptance_decays_per_speculative_step_only() -> None:
    f = Featurizer(DEPTHS)
    f.update(step(0, 1, [1, 1]))  # position 1: 2 of 2
    f.update(step(1, 0, [], bs=7))  # depth 0 brings no acceptance evidence: no decay
    f.update(step(2, 1, [0, 0]))  # position 1: 0 of 2, older batch decayed once
    acc, tried = 2 * ACCEPT_DECAY + 0, 2 * ACCEPT_DECAY + 2
    want = (acc + PRIOR_ACCEPT * PRIOR_WEIGHT) / (tried + PRIOR_WEIGHT)
    assert f.accept_prob(1) == pytest.approx(want)


def test_acceptance_evidence_ages_back_to_the_prior_while_nothing_is_drafted() -> None:
    # A bad stretch must not freeze a pessimistic estimate forever once drafting stops: the
    # evidence loses weight per depth-0 step, so a policy trusting it will look again.
    f = Featurizer(DEPTHS)
    for seq in range(30):
        f.update(step(seq, 3, [0] * 8, bs=8))
    low = f.accept_prob(1)
    assert low < 0.05
    seen = [f.accept_prob(1)]
    for seq in range(30, 230):
        f.update(step(seq, 0, [], bs=8))
        seen.append(f.accept_prob(1))
    assert all(a < b for a, b in zip(seen, seen[1:]))  # monotone recovery
    w = STALE_DECAY**200
    acc, tried = f._acc[1], f._tried[1]
    assert f.accept_prob(1) == pytest.approx(
        (w * acc + PRIOR_ACCEPT * PRIOR_WEIGHT) / (w * tried + PRIOR_WEIGHT)
    )
    assert f.accept_prob(1) > PRIOR_ACCEPT - 0.05
    # The observation carries the same aged estimate.
    obs = f.update(step(230, 0, [], bs=8))
    assert obs[f.feature_names.index("p_accept_1")] == pytest.approx(f.accept_prob(1), rel=1e-6)
    # One speculative step brings fresh evidence at full weight again.
    f.update(step(231, 1, [1] * 8, bs=8))
    acc, tried = f._acc[1], f._tried[1]
    assert f.accept_prob(1) == (acc + PRIOR_ACCEPT * PRIOR_WEIGHT) / (tried + PRIOR_WEIGHT)


def test_version_7_takes_no_evidence_from_the_first_drafted_step_after_depth_0() -> None:
    """The off switch's resume proposes from a stale state and accepts nothing: version 7 reads
    that step as no evidence (counts, trend and staleness as at depth 0), version 5 as a bad
    drafter; the drafted steps after it count in both."""
    v5, v7, off = Featurizer(DEPTHS, 5), Featurizer(DEPTHS, 7), Featurizer(DEPTHS, 7)
    for f in (v5, v7, off):
        for seq in range(20):
            f.update(step(seq, 3, [3] * 8, bs=8))
        f.update(step(20, 0, [], bs=8))
    before = v7.accept_prob(1), v7._acc[1], v7._tried[1]
    o5, o7 = v5.update(step(21, 3, [0] * 8, bs=8)), v7.update(step(21, 3, [0] * 8, bs=8))
    off.update(step(21, 0, [], bs=8))  # what a second step at depth 0 would leave
    assert (v7._acc[1], v7._tried[1]) == before[1:]
    assert v7.accept_prob(1) == off.accept_prob(1) > before[0] - 0.001
    assert v5.accept_prob(1) < before[0] - 0.05
    stale = v7.feature_names.index("spec_staleness")
    assert o7[stale] > 0.0 and o5[stale] == 0.0  # nothing drafted as far as version 7 reads
    # The next drafted step is evidence again, in both (a run at depth > 0 is no resume).
    for f in (v5, v7):
        acc = f._acc[1]
        f.update(step(22, 3, [0] * 8, bs=8))
        assert f._acc[1] == pytest.approx(acc * ACCEPT_DECAY)
    assert v7.accept_prob(1) < before[0]


def test_version_7_reads_a_stream_without_resumes_as_version_5() -> None:
    a, b = Featurizer(DEPTHS, 5), Featurizer(DEPTHS, 7)
    for s in random_stream(300, seed=4, depths=(1, 2, 3, 5)):
        assert np.array_equal(a.update(s), b.update(s))


@pytest.mark.parametrize("true_p", [0.3, 0.8])
def test_acceptance_converges_to_the_true_conditional_rate(true_p: float) -> None:
    # Each draft position accepted with probability true_p given the earlier ones were: the
    # estimate of every position must find true_p, whatever depth the steps ran with.
    rng = random.Random(11)
    f = Featurizer(DEPTHS)
    for seq in range(400):
        d = rng.choice((1, 2, 3, 5))
        accept = []
        for _ in range(128):
            a = 0
            while a < d and rng.random() < true_p:
                a += 1
            accept.append(a)
        f.update(step(seq, d, accept))
    for i in (1, 2, 3):
        assert f.accept_prob(i) == pytest.approx(true_p, abs=0.06), i
    want = sum(true_p**i for i in range(4))
    assert f.expected_tokens(3) == pytest.approx(want, rel=0.08)


def test_latency_ratio_known_values_and_fallback() -> None:
    f = Featurizer(DEPTHS, version=4)  # each record enters at once; version 5: one record late
    idx = names(f)
    assert f.latency_ratio(2, 8) is None
    f.update(step(0, 0, [], bs=8, step_us=10_000))
    obs = f.update(step(1, 2, [1] * 8, step_us=15_000))
    assert bs_bucket(8) == 3
    assert f.latency_ratio(2, 8) == pytest.approx(1.5)
    assert obs[idx["lat_ratio_2"]] == pytest.approx(math.log(1.5), rel=1e-6)
    assert obs[idx["lat_ratio_0"]] == 0.0 and obs[idx["lat_ratio_3"]] == 0.0  # 3 never seen
    tokens_2 = f.expected_tokens(2)
    assert obs[idx["goodput_2"]] == pytest.approx(math.log(tokens_2 / 1.0 / 1.5), rel=1e-5)
    # Another batch-size bucket with no measurement falls back to the running ratio.
    assert f.latency_ratio(2, 100) == pytest.approx(1.5)
    # The per-bucket table follows drift with an EMA.
    f.update(step(2, 2, [1] * 8, step_us=25_000))
    assert f.latency_us(2, 8) == pytest.approx(15_000 + 0.2 * (25_000 - 15_000))


def test_ratios_are_clipped() -> None:
    f = Featurizer(DEPTHS, version=4)  # each record enters at once; version 5: one record late
    idx = names(f)
    f.update(step(0, 0, [], bs=2, step_us=1_000))
    obs = f.update(step(1, 5, [5, 5], step_us=1_000_000))
    assert obs[idx["lat_ratio_5"]] == 2.0 and obs[idx["goodput_5"]] == -2.0


def test_staleness_features() -> None:
    f = Featurizer(DEPTHS, version=4)  # each record enters at once; version 5: one record late
    idx = names(f)
    f.update(step(0, 2, [1]))
    for seq in range(1, 51):
        obs = f.update(step(seq, 0, [], bs=1))
    assert obs[idx["spec_staleness"]] == pytest.approx(1 - math.exp(-1), rel=1e-5)  # 50 steps
    assert obs[idx["lat_stale_0"]] == 0.0
    assert obs[idx["lat_stale_2"]] == pytest.approx(1 - math.exp(-50 / 200), rel=1e-5)
    assert obs[idx["lat_stale_3"]] == pytest.approx(1.0)  # never seen


def test_trends_follow_changes() -> None:
    f = Featurizer(DEPTHS)
    idx = names(f)
    for seq in range(200):
        obs = f.update(step(seq, 2, [2] * 4))
    assert abs(obs[idx["bs_trend"]]) < 1e-3 and abs(obs[idx["accept_trend"]]) < 0.01
    for seq in range(200, 205):
        obs = f.update(step(seq, 2, [0] * 64))
    assert obs[idx["bs_trend"]] > 0.1  # batch growing
    assert obs[idx["accept_trend"]] < -0.3  # acceptance collapsing


def test_accept_trend_fades_while_nothing_is_drafted() -> None:
    """A trend is evidence: without drafting it fades as the acceptance estimate does, so a
    collapse long ago does not read as "acceptance is falling" hundreds of steps later."""
    f = Featurizer(DEPTHS)
    idx = names(f)
    for seq in range(200):
        obs = f.update(step(seq, 2, [2] * 4))
    for seq in range(200, 205):
        obs = f.update(step(seq, 2, [0] * 4))
    collapsed = float(obs[idx["accept_trend"]])
    assert collapsed < -0.3
    obs = f.update(step(205, 0, [], bs=4))  # one step without drafting: faded by STALE_DECAY
    assert obs[idx["accept_trend"]] == pytest.approx(collapsed * STALE_DECAY, rel=1e-5)
    for seq in range(206, 205 + 150):
        obs = f.update(step(seq, 0, [], bs=4))
    assert abs(obs[idx["accept_trend"]]) < 0.01
    obs = f.update(step(400, 2, [0] * 4))  # drafting again: the EMAs it kept, undecayed
    assert obs[idx["accept_trend"]] < collapsed


def test_version_2_keeps_its_frozen_trend_and_nothing_else_differs() -> None:
    """Version 2 (still served, for zips trained on it) holds the trend while nothing is
    drafted; every other entry of the observation is version 3's, bit for bit."""
    v2, v3 = Featurizer(DEPTHS, version=2), Featurizer(DEPTHS, version=3)
    assert (v2.version, v3.version) == (2, 3)
    idx = names(v2)
    records = [step(s, 2, [2] * 4) for s in range(100)] + [step(s, 2, [0] * 4) for s in range(100, 105)]
    records += [step(s, 0, [], bs=4) for s in range(105, 180)]
    for rec in records:
        a, b = v2.update(rec), v3.update(rec)
    trend = idx["accept_trend"]
    assert a[trend] < -0.3 and abs(b[trend]) < 0.2 * abs(a[trend])
    others = [i for i in range(len(a)) if i != trend]
    assert np.array_equal(a[others], b[others])
    with pytest.raises(ValueError, match="Featurizer version 1"):
        Featurizer(DEPTHS, version=1)


def test_a_step_that_admitted_requests_stays_out_of_the_latency_table() -> None:
    """Version 4: a step that admitted requests (prefill_tokens > 0) timed their admission too
    (on the H100 testbed 47-58 ms at every depth, even from the prefix cache, against 9.7 ms
    for a depth-0 decode step). Its time does not become depth 0's latency at batch 64, so
    depth 3 (23 ms a step) does not read as cheaper than depth 0 (8.5 ms); version 3 took it.
    Nothing else differs (but when each depth's latency was last measured)."""
    v3, v4 = Featurizer(DEPTHS, version=3), Featurizer(DEPTHS, version=4)
    idx = names(v4)
    records = [step(1, 0, [], bs=64, step_us=54_000, prefill_tokens=8)]
    records += [step(s, 0, [], bs=64, step_us=8_500) for s in range(2, 6)]
    records += [step(s, 3, [1] * 64, step_us=23_000) for s in range(6, 11)]
    records += [step(11, 3, [1] * 64, step_us=60_000, prefill_tokens=3)]
    for rec in records:
        a, b = v3.update(rec), v4.update(rec)
    lat3 = idx["lat_ratio_3"]
    assert np.exp(b[lat3]) == pytest.approx(23_000 / 8_500, rel=1e-4)  # the decode steps' ratio
    assert a[lat3] < np.log(23_000 / 8_500) - 0.3  # version 3: depth 3 cheaper, against the 54 ms step
    lat = [i for n, i in idx.items() if n.startswith(("lat_ratio_", "lat_stale_", "goodput_"))]
    others = [i for i in range(len(a)) if i not in lat]
    assert np.array_equal(a[others], b[others])


def test_the_step_before_an_admitting_one_stays_out_of_the_latency_table() -> None:
    """Version 5: SGLang's overlap scheduler records most of an admission's time in the record
    before the one that counts the prefilled tokens (H100 drawn traces: ~30 ms over a decode
    step there, ~4 ms in the counting record). A record enters the table once the next one is
    known, and not if that one admits: the depth-0 step before an admission does not make
    depth 0 read slow; version 4 took it."""
    v4, v5 = Featurizer(DEPTHS, version=4), Featurizer(DEPTHS)
    assert v5.version == FEATURIZER_VERSION == 5
    idx = names(v5)
    records = [step(s, 0, [], bs=64, step_us=8_500) for s in range(1, 5)]
    records += [step(s, 3, [1] * 64, step_us=23_000) for s in range(5, 10)]
    records += [step(10, 0, [], bs=64, step_us=40_000)]  # timed the admission counted next
    records += [step(11, 3, [1] * 64, step_us=27_000, prefill_tokens=8)]
    records += [step(12, 3, [1] * 64, step_us=23_000)]
    for rec in records:
        a, b = v4.update(rec), v5.update(rec)
    lat3 = idx["lat_ratio_3"]
    assert np.exp(b[lat3]) == pytest.approx(23_000 / 8_500, rel=1e-4)  # the decode steps' ratio
    assert v5.latency_us(0, 64) == 8_500 and v4.latency_us(0, 64) == 8_500 + 0.2 * (40_000 - 8_500)
    assert a[lat3] < np.log(23_000 / 8_500) - 0.3  # version 4: depth 3 cheaper, against the 40 ms step
    lat = [i for n, i in idx.items() if n.startswith(("lat_ratio_", "lat_stale_", "goodput_"))]
    others = [i for i in range(len(a)) if i not in lat]
    assert np.array_equal(a[others], b[others])


def test_version_5_takes_each_decode_record_one_record_late() -> None:
    """Without admissions version 5's table is version 4's one record later: the same values,
    entered when the next record arrives (and stamped with the record's own step index)."""
    v5 = Featurizer(DEPTHS)
    v5.update(step(0, 0, [], bs=8, step_us=10_000))
    assert v5.latency_us(0, 8) == 0.0  # waits for the next record
    v5.update(step(1, 2, [1] * 8, step_us=15_000))
    assert v5.latency_us(0, 8) == 10_000 and v5.latency_us(2, 8) == 0.0
    obs = v5.update(step(2, 2, [1] * 8, step_us=15_000))
    assert v5.latency_ratio(2, 8) == pytest.approx(1.5)
    assert obs[names(v5)["lat_stale_2"]] == pytest.approx(1 - math.exp(-1 / 200), rel=1e-5)
    # Replayed one record behind, version 4 gives the same table: no admissions, no difference.
    stream = random_stream(400, seed=8)
    v4, v5 = Featurizer(DEPTHS, version=4), Featurizer(DEPTHS)
    for prev, cur in zip(stream, stream[1:]):
        v4.update(prev)
        v5.update(cur)
        for d in DEPTHS:
            for bs in (1, 8, 64, 300):
                assert v5.latency_us(d, bs) == v4.latency_us(d, bs)
                assert v5.latency_ratio(d, bs) == v4.latency_ratio(d, bs)


@pytest.mark.parametrize("depths", [(0,), (3,), (1, 2), tuple(range(16))])
def test_any_allowed_depth_set(depths: tuple[int, ...]) -> None:
    f = Featurizer(depths)
    for s in random_stream(200, seed=9, depths=depths):
        obs = f.update(s)
        assert obs.shape == (f.obs_dim,) and np.isfinite(obs).all()


@pytest.mark.parametrize("depths", [(), (1, 0), (0, 0), (-1, 2)])
def test_bad_depths_refused(depths: tuple[int, ...]) -> None:
    with pytest.raises(ValueError):
        Featurizer(depths)
