"""Metadata filters: the contract's dict syntax compiled to one SQL query over the doc store's
field table `fields(row, key, t, v)`, which holds every scalar metadata value of every live
document with its type t ('s' string, 'n' number, 'b' bool) under an index on (key, t, v).

Each comparison is an index range, not a scan of every document's JSON; $and/$or combine the
row sets by INTERSECT/UNION, and $ne/$nin are the complement of $eq/$in (so a document without
the field passes them). Comparisons are typed: a string never equals or orders against a number,
and a bool matches only a bool.
"""

from __future__ import annotations

from fusionrag.retriever.errors import InputError

_CMP = {"$eq": "=", "$ne": "=", "$gt": ">", "$gte": ">=", "$lt": "<", "$lte": "<="}
_LIST = ("$in", "$nin")
_INT64 = (-(1 << 63), (1 << 63) - 1)


def field_value(value) -> tuple[str, object] | None:
    """(type, value as stored) of a metadata value a filter can use; None for anything else."""
    if isinstance(value, bool):
        return "b", int(value)
    if isinstance(value, int):
        return "n", value if _INT64[0] <= value <= _INT64[1] else float(value)
    if isinstance(value, float):
        return "n", value
    if isinstance(value, str):
        return "s", value
    return None


def _typed(value, where: str) -> tuple[str, object]:
    if isinstance(value, float) and (value != value or value in (float("inf"), float("-inf"))):
        raise InputError(f"filter {where}: {value!r} is not a finite number")
    tv = field_value(value)
    if tv is None:
        raise InputError(f"filter {where}: value {value!r} must be a string, number or bool, "
                         f"not {type(value).__name__}")
    return tv


def _sub(sql: str) -> str:
    """A compound-select operand: SQLite groups compounds left to right, so nest each one."""
    return f"SELECT row FROM ({sql})"


def _compound(parts: list[str], op: str) -> str:
    return parts[0] if len(parts) == 1 else f" {op} ".join(_sub(p) for p in parts)


def _not(sql: str) -> str:
    return f"SELECT row FROM docs EXCEPT {_sub(sql)}"


def _cmp(field: str, op: str, value, where: str, params: list) -> str:
    t, v = _typed(value, where)
    params += [field, t, v]
    return f"SELECT row FROM fields WHERE key = ? AND t = ? AND v {op} ?"


def _in(field: str, values, where: str, params: list) -> str:
    if not isinstance(values, (list, tuple)) or not values:
        raise InputError(f"filter {where}: expects a non-empty list of values")
    groups: dict[str, list] = {}
    for value in values:
        t, v = _typed(value, where)
        groups.setdefault(t, []).append(v)
    parts = []
    for t, vs in groups.items():
        params += [field, t, *vs]
        parts.append(f"SELECT row FROM fields WHERE key = ? AND t = ? AND v IN ({','.join('?' * len(vs))})")
    return _compound(parts, "UNION")


def _field(field: str, cond, params: list) -> str:
    if not isinstance(field, str) or not field:
        raise InputError(f"filter field {field!r} must be a non-empty string")
    if not isinstance(cond, dict):
        return _cmp(field, "=", cond, f"on {field!r}", params)
    if not cond:
        raise InputError(f"filter on {field!r}: empty operator dict")
    parts = []
    for op, value in cond.items():
        where = f"{op} on {field!r}"
        if op in _CMP:
            if op not in ("$eq", "$ne") and isinstance(value, bool):
                raise InputError(f"filter {where}: a bool cannot be ordered")
            sql = _cmp(field, _CMP[op], value, where, params)
            parts.append(_not(sql) if op == "$ne" else sql)
        elif op in _LIST:
            sql = _in(field, value, where, params)
            parts.append(_not(sql) if op == "$nin" else sql)
        else:
            raise InputError(f"filter on {field!r}: unknown operator {op!r}; expected one of "
                             f"{', '.join(list(_CMP) + list(_LIST))}")
    return _compound(parts, "INTERSECT")


def _node(f, params: list) -> str:
    if not isinstance(f, dict) or not f:
        raise InputError(f"a filter must be a non-empty dict, got {f!r}")
    parts = []
    for key, value in f.items():
        if key in ("$and", "$or"):
            if not isinstance(value, (list, tuple)) or not value:
                raise InputError(f"filter {key} expects a non-empty list of filters")
            parts.append(_compound([_node(sub, params) for sub in value], "INTERSECT" if key == "$and" else "UNION"))
        elif isinstance(key, str) and key.startswith("$"):
            raise InputError(f"filter: unknown operator {key!r} at the top level; expected $and, $or or a field name")
        else:
            parts.append(_field(key, value, params))
    return _compound(parts, "INTERSECT")


def compile_filter(f: dict) -> tuple[str, list]:
    """(SQL query yielding the rows that pass, sorted and distinct; its parameters)."""
    params: list = []
    return f"SELECT DISTINCT row FROM ({_node(f, params)}) ORDER BY row", params
