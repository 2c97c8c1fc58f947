"""Wire protocol, version 1: the one schema spoken by the hook, the controller and the simulator.

This module is the protocol's normative description. Transport: ZeroMQ, one ROUTER bound by
the controller (default :data:`DEFAULT_ENDPOINT`), one DEALER per hook process that talks (the
entry rank of each SGLang replica). Every message is one frame holding one msgpack map with
``t`` (type) and ``v`` (protocol major version); unknown keys are ignored. Frames over
:data:`MAX_FRAME_BYTES` are refused. hook → controller: ``hello`` (:class:`Hello`), then one
``step`` (:class:`Step`) per decode step. controller → hook: ``welcome`` (:class:`Welcome`)
answers a ``hello``, one ``decision`` (:class:`Decision`) answers each ``step``, and ``error``
(:class:`Error`) answers any frame it refuses.

Decision semantics: the hook never waits for the controller. At each decode launch it uses
the newest valid decision received (latest wins); with overlap scheduling that decision was
made from telemetry one or two steps old. A depth not in the ``hello``'s ``depths`` is ignored.
With no decision for ``stale_ms`` the hook falls back to SGLang's own adaptive policy (or a
fixed depth, if configured) until decisions flow again. Under the hook's default off switch a
depth above 0 right after a depth-0 launch runs one step late: one more depth-0 step first,
whose record says depth 0, then the depth decided, at least once (:class:`WarmResume`).

This module is imported inside SGLang's scheduler process, so it imports only the standard
library and msgpack. It never unpickles: msgpack maps become plain Python values, then typed
dataclasses after validation.

Error codes (the ``code`` of an ``error`` reply; each reply changes nothing else):

===================  =========================================================================
code                 meaning
===================  =========================================================================
``too_large``        the frame is over 64 KiB
``bad_msgpack``      the bytes are not one complete msgpack value
``not_a_map``        the value is not a map, or has non-string keys
``bad_version``      ``v`` is missing, not an int, or not 1
``unknown_type``     ``t`` is missing, not a string, or not a known message type
``bad_field``        a required field is missing, ill-typed, or out of range
``bad_depth``        a ``step``'s ``depth`` is not one of the instance's ``depths``
``bad_accept``       ``accept`` is not a list of ints of length ``bs`` each in 0..depth
                     (or not empty when ``depth`` is 0)
``stale_seq``        ``seq`` did not increase since the instance's previous ``step``
``unknown_instance`` a ``step`` from an instance that sent no ``hello`` (e.g. after a
                     controller restart); the hook answers by sending ``hello`` again
``wrong_direction``  a controller-to-hook message sent to the controller, or vice versa
``internal``         the controller failed on a valid message (a bug; it keeps serving)
===================  =========================================================================
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final

import msgpack

PROTOCOL_VERSION: Final = 1
MAX_FRAME_BYTES: Final = 64 * 1024
DEFAULT_ENDPOINT: Final = "ipc:///tmp/spec-controller.sock"
# The allowed draft depths a hook announces unless told otherwise (``--spec-depths``), and the
# depths the simulator, training and evaluation use by default (the bundled policies' depths).
DEFAULT_DEPTHS: Final[tuple[int, ...]] = (0, 1, 2, 3, 5)

MAX_INSTANCE_CHARS: Final = 128
MAX_TEXT_CHARS: Final = 1024
MAX_DEPTH: Final = 32
MAX_DEPTHS: Final = 16
MAX_BS: Final = 65536
MAX_COUNT: Final = 2**40
MAX_STEP_US: Final = 3_600_000_000  # one hour: anything longer is a broken clock
MAX_U63: Final = 2**63 - 1

ERROR_CODES: Final = (
    "too_large",
    "bad_msgpack",
    "not_a_map",
    "bad_version",
    "unknown_type",
    "bad_field",
    "bad_depth",
    "bad_accept",
    "stale_seq",
    "unknown_instance",
    "wrong_direction",
    "internal",
)

TO_CONTROLLER: Final = ("hello", "step")
TO_HOOK: Final = ("welcome", "decision", "error")


@dataclass(slots=True)
class WarmResume:
    """The warm resume: the depth a decode launches when a depth is decided (module docstring,
    "Decision semantics"). One rule for the hook and the simulator.

    Under the hook's ``kv`` off switch the KV-only update leaves SGLang's zeroed proposal at
    depth 0, so a drafted step right after depth 0 would draft from zeros and accept nothing.
    :meth:`depth` sits where the depth of each decode launch is chosen (in the hook,
    ``sglang_hook.actuator.ControlledParams.get_steps_for_batch``, which SGLang calls at the
    top of the step, before its verify and its drafter extend; in the simulator,
    ``env.runner.DecodeLoop``): when a depth above 0 follows depth 0 it returns 0 once more and
    marks the launch, and the hook's ``sglang_hook.off_switch.draft_extend_hook`` runs SGLang's
    whole extend for a marked launch. That extend's proposal is what the next step drafts
    from. Every TP rank sees the same depths in the same order, so every rank inserts the same
    step.

    Attributes:
        enabled: in the hook, set by ``sglang_hook.off_switch.install`` under ``kv`` unless
            ``SPECDEPTH_OFF_RESUME=cold``; in the simulator, ``EngineParams.warm_resume``.
        last: the depth the previous launch ran (-1: it was an inserted step). Starts at 0:
            before the first decode, prefills at depth 0 may have left stub proposals.
        whole_extend: the launch being run is an inserted step (read and cleared by the hook's
            drafter extend).
        owed: the depth asked when the last step was inserted.
    """

    enabled: bool = False
    last: int = 0
    whole_extend: bool = False
    owed: int = 0

    def depth(self, depth: int) -> int:
        """The depth to launch when ``depth`` is asked for (the hot path: one compare most steps).

        A resume, once begun, drafts at least once: if depth 0 is asked right after an inserted
        step, the resume's depth runs. Otherwise a controller that drafts one step to probe the
        acceptance (``builtin:goodput``) would see every probe turned into depth 0 and never
        draft again (``bench/resume_evidence.py``).
        """
        if self.enabled:
            if depth > 0 and self.last == 0:
                self.owed, self.last, self.whole_extend = depth, -1, True
                return 0
            if depth == 0 and self.last < 0:
                depth = self.owed
        self.last, self.whole_extend = depth, False
        return depth


class ProtocolError(Exception):
    """A frame that violates protocol v1. ``code`` is one of :data:`ERROR_CODES`."""

    def __init__(self, code: str, msg: str) -> None:
        super().__init__(f"{code}: {msg}")
        self.code = code
        self.msg = msg


# --------------------------------------------------------------------------- messages


@dataclass(slots=True)
class Hello:
    """hook → controller, once per connection: who the instance is and what it allows."""

    instance: str
    depths: tuple[int, ...]
    engine: str = ""
    model: str = ""
    tp: int = 1

    def to_wire(self) -> dict[str, Any]:
        return {
            "t": "hello",
            "v": PROTOCOL_VERSION,
            "instance": self.instance,
            "depths": list(self.depths),
            "engine": self.engine,
            "model": self.model,
            "tp": self.tp,
        }


@dataclass(slots=True)
class Step:
    """The step record: one decode step of one instance, as the hook saw it.

    This is the one record type of the project: the hook emits it, the controller records it,
    the simulator emits it, and the Featurizer consumes it.

    Attributes:
        instance: replica name, unique per SGLang replica.
        seq: increasing per instance.
        depth: the draft depth this step ran with (0 = no speculation).
        bs: requests in this decode batch.
        waiting: requests queued, not yet running.
        accept: per request, draft tokens accepted (bonus token excluded), each 0..depth;
            length ``bs`` when ``depth > 0``, empty when ``depth == 0``.
        step_us: µs between this decode result and the previous one on this rank.
        ctx_tokens: sum of the sequence lengths in the batch.
        kv_usage: fraction of the KV pool in use, in [0, 1].
        prefill_tokens: prompt tokens prefilled since the previous record.
        ts_ns: monotonic clock at the hook.
    """

    instance: str
    seq: int
    depth: int
    bs: int
    waiting: int
    accept: list[int]
    step_us: int
    ctx_tokens: int
    kv_usage: float
    prefill_tokens: int
    ts_ns: int

    @property
    def tokens(self) -> int:
        """Tokens emitted by the whole batch this step: Σ(accept + 1), or bs at depth 0."""
        return self.bs + sum(self.accept)

    def to_wire(self) -> dict[str, Any]:
        return {
            "t": "step",
            "v": PROTOCOL_VERSION,
            "instance": self.instance,
            "seq": self.seq,
            "depth": self.depth,
            "bs": self.bs,
            "waiting": self.waiting,
            "accept": self.accept,
            "step_us": self.step_us,
            "ctx_tokens": self.ctx_tokens,
            "kv_usage": self.kv_usage,
            "prefill_tokens": self.prefill_tokens,
            "ts_ns": self.ts_ns,
        }


@dataclass(slots=True)
class Welcome:
    """controller → hook, the reply to ``hello``."""

    policy: str
    features: int  # the Featurizer version this instance's observations are computed with

    def to_wire(self) -> dict[str, Any]:
        return {"t": "welcome", "v": PROTOCOL_VERSION, "policy": self.policy, "features": self.features}


@dataclass(slots=True)
class Decision:
    """controller → hook, one per ``step`` received: the depth to use next. Also a heartbeat."""

    instance: str
    seq: int
    depth: int

    def to_wire(self) -> dict[str, Any]:
        return {
            "t": "decision",
            "v": PROTOCOL_VERSION,
            "instance": self.instance,
            "seq": self.seq,
            "depth": self.depth,
        }


@dataclass(slots=True)
class Error:
    """controller → hook: the frame it answers was refused and changed nothing."""

    code: str
    msg: str = ""

    def to_wire(self) -> dict[str, Any]:
        return {"t": "error", "v": PROTOCOL_VERSION, "code": self.code, "msg": self.msg}


Message = Hello | Step | Welcome | Decision | Error


# --------------------------------------------------------------------------- encode / decode


def encode(msg: Message) -> bytes:
    """Encode a message as one msgpack frame."""
    return pack(msg.to_wire())


def pack(wire: dict[str, Any]) -> bytes:
    """Encode a wire map (already holding ``t`` and ``v``)."""
    return msgpack.packb(wire, use_bin_type=True)


def decision_encoder(instance: str) -> Callable[[int, int], bytes]:
    """``encode_decision(seq, depth)`` for one instance: the bytes of
    ``encode(Decision(instance, seq, depth))``, built without a map (the controller's hot path).

    A decision is a map of five entries in a fixed order, of which all but ``seq`` and ``depth``
    are the same for every decision of an instance: they are packed once, here. ``depth`` must
    be in 0..:data:`MAX_DEPTH` (a depth the instance allows). Not thread-safe: one encoder per
    instance, used by one thread.
    """
    pack_value = msgpack.Packer(use_bin_type=True).pack  # reused: packb builds one per call
    three = pack_value({"t": "decision", "v": PROTOCOL_VERSION, "instance": instance})
    # `three` starts with the fixmap header of its 3 entries (0x83); the frame has 5 (0x85).
    head = bytes((three[0] + 2,)) + three[1:] + pack_value("seq")
    tails = tuple(pack_value("depth") + pack_value(d) for d in range(MAX_DEPTH + 1))

    def encode_decision(
        seq: int, depth: int, _head: bytes = head, _tails: tuple[bytes, ...] = tails
    ) -> bytes:
        return _head + pack_value(seq) + _tails[depth]

    return encode_decision


def unpack(frame: bytes) -> dict[str, Any]:
    """Turn one frame into a wire map with string keys, or raise :class:`ProtocolError`.

    Checks size, msgpack well-formedness, map-ness and ``v``; not the fields of ``t``.
    """
    if len(frame) > MAX_FRAME_BYTES:
        raise ProtocolError("too_large", f"frame of {len(frame)} bytes exceeds {MAX_FRAME_BYTES}")
    try:
        # msgpack's defaults: str as str, arrays as lists, and map keys only str or bytes
        # (strict_map_key). A bytes key can only come from msgpack's bin type, whose tags are
        # the bytes 0xc4-0xc6: a frame holding none of them has only str keys.
        wire = _unpackb(frame)
        str_keys = 0xC4 not in frame and 0xC5 not in frame and 0xC6 not in frame
    except Exception:
        # Not msgpack, or a map key of another type somewhere: decode again without that
        # rule, so that a map with such keys gets the code below, as any other map does.
        try:
            wire = msgpack.unpackb(frame, strict_map_key=False)
        except Exception as exc:  # msgpack raises several unrelated types for bad input
            raise ProtocolError("bad_msgpack", f"not one msgpack value ({type(exc).__name__})") from None
        str_keys = False
    # set(map(type, ...)) walks the keys in C: half the cost of a generator on the hot path.
    if type(wire) is not dict or not (str_keys or _STR_ONLY.issuperset(map(type, wire))):
        raise ProtocolError("not_a_map", "a frame must hold one msgpack map with string keys")
    v = wire.get("v")
    if type(v) is not int or v != PROTOCOL_VERSION:
        raise ProtocolError("bad_version", f"v must be {PROTOCOL_VERSION}, got {_short(v)}")
    return wire


def decode(frame: bytes) -> Message:
    """Decode and validate any message (either direction). Raises :class:`ProtocolError`."""
    return from_wire(unpack(frame))


def from_wire(wire: dict[str, Any]) -> Message:
    """Validate a wire map (as :func:`unpack` returns it) into its typed message."""
    t = wire.get("t")
    parser = _PARSERS.get(t) if type(t) is str else None
    if parser is None:
        raise ProtocolError("unknown_type", f"unknown message type {_short(t)}")
    return parser(wire)


def parse_hello(wire: dict[str, Any]) -> Hello:
    instance = _instance(wire)
    depths = wire.get("depths")
    if (
        type(depths) is not list
        or not 1 <= len(depths) <= MAX_DEPTHS
        or not all(type(d) is int and 0 <= d <= MAX_DEPTH for d in depths)
        or any(a >= b for a, b in zip(depths, depths[1:]))
    ):
        raise ProtocolError(
            "bad_field",
            f"depths must be 1..{MAX_DEPTHS} strictly increasing ints in 0..{MAX_DEPTH}",
        )
    return Hello(
        instance=instance,
        depths=tuple(depths),
        engine=_text(wire, "engine", MAX_TEXT_CHARS),
        model=_text(wire, "model", MAX_TEXT_CHARS),
        tp=_int(wire, "tp", 1, 65536),
    )


def parse_step(wire: dict[str, Any]) -> Step:
    """Validate a ``step`` map. Checks that need the instance's ``hello`` are in :func:`check_step`."""
    return read_step(wire)[0]


def read_step(wire: dict[str, Any], frame: bytes | None = None) -> tuple[Step, bytes]:
    """:func:`parse_step`, also returning ``accept`` as bytes (one per request), as the
    Featurizer's kernel reads it: validating ``accept`` builds them anyway. ``frame``, if
    given, must be the bytes ``wire`` was unpacked from: it lets the check of ``accept`` skip
    a pass (see :func:`_accept_u8`).

    One pass of inline checks accepts a valid record (the controller's hot path, a few µs
    cheaper than a call per field); anything it does not accept goes through
    :func:`_parse_step_checked`, which applies the same rules one by one and raises the
    first one broken (or converts an integral ``kv_usage``).
    """
    g = wire.get
    instance, seq, depth, bs, waiting = g("instance"), g("seq"), g("depth"), g("bs"), g("waiting")
    accept, step_us, ctx, kv = g("accept"), g("step_us"), g("ctx_tokens"), g("kv_usage")
    prefill, ts = g("prefill_tokens"), g("ts_ns")
    if (
        type(instance) is str
        and 1 <= len(instance) <= MAX_INSTANCE_CHARS
        and type(seq) is int
        and 0 <= seq <= MAX_U63
        and type(depth) is int
        and 0 <= depth <= MAX_DEPTH
        and type(bs) is int
        and 1 <= bs <= MAX_BS
        and type(waiting) is int
        and 0 <= waiting <= MAX_COUNT
        and type(step_us) is int
        and 0 <= step_us <= MAX_STEP_US
        and type(ctx) is int
        and 0 <= ctx <= MAX_COUNT
        and type(kv) is float
        and 0.0 <= kv <= 1.0
        and type(prefill) is int
        and 0 <= prefill <= MAX_COUNT
        and type(ts) is int
        and 0 <= ts <= MAX_U63
        and type(accept) is list
    ):
        u8 = _accept_u8(accept, bs, depth, frame) if depth else (None if accept else b"")
        if u8 is not None:
            return Step(instance, seq, depth, bs, waiting, accept, step_us, ctx, kv, prefill, ts), u8
    step = _parse_step_checked(wire)
    return step, bytes(step.accept)  # valid, so every entry is in 0..MAX_DEPTH


def _accept_u8(accept: list[Any], bs: int, depth: int, frame: bytes | None) -> bytes | None:
    """``accept`` as bytes if it holds exactly ``bs`` ints in 0..depth (1 ≤ depth ≤ MAX_DEPTH),
    else None; checked in C."""
    if len(accept) != bs:
        return None
    try:  # ints (and bools) in 0..255 in one C loop; any other type raises TypeError
        u8 = bytes(accept)
    except (TypeError, ValueError):
        return None
    if u8.translate(None, _ACCEPT_VALUES[depth]):  # translate() drops every allowed value
        return None
    # bytes() took a bool as 0 or 1; msgpack has a bool type of its own, so refuse it. msgpack
    # writes false/true as the one-byte tags 0xc2/0xc3 and nothing else: a frame holding
    # neither byte holds no bool. Otherwise (or without the frame) check each entry's type;
    # issuperset(map(type, ...)) is exact, as a bool's type is not int.
    if frame is None or 0xC3 in frame or 0xC2 in frame:
        if not _INT_ONLY.issuperset(map(type, accept)):
            return None
    return u8


def _parse_step_checked(wire: dict[str, Any]) -> Step:
    """:func:`parse_step` one rule at a time, in the documented order of its error codes."""
    depth = _int(wire, "depth", 0, MAX_DEPTH)
    bs = _int(wire, "bs", 1, MAX_BS)
    accept = wire.get("accept")
    if type(accept) is not list:
        raise ProtocolError("bad_accept", "accept must be a list")
    if depth == 0:
        if accept:
            raise ProtocolError("bad_accept", "accept must be empty when depth is 0")
    elif len(accept) != bs:
        raise ProtocolError("bad_accept", f"accept has {len(accept)} entries for bs={bs}")
    else:
        for a in accept:
            if type(a) is not int or not 0 <= a <= depth:
                raise ProtocolError("bad_accept", f"accept entries must be ints in 0..{depth}")
    kv = wire.get("kv_usage")
    if type(kv) is int:
        kv = float(kv)
    if type(kv) is not float or not 0.0 <= kv <= 1.0:  # NaN fails both comparisons
        raise ProtocolError("bad_field", f"kv_usage must be a number in [0, 1], got {_short(kv)}")
    return Step(
        instance=_instance(wire),
        seq=_int(wire, "seq", 0, MAX_U63),
        depth=depth,
        bs=bs,
        waiting=_int(wire, "waiting", 0, MAX_COUNT),
        accept=accept,
        step_us=_int(wire, "step_us", 0, MAX_STEP_US),
        ctx_tokens=_int(wire, "ctx_tokens", 0, MAX_COUNT),
        kv_usage=kv,
        prefill_tokens=_int(wire, "prefill_tokens", 0, MAX_COUNT),
        ts_ns=_int(wire, "ts_ns", 0, MAX_U63),
    )


def check_step(step: Step, depths: tuple[int, ...], last_seq: int | None) -> None:
    """The checks of a ``step`` that need its instance's ``hello`` and previous ``seq``."""
    if step.depth not in depths:
        raise ProtocolError("bad_depth", f"depth {step.depth} is not one of {list(depths)}")
    if last_seq is not None and step.seq <= last_seq:
        raise ProtocolError("stale_seq", f"seq {step.seq} does not follow {last_seq}")


def parse_welcome(wire: dict[str, Any]) -> Welcome:
    return Welcome(policy=_text(wire, "policy", MAX_TEXT_CHARS), features=_int(wire, "features", 0, MAX_U63))


def parse_decision(wire: dict[str, Any]) -> Decision:
    # Inline fast path for the hook's poll (a valid decision); the field helpers otherwise.
    instance, seq, depth = wire.get("instance"), wire.get("seq"), wire.get("depth")
    if (
        type(instance) is str
        and 1 <= len(instance) <= MAX_INSTANCE_CHARS
        and type(seq) is int
        and 0 <= seq <= MAX_U63
        and type(depth) is int
        and 0 <= depth <= MAX_DEPTH
    ):
        return Decision(instance, seq, depth)
    return Decision(
        instance=_instance(wire),
        seq=_int(wire, "seq", 0, MAX_U63),
        depth=_int(wire, "depth", 0, MAX_DEPTH),
    )


def parse_error(wire: dict[str, Any]) -> Error:
    code = wire.get("code")
    if type(code) is not str or not code:
        raise ProtocolError("bad_field", "error needs a string code")
    return Error(code=code[:64], msg=_text(wire, "msg", MAX_TEXT_CHARS, required=False))


_PARSERS: dict[str, Callable[[dict[str, Any]], Message]] = {
    "hello": parse_hello,
    "step": parse_step,
    "welcome": parse_welcome,
    "decision": parse_decision,
    "error": parse_error,
}


# --------------------------------------------------------------------------- field helpers

_unpackb: Final = msgpack.unpackb
_STR_ONLY: Final = frozenset((str,))
_INT_ONLY: Final = frozenset((int,))
_ACCEPT_VALUES: Final = tuple(bytes(range(d + 1)) for d in range(MAX_DEPTH + 1))  # allowed accept per depth


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _int(wire: dict[str, Any], key: str, lo: int, hi: int) -> int:
    value = wire.get(key)
    # bool is an int subclass in Python; msgpack has a distinct bool type, so refuse it.
    if type(value) is not int or not lo <= value <= hi:
        raise ProtocolError("bad_field", f"{key} must be an int in {lo}..{hi}, got {_short(value)}")
    return value


def _text(wire: dict[str, Any], key: str, max_chars: int, *, required: bool = True) -> str:
    # Every field of hello and welcome is required; only an error's msg is optional.
    value = wire.get(key) if required else wire.get(key, "")
    if type(value) is not str or len(value) > max_chars:
        raise ProtocolError("bad_field", f"{key} must be a string of at most {max_chars} chars")
    return value


def _instance(wire: dict[str, Any]) -> str:
    value = wire.get("instance")
    if type(value) is not str or not 1 <= len(value) <= MAX_INSTANCE_CHARS:
        raise ProtocolError("bad_field", f"instance must be a string of 1..{MAX_INSTANCE_CHARS} chars")
    return value


__all__ = [
    "DEFAULT_DEPTHS",
    "DEFAULT_ENDPOINT",
    "ERROR_CODES",
    "MAX_FRAME_BYTES",
    "PROTOCOL_VERSION",
    "Decision",
    "Error",
    "Hello",
    "Message",
    "ProtocolError",
    "Step",
    "Welcome",
    "check_step",
    "decision_encoder",
    "decode",
    "encode",
    "from_wire",
    "pack",
    "unpack",
]
