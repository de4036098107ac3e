"""Vector files, memory-mapped so that a build never needs the whole file in RAM.

texmex: .fvecs (float32), .bvecs (uint8), .ivecs (int32); each row is an int32 dimension then
the values. big-ann-benchmarks: .fbin (float32), .u8bin (uint8), .i8bin (int8), .ibin (int32):
int32 count, int32 dimension, then the values. NumPy: .npy (2-D). All little-endian.
"""

from __future__ import annotations

import mmap
import os
from dataclasses import dataclass

import numpy as np

from fusionrag.retriever.errors import InputError, VectorFileError

_TEXMEX = {".fvecs": np.float32, ".bvecs": np.uint8, ".ivecs": np.int32}
_BIN = {".fbin": np.float32, ".u8bin": np.uint8, ".i8bin": np.int8, ".ibin": np.int32}
EXTENSIONS = tuple(_TEXMEX) + tuple(_BIN) + (".npy",)
# Element types an index stores as they are; other float types are stored as float32.
STORAGE_DTYPES = {np.dtype(np.float32): "f32", np.dtype(np.uint8): "u8", np.dtype(np.int8): "i8"}


@dataclass
class VectorFile:
    """A read-only (count, dim) matrix backed by a file; slicing returns NumPy arrays.

    Read as a build reads it, larger than memory: its map is advised MADV_RANDOM, so that a gather of scattered
    rows (k-means' clusters, a sample) faults in the pages it touches and no more, where the kernel's read-around
    brought in read_ahead_kb (8 MiB on this machine's disk) per fault: the rows of a 3M x 128 build's clustering
    read 339 GB from disk under a cap of a third of them. A range of rows (a pass in chunks) is asked for whole,
    MADV_WILLNEED, before it is copied, so passes still read ahead."""

    path: str
    data: np.ndarray  # a memmap view, possibly strided (texmex rows carry a header)

    def __post_init__(self):
        self._map, self._offset = _mapping(self.data)
        if self._map is not None:
            try:
                self._map.madvise(mmap.MADV_RANDOM)
            except (OSError, ValueError):  # an OS without it: the kernel's default
                self._map = None

    @property
    def count(self) -> int:
        return self.data.shape[0]

    @property
    def dim(self) -> int:
        return self.data.shape[1]

    @property
    def dtype(self) -> np.dtype:
        return self.data.dtype

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, idx) -> np.ndarray:
        if self._map is not None:
            span = _span(idx, self.count)
            if span is not None and span[1] - span[0] > 1:
                self._will_need(*span)
        return np.ascontiguousarray(self.data[idx])

    def __getstate__(self):  # a map is not pickled: the unpickled file reads with the kernel's default
        return {**self.__dict__, "_map": None}

    def _will_need(self, lo: int, hi: int) -> None:
        row = self.data.strides[0]
        start = self._offset + lo * row
        aligned = start - start % mmap.PAGESIZE
        try:
            self._map.madvise(mmap.MADV_WILLNEED, aligned, min(len(self._map), self._offset + hi * row) - aligned)
        except (OSError, ValueError):
            pass


def _mapping(data: np.ndarray):
    """(the mmap a memmap view reads, the byte offset of its row 0 in it); (None, 0) for anything else."""
    base = data
    while base is not None and getattr(base, "_mmap", None) is None:
        base = getattr(base, "base", None)
    m = getattr(base, "_mmap", None) if base is not None else None
    if not isinstance(m, mmap.mmap) or data.strides[0] <= 0:
        return None, 0
    return m, int(data.ctypes.data - np.frombuffer(m, dtype=np.uint8).ctypes.data)


def _span(idx, count: int) -> tuple[int, int] | None:
    """(lo, hi) where idx asks for the rows lo..hi-1 in order (a slice of step 1, or an array of consecutive ids)."""
    if isinstance(idx, slice):
        lo, hi, step = idx.indices(count)
        return (lo, hi) if step == 1 and hi > lo else None
    if isinstance(idx, np.ndarray) and idx.ndim == 1 and idx.dtype.kind in "iu" and len(idx) > 1:
        lo, hi = int(idx[0]), int(idx[-1]) + 1
        if hi - lo == len(idx) and lo >= 0 and hi <= count and (len(idx) < 3 or idx[1] - idx[0] == 1):
            return (lo, hi) if bool(np.all(np.diff(idx) == 1)) else None
    return None


def _fail(path: str, msg: str) -> VectorFileError:
    return VectorFileError(f"{path}: {msg}")


