"""Optional API keys: bearer tokens, each allowed every collection or only some (names or glob patterns).

An entry is `TOKEN` (every collection, and creating any) or `TOKEN name,team-*` (only those). Keys are
kept as SHA-256 digests and a presented token is compared with every one of them in constant time, so
neither the answer nor its timing tells how much of a guess was right.
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass
from fnmatch import fnmatchcase
from pathlib import Path

from fusionrag.retriever.errors import ConfigError


@dataclass(frozen=True)
class Key:
    digest: bytes
    patterns: tuple[str, ...]  # empty: every collection

    def allows(self, collection: str) -> bool:
        return not self.patterns or any(fnmatchcase(collection, p) for p in self.patterns)

    @property
    def unrestricted(self) -> bool:
        return not self.patterns


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


def parse_entries(text: str, source: str) -> list[Key]:
    keys = []
    for n, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        token, *patterns = line.replace(",", " ").split()
        if len(token) < 8:
            raise ConfigError(f"{source}, entry {n}: an API key must be at least 8 characters")
        keys.append(Key(_digest(token), () if "*" in patterns else tuple(patterns)))
    return keys


class KeyRing:
    """The configured keys; `enabled` is False when there are none (the service is then open)."""

    def __init__(self, keys: list[Key]):
        self.keys = keys

    @classmethod
    def from_config(cls, inline: str, file: str) -> "KeyRing":
        keys = parse_entries(inline.replace(";", "\n"), "api_keys") if inline else []
        if file:
            try:
                text = Path(file).read_text()
            except OSError as e:
                raise ConfigError(f"cannot read API key file {file}: {e.strerror}") from e
            keys += parse_entries(text, file)
        return cls(keys)

    @property
    def enabled(self) -> bool:
        return bool(self.keys)

    def lookup(self, token: str) -> Key | None:
        presented = _digest(token)
        found = None
        for key in self.keys:  # no early exit: the time taken does not depend on which key matched
            if hmac.compare_digest(presented, key.digest):
                found = key
        return found
