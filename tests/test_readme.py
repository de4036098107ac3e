"""The README holds: each of its Python snippets runs as written (in a fresh directory, against a real service where
it says it talks to one), and the license pyproject.toml names is the text in LICENSE."""

from __future__ import annotations

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


def _snippets() -> list[tuple[str, str]]:
    """(the README section it is in, code) of every ```python block."""
    out, section = [], ""
    for part in re.split(r"(^## [^\n]*$|^```python\n.*?^```$)", (ROOT / "README.md").read_text(), flags=re.M | re.S):
        if part.startswith("## "):
            section = part[3:].strip()
        elif part.startswith("```python"):
            out.append((section, part[len("```python\n"):-3]))
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
    sections = [s for s, _ in SNIPPETS]
    assert len(SNIPPETS) >= 5 and {"Python", "Integrations", "Collections"} <= set(sections), sections


@pytest.mark.parametrize("section, code", SNIPPETS, ids=[f"{i}-{s}" for i, (s, _) in enumerate(SNIPPETS)])
def test_snippet_runs_as_written(section, code, service, tmp_path):
    env = {**os.environ, "FUSIONRAG_URL": service.url, "FUSIONRAG_API_KEY": KEY}
    run = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, f"{section} snippet failed:\n{code}\n{run.stderr[-4000:]}"
    # The LangChain snippet's remote store wrote to the service, and recorded the model it embeds with.
    if "FUSIONRAG_URL" in code and "FusionRAGVectorStore" in code:
        headers = {"Authorization": f"Bearer {KEY}"}
        with service.client(headers=headers) as c:
            info = c.get("/v1/collections/docs").json()
            assert info["embedding"] == "all-MiniLM-L6-v2" and info["count"] == 3, info
            r = c.post("/v1/collections/docs/search", json={"texts": ["what happens to deleted documents?"], "k": 1})
            assert r.json()["results"][0][0]["id"] == "tombstones", r.text
            assert c.delete("/v1/collections/docs").status_code == 200


def test_license_is_the_apache_2_text_pyproject_names():
    assert re.search(r'^license = "Apache-2.0"$', (ROOT / "pyproject.toml").read_text(), re.M)
    # apache.org's LICENSE-2.0.txt, byte for byte.
    digest = hashlib.sha256((ROOT / "LICENSE").read_bytes()).hexdigest()
    assert digest == "cfc7749b96f63bd31c3c42b5c471bf756814053e847c10f3eb003417bc523d30"


def test_service_answers_on_the_url_it_was_given(service):
    # The fixture is the service the snippets reach: it is up, and it wants the key.
    assert httpx.get(service.url + "/v1/collections").status_code == 401