def open_vectors(path: str | os.PathLike) -> VectorFile:
    """Open a vector file by its extension, checking its size and header before any use."""
    path = os.fspath(path)
    ext = os.path.splitext(path)[1].lower()
    if ext not in EXTENSIONS:
        raise _fail(path, f"unknown vector file extension {ext!r}; expected one of {', '.join(EXTENSIONS)}")
    try:
        size = os.path.getsize(path)
    except OSError as e:
        raise _fail(path, f"cannot read: {e.strerror}") from e
    if size == 0:
        raise _fail(path, "empty file")
    if ext == ".npy":
        return _open_npy(path)
    if ext in _BIN:
        return _open_bin(path, size, np.dtype(_BIN[ext]))
    return _open_texmex(path, size, np.dtype(_TEXMEX[ext]))


def _open_bin(path: str, size: int, dtype: np.dtype) -> VectorFile:
    if size < 8:
        raise _fail(path, f"truncated: {size} bytes, shorter than the 8-byte header")
    n, d = (int(x) for x in np.fromfile(path, dtype="<i4", count=2))
    if n <= 0 or d <= 0:
        raise _fail(path, f"header says {n} vectors of dimension {d}; both must be positive")
    expected = 8 + n * d * dtype.itemsize
    if size != expected:
        raise _fail(path, f"header says {n} x {d} {dtype.name} ({expected} bytes) but the file has {size} bytes"
                    + (" (truncated)" if size < expected else ""))
    return VectorFile(path, np.memmap(path, dtype=dtype.newbyteorder("<"), mode="r", offset=8, shape=(n, d)))


def _open_texmex(path: str, size: int, dtype: np.dtype) -> VectorFile:
    if size < 4:
        raise _fail(path, f"truncated: {size} bytes")
    d = int(np.fromfile(path, dtype="<i4", count=1)[0])
    if d <= 0 or d > 1 << 20:
        raise _fail(path, f"first row says dimension {d}; not a texmex vector file?")
    row = 4 + d * dtype.itemsize
    if size % row:
        raise _fail(path, f"size {size} is not a multiple of the row size {row} (dimension {d}): truncated or mixed dimensions")
    n = size // row
    rows = np.memmap(path, dtype=np.dtype([("d", "<i4"), ("v", dtype.newbyteorder("<"), (d,))]), mode="r", shape=(n,))
    # Every row repeats the dimension; checking a spread of rows catches mixed files cheaply.
    probe = rows["d"][np.unique(np.linspace(0, n - 1, num=min(n, 4096)).astype(np.int64))]
    bad = np.flatnonzero(probe != d)
    if bad.size:
        raise _fail(path, f"rows have different dimensions ({d} and {int(probe[bad[0]])})")
    return VectorFile(path, rows["v"])


def _open_npy(path: str) -> VectorFile:
    try:
        arr = np.load(path, mmap_mode="r", allow_pickle=False)
    except ValueError as e:
        raise _fail(path, f"not a readable .npy file: {e}") from e
    if arr.ndim != 2 or arr.shape[0] == 0 or arr.shape[1] == 0:
        raise _fail(path, f"expected a non-empty 2-D array, got shape {arr.shape}")
    if arr.dtype.kind not in "fiu":
        raise _fail(path, f"unsupported element type {arr.dtype}")
    return VectorFile(path, arr)


def as_source(source) -> VectorFile:
    """A path or an in-memory (count, dim) array as a VectorFile."""
    if isinstance(source, VectorFile):
        return source
    if isinstance(source, (str, os.PathLike)):
        return open_vectors(source)
    arr = np.asarray(source)
    if arr.ndim != 2 or arr.shape[0] == 0 or arr.shape[1] == 0:
        raise InputError(f"vectors must be a non-empty 2-D array, got shape {arr.shape}")
    if arr.dtype.kind not in "fiu":
        raise InputError(f"unsupported element type {arr.dtype}")
    return VectorFile("<array>", arr)


def storage_dtype(dtype: np.dtype) -> np.dtype:
    """The element type vectors are kept in on the SSD tier."""
    dtype = np.dtype(dtype)
    return dtype if dtype in STORAGE_DTYPES else np.dtype(np.float32)


# Float32 arithmetic on vectors must stay finite: a squared distance is at most 2|q|² + 2|x|², and
# sums run over whole clusters (k-means, PQ tables). So a vector's squared norm must stay far below
# float32's largest value (3.4e38), or one finite but huge vector turns distances into inf and NaN.
MAX_SQ_NORM = 1e30


