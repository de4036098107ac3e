"""OpenAI's files and vector stores over the service's collections, so that code written against the OpenAI SDK's
`client.files` and `client.vector_stores` runs unchanged against fusionrag (routes: server/routes/openai.py).

- A file is its bytes and a JSON record under <data-dir>/openai/files/, owned by the API key that uploaded it
  (the service's, without keys); one key sees its own files and stores, a key unrestricted sees all.
- A vector store is a collection named by its id (`vs_` and 24 hex digits), cosine, embedded by the service's
  embedding model, with a JSON record under <data-dir>/openai/stores/ holding its name, metadata and files.
- Adding a file to a store queues it; worker threads (`file_workers`, 1 by default) chunk its text by the
  embedding model's own tokens (a static strategy's window and overlap, or `auto`: the model's window, half of
  it overlapping, as OpenAI's auto is 800 and 400; each chunk cut between words, never inside one a word of more
  tokens than a chunk excepted: server/file_chunks.py), embed the chunks and upsert them as documents
  `<file id>#<n>` with metadata {"file_id", "filename", "attributes"}. A file's status goes in_progress ->
  completed (or failed, with the reason); a restart takes up the files still in progress, from their start.
  Removing a file from a store deletes its chunks by filter; attributes changed later reach the chunks as a
  metadata update (nothing re-embedded).
- The work goes in turns by owner (the store's): a worker does one step of an owner's first file (a part of
  its tokens counted, or one batch of EMBED_BATCH chunks embedded and written), then goes to the next owner
  with files waiting, so one owner's large or many files hold another's for about one batch. A file is read
  as a stream (server/file_chunks.py: a step reads from where the one before stopped), so a step takes a
  batch's memory whatever the file's size. Its tokens are counted first, before anything is embedded (a file
  of no more bytes than the limit only read: a token is at least a byte): a file that is not UTF-8 text,
  holds none, or has more than `max_file_tokens` (OpenAI's 5,000,000) fails then, after at most that many
  tokens counted.
- Records are written whole and renamed into place (fsynced), so a crash leaves the old record or the new one.
  A store being deleted is marked first, its collection dropped, then its record removed: a restart finishes
  what a crash cut short.
"""

from __future__ import annotations

import logging
import math
import os
import re
import secrets
import threading
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from pathlib import Path

import json

from fusionrag.retriever.collection import Document
from fusionrag.retriever.collection.embedding import get_embedder
from fusionrag.retriever.collection.generations import write_json_atomic
from fusionrag.retriever.collection.quota import check_room
from fusionrag.retriever.collection.values import bad_value
from fusionrag.retriever.process import lower_thread_priority
from fusionrag.retriever.errors import (ConflictError, FusionRAGError, InputError, NotFoundError, QuotaError)
from fusionrag.server.file_chunks import BadText, Chunker, Mark, count_tokens

log = logging.getLogger("fusionrag.server")

FILE_RE = re.compile(r"file-[0-9a-f]{24}")
STORE_RE = re.compile(r"vs_[0-9a-f]{24}")
BATCH_RE = re.compile(r"vsfb_[0-9a-f]{24}")
PURPOSES = ("assistants", "batch", "fine-tune", "vision", "user_data", "evals")
MAX_PAIRS, MAX_KEY, MAX_VALUE = 16, 64, 512  # OpenAI's bounds on metadata and attributes
STATIC_MAX, STATIC_MIN = 4096, 100  # OpenAI's bounds on a static strategy's max_chunk_size_tokens
AUTO_MAX = 800
EMBED_BATCH = 64  # chunks embedded and written in one step of the worker
COUNT_CHARS = 1 << 20  # characters whose tokens one step counts (about 0.3 s of tokenizing on a CPU core)
LIVE_CHUNKERS = 16  # files whose Chunker is kept between steps (each under a MiB); the others start from a mark
_NO_TEXT = {"code": "invalid_file", "message": "the file holds no text"}
_FILTER_OPS = {"eq": "$eq", "ne": "$ne", "gt": "$gt", "gte": "$gte", "lt": "$lt", "lte": "$lte", "in": "$in",
               "nin": "$nin"}


def too_many_tokens(limit: int) -> str:
    return f"the file has more than {limit:,} tokens, the limit of one file (max_file_tokens)"


def over_token_limit(path: Path, nbytes: int, spans, limit: int) -> bool:
    """Whether the file has more than `limit` tokens, read as a store's file is before anything of it is embedded
    (VectorStores._step, there a part a step); BadText where it is not UTF-8 text. A file of no more bytes than the
    limit is only read (a token is at least a byte)."""
    exact = nbytes > limit
    mark, ended = Mark(), False
    while not ended:
        mark, ended = count_tokens(path, mark, spans if exact else None, limit,
                                   COUNT_CHARS if exact else 16 * COUNT_CHARS)
    return mark.tokens > limit


def new_id(prefix: str) -> str:
    return prefix + secrets.token_hex(12)


