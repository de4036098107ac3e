"""Hits grouped by a metadata field (Qdrant's search groups; the route: routes/search.py `search_groups`).

A hit's group values are those under the field in its metadata: the key itself where the metadata has it, else the
dotted path through objects ("a.b" reaches {"a": {"b": ...}}). A string or an integer is one value; a list puts the
hit in the group of each distinct string or integer among its elements; anything else (no field, null, a float,
a bool, an object) puts it in no group, and it is left out. "1" and 1 are different groups.

Grouping walks a ranking best first: a value not seen yet opens a group while fewer than `limit` are open, and a
group takes the hits of its value until it holds `size`. So the groups are the `limit` values whose best hits rank
highest, in that order, each with its best `size` hits: the grouping of the whole ranking where the ranking walked
was deep enough (every group full, or the ranking ended before its depth).
"""

from __future__ import annotations

from collections.abc import Iterable

_MISSING = object()


def group_values(metadata: dict, field: str) -> list:
    """The groups a document with this metadata is in (the module's docstring), in the order of its values."""
    value = metadata.get(field, _MISSING)
    if value is _MISSING:
        value = metadata
        for part in field.split("."):
            value = value.get(part, _MISSING) if isinstance(value, dict) else _MISSING
            if value is _MISSING:
                return []
    values = value if isinstance(value, list) else [value]
    return list(dict.fromkeys(v for v in values
                              if isinstance(v, str) or (isinstance(v, int) and not isinstance(v, bool))))


def group_hits(hits: Iterable, field: str, limit: int, size: int) -> tuple[list[tuple[object, list]], bool]:
    """(the groups of the ranking `hits` (best first), as (value, hits) best group first; whether all `limit`
    groups are open and each holds `size` hits, so that a deeper ranking would not change them)."""
    groups: dict[object, list] = {}
    for h in hits:
        for v in group_values(h.metadata or {}, field):
            g = groups.get(v)
            if g is None:
                if len(groups) >= limit:
                    continue
                g = groups[v] = []
            if len(g) < size:
                g.append(h)
    full = len(groups) >= limit and all(len(g) >= size for g in groups.values())
    return list(groups.items()), full


def first_depth(limit: int, size: int, max_k: int) -> int:
    """The ranking's depth a group search looks at first: twice the hits its groups can hold, at most max_k."""
    return min(max_k, 2 * limit * size)


def next_depth(k: int, max_k: int) -> int:
    """The next depth of a group search whose groups did not fill: four times deeper, at most max_k."""
    return min(max_k, 4 * k)
