"""The README and docs/ hold: each of their Python snippets runs as written (in a fresh directory, against a real
service where it says it talks to one), every relative link and #anchor resolves inside the repository, the code
map of docs/design.md names what its files hold, the README's two commands are what CI and the Makefile run, and
the license pyproject.toml names is the text in LICENSE. Their shell commands: tests/test_docs_commands.py."""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from server_util import ServerProcess

ROOT = Path(__file__).resolve().parents[1]
KEY = "readme-key-0123456789"
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# Put this line right before a ```python block that cannot run as written (say why after the colon).
NOT_RUN = "<!-- not run:"


def _rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def _snippets() -> list[tuple[str, str, str]]:
    """(page, the heading it is under, code) of every ```python block of the README and docs/*.md."""
    out = []
    for page in PAGES:
        section, before = "", ""
        for part in re.split(r"(^#{1,3} [^\n]*$|^```python\n.*?^```$)", page.read_text(), flags=re.M | re.S):
            if re.match(r"#{1,3} ", part):
                section = part.lstrip("#").strip()
            elif part.startswith("```python"):
                if not before.rstrip().endswith("-->") or NOT_RUN not in before.rstrip().rsplit("\n", 1)[-1]:
                    out.append((_rel(page), section, part[len("```python\n"):-3]))
            before = part
    return out


SNIPPETS = _snippets()


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    """The service, as `make run` starts it, with an API key: the remote stores' URL and key come from the
    variables the README names."""
    root = tmp_path_factory.mktemp("readme-service")
    srv = ServerProcess(root / "data", root / "server.log", "--no-demo", env={"FUSIONRAG_API_KEYS": KEY})
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()


def test_the_readme_has_its_snippets():
    readme = {s for p, s, _ in SNIPPETS if p == "README.md"}
    assert {"With the Python client", "With LangChain", "With LlamaIndex"} <= readme, readme
    docs = {(p, s) for p, s, _ in SNIPPETS if p != "README.md"}
    assert {("docs/api.md", "Python client"), ("docs/engine.md", "From Python"),
            ("docs/collections.md", "Hybrid search"), ("docs/integrations.md", "One GPU for both")} <= docs, docs


@pytest.mark.parametrize("page, section, code", SNIPPETS,
                         ids=[f"{i}-{p}-{s}" for i, (p, s, _) in enumerate(SNIPPETS)])
def test_snippet_runs_as_written(page, section, code, service, tmp_path):
    env = {**os.environ, "FUSIONRAG_URL": service.url, "FUSIONRAG_API_KEY": KEY}
    run = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, f"{page}, {section}: snippet failed:\n{code}\n{run.stderr[-4000:]}"
    # The LangChain snippet's remote store wrote to the service, and recorded the model it embeds with.
    if "FUSIONRAG_URL" in code and "FusionRAGVectorStore" in code:
        headers = {"Authorization": f"Bearer {KEY}"}
        with service.client(headers=headers) as c:
            info = c.get("/v1/collections/docs").json()
            assert info["embedding"] == "all-MiniLM-L6-v2" and info["count"] == 3, info
            r = c.post("/v1/collections/docs/search", json={"texts": ["what happens to deleted documents?"], "k": 1})
            assert r.json()["results"][0][0]["id"] == "tombstones", r.text
            assert c.delete("/v1/collections/docs").status_code == 200


# -- links ------------------------------------------------------------------------------------------------------

def _prose(text: str) -> str:
    """The text without its fenced code blocks and inline code, where a link is not a link."""
    text = re.sub(r"^(```|~~~).*?^\1[^\n]*$", "", text, flags=re.M | re.S)
    return re.sub(r"(`+)(?:(?!\1).)+?\1", "", text, flags=re.S)


