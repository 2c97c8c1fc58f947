"""Trace files: round trip, torn tails, corruption with offsets, the DataFrame, the summary."""

from __future__ import annotations

import gzip
import math
import os
import warnings
from pathlib import Path

import msgpack
import pytest

from controller.errors import TraceError, TraceWarning
from controller.protocol import Decision, Hello, Step, encode
from controller.traces import (
    COLUMNS,
    TraceWriter,
    add_rx,
    iter_records,
    load_traces,
    sanitize_instance,
    step_records,
    summarize,
    trace_files,
)


def make_step(seq: int, depth: int = 2, bs: int = 3, instance: str = "a") -> Step:
    accept = [(seq + i) % (depth + 1) for i in range(bs)] if depth else []
    return Step(
        instance, seq, depth, bs, seq % 4, accept, 1000 + 10 * seq, 500 * bs, 0.25, 7, 10**9 + seq * 1000
    )


def write_session(folder: Path, instance: str = "a", n: int = 20, **kw: object) -> Path:
    with TraceWriter(folder, instance, **kw) as w:  # type: ignore[arg-type]
        w.write(Hello(instance, (0, 2, 4), "sglang", "m", 1).to_wire(), 1)
        for seq in range(n):
            depth = (0, 2, 4)[seq % 3]
            w.write_frame(encode(make_step(seq, depth, instance=instance)), 100 + seq)
            w.write(Decision(instance, seq, 2).to_wire(), 101 + seq)
    return w.path


def test_round_trip_keeps_every_field_and_unknown_keys(tmp_path: Path) -> None:
    wire = make_step(5).to_wire()
    wire["extra"] = {"x": [1, 2]}
    with TraceWriter(tmp_path, "inst/1 ü", start_ns=42) as w:
        w.write_frame(msgpack.packb(wire), 123)
        w.write(wire, 456)
    assert w.path.name == "inst_1__-42.msgpack"
    records = list(iter_records(w.path))
    assert records == [dict(wire, rx_ns=123), dict(wire, rx_ns=456)]


@pytest.mark.parametrize("n_keys", [0, 14, 15, 16, 70000])
def test_add_rx_handles_every_map_header(n_keys: int) -> None:
    wire = {f"k{i}": i for i in range(n_keys)}
    out = msgpack.unpackb(add_rx(msgpack.packb(wire), 2**62))
    assert out == dict(wire, rx_ns=2**62)


def test_add_rx_refuses_non_map() -> None:
    with pytest.raises(ValueError):
        add_rx(msgpack.packb([1, 2]), 1)


def test_existing_file_is_never_overwritten(tmp_path: Path) -> None:
    a = TraceWriter(tmp_path, "x", start_ns=7)
    b = TraceWriter(tmp_path, "x", start_ns=7)
    a.close()
    b.close()
    assert a.path != b.path and a.path.exists() and b.path.exists()


def test_flush_bytes_keeps_records_pending_until_flush(tmp_path: Path) -> None:
    w = TraceWriter(tmp_path, "x", flush_bytes=1 << 20)
    w.write({"t": "hello"}, 1)
    assert w.pending_bytes > 0 and os.path.getsize(w.path) == 0
    w.flush()
    assert w.pending_bytes == 0 and os.path.getsize(w.path) > 0
    w.write({"t": "step"}, 2)
    w.close()
    assert [r["t"] for r in iter_records(w.path)] == ["hello", "step"]
    with pytest.raises(TraceError):
        w.write({"t": "step"}, 3)


def test_torn_last_record_is_skipped_at_every_cut(tmp_path: Path) -> None:
    path = write_session(tmp_path, n=3)
    data = path.read_bytes()
    full = list(iter_records(path))
    sizes = [len(msgpack.packb(r)) for r in full]  # records re-encode to the same length
    ends = [sum(sizes[: i + 1]) for i in range(len(sizes))]
    assert ends[-1] == len(data)
    for cut in range(len(data)):
        path.write_bytes(data[:cut])
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = list(iter_records(path))
        complete = sum(1 for e in ends if e <= cut)
        assert got == full[:complete], cut
        torn = cut not in (0, *ends)  # the file ends inside a record: said once, with its name
        assert [w.category for w in caught] == ([TraceWarning] if torn else []), cut
        assert all(path.name in str(w.message) for w in caught)


def test_corruption_in_the_middle_names_file_and_offset(tmp_path: Path) -> None:
    path = write_session(tmp_path, n=3)
    data = path.read_bytes()
    first = len(msgpack.packb(next(iter(iter_records(path)))))
    path.write_bytes(data[:first] + b"\xc1" + data[first:])  # 0xc1 is never valid msgpack
    with pytest.raises(TraceError, match=rf"{path.name}.*byte {first}"):
        list(iter_records(path))
    path.write_bytes(data[:first] + msgpack.packb(17) + data[first:])  # valid msgpack, not a record
    with pytest.raises(TraceError, match=f"byte {first}"):
        list(iter_records(path))


def test_huge_bogus_length_is_corruption_not_a_torn_tail(tmp_path: Path) -> None:
    path = write_session(tmp_path, n=3)
    data = path.read_bytes()
    first = len(msgpack.packb(next(iter(iter_records(path)))))
    # A str32 header claiming 2 GiB swallows the rest: must not silently hide 100 KiB of records.
    path.write_bytes(data[:first] + b"\xdb\x7f\xff\xff\xff" + data[first:] * 200)
    with pytest.raises(TraceError, match=f"from byte {first}"):
        list(iter_records(path))


