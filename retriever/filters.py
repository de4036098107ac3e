"""Metadata filters: the contract's dict syntax compiled to one SQL expression over the doc
store's JSON metadata column.

Comparisons are typed: a string never equals or orders against a number, a bool matches only a
bool, and a field that is missing (or JSON null) fails every operator except $ne and $nin.
"""

from __future__ import annotations

from fusionrag.retriever.errors import InputError

_CMP = {"$eq": "=", "$ne": "=", "$gt": ">", "$gte": ">=", "$lt": "<", "$lte": "<="}
_LIST = ("$in", "$nin")


def _json_types(value, where: str) -> tuple[str, ...]:
    if isinstance(value, bool):
        return ("true", "false")
    if isinstance(value, (int, float)):
        if value != value or value in (float("inf"), float("-inf")):
            raise InputError(f"filter {where}: {value!r} is not a finite number")
        return ("integer", "real")
    if isinstance(value, str):
        return ("text",)
    raise InputError(f"filter {where}: value {value!r} must be a string, number or bool, "
                     f"not {type(value).__name__}")


def _sql_value(value):
    return int(value) if isinstance(value, bool) else value


def _path(field: str) -> str:
    if not isinstance(field, str) or not field or '"' in field or "\\" in field:
        raise InputError(f"filter field {field!r} must be a non-empty string without quotes or backslashes")
    return f'$."{field}"'


def _typed(path: str, op: str, value, where: str, params: list) -> str:
    types = _json_types(value, where)
    params += [path, *types, path, _sql_value(value)]
    marks = ",".join("?" * len(types))
    # COALESCE: a missing field gives NULL, which must read as false (and NOT false as true).
    return f"COALESCE(json_type(metadata, ?) IN ({marks}) AND json_extract(metadata, ?) {op} ?, 0)"


def _field(field: str, cond, params: list) -> str:
    path = _path(field)
    if not isinstance(cond, dict):
        return _typed(path, "=", cond, f"on {field!r}", params)
    if not cond:
        raise InputError(f"filter on {field!r}: empty operator dict")
    parts = []
    for op, value in cond.items():
        where = f"{op} on {field!r}"
        if op in _CMP:
            if op not in ("$eq", "$ne") and isinstance(value, bool):
                raise InputError(f"filter {where}: a bool cannot be ordered")
            expr = _typed(path, _CMP[op], value, where, params)
            parts.append(f"NOT {expr}" if op == "$ne" else expr)
        elif op in _LIST:
            if not isinstance(value, (list, tuple)) or not value:
                raise InputError(f"filter {where}: expects a non-empty list of values")
            expr = "(" + " OR ".join(_typed(path, "=", v, where, params) for v in value) + ")"
            parts.append(f"NOT {expr}" if op == "$nin" else expr)
        else:
            raise InputError(f"filter on {field!r}: unknown operator {op!r}; expected one of "
                             f"{', '.join(list(_CMP) + list(_LIST))}")
    return "(" + " AND ".join(parts) + ")"


def _node(f, params: list) -> str:
    if not isinstance(f, dict) or not f:
        raise InputError(f"a filter must be a non-empty dict, got {f!r}")
    parts = []
    for key, value in f.items():
        if key in ("$and", "$or"):
            if not isinstance(value, (list, tuple)) or not value:
                raise InputError(f"filter {key} expects a non-empty list of filters")
            glue = " AND " if key == "$and" else " OR "
            parts.append("(" + glue.join(_node(sub, params) for sub in value) + ")")
        elif isinstance(key, str) and key.startswith("$"):
            raise InputError(f"filter: unknown operator {key!r} at the top level; expected $and, $or or a field name")
        else:
            parts.append(_field(key, value, params))
    return "(" + " AND ".join(parts) + ")"


def compile_filter(f: dict) -> tuple[str, list]:
    """(SQL boolean expression over the `metadata` column, its parameters)."""
    params: list = []
    return _node(f, params), params