def github_slug(heading: str) -> str:
    """The anchor GitHub gives a heading: its text as rendered (no markup), lower case, punctuation other than
    '-' and '_' dropped, each space a '-'."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link: its text
    text = re.sub(r"<[^>]+>", "", text).replace("`", "").replace("*", "")
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    out, seen = set(), {}
    for line in re.sub(r"^(```|~~~).*?^\1[^\n]*$", "", page.read_text(), flags=re.M | re.S).splitlines():
        m = re.match(r"#{1,6} +(.*?)\s*#*\s*$", line)
        if m:
            slug = github_slug(m.group(1))
            n = seen.get(slug, 0)
            seen[slug] = n + 1
            out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def _links(page: Path) -> list[str]:
    return [m.group(1) for m in re.finditer(r"\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)", _prose(page.read_text()))]


def _ignored(path: Path) -> bool:
    """Whether git ignores the path: a clean clone would not have it."""
    try:
        run = subprocess.run(["git", "-C", str(ROOT), "check-ignore", "-q", str(path)], capture_output=True)
    except FileNotFoundError:
        return False
    return run.returncode == 0


@pytest.mark.parametrize("page", PAGES, ids=[_rel(p) for p in PAGES])
def test_every_relative_link_resolves_inside_the_repository(page):
    bad = []
    for target in _links(page):
        if re.match(r"[a-z][a-z0-9+.-]*:", target, re.I):  # http:, https:, mailto:
            continue
        path_part, _, anchor = target.partition("#")
        dest = (page.parent / path_part).resolve() if path_part else page
        if not dest.is_relative_to(ROOT):
            bad.append(f"{target}: outside the repository")
        elif not dest.exists():
            bad.append(f"{target}: no such file")
        elif _ignored(dest):
            bad.append(f"{target}: ignored by git, so not in a clone")
        elif anchor and (dest.suffix != ".md" or anchor not in anchors(dest)):
            bad.append(f"{target}: no heading #{anchor} in {_rel(dest)}")
    assert not bad, f"{_rel(page)}: " + "; ".join(bad)


def test_the_link_checker_knows_githubs_slugs():
    assert github_slug("Sharded mode (Ray)") == "sharded-mode-ray"
    assert github_slug("8-bit graph centroids") == "8-bit-graph-centroids"
    assert github_slug("`--rerank`, the *knob*") == "--rerank-the-knob"
    assert github_slug("Retrieval beside an LLM on one GPU") == "retrieval-beside-an-llm-on-one-gpu"
    assert github_slug("[Tuning](docs/tuning.md) & more") == "tuning--more"
    assert "docs/design.md" in _links(ROOT / "README.md")


def test_no_page_links_outside_the_repository_or_to_the_old_design_page():
    for page in PAGES:
        text = page.read_text()
        assert "shared/DESIGN.md" not in text and "](/" not in text, _rel(page)


# -- the code map -----------------------------------------------------------------------------------------------

def _map_rows() -> list[tuple[str, str, list[str]]]:
    """(row, file, names) for each file a row of a code table of docs/design.md links, with the names that
    follow the link in the row's last cell."""
    text = (ROOT / "docs" / "design.md").read_text()
    section = text.split("## Where the code lives", 1)[1].split("\n## ", 1)[0]
    out = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if not line.startswith("|") or len(cells) < 2 or cells[0] in ("step", "part", "folder") or set(cells[0]) <= {"-"}:
            continue
        for m in re.finditer(r"\[`([^`]+)`\]\(\.\./([^)]+)\)((?:\s*`[^`]+`)*)", cells[-1]):
            out.append((cells[0], m.group(2), re.findall(r"`([^`]+)`", m.group(3))))
    return out


def test_the_code_map_names_what_its_files_hold():
    rows = _map_rows()
    assert len(rows) > 40, rows
    missing = []
    for row, path, names in rows:
        file = ROOT / path
        if not file.is_file():
            if not file.is_dir():
                missing.append(f"{row}: {path} does not exist")
            continue
        text = file.read_text()
        for name in names:
            for part in re.split(r"\.|::", name):
                if not re.search(rf"(?<![\w]){re.escape(part)}(?![\w])", text):
                    missing.append(f"{row}: {path} has no {part!r} (of {name!r})")
    assert not missing, "docs/design.md's code map is out of date:\n" + "\n".join(missing)


# -- the two commands -------------------------------------------------------------------------------------------

def test_the_two_commands_are_what_the_makefile_and_ci_run():
    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"^```sh\n(.*?)^```$", readme, flags=re.M | re.S)
    assert "make run\n" in blocks and "make test\n" in blocks, blocks
    assert readme.index("make run") < readme.index("## Index your own documents"), "the two commands come first"
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^run:", makefile, re.M) and re.search(r"^test:", makefile, re.M)
    assert re.search(r"^make test$", (ROOT / ".ci" / "run").read_text(), re.M)


def test_every_service_flag_is_in_the_api_page():
    from fusionrag.cli import build_parser

    commands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    serve = commands.choices["serve"]
    flags = {o for a in serve._actions for o in a.option_strings if o.startswith("--") and o != "--help"}
    api = (ROOT / "docs" / "api.md").read_text()
    assert flags and not [f for f in sorted(flags) if f"`{f}`" not in api], \
        [f for f in sorted(flags) if f"`{f}`" not in api]


# -- the license ------------------------------------------------------------------------------------------------

def test_license_is_the_apache_2_text_pyproject_names():
    assert re.search(r'^license = "Apache-2.0"$', (ROOT / "pyproject.toml").read_text(), re.M)
    # apache.org's LICENSE-2.0.txt, byte for byte.
    digest = hashlib.sha256((ROOT / "LICENSE").read_bytes()).hexdigest()
    assert digest == "cfc7749b96f63bd31c3c42b5c471bf756814053e847c10f3eb003417bc523d30"


def test_service_answers_on_the_url_it_was_given(service):
    # The fixture is the service the snippets reach: it is up, and it wants the key.
    assert httpx.get(service.url + "/v1/collections").status_code == 401
