"""Fuzzed input (issue 41): random bytes, broken JSON, odd types and random Parquet schemas through the
reader.

The property, for any file: every record (a non-blank JSONL line, a Parquet row) becomes exactly one request
or one bad record whose message starts "line N:" / "row N:", in input order; the only exception that escapes
is an InputError naming the file, for a file that cannot be read at all (not Parquet).
"""
from __future__ import annotations

import io
import json
import math
import re
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specgen.config import SamplingParams
from specgen.errors import InputError
from specgen.io import readers
from specgen.io.readers import count_records, iter_records
from specgen.io.records import NATIVE_KEYS, OPENAI_BODY_READ, OPENAI_KEYS
from specgen.io.requests import RequestSource

VOCAB_SIZE = 97
CONTEXT_LEN = 48
ASCII_SPACE = b" \t\r\x0b\x0c"  # a line of only these is blank: not a record
BAD_PREFIX = re.compile(r"(line|row) (\d+): ")

# Derandomized: the same examples on every run, so a failure repeats; sized to take a few seconds on 2 cores.
# (Runs of 4,000 random examples each found nothing more.)
FUZZ = settings(max_examples=300, derandomize=True, deadline=None, database=None, print_blob=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.large_base_example])


def encode_bytes(prompt, where):
    """A tokenizer stand-in: UTF-8 bytes mod the vocabulary (text, or each message's role and content)."""
    if isinstance(prompt, str):
        return tuple(b % VOCAB_SIZE for b in prompt.encode("utf-8"))
    if isinstance(prompt[0], dict):
        return encode_bytes("".join(m["role"] + m["content"] for m in prompt), where)
    return tuple(prompt)


def encode_picky(prompt, where):
    """Like encode_bytes, but refuses texts whose length is a multiple of 3, as a tokenizer's InputError."""
    if isinstance(prompt, str) and len(prompt) % 3 == 0:
        raise InputError(f"{where}: the tokenizer refused this text")
    return encode_bytes(prompt, where)


def read_all(path: Path, fmt: str, encode) -> tuple[int, list, list[tuple[str, int]]]:
    """(count_records, requests, log of ("request" | "bad", line/row number) in the order they came)."""
    unit = readers.unit_name(fmt)
    log: list[tuple[str, int]] = []

    def on_bad(record_id, message, num_prompt_tokens, openai):
        m = BAD_PREFIX.match(message)
        assert m and m.group(1) == unit, message
        number = int(m.group(2))
        assert not message[m.end():].startswith(f"{unit} {number}:"), message  # the line named once
        assert isinstance(record_id, str) and record_id, (record_id, message)
        (record_id + message).encode("utf-8")  # the error record can be written
        assert num_prompt_tokens is None or num_prompt_tokens > 0, message
        log.append(("bad", number))

    total = count_records(path, fmt)
    src = RequestSource(iter_records(path, fmt), encode=encode, sampling=SamplingParams(max_tokens=4),
                        context_len=CONTEXT_LEN, vocab_size=VOCAB_SIZE, unit=unit, on_bad=on_bad)
    requests = []
    for req in src:
        assert 0 < len(req.prompt_ids) < CONTEXT_LEN and all(0 <= t < VOCAB_SIZE for t in req.prompt_ids)
        req.id.encode("utf-8")
        p = req.params  # what the engine's float64 / int64 slot arrays can hold
        assert math.isfinite(p.temperature) and math.isfinite(p.top_p)
        assert all(-(2**63) <= v < 2**63 for v in (p.max_tokens, p.top_k, p.seed))
        log.append(("request", req.index))
        requests.append(req)
    return total, requests, log


def check_accounts(path: Path, fmt: str, numbers: list[int], encode) -> dict[int, str]:
    """Every record in `numbers` (1-based, ascending) is one request or one bad record, in order."""
    total, _, log = read_all(path, fmt, encode)
    assert total == len(numbers)
    assert [n for _, n in log] == numbers
    return {n: kind for kind, n in log}


@pytest.fixture(scope="module")
def fuzz_dir(tmp_path_factory) -> Path:
    """One folder for every example (each overwrites its file): hypothesis runs a test body many times."""
    return tmp_path_factory.mktemp("fuzz")


# ---------------------------------------------------------------------------------------------- JSONL

TEXT = st.text(max_size=12) | st.text(st.sampled_from(["\ud800", "\udfff", "a", "\x00", "\u2028", "é", "😀"]),
                                      max_size=6)
