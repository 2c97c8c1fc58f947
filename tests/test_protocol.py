"""Wire protocol v1: round trips, field ranges, and every error code the codec itself raises.

The codes that need the service's state (``unknown_instance``, ``wrong_direction``,
``internal``) are exercised against a live server in ``test_server.py``.
"""

from __future__ import annotations

import math
import random
import subprocess
import sys
from typing import Any

import msgpack
import pytest

from controller.protocol import (
    ERROR_CODES,
    MAX_BS,
    MAX_COUNT,
    MAX_DEPTH,
    MAX_DEPTHS,
    MAX_FRAME_BYTES,
    MAX_INSTANCE_CHARS,
    MAX_STEP_US,
    MAX_TEXT_CHARS,
    MAX_U63,
    PROTOCOL_VERSION,
    Decision,
    Error,
    Hello,
    ProtocolError,
    Step,
    Welcome,
    _instance,
    _int,
    check_step,
    decision_encoder,
    decode,
    encode,
    from_wire,
    pack,
    parse_decision,
    parse_step,
    read_step,
    unpack,
)
from controller.protocol import _parse_step_checked as parse_step_checked


def good_step(**over: Any) -> dict[str, Any]:
    wire = Step("i", 7, 3, 4, 2, [0, 1, 2, 3], 12_000, 4096, 0.5, 128, 123_456_789).to_wire()
    wire.update(over)
    return wire


def code_of(frame_or_wire: bytes | dict[str, Any]) -> str:
    frame = frame_or_wire if isinstance(frame_or_wire, bytes) else msgpack.packb(frame_or_wire)
    with pytest.raises(ProtocolError) as info:
        decode(frame)
    assert info.value.code in ERROR_CODES
    assert info.value.msg
    return info.value.code


@pytest.mark.parametrize(
    "msg",
    [
        Hello("replica-0", (0, 1, 3, 5), "sglang-0.5.23", "llama-8b", 2),
        Step("replica-0", 0, 0, 1, 0, [], 0, 0, 0.0, 0, 0),
        Step(
            "r", MAX_U63, MAX_DEPTH, 3, MAX_COUNT, [0, MAX_DEPTH, 5], MAX_STEP_US, MAX_COUNT, 1.0, 7, MAX_U63
        ),
        Welcome("ppo:ppo.zip", 1),
        Decision("replica-0", 99, 3),
        Error("bad_field", "why"),
    ],
)
def test_round_trip(msg: Any) -> None:
    frame = encode(msg)
    assert decode(frame) == msg
    wire = unpack(frame)
    assert wire["v"] == PROTOCOL_VERSION and wire["t"] == type(msg).__name__.lower()


def test_unknown_keys_are_ignored() -> None:
    assert decode(pack(good_step(future={"x": 1}, extra=[1, 2]))) == decode(pack(good_step()))


def test_step_tokens_is_accept_plus_one_per_request() -> None:
    assert Step("i", 0, 3, 4, 0, [0, 1, 2, 3], 1, 1, 0.0, 0, 0).tokens == 4 + 6
    assert Step("i", 0, 0, 5, 0, [], 1, 1, 0.0, 0, 0).tokens == 5


def test_kv_usage_accepts_int_zero_and_one() -> None:
    assert decode(pack(good_step(kv_usage=1))).kv_usage == 1.0  # type: ignore[union-attr]
    assert decode(pack(good_step(kv_usage=0))).kv_usage == 0.0  # type: ignore[union-attr]


# --------------------------------------------------------------------------- frame-level codes


def test_too_large_boundary() -> None:
    base = pack(good_step(pad=""))
    pad = "x" * (MAX_FRAME_BYTES - len(base) - 2)  # str16 header: 3 bytes instead of 1
    exact = pack(good_step(pad=pad))
    assert len(exact) == MAX_FRAME_BYTES
    decode(exact)
    assert code_of(pack(good_step(pad=pad + "x"))) == "too_large"


@pytest.mark.parametrize(
    "frame",
    [
        b"",
        b"\xc1",
        b"\x85\xa1t",
        pack(good_step())[:-1],
        pack(good_step()) + b"\x00",
        b"\x91" * 5000 + b"\xc0",
    ],
)
def test_bad_msgpack(frame: bytes) -> None:
    assert code_of(frame) == "bad_msgpack"


@pytest.mark.parametrize("value", [[1], 5, "step", None, {1: 2}, {b"t": "step"}])
def test_not_a_map(value: Any) -> None:
    assert code_of(msgpack.packb(value, use_bin_type=True)) == "not_a_map"