def test_gzipped_traces_read_like_plain_ones(tmp_path: Path) -> None:
    plain = write_session(tmp_path / "plain", n=5, start_ns=1)
    later = write_session(tmp_path / "plain", n=2, start_ns=3)
    gz_dir = tmp_path / "gz"
    gz_dir.mkdir()
    gz_dir.joinpath("a-2.msgpack.gz").write_bytes(gzip.compress(plain.read_bytes()))
    gz_dir.joinpath(later.name).write_bytes(later.read_bytes())  # mixed folders are fine
    assert [p.name for p in trace_files(gz_dir)] == ["a-2.msgpack.gz", "a-3.msgpack"]
    assert list(iter_records(gz_dir / "a-2.msgpack.gz")) == list(iter_records(plain))
    # A torn tail inside the compressed stream is skipped exactly like a plain one.
    data = plain.read_bytes()
    full = list(iter_records(plain))
    gz = gz_dir / "a-2.msgpack.gz"
    gz.write_bytes(gzip.compress(data[:-3]))
    with pytest.warns(TraceWarning, match="a-2.msgpack.gz"):
        assert list(iter_records(gz)) == full[:-1]
    # A gzip stream cut short (a crash while compressing, a partial copy) is a torn tail too:
    # the records before the cut, and the same warning.
    packed = gzip.compress(data)
    for cut in (len(packed) - 4, len(packed) // 2, 30):
        gz.write_bytes(packed[:cut])
        with pytest.warns(TraceWarning, match="a-2.msgpack.gz.*gzip stream is cut short"):
            got = list(iter_records(gz))
        assert got == full[: len(got)] and (cut < len(packed) // 2 + 1 or len(got) == len(full))
    # Members padded with zeros read as one stream, as gzip itself reads them.
    gz.write_bytes(gzip.compress(data[:100]) + b"\0" * 8 + gzip.compress(data[100:]))
    assert list(iter_records(gz)) == full
    # Not gzip, or a stream that does not decompress: one TraceError naming the file.
    corrupt = bytearray(packed)
    corrupt[len(corrupt) // 2] ^= 0xFF
    for bad in (data, bytes(corrupt)):
        gz.write_bytes(bad)
        with pytest.raises(TraceError, match="a-2.msgpack.gz"):
            list(iter_records(gz))


def test_load_traces_columns_and_types(tmp_path: Path) -> None:
    write_session(tmp_path, "a", n=6)
    write_session(tmp_path, "b", n=3)
    frame = load_traces(tmp_path)
    assert tuple(frame.columns) == COLUMNS
    assert len(frame) == (1 + 12) + (1 + 6)
    assert set(frame["instance"]) == {"a", "b"}
    steps = frame[(frame["t"] == "step") & (frame["instance"] == "a")]
    assert list(steps["seq"]) == list(range(6))
    assert str(steps["bs"].dtype) == "Int64" and str(frame["kv_usage"].dtype) == "float64"
    assert steps.iloc[1]["accept"] == make_step(1, 2).accept
    hello = frame[frame["t"] == "hello"].iloc[0]
    assert list(hello["depths"]) == [0, 2, 4] and hello["engine"] == "sglang" and hello["tp"] == 1
    assert frame[frame["t"] == "hello"]["bs"].isna().all()


def test_stray_and_out_of_range_values_read_as_null(tmp_path: Path) -> None:
    with TraceWriter(tmp_path, "a") as w:
        w.write({**Hello("a", (0, 2)).to_wire(), "seq": 2**64 - 1, "bs": "x"}, 1)
        w.write({**make_step(0).to_wire(), "waiting": 2**64 - 1, "kv_usage": "high"}, 2)
    frame = load_traces(tmp_path)
    assert frame["seq"].isna().iloc[0] and frame["bs"].isna().iloc[0]
    assert frame["waiting"].isna().iloc[1] and math.isnan(frame["kv_usage"].iloc[1])
    assert frame["bs"].iloc[1] == 3


def test_empty_or_missing_folder_is_a_trace_error(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match="does not exist"):
        load_traces(tmp_path / "nope")
    with pytest.raises(TraceError, match="no"):
        load_traces(tmp_path)


def test_step_records_groups_valid_steps_in_order(tmp_path: Path) -> None:
    write_session(tmp_path, "a", n=5, start_ns=1)
    with TraceWriter(tmp_path, "a", start_ns=2) as w:  # a later run of the same instance
        w.write(make_step(0, 2).to_wire(), 5)
        bad = make_step(1, 2).to_wire()
        bad["accept"] = [9, 9, 9]
        w.write(bad, 6)
    assert [p.name for p in trace_files(tmp_path)] == ["a-1.msgpack", "a-2.msgpack"]
    steps = step_records(tmp_path)["a"]
    assert [s.seq for s in steps] == [0, 1, 2, 3, 4, 0]
    assert steps[1] == make_step(1, 2)


def test_summarize_table(tmp_path: Path) -> None:
    write_session(tmp_path, "a", n=9)
    text = summarize(tmp_path)
    assert "instance a: 9 steps, 9 decisions" in text
    lines = {ln.split()[0]: ln.split() for ln in text.splitlines() if ln.strip()[:1].isdigit()}
    assert set(lines) == {"0", "2", "4"}
    assert lines["0"][1] == "3" and lines["0"][3] == "-"  # depth 0: no drafts to accept
    accepts = [a for s in range(9) if s % 3 == 1 for a in make_step(s, 2).accept]
    assert float(lines["2"][3]) == pytest.approx(sum(accepts) / len(accepts), abs=0.005)


def test_sanitize_instance() -> None:
    assert sanitize_instance("a.b-c_d") == "a.b-c_d"
    assert "/" not in sanitize_instance("../..")
    assert sanitize_instance("x" * 300) == "x" * 128