HUGE_INTS = st.sampled_from([2**63 - 1, 2**63, -(2**63) - 1, 2**64, 10**400, -(10**4299)])
INTS = st.integers(-3, VOCAB_SIZE + 2) | st.integers() | HUGE_INTS
FLOATS = st.floats() | st.sampled_from([0.5, 1.0, 2.0, -0.0])
SCALARS = st.none() | st.booleans() | INTS | FLOATS | TEXT
KEYS = st.sampled_from(sorted({*NATIVE_KEYS, *OPENAI_KEYS, *OPENAI_BODY_READ, "n", "stream"})) | TEXT
JSON_VALUES = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=4)
                           | st.dictionaries(KEYS, inner, max_size=4), max_leaves=10)

MESSAGE = st.fixed_dictionaries({"role": st.sampled_from(["user", "system"]) | TEXT, "content": TEXT})
FIELDS = {  # a plausible value or any JSON value, for each field a record may carry
    "id": TEXT | INTS,
    "prompt": TEXT | st.lists(st.integers(0, VOCAB_SIZE), max_size=4),
    "messages": st.lists(MESSAGE, max_size=3),
    "input_ids": st.lists(INTS, max_size=5),
    "max_tokens": INTS,
    "max_completion_tokens": INTS,
    "temperature": FLOATS | INTS,
    "top_p": FLOATS | INTS,
    "top_k": INTS,
    "seed": INTS,
    "stop": TEXT | st.lists(TEXT, max_size=3),
}


def _record(keys: list[str]):
    return st.fixed_dictionaries({}, optional={k: FIELDS[k] | JSON_VALUES for k in keys})


NATIVE = _record(["id", "prompt", "messages", "input_ids", "max_tokens", "temperature", "top_p", "top_k",
                  "seed", "stop"])
OPENAI = st.fixed_dictionaries(
    {"custom_id": FIELDS["id"], "body": _record(["messages", "prompt", "max_tokens", "max_completion_tokens",
                                                 "temperature", "top_p", "seed", "stop"]) | JSON_VALUES},
    optional={"method": st.just("POST") | JSON_VALUES,
              "url": st.sampled_from(["/v1/chat/completions", "/v1/completions"]) | JSON_VALUES})
RECORDS = NATIVE | OPENAI | st.dictionaries(KEYS, JSON_VALUES, max_size=3) | JSON_VALUES


@st.composite
def json_lines(draw) -> bytes:
    """One line's bytes: a (maybe odd) record as JSON, possibly cut short or with bytes spliced in."""
    text = json.dumps(draw(RECORDS), ensure_ascii=draw(st.booleans()))
    data = text.encode("utf-8", "surrogatepass")  # a lone surrogate written raw: invalid UTF-8
    mutation = draw(st.sampled_from(["none", "none", "truncate", "splice", "nul"]))
    at = draw(st.integers(0, len(data)))
    if mutation == "truncate":
        data = data[:at]
    elif mutation == "splice":
        data = data[:at] + draw(st.binary(min_size=1, max_size=4)) + data[at:]
    elif mutation == "nul":
        data = data[:at] + b"\x00" + data[at:]
    return data


def _nested(depth: int, inner: bytes = b"1") -> bytes:
    return b"[" * depth + inner + b"]" * depth


ODD_LINES = st.one_of(
    st.binary(max_size=24),
    st.sampled_from([b"", b" ", b"\t", b"\r", b"\x0b\x0c ", b"\xef\xbb\xbf", b"\x00", b"NaN", b"-Infinity"]),
    st.sampled_from([10, 500, 900, 1000, 5000, 100_000]).map(_nested),
    st.sampled_from([500, 900, 1000, 5000]).map(lambda d: b'{"prompt": ' + _nested(d) + b"}"),
    st.sampled_from([20, 400, 4300, 4301, 20_000]).map(
        lambda n: b'{"prompt": "a", "seed": ' + b"9" * n + b"}"),
    st.sampled_from([b'{"prompt": "a", "temperature": 1e999}', b'{"prompt": "ab", "top_p": NaN}',
                     b'{"custom_id": "c", "url": [], "body": {}}',
                     b'{"custom_id": "c", "url": {}, "body": {}}',
                     '{"prompt": "hi"}'.encode("utf-16-le"), b'{"prompt": "\\ud800"}']),
)