@pytest.mark.parametrize("extra", [{1: 2}, {b"pad": 1}, {None: 1}, {1.5: "x"}])
def test_a_step_with_one_non_string_key_is_not_a_map(extra: dict[Any, Any]) -> None:
    assert code_of(msgpack.packb({**good_step(), **extra}, use_bin_type=True)) == "not_a_map"


@pytest.mark.parametrize("extra", [{"x": {1: 2}}, {"x": b"\xc4\xc5"}, {"x": [{b"k": 1}]}])
def test_unknown_fields_may_hold_anything(extra: dict[str, Any]) -> None:
    """Only the top-level keys must be strings: what an unknown field holds is ignored."""
    assert decode(msgpack.packb({**good_step(), **extra}, use_bin_type=True)) == decode(pack(good_step()))


def _reference_unpack(frame: bytes) -> Any:
    """unpack's frame-level rules, one by one, without its fast path."""
    if len(frame) > MAX_FRAME_BYTES:
        return "too_large"
    try:
        wire = msgpack.unpackb(frame, strict_map_key=False)
    except Exception:
        return "bad_msgpack"
    if type(wire) is not dict or any(type(k) is not str for k in wire):
        return "not_a_map"
    if type(wire.get("v")) is not int or wire["v"] != PROTOCOL_VERSION:
        return "bad_version"
    return wire


def test_unpack_agrees_with_its_rules_on_mutated_frames() -> None:
    """unpack trusts a frame without the bin tags 0xc4-0xc6 to have only str keys, and decodes
    with strict map keys first: neither may change an outcome."""
    rng = random.Random(11)
    keys: list[Any] = [1, -1, b"t", b"\xc4", None, 2.5, True, "t", "x"]
    values: list[Any] = [{1: 2}, {b"k": b"v"}, b"\xc4", [b"", {3: 4}], "\xc4", 1.5, None]
    seen: set[Any] = set()
    for n in range(5_000):
        wire: dict[Any, Any] = good_step(accept=[rng.randint(0, 3) for _ in range(4)])
        for _ in range(rng.choice((0, 1, 2))):
            wire[rng.choice(keys)] = rng.choice(values)
        frame = bytearray(msgpack.packb(wire, use_bin_type=True))
        for _ in range(rng.choice((0, 0, 1, 3))):  # flip a byte, often into a bin tag
            frame[rng.randrange(len(frame))] = rng.choice((0xC4, 0xC5, 0xC6, rng.randrange(256)))
        want = _reference_unpack(bytes(frame))
        try:
            got: Any = unpack(bytes(frame))
        except ProtocolError as exc:
            got = exc.code
        assert got == want, (n, bytes(frame))
        seen.add(want if isinstance(want, str) else "ok")
    assert seen == {"ok", "bad_msgpack", "not_a_map", "bad_version"}


@pytest.mark.parametrize("v", [None, 0, 2, "1", 1.0, True, -1])
def test_bad_version(v: Any) -> None:
    wire = good_step(v=v) if v is not None else {k: x for k, x in good_step().items() if k != "v"}
    assert code_of(wire) == "bad_version"


@pytest.mark.parametrize("t", [None, "", "Step", "steps", 1, ["step"]])
def test_unknown_type(t: Any) -> None:
    wire = good_step(t=t) if t is not None else {k: x for k, x in good_step().items() if k != "t"}
    assert code_of(wire) == "unknown_type"


# --------------------------------------------------------------------------- field ranges

INT_RANGES = {
    "seq": (0, MAX_U63),
    "bs": (1, MAX_BS),
    "waiting": (0, MAX_COUNT),
    "step_us": (0, MAX_STEP_US),
    "ctx_tokens": (0, MAX_COUNT),
    "prefill_tokens": (0, MAX_COUNT),
    "ts_ns": (0, MAX_U63),
}


@pytest.mark.parametrize("field", sorted(INT_RANGES))
def test_step_int_field_ranges(field: str) -> None:
    lo, hi = INT_RANGES[field]
    depth0 = {"depth": 0, "accept": []}  # so bs may vary freely
    for ok in (lo, hi):
        decode(pack(good_step(**depth0, **{field: ok})))
    for bad in (lo - 1, hi + 1, float(lo), True, "1", None, [lo]):
        if bad is True and lo == 1:
            bad = False  # False is the bool that lies outside 1..hi
        assert code_of(good_step(**depth0, **{field: bad})) == "bad_field", (field, bad)


