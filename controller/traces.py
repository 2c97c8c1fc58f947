"""Trace recording and reading: ``runs/<instance>-<start>.msgpack``.

A trace file holds one instance's records as concatenated msgpack maps: every ``hello`` and
``step`` the controller received and every ``decision`` it sent, each the wire map (unknown
keys kept) plus ``rx_ns``, the controller's ``time.monotonic_ns()`` when it received the
message (for a ``decision``: when it was sent). ``<start>`` is the wall clock at creation in
ns, so restarts never overwrite an earlier file; the instance name is sanitized to
``[A-Za-z0-9._-]``.

Crash safety: a writer keeps records in memory only until :meth:`TraceWriter.flush`, which
hands them to the OS with one unbuffered ``os.write`` (no fsync: a ``kill -9`` of the process
loses nothing the OS has; a power loss may). With the default ``flush_bytes=0`` every
:meth:`TraceWriter.write` flushes at once. The service batches: it flushes whenever its socket
is drained and at least every ``flush_bytes``, so a ``kill -9`` loses at most the burst being
handled.

Readers also take gzip-compressed files (``<instance>-<start>.msgpack.gz``, e.g. after
``gzip runs/*.msgpack``): traces compress 7× and the bundled examples are kept that way.

A torn tail never hides the records before it, plain or gzipped: a file that ends inside a
record, or a gzip stream cut short, yields every complete record before the tear and warns
(:class:`~controller.errors.TraceWarning`, one per file). Bytes that are not a trace (corrupt
msgpack before the end, a gzip stream that does not decompress, a tail longer than any record)
raise :class:`~controller.errors.TraceError` naming the file and the byte offset.

Table (:func:`load_traces`), one row per record, in file order:

==================  =====================================================================
column              meaning
==================  =====================================================================
``file``            trace file name (no folder)
``instance``        the record's ``instance``
``t``               ``hello`` | ``step`` | ``decision``
``seq``, ``depth``  step: its seq and the depth it ran with; decision: the seq it follows and
                    the depth chosen (nullable Int64)
``bs`` .. ``ts_ns`` the ``step`` fields (``accept`` is a list; null on other rows)
``rx_ns``           controller monotonic ns (receipt, or send time for a decision)
``depths``          hello: the allowed depths (list); ``engine``, ``model``, ``tp``: hello
==================  =====================================================================

Each row fills only its own type's columns; a value of the wrong type, or an integer outside
int64, reads as null (recorded frames are verbatim, and unknown keys are allowed).
"""

from __future__ import annotations

import argparse
import io
import math
import os
import re
import time
import warnings
import zlib
from collections.abc import Iterator
from dataclasses import fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

import msgpack

from controller.errors import TraceError, TraceWarning
from controller.protocol import MAX_FRAME_BYTES, Decision, Hello, ProtocolError, Step, parse_step

if TYPE_CHECKING:  # pandas is only needed by readers, never by the service's hot path
    import pandas as pd

SUFFIX = ".msgpack"
GZ_SUFFIX = SUFFIX + ".gz"  # read, never written: archives and the bundled examples
# A record is one wire frame (≤ 64 KiB) plus the rx_ns entry; a longer unreadable tail is
# corruption, not a torn write.
MAX_RECORD_BYTES = MAX_FRAME_BYTES + 64

# Columns come from the protocol's own message types, so a field added there is read here too.
_STEP_FIELDS = tuple(f.name for f in fields(Step))
_HELLO_FIELDS = tuple(f.name for f in fields(Hello) if f.name != "instance")
_DECISION_FIELDS = tuple(f.name for f in fields(Decision))
COLUMNS = ("file", "instance", "t", *_STEP_FIELDS[1:], "rx_ns", *_HELLO_FIELDS)
INT_COLUMNS = tuple(c for c in COLUMNS if Step.__annotations__.get(c) == "int" or c in ("rx_ns", "tp"))

_I64_MIN, _I64_MAX = -(2**63), 2**63 - 1
_COMMON = frozenset(("instance", "t", "rx_ns"))
_FIELDS_OF = {
    "step": _COMMON | set(_STEP_FIELDS),
    "hello": _COMMON | set(_HELLO_FIELDS),
    "decision": _COMMON | set(_DECISION_FIELDS),
}

_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")
_RX_KEY = msgpack.packb("rx_ns")
_pack = msgpack.Packer().pack  # reused: msgpack.packb builds a Packer per call (≈1 µs here)