def check_pairs(pairs, what: str, values: tuple = (str,)) -> dict:
    """OpenAI's metadata (string values) or attributes (strings, numbers, bools): at most 16 pairs, keys of at
    most 64 characters, strings of at most 512."""
    if pairs is None:
        return {}
    if not isinstance(pairs, dict):
        raise InputError(f"{what} must be an object of at most {MAX_PAIRS} key-value pairs")
    if len(pairs) > MAX_PAIRS:
        raise InputError(f"{what} has {len(pairs)} pairs, at most {MAX_PAIRS} allowed")
    for k, v in pairs.items():
        if not k or len(k) > MAX_KEY or "." in k:
            raise InputError(f"{what}: key {k[:80]!r} must be 1-{MAX_KEY} characters without '.'")
        if not isinstance(v, values) or (isinstance(v, float) and not math.isfinite(v)) or (
                isinstance(v, bool) and bool not in values):
            kinds = "a string" if values == (str,) else "a string, a number or a boolean"
            raise InputError(f"{what}: the value of {k!r} must be {kinds}")
        if isinstance(v, str) and len(v) > MAX_VALUE:
            raise InputError(f"{what}: the value of {k!r} is {len(v)} characters, at most {MAX_VALUE} allowed")
    bad = bad_value(pairs)  # a lone surrogate, an integer past int64: what no store can hold
    if bad:
        raise InputError(f"{what}: {bad[0]!r} {bad[1]}")
    return dict(pairs)


def check_attributes(attributes) -> dict:
    return check_pairs(attributes, "attributes", (str, int, float, bool))


