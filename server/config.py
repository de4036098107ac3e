"""The service's configuration: one declaration per setting (ServerConfig), filled from a file, then the
environment, then flags.

Every setting can be set in all three places: `port = 8001` in the TOML file, FUSIONRAG_PORT=8001, or
`--port 8001`; a later source wins (flags > environment > file > defaults). pydantic-settings reads and layers
the sources; the flags, their help and the checks come from the declarations (retriever/engine/config.py).
"""

from __future__ import annotations

import contextvars
import functools
import os
from pathlib import Path
from typing import Annotated, Literal, get_args

from pydantic import AfterValidator, TypeAdapter, ValidationError, create_model

from fusionrag.retriever.collection.embedding import DEFAULT_MODEL, canonical_name, register_models
from fusionrag.retriever.engine.config import (BufferCompression, BufferPolicy, ConfigBase, EngineConfig, FilterTier,
                                               GpuSearch, RawInRam, RecordCache, add_flags, config_class, knob, knobs,
                                               problems)
from fusionrag.retriever.engine.config import flags_of as _flags_of
from fusionrag.retriever.errors import ConfigError

ENV_PREFIX = "FUSIONRAG_"
LogLevel = Literal["debug", "info", "warning", "error"]
LogFormat = Literal["json", "text"]
EmbedRuntime = Literal["auto", "onnx", "bf16", "torch"]
LOG_LEVELS = get_args(LogLevel)
LOG_FORMATS = get_args(LogFormat)


def _registered(spec: str) -> str:
    register_models(spec)
    return spec