@given(lines=st.lists(json_lines() | ODD_LINES, max_size=8), crlf=st.booleans(), final_newline=st.booleans(),
       picky=st.booleans())
@FUZZ
def test_fuzzed_jsonl_every_line_is_a_request_or_names_its_line(fuzz_dir, lines, crlf, final_newline,
                                                                picky):
    data = (b"\r\n" if crlf else b"\n").join(lines) + (b"\n" if final_newline else b"")
    path = fuzz_dir / "in.jsonl"
    path.write_bytes(data)
    physical = data.split(b"\n")  # what iterating the file in binary yields, without the newlines
    numbers = [i for i, line in enumerate(physical, start=1) if line.strip(ASCII_SPACE)]
    kinds = check_accounts(path, "jsonl", numbers, encode_picky if picky else encode_bytes)
    for number in numbers:
        line = physical[number - 1]
        if b"\x00" in line or not _is_utf8(line):  # never JSON: a raw NUL is neither text nor spacing
            assert kinds[number] == "bad", line[:80]


def _is_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


# -------------------------------------------------------------------------------------------- Parquet

_MESSAGE_TYPE = pa.struct([("role", pa.string()), ("content", pa.string())])
_PLAIN_TEXT = st.text(max_size=8)  # Arrow strings are UTF-8: no lone surrogates
_INT64 = st.integers(-(2**63), 2**63 - 1)
COLUMN_TYPES = [  # (Arrow type, values it holds); None (null) is mixed in for every type
    (pa.int64(), st.integers(-2, 100) | _INT64),
    (pa.int8(), st.integers(-128, 127)),
    (pa.uint64(), st.integers(0, 2**64 - 1)),
    (pa.float64(), st.floats()),
    (pa.float32(), st.floats(width=32)),
    (pa.float16(), st.floats(width=16)),
    (pa.bool_(), st.booleans()),
    (pa.string(), _PLAIN_TEXT),
    (pa.large_string(), _PLAIN_TEXT),
    ("dictionary", st.sampled_from(["a", "b", "hello"])),
    (pa.binary(), st.binary(max_size=8)),
    (pa.list_(pa.int64()), st.lists(st.integers(-1, 100) | _INT64, max_size=4)),
    (pa.list_(pa.string()), st.lists(_PLAIN_TEXT, max_size=3)),
    (pa.list_(_MESSAGE_TYPE), st.lists(st.fixed_dictionaries({"role": _PLAIN_TEXT, "content": _PLAIN_TEXT}),
                                       max_size=3)),
    (pa.list_(pa.list_(pa.int32())),
     st.lists(st.lists(st.integers(-(2**31), 2**31 - 1), max_size=2), max_size=2)),
    (pa.struct([("a", pa.int32()), ("b", pa.list_(pa.float64()))]),
     st.fixed_dictionaries({"a": st.integers(-5, 5), "b": st.lists(st.floats(), max_size=2)})),
    (pa.map_(pa.string(), pa.int64()), st.lists(st.tuples(_PLAIN_TEXT, st.integers(-5, 5)), max_size=2)),
    (pa.timestamp("ms"), _INT64),  # most of int64 is past the year 9999: no Python datetime holds it
    (pa.timestamp("ns"), _INT64),
    (pa.date32(), st.integers(-(2**31), 2**31 - 1)),
    (pa.date64(), _INT64),
    (pa.duration("s"), _INT64),
    (pa.time64("us"), _INT64),
    (pa.decimal128(38, 4), st.decimals(min_value=-(10**30), max_value=10**30, places=4)),
    (pa.null(), st.none()),
]
COLUMN_NAMES = st.sampled_from(sorted({*NATIVE_KEYS, *OPENAI_KEYS})) | st.text(min_size=1, max_size=6)


def _column(arrow_type, values: list) -> pa.Array:
    if arrow_type == "dictionary":
        return pa.array(values, pa.string()).dictionary_encode()
    if arrow_type == pa.float16():
        return pa.array(np.array([np.nan if v is None else v for v in values], np.float16),
                        mask=np.array([v is None for v in values], bool))
    return pa.array(values, arrow_type)


@st.composite
def parquet_tables(draw) -> pa.Table:
    num_rows = draw(st.integers(0, 12))
    names = draw(st.lists(COLUMN_NAMES, max_size=5))  # duplicates allowed: Parquet allows them
    columns = []
    for _ in names:
        arrow_type, values = draw(st.sampled_from(COLUMN_TYPES))
        columns.append(_column(arrow_type, draw(st.lists(st.none() | values, min_size=num_rows,
                                                         max_size=num_rows))))
    if not names:
        return pa.table({})
    return pa.Table.from_arrays(columns, names=names)


