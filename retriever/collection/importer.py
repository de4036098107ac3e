"""Bulk import into an empty collection: documents from files, indexed by one build, not through the
fresh tier (which would hold every vector in RAM until a merge).

Sources: a JSON-lines file of documents ({"id", "text", "metadata", "vector"}: a line without a vector
has its text embedded by the collection's model), or a vector file (.fvecs .fbin .npy ... as
`fusionrag build` reads) with an optional JSON-lines sidecar describing row i on line i (id, text,
metadata; ids default to the row number). Nothing is held whole: the files are read in chunks,
three times (check and stage the vectors in a memory-mapped float32 file, build the index from it,
store the documents). check_start checks the start of the files as the import will (check_record, one line's
checks, shared by both), so that the service refuses an upload whose first lines the import would refuse
before it accepts it.

The import is one write: its documents are stored in one SQLite transaction, made durable, and then
published with the index as a new generation, so a failure before that leaves the collection as it
was, and a crash after the store's commit leaves the documents stored (the next open takes them into
the fresh tier and a merge indexes them). Writes made to the collection meanwhile stay, after it.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from fusionrag.retriever.collection import quota
from fusionrag.retriever.collection.generations import write_json_atomic
from fusionrag.retriever.collection.values import check_id, check_text, metadata_json
from fusionrag.retriever.engine.build import build_index
from fusionrag.retriever.engine.manifest import fsync_path
from fusionrag.retriever.engine.vectors import open_vectors, vector_problems
from fusionrag.retriever.errors import ConflictError, FusionRAGError, InputError
from fusionrag.retriever.progress import Progress

if TYPE_CHECKING:
    from fusionrag.retriever.collection import Collection

CHUNK = 4096  # documents read, checked, embedded and stored at a time
EMBED_BATCH = 256  # texts embedded at a time: the progress moves as each batch is done (CPU: seconds each)
_KEYS = {"id", "text", "metadata", "vector"}
# The start of an upload the service checks before it accepts an import (check_start): the documents' lines within
# their first CHECKED_BYTES, the first line whole up to FIRST_LINE_BYTES, the vector file's first rows.
CHECKED_BYTES = 64 << 10
FIRST_LINE_BYTES = 16 << 20


log = logging.getLogger(__name__)

# An import's state, in import.json beside the collection, so that a restart reports one it cut short: "uploading"
# (claimed by a request whose files are still arriving), "running", then "done" or "failed" (with the reason), or
# "interrupted" (the process ended meanwhile). Writes are refused while it is uploading or running.
ACTIVE = ("uploading", "running")
STATE = "import.json"


def read_state(folder: Path) -> dict | None:
    """The import state the last process left in folder (None: none, or unreadable)."""
    try:
        state = json.loads((Path(folder) / STATE).read_text())
    except (OSError, ValueError):
        return None
    return state if isinstance(state, dict) else None


def record_state(folder: Path, state: dict | None, what: str) -> None:
    """Write (None: remove) folder's import state; a failure is logged, not raised: the state stays known to this
    process, and only a restart would not report it. what: the collection, as the log names it."""
    try:
        if state is None:
            (Path(folder) / STATE).unlink(missing_ok=True)
        else:
            write_json_atomic(Path(folder) / STATE, state)
    except OSError:
        log.exception("%s: cannot record its import's state", what)


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


class ImportState:
    """One bulk import at a time into an empty collection, and its state kept in the collection's directory
    (read_state, record_state): "uploading" (claimed, its files arriving), "running", then "done" (what it did),
    "failed" (why) or "interrupted" (the process stopped during it; found so at the next open). A collection
    (import_ops.py) and a sharded collection in a data directory (sharded/hosted.py) each hold one, under their own
    lock: one lifecycle, the same words. what: the collection as messages name it ("collection 'c'")."""

    def __init__(self, path: Path, what: str):
        self.path, self.what = Path(path), what
        self.now: dict | None = None
        self._before_claim: dict | None = None

    @property
    def active(self) -> bool:
        """An import claimed or running."""
        return self.now is not None and self.now.get("state") in ACTIVE

    def load(self, interrupted: Callable[[], str]) -> None:
        """The last import's state, as the previous process left it: one it left active is interrupted
        (interrupted(): why, in the state's words)."""
        state = read_state(self.path)
        if state is not None and state.get("state") in ACTIVE:
            state = {**state, "state": "interrupted", "reason": interrupted()}
            record_state(self.path, state, self.what)
        self.now = state

    def set(self, state: dict | None) -> None:
        self.now = state
        record_state(self.path, state, self.what)

    def refuse_if_active(self) -> None:
        if self.active:
            raise ConflictError(f"{self.what} is already importing documents (its progress is in the collection's "
                                "info)")

    def claim(self) -> None:
        """Reserve the collection for one import before its files arrive (the caller checked it may take one)."""
        self.refuse_if_active()
        self._before_claim = self.now
        self.set({"state": "uploading", "started": _now()})

    def release(self) -> None:
        """Give up a claim whose upload was refused: the state as before it."""
        if self.now is not None and self.now.get("state") == "uploading":
            self.set(self._before_claim)

    def start(self, claimed: bool) -> None:
        """The import runs now (claimed: the caller claimed it first; else the caller checked it may take one)."""
        state = None if self.now is None else self.now.get("state")
        if claimed and state != "uploading":
            raise ConflictError(f"{self.what}: the import's claim was lost")
        if not claimed:
            self.refuse_if_active()
        self.set({"state": "running", "started": self.now["started"] if claimed else _now()})

    def failed(self, reason: str) -> None:
        self.set({**self.now, "state": "failed", "reason": reason})

    def done(self, done: dict) -> None:
        self.set({**self.now, "state": "done", **done})


def public_reason(e: BaseException, path: Path, *folders: Path) -> str:
    """What an import's state says of the error e, without the service's paths: the collection's own (path), the
    data directory's (its grandparent), and `folders` (the upload's)."""
    text = str(e) if isinstance(e, FusionRAGError) else f"{type(e).__name__}: {e}"
    for folder in folders:
        text = text.replace(f"{folder}{os.sep}", "").replace(str(folder), ".")
    return text.replace(f"{path}{os.sep}", "").replace(str(path), ".").replace(str(path.parent.parent), "<data-dir>")


def parse_line(number: int, raw: bytes) -> dict | None:
    """Line `number` of an import's JSON lines (raw: its bytes), as every reader of them takes it: None where it is
    blank, else its document, an object with keys among _KEYS. InputError naming the line and the problem: not
    UTF-8, not JSON, not an object, an unknown key."""
    if not raw.strip():
        return None
    try:
        doc = json.loads(raw)
    except UnicodeDecodeError as e:  # json.loads decodes bytes (UTF-8, or UTF-16/32 by the first bytes) itself
        hint = ("; it looks gzip-compressed: decompress it (over HTTP: send it with Content-Encoding: gzip, or as a "
                "part whose file name ends in .gz)") if number == 1 and raw[:2] == b"\x1f\x8b" else ""
        raise InputError(f"documents line {number}: not UTF-8 (byte 0x{e.object[e.start]:02x} at byte {e.start + 1} "
                         f"of the line){hint}") from e
    except ValueError as e:
        raise InputError(f"documents line {number}: not JSON ({e})") from e
    if not isinstance(doc, dict):
        raise InputError(f"documents line {number}: a document is an object with keys among {sorted(_KEYS)}, got "
                         f"{_JSON_KINDS.get(type(doc), type(doc).__name__)} {str(doc)[:80]}")
    unknown = sorted(set(doc) - _KEYS)
    if unknown:
        raise InputError(f"documents line {number}: unknown key {unknown[0][:80]!r}: a document is an object with "
                         f"keys among {sorted(_KEYS)}")
    return doc


_JSON_KINDS = {list: "an array", str: "a string", int: "a number", float: "a number", bool: "a boolean",
               type(None): "null"}


def _lines(path: Path) -> Iterator[tuple[int, dict]]:
    """(line number, document) of each non-blank line, checked for shape (parse_line)."""
    with open(path, "rb") as f:
        for number, raw in enumerate(f, 1):
            doc = parse_line(number, raw)
            if doc is not None:
                yield number, doc


def _chunks(it, n: int = CHUNK):
    chunk = []
    for item in it:
        chunk.append(item)
        if len(chunk) == n:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def _check_doc(number: int, doc: dict) -> tuple[str | None, str | None, str]:
    doc_id, text, meta = doc.get("id"), doc.get("text"), doc.get("metadata", {})
    if doc_id is not None and (not isinstance(doc_id, str) or not doc_id or len(doc_id) > 512):
        raise InputError(f"documents line {number}: id must be a non-empty string of at most 512 characters")
    if doc_id is not None:
        check_id(doc_id, f"documents line {number}: id")
    if text is not None and not isinstance(text, str):
        raise InputError(f"documents line {number}: text must be a string")
    if text is not None:
        check_text(text, f"documents line {number}: text")
    if not isinstance(meta, dict):
        raise InputError(f"documents line {number}: metadata must be an object")
    # The one check of what a store can hold (values.py), in this line's words.
    return doc_id, text, metadata_json(doc_id, meta, f"documents line {number}")


def check_record(number: int, doc: dict, dim: int, embeds: bool, vector_file: bool, owner: str
                 ) -> tuple[str | None, str | None, str, np.ndarray | None]:
    """The checks of one document of an import (line `number`, as parse_line read it), the same wherever it is
    read: as the import stages it (stage_vectors), as a sharded build reads a vector file's sidecar, and on the
    first lines of an upload before the service accepts it (check_start). Its id, text and metadata (_check_doc);
    with a vector file (vector_file), no vector of its own; else a vector of dim numbers, or a text for the
    collection's model to embed (embeds: it has one; owner names the collection). Returns (id, text, metadata
    JSON, the vector as float32, None where the line gives none). Whether a vector is finite and within the
    metric's bounds is checked a block of them at a time (_check_block)."""
    doc_id, text, meta = _check_doc(number, doc)
    if vector_file:
        if "vector" in doc:
            raise InputError(f"documents line {number}: with a vector file, vectors come from it, not from the "
                             "documents")
        return doc_id, text, meta, None
    vec = doc.get("vector")
    if vec is None:
        if text is None:
            raise InputError(f"documents line {number}: a document needs a text, a vector, or both")
        if not embeds:
            raise InputError(f"{owner} has no embedding model, so every document needs a vector (line {number} has "
                             "none)")
        return doc_id, text, meta, None
    try:
        with np.errstate(over="ignore"):
            v = np.asarray(vec, dtype=np.float32) if isinstance(vec, list) else None
    except OverflowError:  # an integer past float64's range: refused as not finite by _check_block
        v = np.full(dim, np.inf, np.float32) if len(vec) == dim else None
    except (TypeError, ValueError):
        v = None
    if v is None or v.shape != (dim,):
        raise InputError(f"documents line {number}: vector must be {dim} numbers")
    return doc_id, text, meta, v


def _count_mismatch(lines: int, vectors: int) -> InputError:
    return InputError(f"the documents file has {lines} lines, the vector file {vectors} vectors: line i describes "
                      "vector i")


def check_start(documents: Path | None, vectors: Path | None, dim: int, metric: str, embeds: bool, owner: str,
                limit: int = CHECKED_BYTES) -> int:
    """What the start of an import's files shows, checked as the import checks it, before the import is accepted
    (the service checks an upload so before it answers 202): the vector file's header and size (open_vectors), its
    dimension against dim and its first rows; the documents' lines within their first `limit` bytes (the first
    line whole, up to FIRST_LINE_BYTES), each by check_record (embeds, owner: as there) and their vectors as a
    block; and where the documents are whole within `limit`, that there are some, and as many as vectors. Raises
    the InputError the import would raise for them later; returns the lines checked."""
    if documents is None and vectors is None:
        raise InputError("an import needs documents (JSON lines), vectors (a vector file), or both")
    src = None
    if vectors is not None:
        src = open_vectors(vectors)
        if src.dim != dim:
            raise InputError(f"vectors: dimension {src.dim}, {owner} has dimension {dim}")
        rows = max(1, limit // max(1, src.dim * src.dtype.itemsize))
        _check_block(np.asarray(src[:rows], dtype=np.float32), metric, 0, "vectors: row")
    if documents is None:
        return 0
    with open(documents, "rb") as f:
        head = f.read(limit)
        whole = not f.read(1)
        lines = head.split(b"\n")
        if head.endswith(b"\n") or not whole:
            lines.pop()  # not a line: what follows the last newline, or a line the limit cuts
        if not lines and not whole:  # a first line longer than the limit: read on to its end
            f.seek(0)
            first = f.readline(FIRST_LINE_BYTES)
            lines = [first] if first.endswith(b"\n") or not f.read(1) else []
    count, vecs, numbers = 0, [], []
    for number, raw in enumerate(lines, 1):
        doc = parse_line(number, raw)
        if doc is None:
            continue
        _, _, _, v = check_record(number, doc, dim, embeds, src is not None, owner)
        if v is not None:
            vecs.append(v)
            numbers.append(number)
        count += 1
    if vecs:
        _check_block(np.stack(vecs), metric, 0, "documents line", numbers)
    if whole and src is None and not count:
        raise InputError("nothing to import: no documents")
    if whole and src is not None and count != src.count:
        raise _count_mismatch(count, src.count)
    return count


def import_files(col: Collection, documents: Path | None, vectors: Path | None, progress: bool | None,
                 embedder=None) -> dict:
    """Import into `col` (see the module); the caller holds col's merge lock. embedder: the collection's
    model, needed when documents carry texts without vectors. What it needs of col beyond its description:
    col.import_steps() (each step's progress, the build's config, the publication of the staged import)."""
    t0 = time.perf_counter()
    if documents is None and vectors is None:
        raise InputError("an import needs documents (JSON lines), vectors (a vector file), or both")
    on_step, build_config, publish = col.import_steps()
    steps = Progress(progress, on_step)
    staging = col.path / f".import-{uuid.uuid4().hex}"
    staging.mkdir()
    try:
        n, source = _stage(col, documents, vectors, staging, steps, embedder)
        index_dir = staging / "index"
        indexed = n >= col.config.min_index_count
        if indexed:
            build_index(str(source), index_dir, build_config, progress, on_progress=on_step,
                            resume=False)  # staging is the import's own: a killed import starts over
        stored = publish(n, source, lambda: _documents(documents, n, vectors is not None),
                         index_dir if indexed else None, steps)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return {"documents": n, "stored": stored, "indexed": indexed, "seconds": round(time.perf_counter() - t0, 3)}


def _documents(documents: Path | None, n: int, sidecar: bool) -> Iterator[list[tuple[str, str | None, str]]]:
    """(id, text, metadata JSON) of the n documents, in chunks: from the JSON lines, else ids by row number."""
    if documents is None:
        for s in range(0, n, CHUNK):
            yield [(str(i), None, "{}") for i in range(s, min(n, s + CHUNK))]
        return
    row = 0
    for chunk in _chunks(_lines(documents)):
        out = []
        for number, doc in chunk:
            doc_id, text, meta = _check_doc(number, doc)
            out.append((doc_id or (str(row) if sidecar else uuid.uuid4().hex), text, meta))
            row += 1
        yield out


def check_sidecar(path: Path, n: int, vectors_in_lines: bool = False) -> None:
    """A JSON-lines sidecar of a vector file, as a sharded build takes it: n documents (line i describes vector i:
    its id, text and metadata, no vector unless vectors_in_lines: the lines were the vectors' source), each
    checked, their ids (the row number where a line has none) all different. InputError naming the first line
    at fault."""
    hashes, count = [], 0
    for number, doc in _lines(Path(path)):
        # lines that were the vectors' source were checked whole as they were staged (stage_vectors)
        doc_id, _, _, _ = check_record(number, doc, 0, False, True, "") if not vectors_in_lines else \
            (*_check_doc(number, doc), None)
        hashes.append(hash(doc_id if doc_id is not None else str(count)))
        count += 1
    if count != n:
        raise _count_mismatch(count, n)
    h = np.sort(np.asarray(hashes, dtype=np.int64))
    if len(h) and (h[1:] == h[:-1]).any():  # a hash met twice: find the id met twice, if it is one
        seen = {}
        for row, chunk in enumerate(sidecar_documents(path)):
            for j, (doc_id, _, _) in enumerate(chunk):
                if doc_id in seen:
                    raise InputError(f"documents: id {doc_id!r} is given twice (rows {seen[doc_id]} and "
                                     f"{row * CHUNK + j})")
                seen[doc_id] = row * CHUNK + j


def first_vector_dim(path: Path) -> int:
    """The length of the first document's vector: JSON lines without an embedding model carry their vectors, and
    the first gives the dimension the others are checked against (stage_vectors)."""
    for number, doc in _lines(Path(path)):
        vec = doc.get("vector")
        if isinstance(vec, list) and vec:
            return len(vec)
        raise InputError(f"documents line {number}: without an embedding model every document needs a vector")
    raise InputError("nothing to import: no documents")


def sidecar_documents(path: Path) -> Iterator[list[tuple[str, str | None, str]]]:
    """(id, text, metadata JSON) of each row of a vector file's sidecar, CHUNK rows at a time (check_sidecar
    first)."""
    return _documents(Path(path), -1, True)


def _stage(col: Collection, documents: Path | None, vectors: Path | None, staging: Path, steps: Progress,
           embedder) -> tuple[int, Path]:
    """Check every document and write their vectors, as the collection stores them (float32, as given),
    to a memory-mapped staging/vectors.npy; returns their count and that file."""
    def room(count: int) -> None:
        # What it writes, about: the staged vectors, the index's pages, the doc store's copy of both and the texts.
        need = 3 * count * col.dim * 4 + (os.path.getsize(documents) if documents is not None else 0)
        quota.check_room(col.path, need, col.limits.disk_reserve_bytes, f"importing {count} documents")

    path = staging / "vectors.npy"
    return stage_vectors(documents, vectors, path, steps, embedder, col.dim, col.metric,
                         f"collection {col.name!r}", room), path


def stage_vectors(documents: Path | None, vectors: Path | None, path: Path, steps: Progress, embedder, dim: int,
                  metric: str, owner: str, room=None) -> int:
    """Check every document and write their vectors (float32, as given; a line without a vector has its text
    embedded by `embedder`) to a memory-mapped .npy at path, made durable; returns their count. room(count), if
    given, is called before anything is written (a disk quota's check). owner names what they go to in errors."""
    count = 0
    if documents is not None:
        with steps.step("reading documents", os.path.getsize(documents), "B") as update:
            with open(documents, "rb") as f:
                for raw in f:
                    count += bool(raw.strip())
                    update(len(raw))
    src = None
    if vectors is not None:
        src = open_vectors(vectors)
        if src.dim != dim:
            raise InputError(f"vectors: dimension {src.dim}, {owner} has dimension {dim}")
        if documents is not None and count != src.count:
            raise _count_mismatch(count, src.count)
        count = src.count
    if not count:
        raise InputError("nothing to import: no documents")
    if room is not None:
        room(count)
    out = np.lib.format.open_memmap(path, mode="w+", dtype=np.float32, shape=(count, dim))
    name = "checking vectors" if src is not None else "staging vectors" if embedder is None else \
        "staging vectors (embedding texts)"
    embedded, embed_s = 0, 0.0
    with steps.step(name, count) as update:
        if src is not None:
            for s in range(0, count, CHUNK):
                block = np.asarray(src[s:s + CHUNK], dtype=np.float32)
                _check_block(block, metric, s, "vectors: row")
                out[s:s + len(block)] = block
                update(len(block))
            for number, doc in _lines(documents) if documents is not None else ():
                check_record(number, doc, dim, embedder is not None, True, owner)
        else:
            row = 0
            for chunk in _chunks(_lines(documents)):
                to_embed = []
                for j, (number, doc) in enumerate(chunk):
                    _, text, _, v = check_record(number, doc, dim, embedder is not None, False, owner)
                    if v is None:  # its text, for the model to embed
                        to_embed.append((j, text))
                        continue
                    out[row + j] = v
                if to_embed:
                    for s in range(0, len(to_embed), EMBED_BATCH):
                        part = to_embed[s:s + EMBED_BATCH]
                        t0 = time.perf_counter()
                        # bulk: on every core (embedding.set_threads' bulk threads), beside the queries' own session
                        vectors = embedder.embed([t for _, t in part], bulk=True)
                        embed_s, embedded = embed_s + time.perf_counter() - t0, embedded + len(part)
                        for (j, _), v in zip(part, vectors):
                            out[row + j] = v
                        update(len(part))  # documents staged: their vectors are ready
                _check_block(np.asarray(out[row:row + len(chunk)]), metric, 0,
                             "documents line", [number for number, _ in chunk])
                row += len(chunk)
                update(len(chunk) - len(to_embed))
    if embedded:
        log.info("%s: embedded %d texts in %.1f s (%.0f docs/s)", owner, embedded, embed_s,
                 embedded / max(embed_s, 1e-9))
    out.flush()
    del out
    fsync_path(path)
    return count


def _check_block(block: np.ndarray, metric: str, offset: int, what: str, numbers: list[int] | None = None) -> None:
    bad, why = vector_problems(block, metric)
    if bad.size:
        at = numbers[bad[0]] if numbers is not None else offset + int(bad[0])
        raise InputError(f"{what} {at}: vector {why[0]}")


def check_empty(col: Collection) -> None:
    if not col.is_empty():
        raise ConflictError(f"collection {col.name!r} already holds documents: import into a new, empty collection "
                            "(or write through the documents API)")
