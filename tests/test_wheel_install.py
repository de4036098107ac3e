"""The service installs from a wheel, without the repository and without a compiler (#67 item 1): the package is
built once into a wheel with its native extension inside (`pip wheel .`, as `make wheel` does), that wheel is
installed with its [server] extra into a fresh virtual environment whose PATH holds no compiler, and
`fusionrag serve` started from there answers vector and text searches.

The wheel is cached by a hash of the sources that go into it (in FUSIONRAG_WHEEL_CACHE, default
$TMPDIR/fusionrag-test-wheels, with a CMake build folder kept beside it so that a change rebuilds only what
changed): a rerun with unchanged sources skips the build (from nothing ~1-2.5 min on 2 busy cores, ~30 s after a
change). The install goes through the package registry with pip's cache (a first run on a machine downloads ~250 MB
of wheels besides torch's, whose CPU build comes pinned first as the Makefile installs it); the venv, ~1.6 GB, is
removed at the end."""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
# What goes into the wheel (pyproject.toml's [tool.scikit-build.wheel.packages], its metadata, the build).
SOURCES = ["pyproject.toml", "CMakeLists.txt", "README.md", "LICENSE", "src", "retriever", "kernels", "native",
           "server", "integrations", "loadtests"]
COMPILERS = ["cc", "gcc", "g++", "c++", "clang", "clang++", "cpp", "ld", "cmake", "ninja", "make"]
# What serving does not need: none of it may come with the [server] extra.
NOT_SERVING = {"pytest", "ray", "locust", "langchain-core", "llama-index-core", "triton", "selenium",
               "schemathesis", "openai", "vllm", "matplotlib", "faiss-cpu", "hnswlib", "langchain-tests"}


def _cache_root() -> Path:
    return Path(os.environ.get("FUSIONRAG_WHEEL_CACHE") or Path(tempfile.gettempdir()) / "fusionrag-test-wheels")


def _source_files() -> list[Path]:
    """The files under SOURCES a clone would have: git's tracked and not-ignored ones (every file where git is
    missing)."""
    try:
        out = subprocess.run(["git", "-C", str(ROOT), "ls-files", "-z", "-co", "--exclude-standard", "--", *SOURCES],
                             capture_output=True, check=True).stdout.decode()
        files = [ROOT / p for p in out.split("\0") if p]
    except (OSError, subprocess.CalledProcessError):
        files = [p for s in SOURCES for p in ([ROOT / s] if (ROOT / s).is_file() else (ROOT / s).rglob("*"))]
    return sorted(p for p in files if p.is_file() and "__pycache__" not in p.parts)


def _sources_hash() -> str:
    h = hashlib.sha256(f"{sys.version_info[:2]}\n".encode())
    for f in _source_files():
        h.update(f"{f.relative_to(ROOT).as_posix()}\0{hashlib.sha256(f.read_bytes()).hexdigest()}\n".encode())
    return h.hexdigest()[:24]


def _run(cmd: list[str], timeout: float, **kw) -> subprocess.CompletedProcess:
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)
    if run.returncode != 0:
        noise = re.compile(r"^WARNING: Location .* is ignored")  # this machine's pip config: not the failure
        out = "\n".join(line for line in (run.stdout + run.stderr).splitlines() if not noise.match(line))
        raise AssertionError(f"{' '.join(cmd)} exited with {run.returncode}:\n{out[-6000:]}")
    return run