@config_class
class ServerConfig(ConfigBase):
    """The service's settings. Each is a flag (--max-k), an environment variable (FUSIONRAG_MAX_K) and a key
    of the TOML file (max_k), all from this one declaration."""

    host: Annotated[str, knob("address to listen on")] = "127.0.0.1"
    port: Annotated[int, knob("TCP port to listen on", ge=0, le=65535)] = 8000
    data_dir: Annotated[str, knob("where collections live (one directory each)", min_length=1)] = "fusionrag-data"
    demo: Annotated[bool, knob("build the demo collection on the first start (when there are no collections)")] = True
    # Secrets stay off the command line, where every user of the machine can read them.
    api_keys: Annotated[str, knob("API keys, entries separated by ';' (no flag: secrets stay off the command "
                                  "line)", flag=False)] = ""
    api_keys_file: Annotated[str, knob("file of API keys, one 'TOKEN [collection,...]' entry per line")] = ""
    metrics_auth: Annotated[bool, knob("with API keys, /metrics answers only a key that covers every collection "
                                       "(its names and sizes)")] = True
    max_body_bytes: Annotated[int, knob("largest request body accepted", ge=1024)] = 16 << 20
    max_upload_bytes: Annotated[int, knob("largest upload accepted: a snapshot to restore or a file to import",
                                          ge=1024)] = 64 << 30
    max_file_bytes: Annotated[int, knob("largest file uploaded for a vector store (the OpenAI API's /v1/files)",
                                        ge=1024)] = 512 << 20
    max_files_per_key: Annotated[int, knob("files (the OpenAI API's) one API key restricted to some collections, "
                                           "or the service's keys together, may hold at most", ge=1)] = 10000
    max_file_bytes_per_key: Annotated[int, knob("bytes those files may take on the data disk at most",
                                                ge=1024)] = 8 << 30
    max_file_tokens: Annotated[int, knob("tokens of the embedding model one file added to a vector store may have "
                                         "at most (counted before anything is embedded; OpenAI's limit)",
                                         ge=1)] = 5_000_000
    file_workers: Annotated[int, knob("threads that add files to vector stores (each a different owner's, in "
                                      "turns by owner, a batch of chunks at a time)", ge=1, le=16)] = 1
    max_restore_bytes: Annotated[int, knob("bytes one restore may write at most (its archive's members)",
                                           ge=1024)] = 64 << 30
    max_collections: Annotated[int, knob("collections the service holds at most (0: no limit)", ge=0)] = 1000
    max_collections_per_key: Annotated[int, knob("collections an API key restricted to some collections may "
                                                 "hold at most, counting those it reaches (its patterns cover; another "
                                                 "key's vector stores never count) (0: no limit)",
                                                 ge=0)] = 100
    max_open_collections: Annotated[int, knob("collections with their doc store and log open at most (a sharded "
                                              "one counts for its shards' files); idle ones past it close their "
                                              "files until their next call",
                                              ge=0, note="0 = from the open-files limit")] = 0
    descriptor_reserve: Annotated[int, knob("open files the collections never take: kept for connections and logs",
                                            ge=16)] = 128
    disk_reserve_mb: Annotated[float, knob("free disk, MiB, that snapshots, imports and restores leave for the "
                                           "collections' writes (they are refused first)", ge=0)] = 512.0
    max_snapshots: Annotated[int, knob("snapshots kept per collection at most", ge=1)] = 8
    max_snapshot_bytes: Annotated[int, knob("bytes one collection's snapshots may take on the data disk",
                                            ge=0, note="0 = half the data disk")] = 0
    max_queries: Annotated[int, knob("queries (vectors or texts) per search request at most", ge=1)] = 256
    max_k: Annotated[int, knob("largest k of a search", ge=1, le=100_000)] = 1000
    max_text_chars: Annotated[int, knob("longest text accepted, per query or document", ge=1)] = 8192
    max_documents: Annotated[int, knob("documents per upsert request, ids per get or delete, documents per page, "
                                       "at most", ge=1)] = 1024
    batch_wait_ms: Annotated[float, knob("how long a search waits for others to share its engine batch while another "
                                         "batch runs (one that finds the engine idle goes at once)",
                                         ge=0, le=10_000)] = 2.0
    batch_max_queries: Annotated[int, knob("queries per engine batch at most", ge=1)] = 256
    # A collection whose index serves a call from the GPU once it is large enough (filter_tier auto with CUDA,
    # Index.crossover): under load its batch is held open up to this long to reach that size, when queries
    # arrive fast enough to fill it in time.
    gpu_batch_wait_ms: Annotated[float, knob("under load, how long a batch may wait to reach the size from which "
                                             "the GPU serves it cheaper than the CPU", ge=0)] = 5.0
    search_threads: Annotated[int, knob("engine batches running at once", ge=1, le=64)] = 2
    buffer_mb: Annotated[float, knob("DRAM per collection for its raw vectors (where they fit: raw_in_ram) or else "
                                     "its page buffer, MiB", ge=0)] = 64.0
    raw_in_ram: Annotated[RawInRam, knob("hold a collection's raw vectors in RAM and re-rank from them, reading "
                                         "nothing from the SSD: auto (where buffer_mb holds them), on or off")
                          ] = EngineConfig.raw_in_ram
    doc_cache_mb: Annotated[float, knob("documents searches returned (id, text, metadata), kept for the searches "
                                        "that return them again, MiB, all collections together", ge=0,
                                        note="0 = read each from the store")] = 32.0
    buffer_policy: Annotated[BufferPolicy, knob("page buffer replacement: auto (lfu or clock, whichever serves more "
                                                "now), lfu (counts use, weighted by the queries asking, aged) or "
                                                "clock")] = "auto"
    record_cache: Annotated[RecordCache, knob("the page buffer's bytes as single records or whole pages: auto "
                                              "(whichever serves more now, one at a time), on or off")
                            ] = EngineConfig.record_cache
    buffer_compression: Annotated[BufferCompression, knob("hold the page buffer's blocks zero-run coded: auto (where "
                                                          "a sample of blocks codes to 0.8 of its bytes or less), "
                                                          "on or off")] = EngineConfig.buffer_compression
    pipeline: Annotated[bool, knob("overlap an engine batch's stages with the next batch's graph search")] = True
    rerank_prefetch: Annotated[bool, knob("read each query's next mini-batch of pages while the current one is "
                                          "scored")] = EngineConfig.rerank_prefetch
    filter_tier: Annotated[FilterTier, knob("where PQ candidates are filtered: auto (with a GPU, the GPU and the "
                                            "CPU tier both, each call to the one measured cheaper for its size), "
                                            "cpu or gpu (every call)")] = "auto"
    gpu_budget_mb: Annotated[float, knob("GPU memory the filter tiers of all collections share, MiB, the service's "
                                         "CUDA context and kernels included (0: what the LLM server leaves)",
                                         ge=0, note="0 = automatic")] = 0.0
    gpu_memory_utilization: Annotated[float, knob("the LLM server's share of the GPU (vLLM's "
                                                  "gpu_memory_utilization), for the default budget",
                                                  ge=0, lt=1)] = 0.9
    gpu_tiered_share: Annotated[float, knob("a collection whose PQ codes do not all fit the GPU takes at most this "
                                            "share of what is left", gt=0, le=1)] = 0.5
    gpu_search: Annotated[GpuSearch, knob("on the GPU tier: auto (each batch's whole search on the device where "
                                          "its parts fit the budget, else lists), device or lists (the host "
                                          "navigates and gathers each query's candidates)")] = EngineConfig.gpu_search
    min_index_count: Annotated[int, knob("a merge builds the main index only for collections at least this large "
                                         "(smaller: exact search)", ge=1)] = 1
    probe_model: Annotated[bool, knob("each collection's index builds train learned pruning's model, so that "
                                      "searches may ask for params probe 'learned' (docs/tuning.md)")] = False
    # Before `embedding`: its models are registered as this is checked, so `embedding` may name one of them.
    embedding_models: Annotated[str, knob("more embedding models for collections to name: 'NAME=DIR' (a "
                                          "sentence-transformers model directory) or 'NAME=URL#MODEL' (an "
                                          "OpenAI-compatible /v1/embeddings API; its key in "
                                          "FUSIONRAG_EMBEDDING_API_KEY), entries separated by ';'"),
                                AfterValidator(_registered)] = ""
    embedding: Annotated[str, knob("embedding model of the demo collection and the default for new text "
                                   "collections"), AfterValidator(canonical_name)] = DEFAULT_MODEL
    embed_threads: Annotated[int, knob("CPU threads that embed texts (0: every core; more than one pays only on an "
                                       "idle machine)", ge=0)] = 1
    embed_bulk_threads: Annotated[int, knob("CPU threads that embed an import's texts, on ONNX Runtime (0: every "
                                            "core)", ge=0)] = 0
    embed_runtime: Annotated[EmbedRuntime, knob("what runs the embedding models from a directory: auto (ONNX "
                                                "Runtime where a model can run there, else torch; its transformer "
                                                "in bf16 on torch where the CPU has bf16 matrix instructions and "
                                                "that measures right and faster as it loads, unless "
                                                "FUSIONRAG_EMBED_BF16=off), onnx (float32), bf16 (the transformer "
                                                "in bf16 on torch, ~155 MiB more memory) or torch (float32)")] = "auto"
    embedding_timeout_s: Annotated[float, knob("an embedding endpoint's whole answer to a call must arrive within "
                                               "this many seconds (503 past it; only that model's requests wait)",
                                               gt=0)] = 30.0
    log_level: Annotated[LogLevel, knob("how much to log")] = "info"
    log_format: Annotated[LogFormat, knob("log lines as JSON objects or text")] = "json"
    header_timeout_s: Annotated[float, knob("a connection's request line and headers must arrive within this "
                                            "many seconds, or it is closed", gt=0)] = 30.0
    body_timeout_s: Annotated[float, knob("a request body that sends nothing for this many seconds is refused "
                                          "(408)", gt=0)] = 60.0
    shutdown_timeout_s: Annotated[float, knob("on SIGTERM, how long in-flight requests may take to finish",
                                              ge=0)] = 30.0