def write_parquet(table: pa.Table, path: Path, row_group_size: int, dictionary: bool) -> bytes:
    buffer = io.BytesIO()
    pq.write_table(table, buffer, row_group_size=row_group_size, use_dictionary=dictionary)
    path.write_bytes(buffer.getvalue())
    return buffer.getvalue()


@given(table=parquet_tables(), row_group_size=st.integers(1, 5), dictionary=st.booleans(),
       picky=st.booleans())
@FUZZ
def test_fuzzed_parquet_every_row_is_a_request_or_names_its_row(fuzz_dir, table, row_group_size,
                                                                dictionary, picky):
    path = fuzz_dir / "in.parquet"
    write_parquet(table, path, row_group_size, dictionary)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(readers, "PARQUET_BATCH_ROWS", 4)  # several batches, row numbers carried across them
        check_accounts(path, "parquet", list(range(1, table.num_rows + 1)),
                       encode_picky if picky else encode_bytes)


FLIPS = st.lists(st.tuples(st.integers(0, 10_000), st.integers(1, 255)), min_size=1, max_size=3)


@given(table=parquet_tables(), data=st.binary(max_size=64), cut=st.integers(0, 10_000), flips=FLIPS,
       kind=st.sampled_from(["random bytes", "cut short", "bytes flipped"]))
@FUZZ
def test_broken_parquet_files_are_one_input_error_naming_the_file(fuzz_dir, table, data, cut, flips,
                                                                  kind):
    """Random bytes, a valid file cut short, or one with bytes flipped (the footer too): every row is
    accounted for, or the file is refused with an InputError that names it (never a pyarrow exception)."""
    path = fuzz_dir / "in.parquet"
    good = write_parquet(table, path, 3, True)
    if kind == "random bytes":
        broken = data
    elif kind == "cut short":
        broken = good[: cut % len(good)]
    else:
        broken = bytearray(good)
        for at, xor in flips:
            broken[at % len(good)] ^= xor
        broken = bytes(broken)
    path.write_bytes(broken)
    try:
        total = count_records(path, "parquet")
        check_accounts(path, "parquet", list(range(1, total + 1)), encode_bytes)
    except InputError as exc:
        assert str(path) in str(exc)


# ------------------------------------------------------------------------------------- explicit cases

def _jsonl(tmp_path, *lines: bytes) -> Path:
    path = tmp_path / "in.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    return path


def bad_messages(path: Path, fmt: str = "jsonl") -> list[str]:
    bad = []
    src = RequestSource(iter_records(path, fmt), encode=encode_bytes, sampling=SamplingParams(max_tokens=4),
                        context_len=CONTEXT_LEN, vocab_size=VOCAB_SIZE, unit=readers.unit_name(fmt),
                        on_bad=lambda rid, msg, n, openai: bad.append(msg))
    list(src)
    return bad


EDGE_LINES = [  # (a line that once crashed the reader or got through it, the message it now gets)
    ("deep nesting", _nested(100_000), "line 1: malformed JSON (nested too deeply)"),
    ("5000-digit integer", b'{"prompt": "a", "seed": ' + b"1" * 5000 + b"}",
     "line 1: malformed JSON (an integer over 4300 digits)"),
    ("NUL outside a string", b'{"prompt": "a"}\x00', "line 1: malformed JSON"),
    ("invalid UTF-8", b'{"prompt": "\xff"}', "line 1: not UTF-8 text (byte 13)"),
    ("invalid UTF-8 after a BOM", b'\xef\xbb\xbf{"prompt": "\xff"}', "line 1: not UTF-8 text (byte 16)"),
    ("url a list", b'{"custom_id": "c", "url": [], "body": {"prompt": "a"}}',
     "line 1: url a list is not supported"),
    ("temperature past float", b'{"prompt": "a", "temperature": 1' + b"0" * 400 + b"}",
     "line 1: temperature must be a finite number, got an integer past the float range"),
    ("top_p NaN", b'{"prompt": "a", "top_p": NaN}', "line 1: top_p must be a finite number, got nan"),
    ("temperature Infinity", b'{"prompt": "a", "temperature": Infinity}',
     "line 1: temperature must be a finite number, got inf"),
    ("top_k past int64", b'{"prompt": "a", "top_k": 9223372036854775808}',
     "line 1: top_k must be a 64-bit integer"),
    ("5000-digit id", b'{"id": "' + b"7" * 5000 + b'", "prompt": "a"}', None),
    ("lone surrogate prompt", b'{"prompt": "a\\ud800"}',
     "line 1: prompt is not valid Unicode (a lone surrogate \\ud800 at character 1)"),
    ("lone surrogate id", b'{"id": "\\udfff", "prompt": "a"}', "line 1: id is not valid Unicode"),
    ("lone surrogate message", b'{"messages": [{"role": "user", "content": "\\udc80"}]}',
     "line 1: messages[0].content is not valid Unicode"),
    ("lone surrogate stop", b'{"prompt": "a", "stop": ["\\ud800"]}', "line 1: stop[0] is not valid Unicode"),
    ("lone surrogate field name", b'{"prompt": "a", "\\ud800": 1}', "line 1: unknown field(s) \\ud800"),
    ("long method", b'{"custom_id": "c", "method": "' + b"G" * 100_000 + b'", "body": {}}',
     "line 1: method must be POST, got 'GGG"),
    ("very long line", b'{"prompt": "' + b"z" * 3_000_000 + b'"}',
     "line 1: prompt has 3000000 tokens; the model's context is 48"),
]