def sanitize_instance(instance: str) -> str:
    """File-name-safe form of an instance name (``[A-Za-z0-9._-]``, at most 128 chars)."""
    name = _UNSAFE.sub("_", instance)[:128]
    return name if name.strip(".") else "_"


def add_rx(frame: bytes, rx_ns: int) -> bytes:
    """Append ``rx_ns`` to an encoded msgpack map without decoding it (the record is verbatim).

    Raises:
        ValueError: ``frame`` does not start with a map header.
    """
    head = frame[0]
    rx = _RX_KEY + _pack(rx_ns)
    if 0x80 <= head <= 0x8E:  # fixmap with room for one more entry
        return bytes((head + 1,)) + frame[1:] + rx
    if head == 0x8F or head == 0xDE:
        n, body = (15, frame[1:]) if head == 0x8F else (int.from_bytes(frame[1:3], "big"), frame[3:])
        if n < 0xFFFF:
            return b"\xde" + (n + 1).to_bytes(2, "big") + body + rx
        return b"\xdf" + (n + 1).to_bytes(4, "big") + body + rx
    if head == 0xDF:
        n = int.from_bytes(frame[1:5], "big")
        return b"\xdf" + (n + 1).to_bytes(4, "big") + frame[5:] + rx
    raise ValueError("not a msgpack map")