def _chunk_rows(x: np.ndarray) -> int:
    """Rows of x whose float64 copy is 256 KiB: what the float64 checks and normalisation work on at a time
    (whole-call copies were 4-5x a call's query bytes at the search's peak)."""
    return max(1, (1 << 15) // max(1, x.shape[-1])) if x.ndim == 2 else max(1, len(x))


def vector_problems(block: np.ndarray, metric: str) -> tuple[np.ndarray, list[str]]:
    """Rows (indices into block) the engine cannot use, and why: NaN or infinity, a squared norm over
    MAX_SQ_NORM, or a zero vector under cosine. Norms are taken in float64, so a tiny (even
    denormal) vector still has its direction."""
    if block.dtype.kind != "f":  # 8-bit and int32 rows are finite and far below the bound
        if metric == "cosine":
            bad = np.flatnonzero(~block.any(axis=1))
            return bad, ["is a zero vector, which has no cosine direction"] * len(bad)
        return np.empty(0, np.int64), []
    finite = np.empty(len(block), dtype=bool)
    sq = np.empty(len(block), dtype=np.float64)
    step = _chunk_rows(block)
    for lo in range(0, len(block), step):  # float64 copies of a chunk at a time, not of the whole block
        part = block[lo:lo + step]
        finite[lo:lo + step] = ok = np.isfinite(part).all(axis=1)
        b = np.where(ok[:, None], part, 0).astype(np.float64)
        sq[lo:lo + step] = np.einsum("ij,ij->i", b, b)
    bad = np.flatnonzero(~finite | (sq > MAX_SQ_NORM) | ((sq == 0) if metric == "cosine" else False))
    return bad, [problem(1 if not finite[i] else 2 if sq[i] > MAX_SQ_NORM else 3, sq[i]) for i in bad.tolist()]


def problem(why: int, sq: float) -> str:
    """What is wrong with a row, by native.check_rows' code: 1 not finite, 2 too long (sq its squared norm), 3 zero
    under cosine."""
    if why == 1:
        return "contains NaN or infinity"
    if why == 2:
        return f"has squared norm {sq:.3g}, over the {MAX_SQ_NORM:.0e} that float32 distances allow"
    return "is a zero vector, which has no cosine direction"


def check_vectors(block: np.ndarray, metric: str, where: str, row_ids: np.ndarray | None = None) -> None:
    """Raise naming the first row (its id in row_ids, else its index) the engine cannot use."""
    bad, why = vector_problems(block, metric)
    if bad.size:
        row = int(bad[0]) if row_ids is None else int(row_ids[bad[0]])
        raise InputError(f"{where}: row {row} {why[0]}")


def normalize(x: np.ndarray) -> np.ndarray:
    """Unit-length float32 rows, the norm taken in float64 so that neither a huge nor a tiny vector
    overflows or underflows on the way (rows must have passed check_vectors under cosine)."""
    x = np.asarray(x)
    out = np.empty(x.shape, dtype=np.float32)
    step = _chunk_rows(x)
    for lo in range(0, len(x), step):
        x64 = np.asarray(x[lo:lo + step], dtype=np.float64)
        out[lo:lo + step] = x64 / np.linalg.norm(x64, axis=-1, keepdims=True)
    return out


def internal_metric(metric: str) -> str:
    """Cosine is L2 over unit vectors inside the engine; the others are themselves."""
    return "ip" if metric == "ip" else "l2"


def sample_query_matrix(sample_queries, dim: int, metric: str) -> np.ndarray:
    """A build's sample queries (a query log) as the engine searches them: float32 (count, dim), unit rows
    under cosine; InputError naming what is wrong."""
    queries = np.ascontiguousarray(np.asarray(sample_queries), dtype=np.float32)
    if queries.ndim != 2 or queries.shape[1] != dim or not len(queries):
        raise InputError(f"sample_queries must be a non-empty (count, {dim}) array, got {queries.shape}")
    check_vectors(queries, metric, "sample_queries")
    return normalize(queries) if metric == "cosine" else queries


def write_bin(path: str | os.PathLike, arr: np.ndarray) -> None:
    """Write a big-ann-benchmarks .fbin/.u8bin/.i8bin/.ibin file."""
    arr = np.ascontiguousarray(arr)
    with open(path, "wb") as f:
        np.array(arr.shape, dtype="<i4").tofile(f)
        arr.tofile(f)


def write_vecs(path: str | os.PathLike, arr: np.ndarray) -> None:
    """Write a texmex .fvecs/.ivecs/.bvecs file."""
    n, d = arr.shape
    rows = np.empty(n, dtype=[("d", "<i4"), ("v", arr.dtype, (d,))])
    rows["d"] = d
    rows["v"] = arr
    rows.tofile(path)