def test_missing_field_is_bad_field() -> None:
    for field in (
        "instance",
        "seq",
        "bs",
        "waiting",
        "step_us",
        "ctx_tokens",
        "kv_usage",
        "prefill_tokens",
        "ts_ns",
    ):
        wire = {k: x for k, x in good_step().items() if k != field}
        assert code_of(wire) == "bad_field", field


def test_depth_range() -> None:
    assert code_of(good_step(depth=-1)) == "bad_field"
    assert code_of(good_step(depth=MAX_DEPTH + 1)) == "bad_field"
    assert code_of(good_step(depth=3.0)) == "bad_field"


@pytest.mark.parametrize("kv", [-0.01, 1.0001, math.nan, math.inf, -math.inf, "0.5", None, True])
def test_kv_usage_range(kv: Any) -> None:
    assert code_of(good_step(kv_usage=kv)) == "bad_field"


@pytest.mark.parametrize(
    "accept",
    [
        [0, 1, 2],  # shorter than bs
        [0, 1, 2, 3, 0],  # longer than bs
        [0, 1, 2, 4],  # above depth
        [0, 1, 2, -1],
        [0, 1, 2, 1.0],
        [0, 1, 2, True],
        [0, 1, 2, None],
        "0123",
        None,
        {"a": 1},
    ],
)
def test_bad_accept(accept: Any) -> None:
    assert code_of(good_step(accept=accept)) == "bad_accept"


def test_accept_must_be_empty_at_depth_zero() -> None:
    assert code_of(good_step(depth=0)) == "bad_accept"
    decode(pack(good_step(depth=0, accept=[])))


def test_instance_length() -> None:
    decode(pack(good_step(instance="x" * MAX_INSTANCE_CHARS)))
    assert code_of(good_step(instance="x" * (MAX_INSTANCE_CHARS + 1))) == "bad_field"
    assert code_of(good_step(instance="")) == "bad_field"
    assert code_of(good_step(instance=b"bytes")) == "bad_field"


@pytest.mark.parametrize(
    "depths",
    [
        [],
        [1, 0],
        [0, 0],
        [-1, 0],
        [0, MAX_DEPTH + 1],
        list(range(MAX_DEPTHS + 1)),
        [0, 1.0],
        [0, True],
        "0,1",
        None,
    ],
)
def test_hello_bad_depths(depths: Any) -> None:
    assert code_of({**Hello("h", (0, 1)).to_wire(), "depths": depths}) == "bad_field"


def test_hello_fields() -> None:
    wire = {"t": "hello", "v": 1, "instance": "h", "depths": [0, 2], "engine": "e", "model": "m", "tp": 4}
    assert decode(msgpack.packb(wire)) == Hello("h", (0, 2), "e", "m", 4)
    for key in ("engine", "model", "tp", "depths", "instance"):  # every hello field is required
        assert code_of({k: v for k, v in wire.items() if k != key}) == "bad_field"
    assert code_of({**Hello("h", (0,)).to_wire(), "engine": "e" * (MAX_TEXT_CHARS + 1)}) == "bad_field"
    assert code_of({**Hello("h", (0,)).to_wire(), "tp": 0}) == "bad_field"
    assert code_of({**Hello("h", (0,)).to_wire(), "model": 5}) == "bad_field"
    decode(pack(Hello("h", tuple(range(MAX_DEPTHS))).to_wire()))


def test_controller_to_hook_messages_validate() -> None:
    assert (
        code_of({"t": "decision", "v": 1, "instance": "a", "seq": 1, "depth": MAX_DEPTH + 1}) == "bad_field"
    )
    assert code_of({"t": "welcome", "v": 1, "policy": "p", "features": -1}) == "bad_field"
    assert code_of({"t": "error", "v": 1, "code": ""}) == "bad_field"
    err = from_wire({"t": "error", "v": 1, "code": "x" * 100})
    assert isinstance(err, Error) and len(err.code) == 64 and err.msg == ""


# --------------------------------------------------------------------------- checks needing state


def _outcome(parse: Any, wire: dict[str, Any]) -> Any:
    try:
        return parse(wire)
    except ProtocolError as exc:
        return exc.code