# --- the sources: flags > environment > file > defaults, layered by pydantic-settings ---------------------

_LOADING: contextvars.ContextVar[tuple] = contextvars.ContextVar("fusionrag_config_loading")


@functools.cache
def _strict(kind: type):
    return TypeAdapter(kind)


@functools.cache
def _settings_class():
    """ServerConfig's knobs as a pydantic-settings class whose sources are the flags (its keyword arguments),
    the environment and the TOML file, in that order of precedence; made on first use."""
    from pydantic_settings import BaseSettings, EnvSettingsSource, SettingsConfigDict, TomlConfigSettingsSource

    class Environment(EnvSettingsSource):
        """FUSIONRAG_<NAME>, exactly so spelled, from the mapping load_config was given."""

        def __init__(self, settings_cls, environ):
            self.environ = environ
            super().__init__(settings_cls, case_sensitive=False, env_prefix=ENV_PREFIX)

        def _load_env_vars(self):
            return {k.lower(): v for k, v in self.environ.items() if k.startswith(ENV_PREFIX) and k == k.upper()}

    class File(TomlConfigSettingsSource):
        """Top-level keys named like the settings, or a [server] table; values of the settings' own types."""

        def __init__(self, settings_cls, path):
            self.path = path
            try:
                open(path, "rb").close()  # pydantic-settings passes over a file that is not there
            except OSError as e:
                raise ConfigError(f"cannot read config file {path}: {e.strerror}") from e
            super().__init__(settings_cls, toml_file=path)

        def _read_file(self, file_path):
            try:
                data = super()._read_file(file_path)
            except ValueError as e:  # tomllib.TOMLDecodeError
                raise ConfigError(f"config file {self.path}: {e}") from e
            data = data.get("server", data)
            by_name = knobs(ServerConfig)
            unknown = sorted(set(data) - set(by_name))
            if unknown:
                raise ConfigError(f"config file {self.path}: unknown setting(s): {', '.join(unknown)}")
            for key, value in data.items():  # TOML has types: a string is not a number here
                kind = by_name[key].type
                try:
                    data[key] = _strict(kind).validate_python(value, strict=True)
                except ValidationError:
                    raise ConfigError(f"config file {self.path}: {key} must be a {kind.__name__}, got {value!r}") \
                        from None
            return data

    class Layers(BaseSettings):
        model_config = SettingsConfigDict(extra="forbid")

        @classmethod
        def settings_customise_sources(cls, settings_cls, init_settings, env_settings, dotenv_settings,
                                       file_secret_settings):
            environ, path = _LOADING.get()
            return (init_settings, Environment(settings_cls, environ)) + \
                ((File(settings_cls, path),) if path else ())

    fields = {name: (info.annotation if not info.metadata else Annotated[(info.annotation, *info.metadata)],
                     info.default) for name, info in ServerConfig.__pydantic_fields__.items()}
    return create_model("ServerSettings", __base__=Layers, **fields)


