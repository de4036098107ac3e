"""Metadata filters: the contract's dict syntax compiled to one SQL query over the doc store's
field table `fields(row, key, t, v)`, which holds every scalar metadata value of every live
document with its type t ('s' string, 'n' number, 'b' bool), and every scalar element of a list
value with its type prefixed by 'l' ('ls', 'ln', 'lb'), under an index on (key, t, v, row).

Each comparison is an index range, not a scan of every document's JSON; $and/$or combine the
row sets by INTERSECT/UNION, and $ne/$nin are the complement of $eq/$in (so a document without
the field passes them). Comparisons are typed: a string never equals or orders against a number,
and a bool matches only a bool. The comparison operators see scalar values; $contains sees the
elements of lists. `filter_warnings` names the comparisons that no stored value can match because
the field holds values of other types only.

Each node of the filter is a CTE that names the nodes below it, so a deep filter never nests the
SQL: SQLite's parser overflows at about ten nested subqueries. A filter has at most MAX_TERMS
comparisons, MAX_VALUES values in its $in/$nin lists and MAX_DEPTH levels of $and/$or, and a
compound of more than SQLite's 500 terms is split.

The document's text is filtered by the reserved top-level key DOCUMENT ("$document", Chroma's `where_document`):
{"$document": {"$contains": "s"}} passes the documents whose text holds the string s, {"$not_contains": "s"} the
others (a document without text among them), and $and/$or of such conditions nest inside it as in Chroma;
"$document" combines with metadata comparisons as any field does. The match is SQLite's instr() on the stored
text: an exact substring, case-sensitive (code points compared, no folding, no word boundaries), over the live
rows, not the full-text index, so that it is exact for any string, punctuation and partial words included.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable

from fusionrag.retriever.collection.values import INT64, check_int, check_text
from fusionrag.retriever.errors import InputError

_CMP = {"$eq": "=", "$ne": "=", "$gt": ">", "$gte": ">=", "$lt": "<", "$lte": "<="}
_LIST = ("$in", "$nin")
_CONTAINS = "$contains"
DOCUMENT = "$document"  # the text filter's key (module docstring)
_TEXT_OPS = ("$contains", "$not_contains")
_ELEMENT = "l"  # type prefix of a list's elements
TYPES = ("s", "n", "b", "ls", "ln", "lb")
_TYPE_NAMES = {"s": "strings", "n": "numbers", "b": "bools", "ls": "lists of strings", "ln": "lists of numbers",
               "lb": "lists of bools"}
MAX_TERMS = 1000
MAX_VALUES = 10000
MAX_DEPTH = 32
_COMPOUND_MAX = 500  # SQLITE_MAX_COMPOUND_SELECT's default


def field_value(value) -> tuple[str, object] | None:
    """(type, value as stored) of a metadata value a filter can use; None for anything else."""
    if isinstance(value, bool):
        return "b", int(value)
    if isinstance(value, int):
        if INT64[0] <= value <= INT64[1]:
            return "n", value
        # Writes refuse integers outside int64 (values.py); a store written before may hold some: compared as
        # floats, and those past float's range not at all.
        return ("n", float(value)) if abs(value) < (1 << 1023) else None
    if isinstance(value, float):
        return "n", value
    if isinstance(value, str):
        return "s", value
    return None


NESTED_DEPTH = 8  # keys in the longest dotted path ("a.b.c" is 3) of an object's value that filters see


def field_rows(metadata: dict, prefix: str = "", depth: int = 0) -> list[tuple[str, str, object]]:
    """(key, type, value) rows of the field table for one document's metadata: its scalar values, each distinct
    scalar element of its list values, and the same of objects' values under their dotted path ("a.b" for
    {"a": {"b": 1}}, paths of at most NESTED_DEPTH keys); lists of objects and nested lists are kept but not
    filterable."""
    out = []
    for key, value in metadata.items():
        key = prefix + key
        if isinstance(value, dict):
            if depth + 1 < NESTED_DEPTH:
                out += field_rows(value, key + ".", depth + 1)
        elif isinstance(value, list):
            elements = dict.fromkeys(tv for tv in map(field_value, value) if tv is not None)
            out += [(key, _ELEMENT + t, v) for t, v in elements]
        else:
            tv = field_value(value)
            if tv is not None:
                out.append((key, *tv))
    return out


def _typed(value, where: str) -> tuple[str, object]:
    if isinstance(value, float) and (value != value or value in (float("inf"), float("-inf"))):
        raise InputError(f"filter {where}: {value!r} is not a finite number")
    if isinstance(value, int) and not isinstance(value, bool):
        check_int(value, f"filter {where}: the value")
    elif isinstance(value, str):
        check_text(value, f"filter {where}: the value")
    tv = field_value(value)
    if tv is None:
        raise InputError(f"filter {where}: value {value!r:.200} must be a string, number or bool, "
                         f"not {type(value).__name__}")
    return tv


class _Query:
    """The CTEs of a filter, in the order their SQL (and so their parameters) is written."""

    def __init__(self):
        self.ctes: list[str] = []
        self.params: list = []
        self.terms = self.values = 0
        self.types: dict[str, set[str]] = {}  # field -> the stored types its comparisons can match

    def add(self, sql: str) -> str:
        name = f"f{len(self.ctes)}"
        self.ctes.append(f"{name} AS ({sql})")
        return name

    def term(self, where: str) -> None:
        self.terms += 1
        if self.terms > MAX_TERMS:
            raise InputError(f"filter {where}: a filter has at most {MAX_TERMS} comparisons")

    def compound(self, names: list[str], op: str) -> str:
        while len(names) > 1:
            names = [self.add(f" {op} ".join(f"SELECT row FROM {n}" for n in names[i:i + _COMPOUND_MAX]))
                     for i in range(0, len(names), _COMPOUND_MAX)]
        return names[0]

    def negate(self, name: str) -> str:
        return self.add(f"SELECT row FROM docs EXCEPT SELECT row FROM {name}")


def _cmp(q: _Query, field: str, op: str, value, where: str, prefix: str = "") -> str:
    t, v = _typed(value, where)
    t = prefix + t
    q.term(where)
    q.types.setdefault(field, set()).add(t)
    q.params += [field, t, v]
    return q.add(f"SELECT row FROM fields WHERE key = ? AND t = ? AND v {op} ?")


def _in(q: _Query, field: str, values, where: str) -> str:
    if not isinstance(values, (list, tuple)) or not values:
        raise InputError(f"filter {where}: expects a non-empty list of values")
    q.term(where)
    q.values += len(values)
    if q.values > MAX_VALUES:
        raise InputError(f"filter {where}: a filter has at most {MAX_VALUES} values in its $in and $nin lists")
    groups: dict[str, list] = {}
    for value in values:
        t, v = _typed(value, where)
        groups.setdefault(t, []).append(v)
    q.types.setdefault(field, set()).update(groups)
    parts = []
    for t, vs in groups.items():
        q.params += [field, t, *vs]
        parts.append(q.add(f"SELECT row FROM fields WHERE key = ? AND t = ? AND v IN ({','.join('?' * len(vs))})"))
    return q.compound(parts, "UNION")


def _field(q: _Query, field: str, cond) -> str:
    if not isinstance(field, str) or not field:
        raise InputError(f"filter field {field!r} must be a non-empty string")
    check_text(field, "filter field")
    if not isinstance(cond, dict):
        return _cmp(q, field, "=", cond, f"on {field!r}")
    if not cond:
        raise InputError(f"filter on {field!r}: empty operator dict")
    parts = []
    for op, value in cond.items():
        where = f"{op} on {field!r}"
        if op in _CMP:
            if op not in ("$eq", "$ne") and isinstance(value, bool):
                raise InputError(f"filter {where}: a bool cannot be ordered")
            name = _cmp(q, field, _CMP[op], value, where)
            parts.append(q.negate(name) if op == "$ne" else name)
        elif op in _LIST:
            name = _in(q, field, value, where)
            parts.append(q.negate(name) if op == "$nin" else name)
        elif op == _CONTAINS:  # a list value holds this element
            parts.append(_cmp(q, field, "=", value, where, _ELEMENT))
        else:
            raise InputError(f"filter on {field!r}: unknown operator {op!r}; expected one of "
                             f"{', '.join(list(_CMP) + list(_LIST) + [_CONTAINS])}")
    return q.compound(parts, "INTERSECT")


def _text(q: _Query, cond, depth: int) -> str:
    """A text condition under DOCUMENT: {"$contains": s}, {"$not_contains": s} (both in one dict: each must hold),
    or {"$and" / "$or": [conditions]}."""
    if not isinstance(cond, dict) or not cond:
        raise InputError(f"filter {DOCUMENT}: expects a non-empty dict such as {{\"$contains\": \"word\"}}, got "
                         f"{cond!r:.200}")
    parts = []
    for op, value in cond.items():
        where = f"{DOCUMENT} {op}"
        if op in ("$and", "$or"):
            parts.append(_compound(q, op, value, depth, _text,
                                   f"filter {where}: expects a non-empty list of text conditions"))
        elif op in _TEXT_OPS:
            if not isinstance(value, str):
                raise InputError(f"filter {where}: the value must be a string, not {type(value).__name__} "
                                 f"({value!r:.200})")
            if not value:
                raise InputError(f"filter {where}: the value must be a non-empty string")
            check_text(value, f"filter {where}: the value")
            q.term(where)
            q.params.append(value)
            name = q.add("SELECT row FROM docs WHERE instr(text, ?) > 0")
            parts.append(q.negate(name) if op == "$not_contains" else name)
        else:
            raise InputError(f"filter {DOCUMENT}: unknown operator {op!r}; expected one of $contains, $not_contains, "
                             f"$and, $or")
    return q.compound(parts, "INTERSECT")


def _compound(q: _Query, op: str, value, depth: int, each, expects: str) -> str:
    """$and / $or over a list of conditions, each compiled by each(q, condition, depth + 1), a document's text
    conditions (_text) or metadata filters (_node); expects: the words for a value that is no such list."""
    if not isinstance(value, (list, tuple)) or not value:
        raise InputError(expects)
    if depth == MAX_DEPTH:
        raise InputError(f"filter: $and/$or nest at most {MAX_DEPTH} deep")
    return q.compound([each(q, sub, depth + 1) for sub in value], "INTERSECT" if op == "$and" else "UNION")


def _node(q: _Query, f, depth: int) -> str:
    if not isinstance(f, dict) or not f:
        raise InputError(f"a filter must be a non-empty dict, got {f!r:.200}")
    parts = []
    for key, value in f.items():
        if key in ("$and", "$or"):
            parts.append(_compound(q, key, value, depth, _node, f"filter {key} expects a non-empty list of filters"))
        elif key == DOCUMENT:
            parts.append(_text(q, value, depth))
        elif isinstance(key, str) and key.startswith("$"):
            raise InputError(f"filter: unknown operator {key!r} at the top level; expected $and, $or, {DOCUMENT} or a "
                             f"field name")
        else:
            parts.append(_field(q, key, value))
    return q.compound(parts, "INTERSECT")


def compile_filter(f: dict) -> tuple[str, list]:
    """(SQL query yielding the rows that pass, in any order, possibly repeated; its parameters)."""
    q = _Query()
    top = _node(q, f, 0)
    return f"WITH {', '.join(q.ctes)} SELECT row FROM {top}", q.params


def _names(types: set[str]) -> str:
    return " and ".join(_TYPE_NAMES[t] for t in TYPES if t in types)


def filter_warnings(f: dict, stored_types: Callable[[str], set[str]],
                    known_fields: Callable[[], list[str]] | None = None) -> list[str]:
    """For each field of a (valid) filter that no document holds, or holds only as values of types its comparisons
    never match, a sentence saying so: those comparisons match no stored value, silently otherwise.
    stored_types(field) gives the types stored under a field (TYPES' codes); known_fields() the fields stored,
    from which a missing one's near names are suggested."""
    q = _Query()
    _node(q, f, 0)
    out = []
    for field, wanted in q.types.items():
        have = stored_types(field)
        if not have:
            known = known_fields() if known_fields is not None else []
            by_lower = {k.lower(): k for k in known}
            near = [by_lower[k] for k in difflib.get_close_matches(field.lower(), by_lower, 3)]
            inner = [k for k in known if k.startswith(field + ".")][:3]
            out.append(f"filter on {field!r}: no document holds a string, number or bool under it, so only $ne and "
                       f"$nin match (a misspelled field?"
                       + (f" the documents hold {', '.join(map(repr, near))})" if near else ")")
                       + (f"; it holds objects: filter their values by dotted path, {', '.join(map(repr, inner))}"
                          if inner else ""))
            continue
        if have & wanted:
            continue
        held, sought = ({t.startswith(_ELEMENT) for t in ts} for ts in (have, wanted))  # lists' elements?
        hint = ""
        if held == {True} and sought == {False}:
            hint = f'; {{"{_CONTAINS}": value}} tests the elements of a list'
        elif held == {False} and sought == {True}:
            hint = f"; {_CONTAINS} tests the elements of lists only"
        out.append(f"filter on {field!r}: the documents hold it as {_names(have)} only, the filter looks for "
                   f"{_names(wanted)}, so no stored value matches (a value matches only its own type: "
                   f'"3" is not 3{hint})')
    return out
