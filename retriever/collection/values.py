"""What a collection can hold: the one check of every string and number a write or a filter brings, made before
anything is logged, so that no acknowledged (or refused) write can leave the log holding an entry the doc store
cannot apply.

The doc store is SQLite: its text is UTF-8, so a string holding a lone surrogate (a code point in U+D800-DFFF,
which JSON's `\\ud800` escape and Python strings allow and UTF-8 does not) cannot be stored; its integers are
signed 64-bit, so a metadata integer outside that range (10^400, 2^70) could be neither indexed nor compared
exactly. Both are refused with InputError (the service's 422) naming the field, as Qdrant refuses them (serde's
"lone leading surrogate", "number out of range"). Floats must be finite (JSON has no NaN or Infinity).

The checks cost one C-level scan of what is checked in the usual case: a string is tested whole by
`str.isascii` or one regular-expression search, and a document's metadata, once serialised for the log, is walked
value by value only where its JSON holds a `\\ud` escape or a run of 19 digits (where a bad value could be).
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence

from fusionrag.retriever.errors import InputError

INT64 = (-(1 << 63), (1 << 63) - 1)
MAX_NESTING = 64  # lists and objects inside a metadata value, at most
_SURROGATE = re.compile("[\ud800-\udfff]")
# Where the JSON (ensure_ascii) of good metadata can hold no bad value: no escaped surrogate (a valid pair is two
# escapes, a lone one is one; either starts with \ud8-\udf) and no integer of 19 digits or more.
_SUSPECT = re.compile(r"\\u[dD][89abcdefABCDEF]|\d{19}")


def surrogate_at(s: str) -> int:
    """The index of the first lone surrogate in s (a code point UTF-8 cannot encode), -1 where there is none."""
    if s.isascii():
        return -1
    m = _SURROGATE.search(s)
    return m.start() if m else -1


def check_text(s: str, what: str) -> None:
    """InputError unless s can be stored (UTF-8): what names it ("document 'a': text")."""
    at = surrogate_at(s)
    if at >= 0:
        raise InputError(f"{what} holds a lone surrogate (U+{ord(s[at]):04X} at character {at}), which is not "
                         "valid Unicode: send text as valid UTF-8")


def check_int(v: int, what: str) -> None:
    if not INT64[0] <= v <= INT64[1]:
        digits = len(str(abs(v))) if abs(v).bit_length() < 4000 else "thousands of"
        raise InputError(f"{what} is an integer of {digits} digits, outside the signed 64-bit range the store "
                         "holds (-2^63 to 2^63-1); send it as a float or a string")


def _path(path: str, key) -> str:
    return f"{path}.{key}" if path else str(key)


def bad_value(value, path: str = "", depth: int = 0) -> tuple[str, str] | None:
    """(where, why) for the first value under `value` that a collection cannot hold, None where all can: strings
    (keys included) that are not valid Unicode, integers outside int64, floats that are not finite, anything JSON
    has no value for, lists and objects nested over MAX_NESTING deep."""
    if value is None or isinstance(value, bool):
        return None
    if isinstance(value, str):
        at = surrogate_at(value)
        return None if at < 0 else (path, f"holds a lone surrogate (U+{ord(value[at]):04X} at character {at}), "
                                          "which is not valid Unicode")
    if isinstance(value, int):
        return None if INT64[0] <= value <= INT64[1] else (
            path, "is an integer outside the signed 64-bit range (-2^63 to 2^63-1); send it as a float or a string")
    if isinstance(value, float):
        return None if value - value == 0 else (path, f"is {value!r}, not a finite number")
    if isinstance(value, (dict, list, tuple)):
        if depth >= MAX_NESTING:
            return path, f"nests lists and objects more than {MAX_NESTING} deep"
        if isinstance(value, dict):
            for k, v in value.items():
                if not isinstance(k, str):
                    return _path(path, repr(k)), "has a key that is not a string"
                at = surrogate_at(k)
                if at >= 0:
                    return _path(path, k.encode("utf-8", "backslashreplace").decode()), \
                        f"is a key holding a lone surrogate (U+{ord(k[at]):04X} at character {at}), which is not " \
                        "valid Unicode"
                found = bad_value(v, _path(path, k), depth + 1)
                if found:
                    return found
        else:
            for i, v in enumerate(value):
                found = bad_value(v, f"{path}[{i}]", depth + 1)
                if found:
                    return found
        return None
    return path, f"is a {type(value).__name__}, which JSON has no value for"


def metadata_json(doc_id: str, metadata, what: str | None = None) -> str:
    """A document's metadata as the log and the doc store keep it (JSON text, ASCII), checked: a dict with string
    keys whose every value the store can hold (bad_value). what: how errors name the document (its id)."""
    what = f"document {doc_id!r}" if what is None else what
    if not isinstance(metadata, dict) or not all(isinstance(k, str) for k in metadata):
        raise InputError(f"{what}: metadata must be a dict with string keys")
    try:
        text = json.dumps(metadata, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError, RecursionError):
        text = None
    if text is None or _SUSPECT.search(text):
        found = bad_value(metadata)
        if found:
            where, why = found
            raise InputError(f"{what}: metadata field {where!r} {why}")
        if text is None:  # json.dumps refused what bad_value passes: not expected, said plainly all the same
            raise InputError(f"{what}: metadata is not JSON-serialisable")
    return text


def check_id(doc_id: str, what: str = "id") -> None:
    """A document id a write, a read or a delete brings (a string, checked for type by the caller)."""
    check_text(doc_id, f"{what} {doc_id!r:.80}")


def check_ids(ids, verb: str) -> list[str]:
    """The ids a read or a delete names, distinct and in order: a sequence of strings (an id that is not valid
    Unicode was never stored, and cannot be looked up: refused as a write refuses it)."""
    if isinstance(ids, (str, bytes)) or not isinstance(ids, Sequence) or not all(isinstance(i, str) for i in ids):
        raise InputError(f"{verb} takes a sequence of string ids")
    for i in ids:
        check_id(i)
    return list(dict.fromkeys(ids))


def logged_problem(ids, texts, metas) -> InputError | None:
    """What today's checks find wrong with a write already in the log (written by a version that checked less,
    or planted): None where every id, text and metadata JSON passes, else the InputError a write would get now."""
    try:
        for i in ids:
            check_id(i)
        for doc_id, t in zip(ids, texts or ()):
            if t is not None:
                check_text(t, f"document {doc_id!r}: text")
        for doc_id, m in zip(ids, metas or ()):
            found = bad_value(json.loads(m))
            if found:
                raise InputError(f"document {doc_id!r}: metadata field {found[0]!r} {found[1]}")
    except InputError as e:
        return e
    except ValueError as e:  # metadata that is not JSON
        return InputError(f"a logged write's metadata is not JSON ({e})")
    return None
