"""How collections behave: their names, formats, and the knobs of merging, filtering and hybrid search."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Annotated, Sequence

import numpy as np

from fusionrag.retriever.engine.config import BuildConfig, ConfigBase, config_class, knob
from fusionrag.retriever.collection.values import check_text
from fusionrag.retriever.errors import InputError
from fusionrag.types import DEFAULT_TEXT_WEIGHT  # noqa: F401 (named here as ever)

NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
MAX_ID_CHARS = 512
COLLECTION_FORMAT = 1
CURRENT_FORMAT = 2  # 2: CURRENT holds the digest of its generation's rows.npy
MERGE_RETRY_S = 30  # a failed background merge (a full disk, say) waits this long to retry
# The fresh tier's vectors are in RAM: a merge starts at merge_fresh_bytes or a sixteenth of what the process may
# use, whichever is less, and while one runs, upserts are refused (503) past FRESH_HOLD times that: the merge holds a
# copy of the fresh vectors it folds in, so the fresh vectors take at most about three sixteenths of the limit.
FRESH_SHARE = 16
FRESH_HOLD = 2
SEARCH_MODES = ("vector", "text", "hybrid")
# A collection's text analyzer (docstore.py): Porter stemming or none (the FTS5 tokenizer, fixed at create), and
# Lucene's English stop words left out of queries or none; the defaults are for English.
STEMMINGS = ("porter", "none")
STOP_WORD_LISTS = ("english", "none")
DEFAULT_ANALYZER = {"stemming": "porter", "stop_words": "english"}


def check_analyzer(analyzer) -> dict:
    """A collection's text analyzer, its defaults filled in: {"stemming", "stop_words"}; InputError otherwise."""
    if analyzer is None:
        return dict(DEFAULT_ANALYZER)
    if not isinstance(analyzer, dict) or set(analyzer) - set(DEFAULT_ANALYZER):
        raise InputError('the text analyzer must be {"stemming": "porter" | "none", "stop_words": "english" | "none"}')
    out = {**DEFAULT_ANALYZER, **analyzer}
    if out["stemming"] not in STEMMINGS:
        raise InputError(f"stemming must be one of {STEMMINGS}, got {out['stemming']!r}")
    if out["stop_words"] not in STOP_WORD_LISTS:
        raise InputError(f"stop_words must be one of {STOP_WORD_LISTS}, got {out['stop_words']!r}")
    return out
# Hybrid search: each ranking is taken this deep (or k) before fusion, and fused by reciprocal rank
# with the usual constant (Cormack et al., 2009); the text ranking's weight by default (DEFAULT_TEXT_WEIGHT, in
# fusionrag.types, which the client shares). Chosen on half of a labelled question set of the Python docs'
# headings (bench/service/hybrid.py).
HYBRID_DEPTH = 20
RRF_K = 60
FUSIONS = ("rrf", "weighted")
# A query phrased as a question (QUESTION_RE: it ends with "?" or starts with an interrogative or an auxiliary verb,
# "How do I ...", "Why does ...", "What is ...") is fused with this share of the text weight (0.05 of 0.5), and its
# text ranking is made from its words less the words of questions (QUESTION_WORDS): BM25 otherwise ranks first the
# passages that share "how", "do", "I" with it (an FAQ's own questions), and on questions the vectors are far the
# better ranking, the text one a tie-break among their first few. Chosen on 127 labelled questions over the Python
# docs, reported on 75 others (bench/service/hybrid_natural.py, docs/collections.md); 1 turns the rule off.
QUESTION_SHARE = 0.1
QUESTION_WORDS = frozenset(
    "how what why when where which who whom whose do does did doing done i me my we our you your can could should "
    "would may might must shall have has had having get gets got use using used way ways am been being "
    "about from any some".split())
QUESTION_RE = re.compile(r"^\W*(how|what|why|when|where|which|who|whom|whose|is|are|was|were|do|does|did|can|could|"
                         r"should|would|will|may|might|must|shall|has|have)\b|\?\W*$", re.IGNORECASE)
_WORD = re.compile(r"\w+")


def is_question(text: str) -> bool:
    """Whether a query is phrased as a question (QUESTION_RE)."""
    return QUESTION_RE.search(text) is not None


def question_text(text: str) -> str:
    """The words of a question that its text ranking is made of: its words less QUESTION_WORDS, lower-cased, in
    order (the question itself if none is left)."""
    words = [w for w in _WORD.findall(text.lower()) if w not in QUESTION_WORDS]
    return " ".join(words) or text


@dataclass(frozen=True)
class Fusion:
    """How hybrid search fuses its two rankings. 'rrf': reciprocal rank, a document scoring (1 - w) / (k + its
    vector rank) + w / (k + its text rank); 'weighted': each ranking's scores min-max normalised to [0, 1] over
    the query's own ranking (the best 1, the worst 0; distances and bm25 alike, lower being better), then
    (1 - w) x vector + w x text; w = text_weight, a ranking a document is not in adding nothing. A query phrased
    as a question (is_question) is fused with w = text_weight x question_share, its text ranking made without the
    words of questions (question_text); question_share 1: as any other query. Hashable, so that requests asking
    the same can share a batch."""

    method: str = "rrf"
    k: int = RRF_K
    question_share: float = QUESTION_SHARE

    def __post_init__(self):
        if self.method not in FUSIONS:
            raise InputError(f"fusion method must be one of {FUSIONS}, got {self.method!r}")
        if isinstance(self.k, bool) or not isinstance(self.k, (int, np.integer)) or not 1 <= self.k <= 10_000:
            raise InputError(f"fusion k must be an integer from 1 to 10000, got {self.k!r}")
        share = self.question_share
        if isinstance(share, bool) or not isinstance(share, (int, float, np.integer, np.floating)) \
                or not 0 <= share <= 1:
            raise InputError(f"fusion question_share must be a number in [0, 1], got {share!r}")

    @classmethod
    def of(cls, given) -> "Fusion":
        """A Fusion, a dict of its fields ({"method", "k", "question_share"}), or None (the default)."""
        if given is None:
            return cls()
        if isinstance(given, cls):
            return given
        if not isinstance(given, dict) or set(given) - {"method", "k", "question_share"}:
            raise InputError('fusion must be {"method": "rrf" | "weighted", "k": ..., "question_share": ...}')
        return cls(**given)

    def query(self, text: str, text_weight: float) -> tuple[str, float]:
        """What one query's text ranking is made of and the text weight it is fused with: the query and
        text_weight, or for a query phrased as a question (unless question_share is 1) its words less the words
        of questions and text_weight x question_share."""
        if self.question_share < 1 and is_question(text):
            return question_text(text), text_weight * float(self.question_share)
        return text, text_weight