class TraceWriter:
    """Appends one instance's records to ``<directory>/<instance>-<start>.msgpack``.

    Args:
        directory: the trace folder (created if missing).
        instance: the instance name (sanitized for the file name; kept verbatim in records).
        start_ns: the ``<start>`` of the file name; default ``time.time_ns()``. An existing
            file is never overwritten: the next free ``start`` is used.
        flush_bytes: hand records to the OS once this many bytes are pending; 0 = every
            record (see the module docstring for the crash-safety contract).

    Not thread-safe: one writer per instance, used by one thread.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        instance: str,
        start_ns: int | None = None,
        *,
        flush_bytes: int = 0,
    ) -> None:
        folder = Path(directory)
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise TraceError(f"cannot create trace folder {str(folder)!r}: {exc.strerror or exc}") from None
        start = time.time_ns() if start_ns is None else int(start_ns)
        base = sanitize_instance(instance)
        for _ in range(1000):
            path = folder / f"{base}-{start}{SUFFIX}"
            try:
                self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND, 0o644)
                break
            except FileExistsError:
                start += 1
            except OSError as exc:
                raise TraceError(f"cannot create trace file {str(path)!r}: {exc.strerror or exc}") from None
        else:
            raise TraceError(f"no free trace file name for {instance!r} in {str(folder)!r}")
        self.path = path
        self.instance = instance
        self.flush_bytes = flush_bytes
        self.records = 0
        self._pending = bytearray()
        self._closed = False

    def write(self, wire: dict[str, Any], rx_ns: int) -> None:
        """Append a wire map plus ``rx_ns`` as one record."""
        record = dict(wire)
        record["rx_ns"] = rx_ns
        self.write_bytes(msgpack.packb(record, use_bin_type=True))

    def write_frame(self, frame: bytes, rx_ns: int) -> None:
        """Append an encoded wire map verbatim plus ``rx_ns`` (no decode, no re-encode)."""
        self.write_bytes(add_rx(frame, rx_ns))

    def write_bytes(self, record: bytes) -> None:
        """Append one already-encoded record (a msgpack map)."""
        if self._closed:
            raise TraceError(f"trace file {str(self.path)!r} is closed")
        self._pending += record
        self.records += 1
        if len(self._pending) >= self.flush_bytes:
            self.flush()

    @property
    def pending_bytes(self) -> int:
        """Bytes written but not yet handed to the OS."""
        return len(self._pending)

    def flush(self) -> None:
        """Hand every pending record to the OS (survives a ``kill -9`` of this process)."""
        if not self._pending:
            return
        view = memoryview(self._pending)
        done = 0
        while done < len(view):  # os.write on a regular file may, rarely, write less
            done += os.write(self._fd, view[done:])
        view.release()
        self._pending.clear()

    def close(self) -> None:
        """Flush and close the file. Idempotent."""
        if self._closed:
            return
        try:
            self.flush()
        finally:
            self._closed = True
            os.close(self._fd)

    def __enter__(self) -> TraceWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# --------------------------------------------------------------------------- reading


def iter_records(path: str | os.PathLike[str]) -> Iterator[dict[str, Any]]:
    """Yield the records (maps) of one trace file in order.

    A torn tail (the file, or its gzip stream, ends inside a record: a crash while writing) is
    skipped with a :class:`TraceWarning`; the records before it are all yielded. Anything else
    that is not a sequence of msgpack maps with string keys and a string ``t`` raises
    :class:`TraceError` naming the file and the byte offset.
    """
    path = Path(path)
    f: BinaryIO
    gzip_cut = False
    try:
        if path.name.endswith(GZ_SUFFIX):
            # Decompressed whole: the torn-tail check needs the decompressed size.
            data, gzip_cut = _gunzip(path.read_bytes())
            f = io.BytesIO(data)
            size = len(data)
        else:
            f = open(path, "rb")  # noqa: SIM115 — closed in finally; the generator may stop early
            size = os.fstat(f.fileno()).st_size
    except (OSError, zlib.error) as exc:  # gzip: not gzip, or corrupt
        raise TraceError(
            f"cannot read trace {str(path)!r}: {getattr(exc, 'strerror', None) or exc}"
        ) from None
    try:
        unpacker = msgpack.Unpacker(
            f, raw=False, strict_map_key=False, max_buffer_size=4 * MAX_RECORD_BYTES, read_size=1 << 16
        )
        offset = 0
        n = 0
        while True:
            try:
                record = next(unpacker)
            except StopIteration:
                break
            except Exception as exc:  # msgpack raises several unrelated types for bad bytes
                raise TraceError(
                    f"{str(path)!r}: corrupt record at byte {offset} ({type(exc).__name__})"
                ) from None
            if not isinstance(record, dict) or type(record.get("t")) is not str:
                raise TraceError(
                    f"{str(path)!r}: record at byte {offset} is not a trace record (a map with 't')"
                )
            if not all(type(k) is str for k in record):
                raise TraceError(f"{str(path)!r}: record at byte {offset} has non-string keys")
            offset = unpacker.tell()
            n += 1
            yield record
        tail = size - offset
        if tail > MAX_RECORD_BYTES:
            raise TraceError(
                f"{str(path)!r}: unreadable data from byte {offset} ({tail} bytes, not a torn record)"
            )
        if tail or gzip_cut:
            where = (
                "its gzip stream is cut short"
                if gzip_cut
                else f"{tail} bytes of a record after byte {offset}"
            )
            warnings.warn(
                f"{str(path)!r} ends in a torn record ({where}): read the {n} records before it",
                TraceWarning,
                stacklevel=2,
            )
    finally:
        f.close()


def _gunzip(raw: bytes) -> tuple[bytes, bool]:
    """Every gzip member of ``raw`` decompressed, and whether the last one is cut short (what
    it held up to the cut is kept). Raises ``zlib.error`` for bytes that are not gzip."""
    out: list[bytes] = []
    while raw:
        member = zlib.decompressobj(wbits=31)  # gzip framing, checked
        out.append(member.decompress(raw))
        if not member.eof:
            return b"".join(out), True
        raw = member.unused_data.lstrip(b"\0")  # members may be padded with zeros, as gzip allows
    return b"".join(out), False


def trace_files(directory: str | os.PathLike[str]) -> list[Path]:
    """The trace files of a folder, oldest ``<start>`` first; TraceError if there are none."""
    folder = Path(directory)
    if not folder.is_dir():
        raise TraceError(f"trace folder {str(folder)!r} does not exist")
    files = [p for p in folder.iterdir() if p.name.endswith((SUFFIX, GZ_SUFFIX)) and p.is_file()]
    if not files:
        raise TraceError(f"trace folder {str(folder)!r} holds no *{SUFFIX} or *{GZ_SUFFIX} files")
    return sorted(files, key=start_key)


def start_key(path: Path) -> tuple[int, str]:
    """A trace file's ``<name>-<start ns>.msgpack[.gz]`` as (start, name); (0, stem) without a start."""
    stem = path.name.removesuffix(".gz").removesuffix(SUFFIX)
    head, _, start = stem.rpartition("-")
    return (int(start), head) if start.isdigit() else (0, stem)