def load_config(config_file: str | None = None, flags: dict | None = None, environ=os.environ) -> ServerConfig:
    """Defaults, then the file (the argument or FUSIONRAG_CONFIG), then the environment, then flags. A bad
    value is a ConfigError naming where it came from, the setting and what it allows."""
    config_file = config_file or environ.get(ENV_PREFIX + "CONFIG")
    flags = {k: v for k, v in (flags or {}).items() if v is not None}
    token = _LOADING.set((environ, config_file))
    try:
        layered = _settings_class()(**flags)
    except ValidationError as e:
        raise ConfigError("; ".join(f"{_source_of(name, flags, environ, config_file)}: {msg}" if name else msg
                                    for name, msg in problems(ServerConfig, e))) from None
    finally:
        _LOADING.reset(token)
    return ServerConfig(**{name: getattr(layered, name) for name in knobs(ServerConfig)})


def _source_of(name: str, flags: dict, environ, config_file) -> str:
    if name in flags:
        return "--" + name.replace("_", "-")
    if ENV_PREFIX + name.upper() in environ:
        return ENV_PREFIX + name.upper()
    return f"config file {config_file}"


def from_file(path: str | os.PathLike) -> dict:
    """The settings a TOML file gives, by name (checked: known names, the settings' own types)."""
    return dict(_sources({}, str(path))[-1]())


def from_env(environ=os.environ) -> dict:
    """The settings the environment gives (FUSIONRAG_<NAME>), by name, as written there."""
    return dict(_sources(environ, None)[1]())


def _sources(environ, path) -> tuple:
    """load_config's sources: the flags, the environment, and the file when there is one."""
    settings_cls = _settings_class()
    token = _LOADING.set((environ, path))
    try:
        return settings_cls.settings_customise_sources(settings_cls, None, None, None, None)
    finally:
        _LOADING.reset(token)


def add_arguments(parser) -> None:
    """One --flag per setting but the secrets, defaulting to None so that unset flags leave lower sources alone."""
    parser.add_argument("--config", help="TOML file of settings (default: $FUSIONRAG_CONFIG)")
    add_flags(parser, ServerConfig, env_prefix=ENV_PREFIX)


def flags_of(args) -> dict:
    return _flags_of(args, ServerConfig)


def data_path(config: ServerConfig) -> Path:
    return Path(config.data_dir).expanduser().resolve()