def built_wheel() -> Path:
    """The wheel of the sources as they are, built once per version of them (`pip wheel . --no-deps`)."""
    root = _cache_root()
    root.mkdir(parents=True, exist_ok=True)
    folder = root / _sources_hash()
    with open(root / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # two runs at once: one builds, the other takes its wheel
        wheels = sorted(folder.glob("fusionrag-*.whl"))
        if wheels:
            return wheels[0]
        tmp = Path(tempfile.mkdtemp(prefix=".build-", dir=root))
        try:
            # A build folder of its own (the checkout's build/ is the editable install's), kept for the next build.
            _run([sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps", "-q", "-w", str(tmp),
                  "-C", f"build-dir={root / 'build' / sys.implementation.cache_tag}"], timeout=1800)
            wheels = sorted(tmp.glob("fusionrag-*.whl"))
            assert len(wheels) == 1, wheels
            shutil.rmtree(folder, ignore_errors=True)
            tmp.rename(folder)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        for old in root.iterdir():  # earlier sources' wheels
            if old.is_dir() and old.name not in (folder.name, "build") and not old.name.startswith("."):
                shutil.rmtree(old, ignore_errors=True)
        return folder / wheels[0].name


def _tree_bytes(path: Path) -> int:
    total = 0
    for dirpath, _, names in os.walk(path):
        for n in names:
            try:
                total += os.lstat(os.path.join(dirpath, n)).st_size
            except OSError:
                pass
    return total


def _torch_pin() -> str:
    """The torch the Makefile installs first (so that pip takes its CPU build)."""
    m = re.search(r"pip install -q (torch==\S+)", (ROOT / "Makefile").read_text())
    assert m, "the Makefile no longer pins torch"
    return m.group(1)


def _check_wheel(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        meta = z.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    assert [n for n in names if re.fullmatch(r"fusionrag/native/_native\..*\.so", n)], names
    for page in ("index.html", "app.js", "style.css"):  # the search page (server/app.py serves the folder)
        assert f"fusionrag/server/static/{page}" in names, names
    assert "fusionrag/server/corpus/concepts.md" in names, names  # the demo's documents (server/demo.py)
    assert not [n for n in names if n.endswith((".cpp", ".h", ".inc", ".pyc"))], names
    server = {re.split(r"[=<>!~ ;\[]", line.split(":", 1)[1].strip(), maxsplit=1)[0].lower()
              for line in meta.splitlines() if line.startswith("Requires-Dist:") and 'extra == "server"' in line}
    assert "fastapi" in server and "onnxruntime" in server and not server & NOT_SERVING, server


def test_the_wheel_installs_and_serves_without_a_compiler(tmp_path):
    t0 = time.monotonic()
    wheel = built_wheel()
    built_s = time.monotonic() - t0
    _check_wheel(wheel)

    venv = tmp_path / "venv"
    try:
        _install_and_serve(wheel, venv, tmp_path, t0, built_s)
    finally:
        for big in (venv, tmp_path / "cache"):  # 1.6 GB and the model's ONNX export: not kept by pytest
            shutil.rmtree(big, ignore_errors=True)


def _install_and_serve(wheel: Path, venv: Path, tmp_path: Path, t0: float, built_s: float) -> None:
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    bin_dir = venv / "bin"
    py = bin_dir / "python"
    # Nothing of this checkout, this test's environment or a compiler: only the fresh venv's own tools on PATH.
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PYTHON", "VIRTUAL_ENV", "FUSIONRAG_", "CONDA", "CMAKE", "SKBUILD"))
           and k not in ("CC", "CXX", "CPP", "LD", "PATH")}
    env.update(PATH=str(bin_dir), FUSIONRAG_CACHE_DIR=str(tmp_path / "cache"), PIP_DISABLE_PIP_VERSION_CHECK="1")
    missing = [c for c in COMPILERS if shutil.which(c, path=env["PATH"])]
    assert not missing, f"PATH {env['PATH']} has {missing}"
    assert shutil.which("pip", path=env["PATH"]) and shutil.which("python", path=env["PATH"])

    t1 = time.monotonic()
    pip = [str(py), "-m", "pip", "install", "-q", "--only-binary", ":all:"]  # wheels only: nothing is compiled
    _run([*pip, _torch_pin()], timeout=1200, env=env, cwd=tmp_path)
    _run([*pip, f"{wheel}[server]"], timeout=1200, env=env, cwd=tmp_path)
    installed_s = time.monotonic() - t1
    missing = [c for c in COMPILERS if shutil.which(c, path=env["PATH"])]  # nor did the install bring one
    assert not missing, f"PATH {env['PATH']} has {missing}"
    listed = json.loads(_run([str(py), "-m", "pip", "list", "--format", "json"], timeout=120, env=env).stdout)
    names = {p["name"].lower().replace("_", "-") for p in listed}
    assert "fusionrag" in names and not names & NOT_SERVING, sorted(names & NOT_SERVING)
    where = _run([str(py), "-c", "import fusionrag, fusionrag.native._native as n; print(fusionrag.__file__); "
                  "print(n.__file__)"], timeout=120, env=env, cwd=tmp_path).stdout.split()
    site = venv / "lib" / f"python{sys.version_info[0]}.{sys.version_info[1]}" / "site-packages"
    assert all(Path(p).is_relative_to(site) for p in where), where  # the wheel's files, not this checkout's

    log_path = tmp_path / "server.log"
    log = open(log_path, "w")
    proc = subprocess.Popen([str(bin_dir / "fusionrag"), "serve", "--no-demo", "--host", "127.0.0.1", "--port", "0",
                             "--data-dir", str(tmp_path / "data"), "--log-format", "json"],
                            stdout=log, stderr=subprocess.STDOUT, env=env, cwd=tmp_path)
    try:
        url = None
        deadline = time.monotonic() + 120
        while url is None and time.monotonic() < deadline:
            m = re.search(r"Uvicorn running on (http://127\.0\.0\.1:\d+)", log_path.read_text())
            if m:
                url = m.group(1)
            else:
                assert proc.poll() is None, f"server exited with {proc.returncode}:\n{log_path.read_text()}"
                time.sleep(0.2)
        assert url, f"server did not start listening:\n{log_path.read_text()}"
        with httpx.Client(base_url=url, timeout=300) as c:
            while (r := c.get("/readyz")).status_code != 200:
                assert time.monotonic() < deadline and r.json().get("status") != "failed", r.text
                time.sleep(0.2)
            assert r.json()["collections"] == [], r.text  # this server's own, empty data directory

            # Vectors: 2,000 random ones, and queries near some of them, whose nearest one numpy finds.
            rng = np.random.default_rng(67)
            dim, n = 32, 2000
            base = rng.standard_normal((n, dim)).astype(np.float32)
            r = c.post("/v1/collections", json={"name": "wheel", "dimension": dim, "metric": "l2"})
            assert r.status_code in (200, 201), r.text
            for lo in range(0, n, 500):
                docs = [{"id": f"v{i}", "vector": base[i].tolist(), "metadata": {"i": i}} for i in range(lo, lo + 500)]
                r = c.post("/v1/collections/wheel/documents", json={"documents": docs})
                assert r.status_code == 200 and len(r.json()["ids"]) == 500, r.text
            picked = rng.choice(n, 8, replace=False)
            queries = base[picked] + 0.01 * rng.standard_normal((8, dim)).astype(np.float32)
            d = ((queries[:, None, :].astype(np.float64) - base[None].astype(np.float64)) ** 2).sum(-1)
            truth = d.argmin(1)
            r = c.post("/v1/collections/wheel/search", json={"vectors": queries.tolist(), "k": 5})
            assert r.status_code == 200, r.text
            hits = r.json()["results"]
            assert [h[0]["id"] for h in hits] == [f"v{i}" for i in truth], (hits, truth)
            np.testing.assert_allclose([h[0]["distance"] for h in hits], d[np.arange(8), truth], rtol=1e-3,
                                       atol=1e-5)
            assert c.get("/v1/collections/wheel").json()["count"] == n

            # Texts: the [server] set embeds them (all-MiniLM-L6-v2, exported to ONNX on this first use).
            r = c.post("/v1/collections", json={"name": "texts", "embedding": "all-MiniLM-L6-v2"})
            assert r.status_code in (200, 201), r.text
            r = c.post("/v1/collections/texts/documents", json={"documents": [
                {"id": "tombstones", "text": "Deleted documents stay in the index as tombstones until the next merge."},
                {"id": "pq", "text": "Product quantization compresses each vector into a few bytes."},
                {"id": "io", "text": "The re-ranker reads raw vectors from the SSD with io_uring."}]})
            assert r.status_code == 200, r.text
            r = c.post("/v1/collections/texts/search", json={"texts": ["what happens to deleted documents?"], "k": 1})
            assert r.status_code == 200 and r.json()["results"][0][0]["id"] == "tombstones", r.text
            assert c.get("/").status_code == 200  # the search page, from the wheel's static files
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        log.close()
    print(f"\nwheel {wheel.name} ({wheel.stat().st_size / 1e6:.1f} MB, built or cached in {built_s:.0f} s); "
          f"[server] installed in {installed_s:.0f} s: venv {_tree_bytes(venv) / 1e9:.2f} GB; "
          f"whole test {time.monotonic() - t0:.0f} s")
