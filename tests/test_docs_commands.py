"""The README's and docs/'s shell commands hold (#67 item 5): every ```sh, ```bash, ```shell or ```console block
either runs as written or says why not.

- A block runs as written, in bash with `set -eo pipefail`, in a fresh directory holding only the input files it
  names (docs.jsonl, base.fbin, queries.fbin, gt.ivecs, log.fbin: made below as the pages describe them), with the
  venv's `fusionrag` entry point first on the PATH, against one real service (`fusionrag serve` with its demo, no
  API key, as `make run` starts it) where it talks to one: `localhost:8000` is that service's address, and curl
  fails on an HTTP error (`--fail-with-body`), so a 4xx the docs did not expect fails the block. After it, what it
  made is checked: each collection it created in the service finished its import with every document, each
  `--out` file holds an id per query and k, each offline import stored every document.
- A block that cannot run here is marked by a `<!-- not run: reason -->` line right before it (installs packages,
  needs a GPU, a Ray cluster, vLLM and a model, or is a long-running server or job).
- Either way, every command line in it is checked against the code: a `fusionrag ...` command parses with the
  CLI's own parser, a `make` target (never run here: they install the environment or run for long) and the
  variables it is given are in the Makefile, a `pip install` names extras pyproject.toml has, files that exist
  and torch at the Makefile's pin, a `python -m` of the project names a module that exists, and pytest the test
  files that exist.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
import tomllib
from importlib.util import find_spec
from pathlib import Path

import httpx
import numpy as np
import pytest
from server_util import ServerProcess

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
NOT_RUN = "<!-- not run:"
SHELLS = ("sh", "bash", "shell", "console")
VENV_BIN = Path(sys.executable).parent
N_DOCS, N_QUERIES, DIM = 200, 50, 384  # 384: all-MiniLM-L6-v2's, so the vectors and the texts' model agree


def _rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def _blocks() -> list[tuple[str, str, str, str | None]]:
    """(page, the heading it is under, the block's commands, the not-run reason or None) of every shell block."""
    out = []
    fence = r"^```(?:" + "|".join(SHELLS) + r")\n.*?^```$"
    for page in PAGES:
        section, before = "", ""
        for part in re.split(rf"(^#{{1,3}} [^\n]*$|{fence})", page.read_text(), flags=re.M | re.S):
            if re.match(r"#{1,3} ", part):
                section = part.lstrip("#").strip()
            elif part.startswith("```") and part.split("\n", 1)[0][3:] in SHELLS:
                lang, body = part[3:].split("\n", 1)
                body = body[:-3]
                if lang == "console":  # the prompt's lines, and the lines they continue; not the output
                    keep, cont = [], False
                    for line in body.splitlines():
                        if line.startswith("$ ") or cont:
                            keep.append(line[2:] if line.startswith("$ ") and not cont else line)
                            cont = line.rstrip().endswith("\\")
                    body = "\n".join(keep) + "\n"
                last = before.rstrip().rsplit("\n", 1)[-1]
                reason = None
                if last.startswith(NOT_RUN) and last.endswith("-->"):
                    reason = last[len(NOT_RUN):-3].strip()
                out.append((_rel(page), section, body, reason))
            before = part
    return out


BLOCKS = _blocks()
IDS = [f"{i}-{p}-{s}" for i, (p, s, _, _) in enumerate(BLOCKS)]


# -- the commands in a block ----------------------------------------------------------------------------------

def commands(script: str) -> list[list[str]]:
    """Each simple command of a block as its words, the variable assignments before it left out."""
    out = []
    pending = ""
    for line in re.sub(r"\\\n", " ", script).splitlines():
        try:  # a quoted argument may go on over lines
            words = shlex.split(pending + line, comments=True)
        except ValueError:
            pending += line + "\n"
            continue
        pending = ""
        cmd: list[str] = []
        for w in [*words, "&&"]:
            if w in ("&&", "||", ";", "|"):
                while cmd and re.match(r"[A-Za-z_][A-Za-z0-9_]*=", cmd[0]):
                    cmd.pop(0)
                if cmd:
                    out.append(cmd)
                cmd = []
            else:
                cmd.append(w)
    return out


def _makefile() -> str:
    return (ROOT / "Makefile").read_text()


def _torch_pin() -> str:
    return re.search(r"pip install -q (torch==\S+)", _makefile()).group(1)


def check_command(cmd: list[str]) -> list[str]:
    """What is wrong with one command against the code: [] when nothing is."""
    from fusionrag.cli import build_parser

    name = Path(cmd[0]).name
    if name == "fusionrag":
        err = io.StringIO()
        try:
            with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
                build_parser().parse_args(cmd[1:])
        except SystemExit as e:
            if e.code:
                return [f"{shlex.join(cmd)}: the CLI refuses it: {err.getvalue().strip()}"]
        return []
    if name == "make":
        bad, makefile = [], _makefile()
        for word in cmd[1:]:
            if "=" in word:
                var = word.split("=", 1)[0]
                if not re.search(rf"\$\({var}\)", makefile):
                    bad.append(f"{shlex.join(cmd)}: the Makefile reads no {var}")
            elif not re.search(rf"^{re.escape(word)}:", makefile, re.M):
                bad.append(f"{shlex.join(cmd)}: the Makefile has no target {word}")
        return bad
    if name.startswith("python") and cmd[1:3] == ["-m", "pip"]:
        return check_command(["pip", *cmd[3:]])
    if name == "pip" and cmd[1:2] == ["install"]:
        bad, args = [], cmd[2:]
        project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
        extras = set(project["optional-dependencies"])
        for i, word in enumerate(args):
            if word.startswith("torch=="):
                if word != _torch_pin():
                    bad.append(f"{shlex.join(cmd)}: the Makefile installs {_torch_pin()}")
            elif args[i - 1:i] == ["-r"] and not (ROOT / word).is_file():
                bad.append(f"{shlex.join(cmd)}: no file {word}")
            wheel = re.match(r"fusionrag-([^-]+)-cp", word)
            if wheel and wheel.group(1) != project["version"]:
                bad.append(f"{shlex.join(cmd)}: pyproject.toml's version is {project['version']}")
            m = re.search(r"\[([a-z0-9_,-]+)\]$", word)
            if m and (word.startswith(".[") or "fusionrag" in word):
                bad += [f"{shlex.join(cmd)}: pyproject.toml has no extra {e!r}" for e in m.group(1).split(",")
                        if e not in extras]
        return bad
    if name.startswith("python") and cmd[1:2] == ["-m"]:
        module = cmd[2]
        if module == "pytest":
            return [f"{shlex.join(cmd)}: no file {a}" for a in cmd[3:]
                    if not a.startswith("-") and not (ROOT / a.split("::")[0]).exists()]
        if module.split(".")[0] in ("fusionrag", "bench") and find_spec(module) is None:
            return [f"{shlex.join(cmd)}: no module {module}"]
    return []


def test_the_pages_have_their_commands():
    """The blocks the test finds include the ones it must: a guard against a parser that finds nothing."""
    found = {(p, s) for p, s, _, _ in BLOCKS}
    assert {("README.md", "The demo"), ("README.md", "With the Python client"), ("docs/engine.md",
            "From the command line"), ("docs/sharded.md", "A sharded collection in the service")} <= found, found
    run = [b for b in BLOCKS if b[3] is None]
    assert len(run) >= 7 and len(BLOCKS) - len(run) >= 10, (len(run), len(BLOCKS))


def test_every_block_names_its_language():
    """A fence without a language would hide its commands from this test (and from the snippets' one)."""
    bare = []
    for page in PAGES:
        opening = True
        for n, line in enumerate(page.read_text().splitlines(), 1):
            if line.startswith("```"):
                if opening and line == "```":
                    bare.append(f"{_rel(page)}:{n}")
                opening = not opening
    assert not bare, f"code blocks without a language: {bare}"


def test_a_not_run_block_says_why():
    for page, section, _, reason in BLOCKS:
        if reason is not None:
            assert len(reason.split()) >= 3, f"{page}, {section}: 'not run' needs a reason: {reason!r}"


@pytest.mark.parametrize("page, section, script, reason", BLOCKS, ids=IDS)
def test_every_command_is_one_the_code_takes(page, section, script, reason):
    cmds = commands(script)
    assert cmds, f"{page}, {section}: no command in the block"
    bad = [problem for cmd in cmds for problem in check_command(cmd)]
    assert not bad, f"{page}, {section}:\n" + "\n".join(bad)


def test_the_command_checks_can_fail():
    """Each static check refuses what the code does not have."""
    assert check_command(["fusionrag", "search", "idx/", "q.fbin", "--nprobes", "3"])
    assert not check_command(["fusionrag", "serve", "--gpu-budget-mb", "4096"])
    assert check_command(["make", "no-such-target"]) and not check_command(["make", "run"])
    assert check_command(["make", "gpu-accept", "NO_SUCH_VAR=1"])
    assert check_command(["pip", "install", "-e", ".[server,no-such-extra]"])
    assert check_command(["pip", "install", "torch==1.0.0"])
    assert check_command(["python", "-m", "pip", "install", "--no-deps", "-r", "integrations/nothing.txt"])
    assert check_command(["python", "-m", "fusionrag.no_such_module"])
    assert check_command(["python", "-m", "pytest", "tests/no_such_test.py"])
    assert check_command(["pip", "install", "fusionrag-0.0.9-cp311-cp311-linux_x86_64.whl[server]"])
    assert commands("A=1 B=2 fusionrag info idx/ && fusionrag info x  # c\nmake \\\n  run\ncurl -d '{\"a\":\n 1}'\n") == [
        ["fusionrag", "info", "idx/"], ["fusionrag", "info", "x"], ["make", "run"], ["curl", "-d", '{"a":\n 1}']]


# -- running the blocks -----------------------------------------------------------------------------------------

def _fbin(path: Path, x: np.ndarray) -> None:
    with open(path, "wb") as f:
        np.array(x.shape, dtype=np.int32).tofile(f)
        x.astype(np.float32).tofile(f)


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> Path:
    """The files the pages' commands read: docs.jsonl, JSON lines of {"id", "text", "metadata"} (the demo's
    documents' first sentences, numbered); base.fbin, a vector per line of it (its sidecar); queries.fbin with its
    exact ground truth gt.ivecs (L2, 100 a query); log.fbin, a query log."""
    from fusionrag.server.demo import corpus

    folder = tmp_path_factory.mktemp("inputs")
    docs = corpus()
    with open(folder / "docs.jsonl", "w") as f:
        for i in range(N_DOCS):
            d = docs[i % len(docs)]
            f.write(json.dumps({"id": f"doc-{i}", "text": f"{d.text.split('. ')[0]}. ({i})",
                                "metadata": {**d.metadata, "n": i}}) + "\n")
    rng = np.random.default_rng(67)
    base = rng.standard_normal((N_DOCS, DIM)).astype(np.float32)
    queries = rng.standard_normal((N_QUERIES, DIM)).astype(np.float32)
    _fbin(folder / "base.fbin", base)
    _fbin(folder / "queries.fbin", queries)
    _fbin(folder / "log.fbin", rng.standard_normal((200, DIM)).astype(np.float32))
    gt = np.argsort(((queries[:, None, :] - base[None]) ** 2).sum(-1), axis=1)[:, :100].astype(np.int32)
    np.hstack([np.full((N_QUERIES, 1), 100, np.int32), gt]).tofile(folder / "gt.ivecs")
    return folder


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    """The service as `make run` starts it: its demo collection, no API key."""
    root = tmp_path_factory.mktemp("commands-service")
    srv = ServerProcess(root / "data", root / "server.log")
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()


def _names(client: httpx.Client) -> set[str]:
    return {c["name"] for c in client.get("/v1/collections").json()["collections"]}


def _settled(client: httpx.Client, name: str, seconds: float = 300) -> dict:
    """The collection's info once its import, if any, has ended."""
    deadline = time.monotonic() + seconds
    while True:
        info = client.get(f"/v1/collections/{name}").json()
        imp = info["build_state"].get("import") or {}
        if imp.get("state") not in ("uploading", "running") or time.monotonic() > deadline:
            return info
        time.sleep(0.5)


def _json_values(text: str) -> list:
    """The JSON objects printed one after another (curl ends its answer with no newline)."""
    out, decoder, i = [], json.JSONDecoder(), text.find("{")
    while i >= 0:
        try:
            value, end = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            i = text.find("{", i + 1)
            continue
        out.append(value)
        i = text.find("{", end)
    return out


RUN = [(i, b) for i, b in zip(IDS, BLOCKS) if b[3] is None]


@pytest.mark.parametrize("page, section, script, reason", [b for _, b in RUN], ids=[i for i, _ in RUN])
def test_every_block_runs_as_written(page, section, script, reason, service, inputs, tmp_path):
    for f in inputs.iterdir():
        if re.search(rf"(?<![\w.-]){re.escape(f.name)}(?![\w.-])", script):
            shutil.copy(f, tmp_path / f.name)
    address = service.url.removeprefix("http://")
    body = re.sub(r"(?<![\w.-])(localhost|127\.0\.0\.1):8000(?!\d)", address, script)
    prelude = 'set -eo pipefail\ncurl() { command curl --fail-with-body --show-error "$@"; }\n'
    env = {**os.environ, "PATH": f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}"}
    env.pop("FUSIONRAG_API_KEYS", None)
    with service.client() as client:
        before = _names(client)
        run = subprocess.run(["bash", "-c", prelude + body], cwd=tmp_path, env=env, capture_output=True, text=True,
                             timeout=600)
        made = sorted(_names(client) - before)
        try:
            assert run.returncode == 0, \
                f"{page}, {section}: the block failed as written:\n{script}\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
            # Each collection it made in the service holds every document of its import.
            for name in made:
                info = _settled(client, name)
                imp = info["build_state"].get("import")
                if imp is not None:
                    assert imp["state"] == "done" and info["count"] == N_DOCS, (page, section, name, info)
            # Each offline import stored every document.
            for out in _json_values(run.stdout):
                if "stored" in out:
                    assert out["documents"] == out["stored"] == N_DOCS, (page, section, out)
            # Each search's --out: k ids a query, each a row of the source.
            for cmd in commands(script):
                if cmd[:2] == ["fusionrag", "search"] and "--out" in cmd:
                    ids = np.load(tmp_path / cmd[cmd.index("--out") + 1])
                    k = int(cmd[cmd.index("--k") + 1]) if "--k" in cmd else 10
                    assert ids.shape == (N_QUERIES, k) and ((0 <= ids) & (ids < N_DOCS)).all(), (page, section)
            # A search of the demo: the k hits asked for, the best first.
            if "/v1/collections/demo/search" in script:
                k = json.loads(re.search(r"-d '(\{.*?\})'", script, re.S).group(1))["k"]
                hits = _json_values(run.stdout)[0]["results"][0]
                assert len(hits) == k and hits[0]["id"] == "concepts/early-stopping-of-the-re-ranker", hits
        finally:
            for name in made:
                client.delete(f"/v1/collections/{name}")


def test_the_commands_that_run_are_the_ones_that_can():
    """Where a block talks to the service and could run, it does: only what needs what this machine lacks (a GPU,
    Ray, vLLM, an install, a model elsewhere) or would not end is marked."""
    ran = {(p, s) for _, (p, s, _, _) in RUN}
    assert {("README.md", "The demo"), ("README.md", "With the Python client"), ("docs/api.md", "The HTTP service and its Python client"),
            ("docs/engine.md", "From the command line"), ("docs/collections.md", "Snapshots and bulk import"),
            ("docs/sharded.md", "A sharded collection in the service"), ("docs/tuning.md", "Less host memory")} \
        <= ran, ran
