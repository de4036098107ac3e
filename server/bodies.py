"""JSON request bodies read at a bounded cost.

FastAPI parses a body whole into Python objects (some 32 bytes a number), then into pydantic models, before a
route may count its queries: a 16 MiB search body cost ~85 MB before its 257th query was refused. The routes
that take vectors walk their body's bytes here instead: a list over its limit is refused at the item past it,
a vector goes straight into a float32 array (its length checked before its numbers are parsed), and the other
values, which pydantic then validates, count against MAX_VALUES. Strings, numbers and vectors are parsed in C
(orjson, json, numpy); only the structure is walked in Python, MAX_DEPTH levels deep at most.
"""

from __future__ import annotations

import json
import re
from typing import Any, Callable

import numpy as np
import orjson
from fastapi import HTTPException, Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, TypeAdapter, ValidationError

from fusionrag import native

MAX_VALUES = 1 << 18
MAX_DEPTH = 100  # a filter nests $and/$or 32 deep at most: 2 levels each

_WS = re.compile(rb"[ \t\n\r]*")
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_NUMBER = re.compile(rb"-?(?:0|[1-9][0-9]*)(\.[0-9]+)?([eE][-+]?[0-9]+)?")
# A list of numbers only, NaN and Infinity included: json.loads turns each into a float, as it would whole.
_ROW = re.compile(rb"\[[-+0-9.eE,NaInfity \t\n\r]*\]")
_CONSTANTS = ((b"true", True), (b"false", False), (b"null", None), (b"NaN", float("nan")),
              (b"Infinity", float("inf")), (b"-Infinity", float("-inf")))

Reader = Callable[[int], tuple[Any, int]]  # position -> (value, end)
Item = Callable[[int, int], tuple[Any, int]]  # (index in its list, position) -> (value, end)


async def read_body(request: Request) -> bytearray:
    """The body's bytes (BodyLimit refuses more than max_body_bytes), held once: not chunks and their join."""
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
    return body


def validate(model: type[BaseModel] | TypeAdapter, data, loc: tuple = ()):
    """`data` validated as FastAPI would have validated the body, its errors answered alike (422)."""
    try:
        if isinstance(model, TypeAdapter):
            return model.validate_python(data, strict=True)
        return model.model_validate(data)
    except ValidationError as e:
        raise RequestValidationError([{**err, "loc": ("body", *loc, *err["loc"])}
                                      for err in e.errors(include_url=False)]) from None


_VECTOR = TypeAdapter(list[float])