def chunking(strategy, model_tokens: int) -> dict:
    """OpenAI's chunking strategy as stored: {"type": "static", "static": {max_chunk_size_tokens,
    chunk_overlap_tokens}}; auto (or none given) is the model's window, or 800 tokens where it is longer, half
    of it overlapping."""
    if strategy is None or (isinstance(strategy, dict) and strategy.get("type") == "auto"):
        size = min(AUTO_MAX, model_tokens)
        return {"type": "static", "static": {"max_chunk_size_tokens": size, "chunk_overlap_tokens": size // 2}}
    if not isinstance(strategy, dict) or strategy.get("type") != "static" or not isinstance(
            strategy.get("static"), dict):
        raise InputError("chunking_strategy must be {\"type\": \"auto\"} or {\"type\": \"static\", \"static\": "
                         "{\"max_chunk_size_tokens\": ..., \"chunk_overlap_tokens\": ...}}")
    s = strategy["static"]
    size, overlap = s.get("max_chunk_size_tokens"), s.get("chunk_overlap_tokens")
    if not isinstance(size, int) or isinstance(size, bool) or not STATIC_MIN <= size <= STATIC_MAX:
        raise InputError(f"max_chunk_size_tokens must be an integer from {STATIC_MIN} to {STATIC_MAX}")
    if not isinstance(overlap, int) or isinstance(overlap, bool) or not 0 <= overlap <= size // 2:
        raise InputError("chunk_overlap_tokens must be an integer from 0 to half of max_chunk_size_tokens")
    return {"type": "static", "static": {"max_chunk_size_tokens": size, "chunk_overlap_tokens": overlap}}


def translate_filter(f) -> dict:
    """OpenAI's attribute filter (comparison {type, key, value}, compound {type: and/or, filters}) as the
    collection's filter over the chunks' `attributes`."""
    if not isinstance(f, dict):
        raise InputError("a filter must be an object: {\"type\": \"eq\", \"key\": ..., \"value\": ...} or "
                         "{\"type\": \"and\", \"filters\": [...]}")
    kind = f.get("type")
    if kind in ("and", "or"):
        parts = f.get("filters")
        if not isinstance(parts, list) or not parts:
            raise InputError(f"an {kind!r} filter needs a non-empty list of filters")
        return {f"${kind}": [translate_filter(p) for p in parts]}
    if kind not in _FILTER_OPS:
        raise InputError(f"unknown filter type {str(kind)[:40]!r}: one of {', '.join([*_FILTER_OPS, 'and', 'or'])}")
    key, value = f.get("key"), f.get("value")
    if not isinstance(key, str) or not key or "." in key:
        raise InputError("a comparison filter's key must be an attribute's name (a non-empty string without '.')")
    if (kind in ("in", "nin")) != isinstance(value, list):
        raise InputError(f"filter {kind!r} takes {'a list' if kind in ('in', 'nin') else 'a single value'}")
    return {f"attributes.{key}": {_FILTER_OPS[kind]: value}}


def _page(items: list[dict], limit: int, order: str, after: str | None, before: str | None,
          made: dict[str, int]) -> dict:
    """OpenAI's cursor page: {"object": "list", "data", "first_id", "last_id", "has_more"}, in the order the
    objects were made (made: each id's creation time in ns; created_at is in whole seconds)."""
    if order not in ("asc", "desc"):
        raise InputError("order must be 'asc' or 'desc'")
    items = sorted(items, key=lambda o: (made.get(o["id"], 0), o["id"]), reverse=order == "desc")
    ids = [o["id"] for o in items]
    lo, hi = 0, len(items)
    if after is not None:
        if after not in ids:
            raise InputError(f"after: no object {after[:60]!r} in this list")
        lo = ids.index(after) + 1
    if before is not None:
        if before not in ids:
            raise InputError(f"before: no object {before[:60]!r} in this list")
        hi = ids.index(before)
    data = items[lo:hi][:limit]
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": lo + len(data) < hi}


@dataclass(frozen=True)
class FileLimits:
    max_files: int  # files one owner may hold
    max_bytes: int  # bytes of files one owner may hold
    max_stores: int  # vector stores one restricted key may own (0: no limit)
    reserve: int  # the disk reserve an upload must leave free
    max_tokens: int = 5_000_000  # tokens of one file added to a store (OpenAI's limit)


@dataclass(eq=False)
class FileJob:
    """One file being added to a store, and where its next step starts."""
    vsid: str
    fid: str
    owner: str  # the store's: whose turn it takes
    entry: dict  # the store's entry for the file when it was queued: one added again is another job
    counted: bool = False  # its tokens counted (then it is embedded)
    mark: Mark = field(default_factory=Mark)
    chunk: int = 0  # the next chunk to embed
    usage: int = 0  # the bytes of the chunks written
    chunker: Chunker | None = None  # kept between its steps while it is among the LIVE_CHUNKERS last stepped
    attributes: dict | None = None  # those its chunks were written with (new ones reach them as it completes)


class OwnerTurns:
    """The jobs waiting, taken in turns by owner: take() gives the first job of the owner whose turn it is, and
    takes that owner out of the turns until back() puts it at their end, so each owner has at most one job
    running and every owner with work waits at most one step of each other owner's."""

    def __init__(self):
        self._cond = threading.Condition()
        self._jobs: dict[str, deque[FileJob]] = {}  # an owner's jobs, in the order added; the first one runs
        self._turns: deque[str] = deque()  # the owners with work and none running, next first
        self._closed = False

    def put(self, job: FileJob) -> None:
        with self._cond:
            if job.owner not in self._jobs:  # an owner with jobs is in the turns, or running one
                self._jobs[job.owner] = deque()
                self._turns.append(job.owner)
                self._cond.notify()
            self._jobs[job.owner].append(job)

    def take(self) -> FileJob | None:
        """The next step's job (None once closed), waiting for one."""
        with self._cond:
            while not self._turns and not self._closed:
                self._cond.wait()
            if self._closed:
                return None
            return self._jobs[self._turns.popleft()][0]

    def back(self, job: FileJob, done: bool) -> None:
        """After a step of `job`: its owner goes to the end of the turns (or out, with nothing left)."""
        with self._cond:
            jobs = self._jobs[job.owner]
            if done:
                jobs.popleft()
            if jobs:
                self._turns.append(job.owner)
                self._cond.notify()
            else:
                del self._jobs[job.owner]

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()


class VectorStores:
    """The files and vector stores of one service (see the module's docstring)."""

    def __init__(self, root: Path, catalog, embedding: str, limits: FileLimits, workers: int = 1):
        self.root, self.catalog, self.embedding, self.limits = root, catalog, embedding, limits
        self.files_dir, self.stores_dir = root / "files", root / "stores"
        self._lock = threading.RLock()
        self._turns = OwnerTurns()
        self._nworkers = max(1, workers)
        self._workers: list[threading.Thread] = []
        self._closing = threading.Event()
        self._live: OrderedDict[FileJob, None] = OrderedDict()  # the jobs holding a Chunker, last stepped last
        self._live_lock = threading.Lock()
        self._files: dict[str, dict] = {}
        self._stores: dict[str, dict] = {}
        self.files_dir.mkdir(parents=True, exist_ok=True)
        self.stores_dir.mkdir(parents=True, exist_ok=True)
        self._files = {p.stem: r for p in self.files_dir.glob("file-*.json") if (r := _record(p)) is not None}
        for p in self.files_dir.glob("*.part"):  # an upload a crash cut short
            p.unlink(missing_ok=True)
        for p in self.files_dir.glob("file-*.data"):  # stored, then the crash came before its record
            if p.stem not in self._files:
                p.unlink(missing_ok=True)
        self._stores = {p.stem: r for p in self.stores_dir.glob("vs_*.json") if (r := _record(p)) is not None}

    # -- life ----------------------------------------------------------------------------------------
    def start(self) -> None:
        """After the catalog is open: finishes deletes a crash cut short, queues the files still in progress,
        and starts the workers."""
        for vsid, s in list(self._stores.items()):
            if s.get("creating") and vsid not in self.catalog.names():  # its collection never made
                (self.stores_dir / f"{vsid}.json").unlink(missing_ok=True)
                del self._stores[vsid]
            elif s.get("deleting") or s.get("creating"):
                s.pop("creating", None)
                if s.get("deleting"):
                    self._finish_delete(vsid)
                else:
                    self._save(s)
            if vsid not in self._stores:
                continue
            for fid, entry in list(s["files"].items()):
                if entry.get("removing"):
                    self._finish_removal(vsid, fid)
                elif entry["status"] == "in_progress":
                    self._queue(s, fid)
        for i in range(self._nworkers):
            t = threading.Thread(target=self._work, name=f"fusionrag-vector-stores-{i}", daemon=True)
            t.start()
            self._workers.append(t)

    def stop(self) -> None:
        """The steps running finish (a batch each); the files in progress stay so, for the next start."""
        self._closing.set()
        self._turns.close()
        for t in self._workers:
            t.join()

    # -- files ---------------------------------------------------------------------------------------
    def _visible(self, obj: dict, owner: str | None) -> bool:
        return owner is None or obj["owner"] == owner

    def upload_path(self) -> Path:
        return self.files_dir / f"{secrets.token_hex(8)}.part"

    def check_upload_room(self, owner: str | None, size: int) -> None:
        """Refused (QuotaError) where one more file of `size` bytes would pass the owner's limits; StorageError
        where it would write into the disk reserve."""
        mine = [f for f in self._files.values() if f["owner"] == (owner or "")]
        if len(mine) >= self.limits.max_files:
            raise QuotaError(f"this key holds {len(mine)} files, its limit (max_files_per_key): delete one first")
        held = sum(f["bytes"] for f in mine)
        if held + size > self.limits.max_bytes:
            raise QuotaError(f"this key's files take {held:,} bytes; {size:,} more would pass its limit of "
                             f"{self.limits.max_bytes:,} (max_file_bytes_per_key)")
        check_room(self.files_dir, size, self.limits.reserve, "the upload")

    def add_file(self, owner: str | None, spooled: Path, filename: str, purpose: str) -> dict:
        if purpose not in PURPOSES:
            spooled.unlink(missing_ok=True)
            raise InputError(f"purpose must be one of {', '.join(PURPOSES)}")
        size = spooled.stat().st_size
        with self._lock:
            try:
                self.check_upload_room(owner, size)
            except BaseException:
                spooled.unlink(missing_ok=True)
                raise
            fid = new_id("file-")
            rec = {"id": fid, "object": "file", "bytes": size, "created_at": int(time.time()),
                   "made_ns": time.time_ns(),
                   "filename": (os.path.basename(filename) or "upload")[:255], "purpose": purpose,
                   "status": "processed", "expires_at": None, "status_details": None, "owner": owner or ""}
            os.replace(spooled, self.files_dir / f"{fid}.data")
            write_json_atomic(self.files_dir / f"{fid}.json", rec)
            self._files[fid] = rec
        return rec

    def file(self, owner: str | None, fid: str) -> dict:
        rec = self._files.get(fid) if FILE_RE.fullmatch(fid) else None
        if rec is None or not self._visible(rec, owner):
            raise NotFoundError(f"no file {fid[:60]!r}")
        return rec

    def file_data(self, owner: str | None, fid: str) -> Path:
        self.file(owner, fid)
        return self.files_dir / f"{fid}.data"

    def list_files(self, owner: str | None, purpose: str | None, limit: int, order: str, after: str | None) -> dict:
        items = [f for f in self._files.values() if self._visible(f, owner) and purpose in (None, f["purpose"])]
        return _page(items, limit, order, after, None, {f["id"]: f.get("made_ns", 0) for f in items})

    def delete_file(self, owner: str | None, fid: str) -> dict:
        """The file itself; as OpenAI's, its chunks stay in the vector stores it was added to."""
        with self._lock:
            self.file(owner, fid)
            (self.files_dir / f"{fid}.json").unlink()
            (self.files_dir / f"{fid}.data").unlink(missing_ok=True)
            del self._files[fid]
        return {"id": fid, "object": "file", "deleted": True}

    # -- stores --------------------------------------------------------------------------------------
    def _store(self, owner: str | None, vsid: str) -> dict:
        s = self._stores.get(vsid) if STORE_RE.fullmatch(vsid) else None
        if s is None or s.get("deleting") or not self._visible(s, owner):
            raise NotFoundError(f"no vector store {vsid[:60]!r}")
        return s

    def owner_of(self, name: str) -> str | None:
        """The owner recorded for the store of id `name` ("" for one an unrestricted key made, or made without
        keys); None where no store has that id (server/deps.py `reaches` asks it for every collection route)."""
        s = self._stores.get(name)
        return None if s is None else s["owner"]

    def _save(self, s: dict) -> None:
        write_json_atomic(self.stores_dir / f"{s['id']}.json", s)

    def model_tokens(self) -> int:
        return get_embedder(self.embedding).max_tokens

    def create_store(self, owner: str | None, restricted: bool, name: str | None, metadata, file_ids,
                     strategy, expires_after, description: str | None = None) -> dict:
        metadata = check_pairs(metadata, "metadata")
        expires_after = _check_expiry(expires_after)
        file_ids = list(file_ids or [])
        plan = chunking(strategy, self.model_tokens())
        with self._lock:
            for fid in file_ids:
                self.file(owner, fid)
            if restricted and self.limits.max_stores:
                mine = sum(1 for s in self._stores.values() if s["owner"] == owner and not s.get("deleting"))
                if mine >= self.limits.max_stores:
                    raise QuotaError(f"this API key owns {mine} vector stores, its limit (max_collections_per_key): "
                                     "delete one before making another")
            vsid = new_id("vs_")
            dim = get_embedder(self.embedding).dim
            now = int(time.time())
            s = {"id": vsid, "object": "vector_store", "created_at": now, "made_ns": time.time_ns(),
                 "name": name or "", "metadata": metadata,
                 "description": description, "expires_after": expires_after, "last_active_at": now,
                 "owner": owner or "", "files": {}, "batches": {}, "creating": True}
            # The record first, marked: a crash before the collection is made leaves a record the next start
            # removes, never a collection no record names.
            self._save(s)
            try:
                self.catalog.create(vsid, dim, "cosine", self.embedding)
            except BaseException:
                (self.stores_dir / f"{vsid}.json").unlink(missing_ok=True)
                raise
            del s["creating"]
            self._stores[vsid] = s
            for fid in file_ids:
                self._attach(s, fid, {}, plan)
            self._save(s)
        return self.store_view(s)

    def store(self, owner: str | None, vsid: str) -> dict:
        return self.store_view(self._store(owner, vsid))

    def store_view(self, s: dict) -> dict:
        counts = {k: 0 for k in ("in_progress", "completed", "failed", "cancelled")}
        live = [e for e in s["files"].values() if not e.get("removing")]
        for e in live:
            counts[e["status"]] += 1
        counts["total"] = len(live)
        expires_at = None
        if s["expires_after"]:
            expires_at = s["last_active_at"] + 86400 * s["expires_after"]["days"]
        status = "expired" if expires_at is not None and time.time() > expires_at else (
            "in_progress" if counts["in_progress"] else "completed")
        return {"id": s["id"], "object": "vector_store", "created_at": s["created_at"], "name": s["name"],
                "description": s.get("description"), "usage_bytes": sum(e["usage_bytes"] for e in live),
                "file_counts": counts, "status": status, "last_active_at": s["last_active_at"],
                "metadata": s["metadata"], "expires_after": s["expires_after"], "expires_at": expires_at}

    def list_stores(self, owner: str | None, limit: int, order: str, after: str | None, before: str | None) -> dict:
        mine = [s for s in self._stores.values() if not s.get("deleting") and self._visible(s, owner)]
        return _page([self.store_view(s) for s in mine], limit, order, after, before,
                     {s["id"]: s.get("made_ns", 0) for s in mine})

    def update_store(self, owner: str | None, vsid: str, body: dict) -> dict:
        with self._lock:
            s = self._store(owner, vsid)
            if "name" in body:
                if body["name"] is not None and not isinstance(body["name"], str):
                    raise InputError("name must be a string")
                s["name"] = body["name"] or ""
            if "metadata" in body:
                s["metadata"] = check_pairs(body["metadata"], "metadata")
            if "expires_after" in body:
                s["expires_after"] = _check_expiry(body["expires_after"])
            s["last_active_at"] = int(time.time())
            self._save(s)
            return self.store_view(s)

    def delete_store(self, owner: str | None, vsid: str) -> dict:
        with self._lock:
            s = self._store(owner, vsid)
            s["deleting"] = True
            self._save(s)
        self._finish_delete(vsid)
        return {"id": vsid, "object": "vector_store.deleted", "deleted": True}

    def _finish_delete(self, vsid: str) -> None:
        try:
            self.catalog.drop(vsid)
        except NotFoundError:
            pass
        with self._lock:
            (self.stores_dir / f"{vsid}.json").unlink(missing_ok=True)
            self._stores.pop(vsid, None)

    def collection(self, owner: str | None, vsid: str):
        """The store's collection, for a search; an expired store is refused."""
        s = self._store(owner, vsid)
        if self.store_view(s)["status"] == "expired":
            raise InputError(f"vector store {vsid} has expired (expires_after); update it to use it again")
        now = int(time.time())
        if now - s["last_active_at"] >= 60:  # kept a minute at a time: not a write per search
            with self._lock:
                s["last_active_at"] = now
                self._save(s)
        return self.catalog.get(vsid)

    # -- a store's files -----------------------------------------------------------------------------
    def _attach(self, s: dict, fid: str, attributes: dict, plan: dict, batch: str | None = None) -> dict:
        entry = {"id": fid, "created_at": int(time.time()), "made_ns": time.time_ns(), "status": "in_progress",
                 "last_error": None,
                 "usage_bytes": 0, "attributes": attributes, "chunking_strategy": plan, "chunks": 0,
                 "filename": self._files[fid]["filename"], "batch": batch}
        s["files"][fid] = entry
        self._queue(s, fid)
        return entry

    def _queue(self, s: dict, fid: str) -> None:
        self._turns.put(FileJob(s["id"], fid, s["owner"], s["files"][fid]))

    def add_store_file(self, owner: str | None, vsid: str, fid: str, attributes, strategy) -> dict:
        attributes = check_attributes(attributes)
        plan = chunking(strategy, self.model_tokens())
        with self._lock:
            s = self._store(owner, vsid)
            self.file(owner, fid)
            if fid in s["files"] and s["files"][fid]["status"] == "in_progress":
                raise ConflictError(f"file {fid} is being added to vector store {vsid} already")
            if fid in s["files"] and s["files"][fid].get("removing"):
                raise ConflictError(f"file {fid} is being removed from vector store {vsid}: add it again after")
            entry = self._attach(s, fid, attributes, plan)
            self._save(s)
            return self.file_view(s, entry)

    def add_batch(self, owner: str | None, vsid: str, body: dict) -> dict:
        plan = chunking(body.get("chunking_strategy"), self.model_tokens())
        common = check_attributes(body.get("attributes"))
        given = body.get("files")
        if given is not None:
            if body.get("file_ids") is not None or not isinstance(given, list):
                raise InputError("give file_ids or files (a list of {file_id, attributes}), not both")
            pairs = [(g.get("file_id") if isinstance(g, dict) else None,
                      check_attributes(g.get("attributes")) if isinstance(g, dict) and "attributes" in g else common)
                     for g in given]
        else:
            ids = body.get("file_ids")
            if not isinstance(ids, list) or not ids:
                raise InputError("file_ids must be a non-empty list of file ids")
            pairs = [(fid, common) for fid in ids]
        if len(pairs) > 2000:
            raise InputError(f"{len(pairs)} files in one batch, at most 2000 allowed")
        with self._lock:
            s = self._store(owner, vsid)
            for fid, _ in pairs:
                if not isinstance(fid, str):
                    raise InputError("each file_id must be a string")
                self.file(owner, fid)
            bid = new_id("vsfb_")
            s["batches"][bid] = {"id": bid, "created_at": int(time.time()), "file_ids": [f for f, _ in pairs],
                                 "cancelled": False}
            for fid, attrs in pairs:
                self._attach(s, fid, attrs, plan, bid)
            self._save(s)
            return self.batch_view(s, bid)

    def _batch(self, owner: str | None, vsid: str, bid: str) -> tuple[dict, dict]:
        s = self._store(owner, vsid)
        b = s["batches"].get(bid) if BATCH_RE.fullmatch(bid) else None
        if b is None:
            raise NotFoundError(f"no file batch {bid[:60]!r} in vector store {vsid}")
        return s, b

    def batch_view(self, s: dict, bid: str) -> dict:
        b = s["batches"][bid]
        entries = [s["files"][f] for f in b["file_ids"]
                   if f in s["files"] and s["files"][f]["batch"] == bid and not s["files"][f].get("removing")]
        counts = {k: sum(e["status"] == k for e in entries)
                  for k in ("in_progress", "completed", "failed", "cancelled")}
        counts["total"] = len(entries)
        status = "in_progress" if counts["in_progress"] else ("cancelled" if b["cancelled"] else (
            "failed" if counts["failed"] and not counts["completed"] else "completed"))
        return {"id": bid, "object": "vector_store.files_batch", "created_at": b["created_at"],
                "vector_store_id": s["id"], "status": status, "file_counts": counts}

    def batch(self, owner: str | None, vsid: str, bid: str) -> dict:
        s, _ = self._batch(owner, vsid, bid)
        return self.batch_view(s, bid)

    def cancel_batch(self, owner: str | None, vsid: str, bid: str) -> dict:
        with self._lock:
            s, b = self._batch(owner, vsid, bid)
            b["cancelled"] = True
            for fid in b["file_ids"]:
                e = s["files"].get(fid)
                if e is not None and e["batch"] == bid and e["status"] == "in_progress":
                    e["status"] = "cancelled"
            self._save(s)
            return self.batch_view(s, bid)

    def file_view(self, s: dict, e: dict) -> dict:
        return {"id": e["id"], "object": "vector_store.file", "created_at": e["created_at"],
                "usage_bytes": e["usage_bytes"],
                "vector_store_id": s["id"], "status": e["status"], "last_error": e["last_error"],
                "attributes": e["attributes"], "chunking_strategy": e["chunking_strategy"]}

    def _entry(self, owner: str | None, vsid: str, fid: str) -> tuple[dict, dict]:
        s = self._store(owner, vsid)
        e = s["files"].get(fid)
        if e is None or e.get("removing"):
            raise NotFoundError(f"no file {fid[:60]!r} in vector store {vsid}")
        return s, e

    def store_file(self, owner: str | None, vsid: str, fid: str) -> dict:
        return self.file_view(*self._entry(owner, vsid, fid))

    def list_store_files(self, owner: str | None, vsid: str, status: str | None, limit: int, order: str,
                         after: str | None, before: str | None, batch: str | None = None) -> dict:
        if status not in (None, "in_progress", "completed", "failed", "cancelled"):
            raise InputError("filter must be one of in_progress, completed, failed, cancelled")
        if batch is not None:
            s, _ = self._batch(owner, vsid, batch)
        else:
            s = self._store(owner, vsid)
        entries = [e for e in s["files"].values()
                   if status in (None, e["status"]) and batch in (None, e["batch"]) and not e.get("removing")]
        return _page([self.file_view(s, e) for e in entries], limit, order, after, before,
                     {e["id"]: e.get("made_ns", 0) for e in entries})

    def update_store_file(self, owner: str | None, vsid: str, fid: str, attributes) -> dict:
        attributes = check_attributes(attributes)
        with self._lock:
            s, e = self._entry(owner, vsid, fid)
            e["attributes"] = attributes
            self._save(s)
            chunks, done = e["chunks"], e["status"] == "completed"
        if done and chunks:  # metadata alone: replaced whole, nothing re-embedded (in progress: the worker
            # gives them to the file's chunks before it completes, _finish)
            meta = {"file_id": fid, "filename": e["filename"], "attributes": attributes}
            self.catalog.get(vsid).set_metadata({f"{fid}#{i}": meta for i in range(chunks)}, merge=False)
        return self.file_view(s, e)

    def delete_store_file(self, owner: str | None, vsid: str, fid: str) -> dict:
        """Marked first, its chunks deleted, then its entry removed: a crash between leaves the mark, which the
        next start finishes (a removed file's chunks never stay searchable)."""
        with self._lock:
            s, e = self._entry(owner, vsid, fid)
            e["removing"] = True
            self._save(s)
        self._finish_removal(vsid, fid)
        return {"id": fid, "object": "vector_store.file.deleted", "deleted": True}

    def _finish_removal(self, vsid: str, fid: str) -> None:
        self.catalog.get(vsid).delete_where({"file_id": fid})
        with self._lock:
            s = self._stores.get(vsid)
            if s is not None and s["files"].get(fid, {}).get("removing"):
                del s["files"][fid]
                self._save(s)

    def store_file_chunks(self, owner: str | None, vsid: str, fid: str) -> list[str]:
        _, e = self._entry(owner, vsid, fid)
        docs = self.catalog.get(vsid).get([f"{fid}#{i}" for i in range(e["chunks"])])
        return [d.text for d in docs]

    # -- the worker ----------------------------------------------------------------------------------
    def _work(self) -> None:
        lower_thread_priority()  # files are embedded on the cores that searches leave
        while (job := self._turns.take()) is not None:
            done = True
            try:
                done = self._step(job)
            except Exception:  # noqa: BLE001 - the file's status says it failed; the log has the rest
                log.exception("adding file %s to vector store %s failed", job.fid, job.vsid)
                self._finish(job, 0, 0, {"code": "server_error", "message": "internal error; see the service's log"})
            finally:
                if done:
                    self._keep(job, None)
                self._turns.back(job, done or self._closing.is_set())

    def _keep(self, job: FileJob, chunker: Chunker | None) -> None:
        """The job's Chunker kept for its next step (None: let go); past LIVE_CHUNKERS the one stepped least
        recently is let go (its next step starts from its mark)."""
        with self._live_lock:
            job.chunker = chunker
            self._live.pop(job, None)
            if chunker is not None:
                self._live[job] = None
                while len(self._live) > LIVE_CHUNKERS:
                    self._live.popitem(last=False)[0].chunker = None

    def _step(self, job: FileJob) -> bool:
        """One step of the job: a part of its tokens counted (with the last part, its first batch), or one batch
        of its chunks embedded and written. True when it is done (completed, failed, or no longer wanted)."""
        if self._closing.is_set():
            return True  # still in progress: taken up again at the next start
        with self._lock:
            wanted = self._still_wanted(job)
            plan, attributes, filename = job.entry["chunking_strategy"]["static"], job.entry["attributes"], \
                job.entry["filename"]
            rec = self._files.get(job.fid)
        if not wanted:
            return self._finish(job, 0, 0, None)  # removed or cancelled meanwhile: what it wrote goes
        path = self.files_dir / f"{job.fid}.data"
        if rec is None or not path.exists():
            return self._finish(job, 0, 0, {"code": "invalid_file", "message": "the file was deleted"})
        size, overlap = plan["max_chunk_size_tokens"], plan["chunk_overlap_tokens"]
        embedder = get_embedder(self.embedding)
        try:
            if not job.counted:  # a part of its tokens counted: nothing is embedded before the file is known good
                limit = self.limits.max_tokens
                # A token is at least a byte of the text: a file of no more bytes than the limit is only read, to
                # check that it is text (a step reads more of it, as reading costs far less than tokenizing).
                exact = rec["bytes"] > limit
                job.mark, ended = count_tokens(path, job.mark, embedder.token_spans if exact else None, limit,
                                               COUNT_CHARS if exact else 16 * COUNT_CHARS)
                if not ended:
                    return False
                if job.mark.tokens > limit:
                    return self._finish(job, 0, 0, {"code": "invalid_file", "message": too_many_tokens(limit)})
                if exact and not job.mark.tokens:
                    return self._finish(job, 0, 0, _NO_TEXT)
                job.counted, job.mark = True, Mark()  # and its first batch in the same turn
            # Cut between words, so the chunk count is known only at the end (about chunk_count's).
            chunker = job.chunker or Chunker(path, job.mark, job.chunk, embedder.token_spans, size, overlap,
                                             whole_words=True)
            chunks = chunker.step(EMBED_BATCH)
            job.mark, ended = chunker.mark, chunker.done
            self._keep(job, chunker)
        except BadText as err:
            return self._finish(job, 0, 0, {"code": err.code, "message": err.message})
        except FileNotFoundError:
            return self._finish(job, 0, 0, {"code": "invalid_file", "message": "the file was deleted"})
        try:
            coll = self.catalog.get(job.vsid)
            if job.chunk == 0:
                coll.delete_where({"file_id": job.fid})  # what an earlier add of the same file left
                job.attributes = attributes
            if chunks:
                meta = {"file_id": job.fid, "filename": filename, "attributes": job.attributes}
                vectors = embedder.embed(chunks)
                coll.upsert([Document(f"{job.fid}#{job.chunk + i}", t, v, meta)
                             for i, (t, v) in enumerate(zip(chunks, vectors))])
        except FusionRAGError as err:
            return self._finish(job, 0, 0, {"code": "server_error", "message": str(err)})
        job.chunk += len(chunks)
        job.usage += sum(len(c.encode()) for c in chunks)
        if ended:
            if not job.chunk:
                return self._finish(job, 0, 0, _NO_TEXT)
            return self._finish(job, job.chunk, job.usage + job.chunk * embedder.dim * 4, None)
        return False

    def _still_wanted(self, job: FileJob) -> bool:
        s = self._stores.get(job.vsid)
        e = None if s is None or s.get("deleting") else s["files"].get(job.fid)
        return e is job.entry and e["status"] == "in_progress" and not e.get("removing")

    def _finish(self, job: FileJob, chunks: int, usage: int, error: dict | None) -> bool:
        """The file's status set (True: the job is done). What a job wrote goes when it fails, or when it is no
        longer wanted (removed, cancelled): a failed file has no chunks."""
        while True:
            with self._lock:
                s = self._stores.get(job.vsid)
                wanted = self._still_wanted(job)
                attributes = job.entry["attributes"]
                stale = wanted and not error and chunks and attributes != job.attributes
                if wanted and not stale:
                    job.entry.update(status="failed" if error else "completed", last_error=error, chunks=chunks,
                                     usage_bytes=usage)
                    self._save(s)
            if not stale:
                break
            # Attributes changed while it was added: they reach its chunks before it completes (then
            # update_store_file does it).
            meta = {"file_id": job.fid, "filename": job.entry["filename"], "attributes": attributes}
            try:
                self.catalog.get(job.vsid).set_metadata({f"{job.fid}#{i}": meta for i in range(chunks)}, merge=False)
                job.attributes = attributes
            except FusionRAGError as err:
                error = {"code": "server_error", "message": str(err)}
        if (error or not wanted) and job.counted and s is not None and not s.get("deleting"):
            # The owner's next job (this file added again, say) starts after this one ends: it loses nothing.
            try:
                self.catalog.get(job.vsid).delete_where({"file_id": job.fid})
            except FusionRAGError:
                log.exception("removing the chunks of file %s from vector store %s failed", job.fid, job.vsid)
        return True

    def idle(self) -> bool:
        """No file in progress in any store."""
        with self._lock:
            return not any(e["status"] == "in_progress" for s in self._stores.values() for e in s["files"].values())


def _record(path: Path) -> dict | None:
    """A record written by write_json_atomic; one that does not parse (a damaged disk) is logged and left where
    it is, not taken for an object."""
    try:
        rec = json.loads(path.read_text())
        if isinstance(rec, dict) and rec.get("id") == path.stem:
            return rec
    except (OSError, ValueError):
        pass
    log.error("vector stores: %s is not a readable record; left out (and left on disk)", path)
    return None


def _check_expiry(expires_after):
    if expires_after is None:
        return None
    if not isinstance(expires_after, dict) or expires_after.get("anchor") != "last_active_at" or not isinstance(
            expires_after.get("days"), int) or isinstance(expires_after.get("days"), bool) or not (
            1 <= expires_after["days"] <= 365):
        raise InputError("expires_after must be {\"anchor\": \"last_active_at\", \"days\": 1-365}")
    return {"anchor": "last_active_at", "days": expires_after["days"]}