def test_step_fast_path_agrees_with_the_rule_by_rule_parser() -> None:
    """parse_step's one-pass fast path accepts exactly what the per-field checks accept."""
    rng = random.Random(5)
    odd = [None, True, False, -1, 0, 1, 2, 3, 255, 256, 2**40, 2**63, 1.0, 0.5, math.nan, "1", b"1", [], [1]]
    fields = list(good_step())
    fast_hits = 0
    for n in range(20_000):
        depth = rng.choice((0, 1, 3, MAX_DEPTH))
        bs = rng.randint(1, 6)
        wire = good_step(
            depth=depth, bs=bs, accept=[rng.randint(0, depth) for _ in range(bs)] if depth else []
        )
        for _ in range(rng.choice((0, 0, 1, 2))):  # mutate a field, or an accept entry
            key = rng.choice(fields)
            if key == "accept" and type(wire.get("accept")) is list and wire["accept"] and rng.random() < 0.7:
                wire["accept"] = list(wire["accept"])
                wire["accept"][rng.randrange(len(wire["accept"]))] = rng.choice(odd)
            elif rng.random() < 0.1:
                wire.pop(key, None)
            else:
                wire[key] = rng.choice(odd)
        got, want = _outcome(parse_step, wire), _outcome(parse_step_checked, wire)
        assert got == want, (n, wire)
        # With the frame (as serve calls it), which lets the accept check skip a pass.
        frame = msgpack.packb(wire)
        framed = _outcome(lambda w: read_step(w, frame), wire)  # noqa: B023 (called right here)
        if isinstance(framed, tuple):
            assert framed[1] == bytes(framed[0].accept), (n, wire)
            framed = framed[0]
        assert framed == want, (n, wire)
        fast_hits += isinstance(got, Step)
    assert fast_hits > 5_000  # the valid share really went through (and agreed with) both


@pytest.mark.parametrize("entry", [True, False])
def test_a_bool_in_accept_is_refused_with_the_frame_too(entry: bool) -> None:
    """read_step skips the per-entry type check for frames without msgpack's bool tags: a
    bool anywhere puts one there (here the only 0xc2/0xc3 byte of the frame)."""
    wire = good_step(accept=[0, 1, entry, 3])
    frame = msgpack.packb(wire)
    assert frame.count(0xC3) + frame.count(0xC2) == 1
    with pytest.raises(ProtocolError) as info:
        read_step(unpack(frame), frame)
    assert info.value.code == "bad_accept"
    ok = msgpack.packb(good_step())
    assert read_step(unpack(ok), ok) == (parse_step(unpack(ok)), bytes([0, 1, 2, 3]))


@pytest.mark.parametrize(
    "wire",
    [
        {"instance": "a", "seq": 1, "depth": 2},
        {"instance": "", "seq": 1, "depth": 2},
        {"instance": "a", "seq": True, "depth": 2},
        {"instance": "a", "seq": 1, "depth": MAX_DEPTH + 1},
        {"instance": "a", "seq": -1, "depth": 2},
        {"instance": "a" * (MAX_INSTANCE_CHARS + 1), "seq": 1, "depth": 2},
        {"seq": 1, "depth": 2},
    ],
)
def test_decision_fast_path_agrees_with_the_field_checks(wire: dict[str, Any]) -> None:
    def checked(w: dict[str, Any]) -> Decision:
        return Decision(_instance(w), _int(w, "seq", 0, MAX_U63), _int(w, "depth", 0, MAX_DEPTH))

    assert _outcome(parse_decision, wire) == _outcome(checked, wire)


@pytest.mark.parametrize("instance", ["a", "x" * 31, "y" * 32, "ü" * MAX_INSTANCE_CHARS])
def test_decision_encoder_makes_the_bytes_of_encode(instance: str) -> None:
    encode_decision = decision_encoder(instance)
    for seq in (0, 1, 127, 128, 2**16, 2**32, MAX_U63):
        for depth in range(MAX_DEPTH + 1):
            assert encode_decision(seq, depth) == encode(Decision(instance, seq, depth)), (seq, depth)


def test_check_step_depth_and_seq() -> None:
    step = decode(pack(good_step()))
    assert isinstance(step, Step)
    check_step(step, (0, 3), None)
    check_step(step, (0, 3), 6)
    with pytest.raises(ProtocolError) as info:
        check_step(step, (0, 1, 2), None)
    assert info.value.code == "bad_depth"
    for last in (7, 8):
        with pytest.raises(ProtocolError) as info:
            check_step(step, (0, 3), last)
        assert info.value.code == "stale_seq"


def test_protocol_imports_only_stdlib_and_msgpack() -> None:
    # Compared with a bare interpreter: site hooks (.pth files) may preload unrelated modules.
    code = (
        "import sys; before = set(sys.modules); import controller.protocol; "
        "new = {m.split('.')[0] for m in set(sys.modules) - before}; "
        "print(sorted(m for m in new if m not in sys.stdlib_module_names and not m.startswith('_')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert set(eval(out)) <= {"controller", "msgpack", "cython_runtime"}, out  # msgpack is Cython
