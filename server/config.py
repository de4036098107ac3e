"""The service's configuration: one typed dataclass, filled from a file, then the environment, then flags.

Every field can be set in all three places: `port = 8001` in the TOML file, FUSIONRAG_PORT=8001, or
`--port 8001`; a later source wins (flags > environment > file > defaults).
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

from fusionrag.retriever.config import FILTER_TIERS
from fusionrag.retriever.embedding import DEFAULT_MODEL, canonical_name
from fusionrag.retriever.errors import ConfigError

ENV_PREFIX = "FUSIONRAG_"
LOG_LEVELS = ("debug", "info", "warning", "error")
LOG_FORMATS = ("json", "text")

_HELP = {
    "host": "address to listen on",
    "port": "TCP port to listen on",
    "data_dir": "where collections live (one directory each)",
    "demo": "build the demo collection on the first start (when there are no collections)",
    "api_keys_file": "file of API keys, one 'TOKEN [collection,...]' entry per line",
    "metrics_auth": "with API keys, /metrics answers only a key that covers every collection (its names and sizes)",
    "max_body_bytes": "largest request body accepted",
    "max_upload_bytes": "largest upload accepted: a snapshot to restore or a file to import",
    "max_queries": "queries (vectors or texts) per search request at most",
    "max_k": "largest k of a search",
    "max_text_chars": "longest text accepted, per query or document",
    "max_documents": "documents per upsert request, ids per get or delete, documents per page, at most",
    "batch_wait_ms": "how long a search waits for others to share its engine batch",
    "batch_max_queries": "queries per engine batch at most",
    "search_threads": "engine batches running at once",
    "buffer_mb": "DRAM page buffer per collection, MiB",
    "filter_tier": "where PQ candidates are filtered: auto (the GPU when there is one), cpu or gpu",
    "gpu_budget_mb": "GPU memory the filter tiers of all collections share, MiB, the service's CUDA context and kernels included (0: what the LLM server leaves)",
    "gpu_tiered_share": "a collection whose PQ codes do not all fit the GPU takes at most this share of what is left",
    "gpu_memory_utilization": "the LLM server's share of the GPU (vLLM's gpu_memory_utilization), for the default budget",
    "min_index_count": "a merge builds the main index only for collections at least this large (smaller: exact search)",
    "embedding": "embedding model of the demo collection and the default for new text collections",
    "embed_threads": "CPU threads that embed texts (0: every core; more than one pays only on an idle machine)",
    "log_level": f"one of {', '.join(LOG_LEVELS)}",
    "log_format": f"one of {', '.join(LOG_FORMATS)}",
    "shutdown_timeout_s": "on SIGTERM, how long in-flight requests may take to finish",
}


# Secrets stay off the command line, where every user of the machine can read them.
_NO_FLAG = {"api_keys"}


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    data_dir: str = "fusionrag-data"
    demo: bool = True
    api_keys: str = ""
    api_keys_file: str = ""
    metrics_auth: bool = True
    max_body_bytes: int = 16 << 20
    max_upload_bytes: int = 64 << 30
    max_queries: int = 256
    max_k: int = 1000
    max_text_chars: int = 8192
    max_documents: int = 1024
    batch_wait_ms: float = 2.0
    batch_max_queries: int = 256
    search_threads: int = 2
    buffer_mb: float = 64.0
    filter_tier: str = "auto"
    gpu_budget_mb: float = 0.0
    gpu_memory_utilization: float = 0.9
    gpu_tiered_share: float = 0.5
    min_index_count: int = 1
    embedding: str = DEFAULT_MODEL
    embed_threads: int = 1
    log_level: str = "info"
    log_format: str = "json"
    shutdown_timeout_s: float = 30.0

    def __post_init__(self):
        _check(0 <= self.port <= 65535, f"port must be in [0, 65535], got {self.port}")
        _check(bool(self.data_dir), "data_dir must not be empty")
        _check(self.max_body_bytes >= 1024, f"max_body_bytes must be >= 1024, got {self.max_body_bytes}")
        _check(self.max_upload_bytes >= 1024, f"max_upload_bytes must be >= 1024, got {self.max_upload_bytes}")
        _check(self.max_queries >= 1, f"max_queries must be >= 1, got {self.max_queries}")
        _check(1 <= self.max_k <= 100_000, f"max_k must be in [1, 100000], got {self.max_k}")
        _check(self.max_text_chars >= 1, f"max_text_chars must be >= 1, got {self.max_text_chars}")
        _check(self.max_documents >= 1, f"max_documents must be >= 1, got {self.max_documents}")
        _check(0 <= self.batch_wait_ms <= 10_000, f"batch_wait_ms must be in [0, 10000], got {self.batch_wait_ms}")
        _check(self.batch_max_queries >= 1, f"batch_max_queries must be >= 1, got {self.batch_max_queries}")
        _check(1 <= self.search_threads <= 64, f"search_threads must be in [1, 64], got {self.search_threads}")
        _check(self.buffer_mb >= 0, f"buffer_mb must be >= 0, got {self.buffer_mb}")
        _check(self.filter_tier in FILTER_TIERS, f"filter_tier must be one of {FILTER_TIERS}, got {self.filter_tier!r}")
        _check(0 <= self.gpu_memory_utilization < 1,
               f"gpu_memory_utilization must be in [0, 1), got {self.gpu_memory_utilization}")
        _check(self.gpu_budget_mb >= 0, f"gpu_budget_mb must be >= 0 (0 = automatic), got {self.gpu_budget_mb}")
        _check(0 < self.gpu_tiered_share <= 1, f"gpu_tiered_share must be in (0, 1], got {self.gpu_tiered_share}")
        _check(self.min_index_count >= 1, f"min_index_count must be >= 1, got {self.min_index_count}")
        _check(self.embed_threads >= 0, f"embed_threads must be >= 0, got {self.embed_threads}")
        _check(self.log_level in LOG_LEVELS, f"log_level must be one of {LOG_LEVELS}, got {self.log_level!r}")
        _check(self.log_format in LOG_FORMATS, f"log_format must be one of {LOG_FORMATS}, got {self.log_format!r}")
        _check(self.shutdown_timeout_s >= 0, f"shutdown_timeout_s must be >= 0, got {self.shutdown_timeout_s}")
        object.__setattr__(self, "embedding", canonical_name(self.embedding))

    def to_dict(self) -> dict:
        return asdict(self)


def _parse(field, raw: str, source: str):
    kind = type(field.default)
    try:
        if kind is bool:
            low = raw.strip().lower()
            if low in ("1", "true", "yes", "on"):
                return True
            if low in ("0", "false", "no", "off"):
                return False
            raise ValueError(raw)
        return kind(raw)
    except ValueError:
        raise ConfigError(f"{source}: {field.name} must be a {kind.__name__}, got {raw!r}") from None


def from_file(path: str | os.PathLike) -> dict:
    """Settings of a TOML file: top-level keys named like the fields (a [server] table works too)."""
    try:
        import tomllib
    except ImportError:  # Python 3.10
        import tomli as tomllib
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except OSError as e:
        raise ConfigError(f"cannot read config file {path}: {e.strerror}") from e
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file {path}: {e}") from e
    data = data.get("server", data)
    by_name = {f.name: f for f in fields(ServerConfig)}
    unknown = sorted(set(data) - set(by_name))
    _check(not unknown, f"config file {path}: unknown setting(s): {', '.join(unknown)}")
    out = {}
    for key, value in data.items():
        kind = type(by_name[key].default)
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        _check(type(value) is kind, f"config file {path}: {key} must be a {kind.__name__}, got {value!r}")
        out[key] = value
    return out


def from_env(environ=os.environ) -> dict:
    out = {}
    for f in fields(ServerConfig):
        name = ENV_PREFIX + f.name.upper()
        if name in environ:
            out[f.name] = _parse(f, environ[name], name)
    return out


def load_config(config_file: str | None = None, flags: dict | None = None, environ=os.environ) -> ServerConfig:
    """Defaults, then the file (the argument or FUSIONRAG_CONFIG), then the environment, then flags."""
    config_file = config_file or environ.get(ENV_PREFIX + "CONFIG")
    settings = from_file(config_file) if config_file else {}
    settings.update(from_env(environ))
    settings.update({k: v for k, v in (flags or {}).items() if v is not None})
    return replace(ServerConfig(), **settings)


def add_arguments(parser) -> None:
    """One --flag per field, defaulting to None so that unset flags leave lower sources alone."""
    import argparse

    parser.add_argument("--config", help="TOML file of settings (default: $FUSIONRAG_CONFIG)")
    for f in fields(ServerConfig):
        if f.name in _NO_FLAG:
            continue
        opt = "--" + f.name.replace("_", "-")
        env = ENV_PREFIX + f.name.upper()
        if type(f.default) is bool:
            parser.add_argument(opt, action=argparse.BooleanOptionalAction, default=None,
                                help=f"{_HELP[f.name]} (env {env}; default {f.default})")
        else:
            parser.add_argument(opt, type=type(f.default), default=None, metavar=f.name.upper(),
                                help=f"{_HELP[f.name]} (env {env}; default {f.default!r})")


def flags_of(args) -> dict:
    return {f.name: getattr(args, f.name) for f in fields(ServerConfig) if f.name not in _NO_FLAG}


def data_path(config: ServerConfig) -> Path:
    return Path(config.data_dir).expanduser().resolve()