def load_traces(directory: str | os.PathLike[str]) -> pd.DataFrame:
    """Load every trace file of a folder as one DataFrame (columns: module docstring).

    Raises:
        TraceError: the folder is missing or empty, or a file is corrupt.
    """
    import pandas as pd

    columns: dict[str, list[Any]] = {c: [] for c in COLUMNS}
    for path in trace_files(directory):
        for record in iter_records(path):
            columns["file"].append(path.name)
            # Only the fields of the record's own type: a hello's stray "seq" is not a seq.
            fields = _FIELDS_OF.get(record["t"], _COMMON)
            for c in COLUMNS[1:]:
                columns[c].append(record.get(c) if c in fields else None)
    # Typed per column from the raw lists: a wrong-typed value becomes null, never a crash.
    data: dict[str, Any] = {}
    for c, values in columns.items():
        if c in INT_COLUMNS:
            data[c] = pd.array(
                [v if type(v) is int and _I64_MIN <= v <= _I64_MAX else None for v in values], dtype="Int64"
            )
        elif c == "kv_usage":
            data[c] = pd.array(
                [float(v) if type(v) in (int, float) else math.nan for v in values], dtype="float64"
            )
        elif c in ("file", "instance", "t", "engine", "model"):
            data[c] = pd.array([v if type(v) is str else None for v in values], dtype="string")
        else:
            data[c] = pd.Series(values, dtype="object")
    return pd.DataFrame(data, columns=list(COLUMNS))


def step_records(directory: str | os.PathLike[str]) -> dict[str, list[Step]]:
    """Every valid ``step`` record of a folder as :class:`Step`, grouped by instance.

    Files are read oldest first, records in file order. Steps that fail protocol validation
    are skipped (the controller never records invalid steps, so there are none in its files).
    """
    out: dict[str, list[Step]] = {}
    for path in trace_files(directory):
        for step in file_steps(path):
            out.setdefault(step.instance, []).append(step)
    return out


def file_steps(path: str | os.PathLike[str]) -> Iterator[Step]:
    """Every valid ``step`` record of one trace file as :class:`Step`, in file order."""
    for record in iter_records(path):
        if record.get("t") != "step":
            continue
        try:
            yield parse_step(record)
        except ProtocolError:
            continue


# --------------------------------------------------------------------------- summary


def summarize(directory: str | os.PathLike[str]) -> str:
    """A text table per instance: steps, time span, depth mix, mean accepted drafts per depth,
    step-latency p50/p99 per depth."""
    import numpy as np

    frame = load_traces(directory)
    steps = frame[frame["t"] == "step"]
    n_files = frame["file"].nunique()
    out = io.StringIO()
    out.write(f"{directory}: {n_files} file(s), {len(frame)} records, {len(steps)} steps\n")
    for instance, group in steps.groupby("instance", sort=True):
        ts = group["ts_ns"].dropna()
        span_s = (int(ts.max()) - int(ts.min())) / 1e9 if len(ts) > 1 else 0.0
        decisions = int(((frame["t"] == "decision") & (frame["instance"] == instance)).sum())
        out.write(
            f"\ninstance {instance}: {len(group)} steps, {decisions} decisions, span {span_s:.3f} s, "
            f"mean bs {group['bs'].astype('float64').mean():.1f}\n"
        )
        out.write(
            f"{'depth':>5} {'steps':>8} {'share':>7} {'accepted/req':>12} {'step_us p50':>11} {'p99':>9}\n"
        )
        for depth, rows in group.groupby("depth", sort=True):
            accepts = [a for lst in rows["accept"] for a in (lst or [])]
            mean_acc = float(np.mean(accepts)) if accepts else math.nan
            lat = rows["step_us"].astype("float64").to_numpy()
            p50, p99 = np.percentile(lat, [50, 99]) if len(lat) else (math.nan, math.nan)
            out.write(
                f"{int(depth):>5} {len(rows):>8} {len(rows) / len(group):>7.1%} "
                f"{_fmt(mean_acc, '.2f'):>12} {_fmt(p50, '.0f'):>11} {_fmt(p99, '.0f'):>9}\n"
            )
    return out.getvalue()


def _fmt(x: float, spec: str) -> str:
    return "-" if math.isnan(x) else format(x, spec)


# --------------------------------------------------------------------------- CLI


def register(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add ``controller traces summarize DIR``."""
    parser = subparsers.add_parser(
        "traces", help="inspect recorded traces", description="Inspect recorded traces."
    )
    sub = parser.add_subparsers(dest="traces_command", metavar="ACTION", required=True)
    summ = sub.add_parser(
        "summarize",
        help="print a table per instance of a trace folder",
        description=(
            "Print, per instance of a trace folder (controller serve --record DIR): steps, time "
            "span, depth mix, mean accepted draft tokens per request at each depth, and step "
            "latency p50/p99 per depth."
        ),
    )
    summ.add_argument("directory", metavar="DIR", help="a folder of <instance>-<start>.msgpack trace files")
    summ.set_defaults(func=_cmd_summarize)


def _cmd_summarize(args: argparse.Namespace) -> int:
    print(summarize(args.directory), end="")
    return 0