def check_search(k, mode: str, texts, vectors, text_weight) -> int:
    """What a search's arguments must be in any collection, single-machine or sharded: k a positive integer,
    a known mode; for 'text' and 'hybrid' texts as a non-empty list of strings and text_weight in [0, 1]; for
    'text' no query vectors. Returns k as an int; InputError says what is wrong."""
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1:
        raise InputError(f"k must be a positive integer, got {k!r}")
    if mode not in SEARCH_MODES:
        raise InputError(f"mode must be one of {SEARCH_MODES}, got {mode!r}")
    if mode == "text" and vectors is not None:
        raise InputError("mode 'text' searches by texts alone: give no query vectors")
    if mode != "vector":
        if isinstance(texts, str) or not isinstance(texts, Sequence) or not texts \
                or not all(isinstance(t, str) for t in texts):
            raise InputError(f"mode {mode!r} needs texts: a non-empty list of strings")
        for i, t in enumerate(texts):
            check_text(t, f"texts[{i}]")
        if isinstance(text_weight, bool) or not isinstance(text_weight, (int, float)) or not 0 <= text_weight <= 1:
            raise InputError(f"text_weight must be a number in [0, 1], got {text_weight!r}")
    return int(k)


@config_class
class CollectionConfig(ConfigBase):
    """How collections fold writes into their main index and answer filtered searches."""

    # A merge starts in the background once the fresh tier holds this many vectors or bytes.
    merge_fresh_count: Annotated[int, knob("a merge starts once the fresh tier holds this many vectors",
                                           ge=1)] = 20000
    merge_fresh_bytes: Annotated[int, knob("a merge starts once the fresh tier (vectors, tombstones or log) "
                                           "holds this many bytes", ge=1)] = 256 << 20
    background_merge: Annotated[bool, knob("merge in a background thread")] = True
    min_index_count: Annotated[int, knob("fewer live documents than this stay in the (exact) fresh tier, "
                                         "without an index", ge=1)] = 1000
    filter_exact_max: Annotated[int, knob("a filter that at most this many documents pass is answered by exact "
                                          "search over them", ge=0)] = 20000
    # Merges fold writes into the current index (merge.py) rather than rebuilding it, until the
    # index has grown this many times over its last full build (its clusters and PQ codebooks
    # were trained on that) or until less than this fraction of its SSD slots hold live vectors.
    incremental_merge: Annotated[bool, knob("merges fold writes into the current index rather than rebuild "
                                            "it")] = True
    rebuild_growth: Annotated[float, knob("rebuild once the index has grown this many times past its last full "
                                          "build", ge=1)] = 4.0
    rebuild_live_fraction: Annotated[float, knob("rebuild once less than this fraction of the SSD slots hold live "
                                                 "vectors", ge=0, lt=1)] = 0.5
    # Under a memory limit a merge may have no room for the graph's second copy a split needs (merge.SPLIT_ROOM): its
    # oversized lists stay whole, slower to scan. Once they hold this share of the postings, the next merge rebuilds
    # (within the same budget) rather than grow the index further.
    rebuild_unsplit_share: Annotated[float, knob("rebuild once posting lists a merge could not split (no room under "
                                                 "the memory limit) hold this share of the postings", gt=0, le=1)] = 0.05
    build: Annotated[BuildConfig, knob("how the collection's index is built", flag=False)] = \
        field(default_factory=BuildConfig)

    # -- the rules a local store follows, a collection's or a shard's (#69: one rule, where each had its own) -----

    def merge_due(self, fresh: int, tombstones: int) -> bool:
        """Whether a collection's writes call for a merge, by count: its fresh tier or its tombstones hold
        merge_fresh_count rows (deletes alone call for one: tombstones cost scan time and the log grows). A
        collection also merges on bytes (its fresh tier's and its log's: MergeOps._merge_due)."""
        return fresh >= self.merge_fresh_count or tombstones >= self.merge_fresh_count

    def shard_merge(self, fresh: int, tombstones: int, shards: int) -> int | None:
        """A sharded collection's merge, by the same rule over all its shards (fresh: its fresh documents, each
        once; tombstones: its indexed documents deleted or replaced): None while none is due, else the share of
        merge_fresh_count from which a shard folds its rows in (each shard holds about a share of them), whether
        the service holds it in its data directory (sharded/hosted.py) or on Ray (server/ray_serve.py)."""
        if not self.merge_due(fresh, tombstones):
            return None
        return max(1, self.merge_fresh_count // shards)

    def filter_exact(self, passing: int) -> bool:
        """Whether a filter that `passing` of a store's documents pass is answered by exact search over them
        (a collection's documents, or one shard's: each shard decides for its own)."""
        return passing <= self.filter_exact_max
