"""A collection's writes (Collection's part, #69): upsert, delete, delete_where, set_metadata and clear, checked
and committed to the collection's local store (store.py: logged, group-committed and applied to the doc store,
the fresh tier and the tombstones; an entry that cannot be applied set aside).
"""

from __future__ import annotations

import json
from typing import Mapping, Sequence

from fusionrag.retriever.collection.config import FRESH_HOLD
from fusionrag.retriever.collection.contract import in_use
from fusionrag.retriever.collection.filters import compile_filter
from fusionrag.retriever.collection.records import Document, StoreRecord, metadata_record, upsert_record
from fusionrag.retriever.collection.values import check_ids
from fusionrag.retriever.errors import ConflictError, UnavailableError


class WriteOps:
    """Collection's write operations: a part of Collection (api.py), whose state they use."""

    # -- the write path ------------------------------------------------------------------------
    @in_use
    def upsert(self, docs: Sequence[Document]) -> list[str]:
        """Insert or replace documents; durable when it returns. Ids in input order."""
        w, ids = upsert_record(docs, self.dim, self.metric)
        if w.ids:
            self._commit(w)
        return ids

    add = upsert

    @in_use
    def delete(self, ids: Sequence[str]) -> int:
        ids = check_ids(ids, "delete")
        return self._commit(StoreRecord("delete", ids)) if ids else 0

    @in_use
    def delete_where(self, filter: dict) -> int:
        """Delete every document the filter passes, as one write: the filter is logged and evaluated when the
        write is applied, in the same transaction, so it sees every write logged before it and none after."""
        compile_filter(filter)  # a bad filter is refused before it is logged
        return self._commit(StoreRecord("delete_where", filter=json.dumps(filter, separators=(",", ":"), allow_nan=False)))

    @in_use
    def set_metadata(self, updates: Mapping[str, dict], merge: bool = True) -> int:
        """Change documents' metadata alone, as Qdrant's set_payload and Chroma's update do: their text, vector and
        place in the index stay (nothing is re-indexed). updates maps an id to its metadata: with merge, an RFC
        7386 merge patch over the stored metadata (a key given None is removed; objects merge key by key), else
        the whole new metadata. One durable write; unknown ids are skipped; returns how many were updated."""
        w = metadata_record(updates, merge)
        return self._commit(w) if w.ids else 0

    @in_use
    def clear(self) -> None:
        self._commit(StoreRecord("clear"))

    def _commit(self, w: StoreRecord) -> int:
        result = self._local.commit(w)
        self._maybe_merge()
        return result

    def _admit(self, w: StoreRecord) -> None:
        """What refuses a write before it is logged (the store calls it under its log lock)."""
        if self._imports.active:
            raise ConflictError(f"collection {self.name!r} is importing documents: write once the import is "
                                "done (its progress is in the collection's info)")
        fresh = self._local.live_set.fresh
        if w.op == "upsert" and self._merging and fresh.bytes >= FRESH_HOLD * self._fresh_limit():
            # The fresh tier holds its vectors in RAM until the merge running now and the next fold them in:
            # past this it would grow with the write rate for as long as the merge takes. A 503: the caller
            # sends it again (the client does not resend writes itself).
            raise UnavailableError(f"collection {self.name!r} holds {fresh.bytes >> 20} MiB of writes in "
                                   "memory while a merge runs: retry once it is done")