class Body:
    """One body's bytes, walked once. Each reader takes the position of a value and returns it and its end."""

    def __init__(self, data: bytes | bytearray):
        self.b = data
        self.values = 0

    def fail(self, at: int, msg: str):
        raise HTTPException(400, f"malformed JSON at character {at}: {msg}")

    def _ws(self, i: int) -> int:
        return _WS.match(self.b, i).end()

    def _deeper(self, depth: int) -> None:
        if depth >= MAX_DEPTH:
            raise HTTPException(422, f"the body nests lists and objects more than {MAX_DEPTH} deep")

    def _walk(self, i: int, close: bytes, one: Callable[[int, int], int]) -> int:
        """Calls one(n, position) for the n-th element of the list or object opening at i; returns its end."""
        i = self._ws(i + 1)
        if self.b[i:i + 1] == close:
            return i + 1
        n = 0
        while True:
            i = self._ws(one(n, i))
            n += 1
            c = self.b[i:i + 1]
            if c == close:
                return i + 1
            if c != b",":
                self.fail(i, "Expecting ',' delimiter")
            i = self._ws(i + 1)

    def _string(self, i: int) -> tuple[str, int]:
        m = _STRING.match(self.b, i)
        if m is None:
            self.fail(i, "Unterminated string")
        try:
            return json.loads(m.group()), m.end()
        except json.JSONDecodeError as e:
            self.fail(i + e.pos, e.msg)
        except ValueError as e:  # not UTF-8
            self.fail(i, str(e))

    def obj(self, i: int, depth: int = 0, fields: dict[str, Reader] | None = None) -> tuple[Any, int]:
        """The object at i, the members named in `fields` read by their reader; anything else: value()."""
        i = self._ws(i)
        if self.b[i:i + 1] != b"{":
            return self.value(i, depth)
        self._deeper(depth)
        out: dict[str, Any] = {}

        def member(_, j: int) -> int:
            if self.b[j:j + 1] != b'"':
                self.fail(j, "Expecting property name enclosed in double quotes")
            key, j = self._string(j)
            j = self._ws(j)
            if self.b[j:j + 1] != b":":
                self.fail(j, "Expecting ':' delimiter")
            read = (fields or {}).get(key)
            out[key], end = read(j + 1) if read else self.value(j + 1, depth + 1)
            return end

        return out, self._walk(i, b"}", member)

    def array(self, i: int, depth: int, item: Item, limit: int | None = None,
              too_many: Callable[[], HTTPException] | None = None) -> tuple[Any, int]:
        """The list at i, each element read by `item`; refused with too_many() at element limit + 1."""
        i = self._ws(i)
        if self.b[i:i + 1] != b"[":
            return self.value(i, depth)
        self._deeper(depth)
        out: list = []

        def element(n: int, j: int) -> int:
            if n == limit:
                raise too_many()
            v, end = item(n, j)
            out.append(v)
            return end

        return out, self._walk(i, b"]", element)

    def value(self, i: int, depth: int = 0) -> tuple[Any, int]:
        """Any JSON value, built as json.loads builds it."""
        i = self._ws(i)
        self.values += 1
        if self.values > MAX_VALUES:
            raise HTTPException(413, f"request body holds more than {MAX_VALUES} JSON values besides its vectors")
        c = self.b[i:i + 1]
        if c == b"{":
            return self.obj(i, depth)
        if c == b"[":
            return self.array(i, depth, lambda _, j: self.value(j, depth + 1))
        if c == b'"':
            return self._string(i)
        m = _NUMBER.match(self.b, i)
        if m is not None:
            try:
                return (float(m.group()) if m.group(1) or m.group(2) else int(m.group())), m.end()
            except ValueError as e:  # an integer of more digits than Python converts
                raise HTTPException(422, f"number at character {i}: {e}") from None
        for literal, v in _CONSTANTS:
            if self.b.startswith(literal, i):
                return v, i + len(literal)
        self.fail(i, "Expecting value")

    def vector(self, i: int, dim: int, loc: tuple, wrong_dim: Callable[[int], HTTPException],
               nullable: bool = False) -> tuple[Any, int]:
        """A vector of `dim` numbers as float32 (None for a null that may be); its length is checked before its
        numbers are parsed. Anything but a list of numbers is built, and refused as pydantic would refuse it."""
        i = self._ws(i)
        m = _ROW.match(self.b, i)
        if m is None:
            v, end = self.value(i, len(loc))
            if v is None and nullable:
                return None, end
            v = validate(_VECTOR, v, loc)
        else:
            row, end = m.group(), m.end()
            n = row.count(b",") + 1 if row[1:-1].strip() else 0
            if n != dim:
                raise wrong_dim(n)
            try:  # orjson parses a row of floats ~5x faster than json (13 against 70 us for 384)
                v = orjson.loads(row)
            except orjson.JSONDecodeError:  # NaN, Infinity, a number past float64, a typo: json's words for it
                try:
                    v = json.loads(row)
                except json.JSONDecodeError as e:
                    self.fail(i + e.pos, e.msg)
                except ValueError as e:  # an integer of more digits than Python converts
                    raise HTTPException(422, f"{'.'.join(map(str, loc))}: {e}") from None
        if len(v) != dim:
            raise wrong_dim(len(v))
        try:
            with np.errstate(over="ignore"):
                a = np.asarray(v, dtype=np.float32)
        except OverflowError:  # an integer past float64's range (10**400): json.loads keeps it an int
            a = np.full(1, np.inf, np.float32)
        if not np.isfinite(a).all():
            raise HTTPException(422, f"{'.'.join(map(str, loc))}: holds a number that is not finite "
                                     "(NaN, infinity, or past float32's range)")
        return a, end

    def vectors(self, i: int, dim: int, what: str, wrong_dim: Callable[[int], HTTPException], limit: int,
                too_many: Callable[[], HTTPException]) -> tuple[Any, int]:
        """The list of query vectors at i, each row as vector() reads it (at most `limit` of them): read in C++ where
        it is the plain case, rows of `dim` numbers finite as float32 (native parse_vectors: the same float32 bits,
        without a Python object per number); anything else, and every error, by the walker, in its words."""
        i = self._ws(i)
        fast = native.parse_vectors(self.b, i, dim, limit)
        if fast is not None:
            rows, end = fast
            return list(rows), end
        return self.array(i, 1, lambda n, j: self.vector(j, dim, (what, n), wrong_dim), limit, too_many)

    def document(self, fields: dict[str, Reader]) -> dict:
        """The whole body: a JSON object, its members in `fields` read by their reader."""
        i = self._ws(0)
        out, end = self.obj(i, 0, fields)
        end = self._ws(end)
        if end != len(self.b):
            self.fail(end, "Extra data")
        if not isinstance(out, dict):
            raise HTTPException(422, "the body must be a JSON object")
        return out
