"""One import lifecycle for a collection and a sharded collection in a data directory (#69 item 2: each had its
own copy of it): importer.ImportState, read back from the state file it writes, and both kinds of collection
claiming, refusing a second claim and releasing alike."""

from __future__ import annotations

import pytest

from fusionrag.retriever.collection import importer
from fusionrag.retriever.directory import catalog
from fusionrag.retriever.errors import ConflictError


def test_the_lifecycle_and_its_state_on_disk(tmp_path):
    s = importer.ImportState(tmp_path, "collection 'c'")
    s.load(lambda: "never asked")
    assert s.now is None and not s.active
    with pytest.raises(ConflictError, match="the import's claim was lost"):
        s.start(claimed=True)
    s.start(claimed=False)
    assert importer.read_state(tmp_path)["state"] == "running" and s.active
    s.failed("bad line 3")
    assert importer.read_state(tmp_path) == {**s.now, "state": "failed", "reason": "bad line 3"}
    s.claim()
    with pytest.raises(ConflictError, match=r"collection 'c' is already importing documents \(its progress"):
        s.claim()
    s.release()  # the upload was refused: the state before the claim, on disk too
    assert s.now["state"] == "failed" and importer.read_state(tmp_path)["state"] == "failed"
    s.claim()
    started = s.now["started"]
    s.start(claimed=True)
    assert s.now == {"state": "running", "started": started}
    again = importer.ImportState(tmp_path, "collection 'c'")  # the process stopped during it
    again.load(lambda: "stopped")
    assert again.now == {"state": "interrupted", "started": started, "reason": "stopped"} and not again.active
    assert importer.read_state(tmp_path)["state"] == "interrupted"
    again.done({"documents": 3})
    assert importer.read_state(tmp_path) == {"state": "done", "started": started, "reason": "stopped",
                                             "documents": 3}


@pytest.mark.parametrize("shards", [None, 2])
def test_a_collection_and_a_sharded_one_claim_refuse_and_release_alike(tmp_path, shards):
    cat = catalog(tmp_path / "data")
    try:
        col = cat.create("c", 4, "l2", **({"shards": shards} if shards else {}))
        what = "sharded collection 'c'" if shards else "collection 'c'"
        col.claim_import()
        assert col.info()["build_state"]["import"]["state"] == "uploading"
        with pytest.raises(ConflictError, match=rf"^{what} is already importing documents \(its progress"):
            col.claim_import()
        with pytest.raises(ConflictError, match=rf"^{what} is already importing documents \(its progress"):
            col.import_files(tmp_path / "none.jsonl")  # not claimed by this call: refused, the claim kept
        assert col.info()["build_state"]["import"]["state"] == "uploading"
        col.release_import()
        assert col.info()["build_state"]["import"] is None
        assert importer.read_state(col.path) is None
    finally:
        cat.close()