@pytest.mark.parametrize("line,expected", [e[1:] for e in EDGE_LINES], ids=[e[0] for e in EDGE_LINES])
def test_edge_lines(tmp_path, line, expected):
    path = _jsonl(tmp_path, line)
    assert count_records(path, "jsonl") == 1
    bad = bad_messages(path)
    if expected is None:
        assert bad == []
    else:
        assert len(bad) == 1 and bad[0].startswith(expected), bad
        assert len(bad[0].split(" (valid: ")[0]) < 300  # a record's own text is quoted shortened


def test_blank_and_whitespace_lines_are_not_records(tmp_path):
    path = _jsonl(tmp_path, b"", b" \t", b'{"prompt": "a"}', b"\x0b\x0c\r", b'{"prompt": "b"}\r', b"\xc2\xa0")
    total, requests, log = read_all(path, "jsonl", encode_bytes)
    assert total == 3  # a no-break space (U+00A0) is not ASCII spacing: a record
    assert [r.index for r in requests] == [3, 5]
    assert log[-1] == ("bad", 6)


def test_byte_order_marks_and_utf16(tmp_path):
    """A UTF-8 byte-order mark may lead a line (files joined with cat); UTF-16 is not JSONL, though
    json.loads(bytes) would read it."""
    path = tmp_path / "in.jsonl"
    path.write_bytes(b'\xef\xbb\xbf{"prompt": "a"}\n\xef\xbb\xbf{"prompt": "b"}\n'
                     + '{"prompt": "c"}'.encode("utf-16-le"))  # the last line: no newline splits it
    total, _, log = read_all(path, "jsonl", encode_bytes)
    assert (total, log) == (3, [("request", 1), ("request", 2), ("bad", 3)])


def test_parquet_value_python_cannot_hold_fails_its_row_only(tmp_path):
    path = tmp_path / "in.parquet"
    when = pa.array([0, 2**62, None], pa.timestamp("ms"))
    pq.write_table(pa.table({"prompt": ["a", "b", "c"], "when": when}), path)
    bad = bad_messages(path, "parquet")  # row 1: "when" is no field of a record; row 3: a null is no field
    assert bad[0].startswith("row 1: unknown field(s) when")
    assert bad[1].startswith("row 2: column 'when' has a value Python cannot hold")
    assert len(bad) == 2


@pytest.mark.parametrize("content", [b"", b"not parquet at all", b"PAR1", b"PAR1\x00\x00\x00\x00PAR1"])
def test_not_parquet_is_an_input_error_naming_the_file(tmp_path, content):
    path = tmp_path / "in.parquet"
    path.write_bytes(content)
    for read in (lambda: count_records(path, "parquet"), lambda: list(iter_records(path, "parquet"))):
        with pytest.raises(InputError, match=re.escape(str(path))):
            read()


def test_zero_row_parquet(tmp_path):
    path = tmp_path / "in.parquet"
    pq.write_table(pa.table({"prompt": pa.array([], pa.string()),
                             "x": pa.array([], pa.list_(pa.int8()))}), path)
    assert count_records(path, "parquet") == 0
    assert bad_messages(path, "parquet") == []
