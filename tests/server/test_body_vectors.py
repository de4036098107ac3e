"""#65: a search body's query vectors read in C++ (native parse_vectors, server/bodies.py Body.vectors) give what the
Python walker gives (Body.vector, row by row, the reference): the same float32 bits for every well-formed body, and
for every other body the walker's own answer (the native path declines it: it never decides an error)."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
from fastapi import HTTPException
from fastapi.exceptions import RequestValidationError

from fusionrag import native as _native
from fusionrag.server.bodies import Body

DIM = 6
LIMIT = 4


def _too_many():
    return HTTPException(422, "too many")


def _wrong_dim(n):
    return HTTPException(422, f"dimension {n}")


def _reference(raw: bytes):
    """What the walker alone reads: (rows as float32, end) or the HTTPException it raises."""
    b = Body(bytearray(raw))
    try:
        rows, end = b.array(0, 1, lambda n, j: b.vector(j, DIM, ("vectors", n), _wrong_dim), LIMIT, _too_many)
        return np.stack(rows) if isinstance(rows, list) and rows else rows, end
    except HTTPException as e:
        return ("error", e.status_code, e.detail)
    except RequestValidationError as e:
        return ("error", 422, repr(e.errors()))


def _fast(raw: bytes):
    b = Body(bytearray(raw))
    try:
        rows, end = b.vectors(0, DIM, "vectors", _wrong_dim, LIMIT, _too_many)
        return np.stack(rows) if isinstance(rows, list) and rows else rows, end
    except HTTPException as e:
        return ("error", e.status_code, e.detail)
    except RequestValidationError as e:
        return ("error", 422, repr(e.errors()))


def _error(x) -> bool:
    return isinstance(x, tuple) and isinstance(x[0], str)


def _same(a, b) -> bool:
    if _error(a) or _error(b):
        return a == b
    (ra, ea), (rb, eb) = a, b
    if not isinstance(ra, np.ndarray) or not isinstance(rb, np.ndarray):  # what the route's model then refuses
        return type(ra) is type(rb) and ra == rb and ea == eb
    return ea == eb and ra.dtype == rb.dtype == np.float32 and ra.tobytes() == rb.tobytes()


def _number(rng: random.Random) -> str:
    kind = rng.randrange(8)
    x = rng.uniform(-10, 10) * 10 ** rng.randint(-8, 8)
    if kind == 0:
        return repr(x)
    if kind == 1:
        return f"{x:.3e}"
    if kind == 2:
        return str(rng.randint(-1000, 1000))
    if kind == 3:
        return repr(float(np.float32(x)))  # float32's shortest digits, as orjson writes them
    if kind == 4:
        return "-0.0"
    if kind == 5:
        return f"{x:.17g}".replace("e+", "E")
    if kind == 6:  # halfway between two float32 neighbours, give or take: double rounding would show here
        f = np.float32(rng.uniform(1, 2))
        return repr((float(f) + float(np.nextafter(f, np.float32(3)))) / 2)
    return repr(rng.uniform(-1, 1))


def _body(rng: random.Random, rows: int) -> str:
    ws = lambda: rng.choice(["", " ", "\n", "\t ", "\r\n  "])  # noqa: E731
    return ws() + "[" + ws() + ("," + ws()).join(
        "[" + ws() + ("," + ws()).join(_number(rng) + ws() for _ in range(DIM)) + "]" + ws()
        for _ in range(rows)) + "]" + ws() + ', "k": 3'


def test_well_formed_bodies_read_the_same_bits_as_the_walker():
    rng = random.Random(7)
    taken = 0
    for _ in range(3000):
        raw = _body(rng, rng.randint(1, LIMIT)).encode()
        ref, fast = _reference(raw), _fast(raw)
        assert _same(ref, fast), (raw[:200], ref, fast)
        taken += _native.parse_vectors(raw, 0, DIM, LIMIT) is not None
    assert taken == 3000  # every one of them went the native way


BAD = [
    "[[1, 2, 3, 4, 5, NaN]]", "[[1, 2, 3, 4, 5, Infinity]]", "[[1, 2, 3, 4, 5, -Infinity]]",
    '[[1, 2, 3, 4, 5, "6"]]', "[[1, 2, 3, 4, 5, null]]", "[[1, 2, 3, 4, 5, true]]", "[[1, 2, 3, 4, 5]]",
    "[[1, 2, 3, 4, 5, 6, 7]]", "[[1, 2, 3, 4, 5, 01]]", "[[1, 2, 3, 4, 5, 1.]]", "[[1, 2, 3, 4, 5, .5]]",
    "[[1, 2, 3, 4, 5, +1]]", "[[1, 2, 3, 4, 5, 1e400]]", "[[1, 2, 3, 4, 5, 1e39]]", "[[1, 2, 3, 4, 5, -1e39]]",
    "[[1, 2, 3, 4, 5, 1" + "0" * 400 + "]]", "[[1, 2, 3, 4, 5, 6],]", "[[1, 2, 3, 4, 5, 6,]]", "[[]]", "[]",
    "[[1, 2, 3, 4, 5, 6]", "[[1, 2, 3, 4, 5, 6]] x", "[[[1], 2, 3, 4, 5, 6]]", "[1, 2, 3, 4, 5, 6]", "null",
    '"vectors"', "[[1, 2, 3, 4, 5, 6]" + ", [1, 2, 3, 4, 5, 6]" * LIMIT + "]", "[[1, 2, 3, 4, 5, 6] [1]]",
    "[[1, 2, 3, 4, 5, 1e-50]]", "[[1, 2, 3, 4, 5, -]]", "[[1, 2, 3, 4, 5, 1e]]", "[[1, 2, 3, 4, 5, 1e+]]",
    "[[1,2,3,4,5,6]", "", "[", "[[1, 2, 3, 4, 5, 0x10]]", "[[1, 2, 3, 4, 5, 6]]",
]


@pytest.mark.parametrize("raw", BAD)
def test_anything_else_is_answered_by_the_walker(raw):
    ref, fast = _reference(raw.encode()), _fast(raw.encode())
    assert _same(ref, fast), (raw[:80], ref, fast)


def test_a_row_of_tiny_numbers_rounds_to_zero_as_numpy_rounds_it():
    raw = b"[[1e-50, -1e-50, 1e-46, 1.4e-45, 3e-39, 0]]"
    arr, _ = _native.parse_vectors(raw, 0, DIM, LIMIT)
    want = np.asarray(json.loads(raw)[0], dtype=np.float32)
    assert arr.tobytes() == want[None].tobytes()
