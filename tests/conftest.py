import gzip
import os
from pathlib import Path

import numpy as np
import pytest
from cgroup import cgroup_factory  # noqa: F401 (a fixture: a memory cgroup of the test's own, tests/cgroup.py)
from rss import status

# Without a GPU the Triton kernels run in Triton's interpreter, which reads this variable when
# triton is first imported: set it before any test module imports the kernels.
if "TRITON_INTERPRET" not in os.environ and not Path("/dev/nvidiactl").exists():
    os.environ["TRITON_INTERPRET"] = "1"

# The embedding model on ONNX Runtime in float32 unless a test asks otherwise: on a CPU with bf16 instructions it
# would otherwise run in bf16 (retriever/collection/embedding_bf16.py), whose vectors are within cosine 0.9999 of the
# float32 model's but differ in the third decimal, batched or alone, where tests compare vectors to 1e-5; its own
# tests (tests/retriever/test_embedding_runtime_bf16.py) set it. Subprocesses (the service) inherit it.
os.environ.setdefault("FUSIONRAG_EMBED_BF16", "off")

# The project's real data sets live in shared/data beside the checkout (each folder has a README).
DATA = Path(os.environ.get("FUSIONRAG_DATA", Path(__file__).resolve().parents[2] / "shared" / "data"))


def status_bytes(key: str) -> int:
    """A size line of /proc/self/status (VmRSS, VmHWM ...), bytes."""
    return status(key)[key]


def idx_images(path) -> np.ndarray:
    """The images of a gzipped IDX file (Fashion-MNIST's), one uint8 row each."""
    with gzip.open(path, "rb") as f:
        raw = f.read()
    n, rows, cols = (int.from_bytes(raw[i:i + 4], "big") for i in (4, 8, 12))
    return np.frombuffer(raw, dtype=np.uint8, offset=16).reshape(n, rows * cols)


@pytest.fixture(scope="session")
def data_dir() -> Path:
    assert DATA.is_dir(), f"real data sets not found at {DATA} (set FUSIONRAG_DATA)"
    return DATA


@pytest.fixture
def device_tier_bookkeeping(monkeypatch):
    """For the device tier's tests (test_device_tier*.py): each starts with no process budget, and budgets count the
    tiers' parts only, no CUDA context (DeviceBudget.true_up) and no allocator slack (test_gpu_tier.py's
    bookkeeping_budgets says why)."""
    from fusionrag.kernels.pool import DeviceBudget
    from fusionrag.retriever.engine import device_tier, gpu_tier

    monkeypatch.setattr(gpu_tier, "_budgets", {})
    monkeypatch.setattr(DeviceBudget, "true_up", lambda self: None)
    monkeypatch.setattr(device_tier, "ALLOCATOR_SLACK", 0)


@pytest.fixture
def fastapi_stack_passes(monkeypatch) -> list[str]:
    """The paths of the requests that pass FastAPI's own stack (its ServerErrorMiddleware, the outermost layer),
    in order: a search the service answers on its fast path (server/fastpath.py) is not among them."""
    from starlette.middleware.errors import ServerErrorMiddleware

    passes: list[str] = []
    real = ServerErrorMiddleware.__call__

    async def counted(self, scope, receive, send):
        passes.append(scope.get("path", ""))
        return await real(self, scope, receive, send)

    monkeypatch.setattr(ServerErrorMiddleware, "__call__", counted)
    return passes


def clustered(n: int, dim: int, clusters: int, seed: int = 0, spread: float = 0.3) -> np.ndarray:
    """A Gaussian mixture: real embeddings are clustered, uniform noise is not."""
    rng = np.random.default_rng(seed)
    centers = rng.standard_normal((clusters, dim)).astype(np.float32)
    labels = rng.integers(clusters, size=n)
    return (centers[labels] + spread * rng.standard_normal((n, dim))).astype(np.float32)


def exact_knn(base: np.ndarray, queries: np.ndarray, k: int, metric: str = "l2") -> np.ndarray:
    base = base.astype(np.float64)
    queries = queries.astype(np.float64)
    if metric == "cosine":
        base = base / np.linalg.norm(base, axis=1, keepdims=True)
        queries = queries / np.linalg.norm(queries, axis=1, keepdims=True)
    if metric == "ip" or metric == "cosine":
        d = -(queries @ base.T)
    else:
        d = (queries**2).sum(1)[:, None] - 2 * queries @ base.T + (base**2).sum(1)[None, :]
    return np.argsort(d, axis=1, kind="stable")[:, :k]


def recall(found: np.ndarray, truth: np.ndarray) -> float:
    k = truth.shape[1]
    return sum(len(np.intersect1d(a[a >= 0], b)) for a, b in zip(found, truth)) / truth.size


def make_index(rng, n_vectors, n_lists, m_sub, replicas=3, list_len=40):
    """Posting lists in CSR form over n_vectors PQ codes; every vector sits in 1..replicas lists."""
    members = [[] for _ in range(n_lists)]
    for v in range(n_vectors):
        for c in rng.choice(n_lists, size=rng.integers(1, replicas + 1), replace=False):
            members[c].append(v)
    for c in range(n_lists):  # random extra members, so lists differ in length and repeat ids
        members[c] += list(rng.integers(0, n_vectors, rng.integers(0, list_len)))
        rng.shuffle(members[c])
    offsets = np.zeros(n_lists + 1, np.int64)
    offsets[1:] = np.cumsum([len(m) for m in members])
    ids = np.concatenate([np.asarray(m, np.uint32) for m in members]) if offsets[-1] else np.zeros(0, np.uint32)
    codes = rng.integers(0, 256, (n_vectors, m_sub), dtype=np.uint8)
    return offsets, ids.astype(np.uint32), codes


def tiny_lists() -> dict:
    """Two queries' probes over three posting lists of a 10-vector, 4-byte-code index: the list arguments
    the native scan and the fused LUT scan share (tests/native), for their argument checks."""
    return dict(probe_lists=np.array([[0, 1], [1, -1]], np.int32), list_offsets=np.array([0, 2, 3], np.int64),
                list_ids=np.array([0, 5, 9], np.uint32), codes=np.zeros((10, 4), np.uint8), n=4)


def sharded_copy(built: Path, dest: Path):
    """A ShardedCollection over a copy of a built sharded index (writes leave the original as built)."""
    import shutil

    from fusionrag.retriever.sharded.docs import ShardedCollection
    from fusionrag.retriever.sharded.router import ShardedIndex

    shutil.copytree(built, dest)
    return ShardedCollection(ShardedIndex.open(dest), "docs")
