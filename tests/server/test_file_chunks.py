"""A vector store's file chunked as a stream (server/file_chunks.py, #66 finding 4): the chunks, step by step from
marks, are those the previous algorithm cut from the whole text at once (kept here as the reference), for texts
that cross every boundary a step has (pieces, the blocks read, multi-byte characters, a BOM, long runs without a
space); its tokens counted step by step are the chunks' tokens; and chunking a large file takes a batch's memory,
not the file's (tracemalloc's peak, against the previous algorithm's on the same file)."""

from __future__ import annotations

import re
import tracemalloc

import pytest

from fusionrag.server import file_chunks
from fusionrag.server.file_chunks import BadText, Chunker, Mark, chunk_count, count_tokens, next_chunks

_WORDS = re.compile(r"\w+|[^\w\s]")


def words(text: str) -> list[tuple[int, int]]:
    return [m.span() for m in _WORDS.finditer(text)]


def reference_chunks(text: str, spans, size: int, overlap: int, piece: int) -> tuple[list[str], int]:
    """The chunks and tokens of server/vector_stores.py's chunk_text before #66 (the whole text at once)."""
    starts: list[int] = []
    ends: list[int] = []
    pos = 0
    while pos < len(text):  # tokenized a piece at a time, each cut at whitespace
        stop = len(text) if len(text) - pos <= piece else pos + piece
        if stop < len(text):
            ws = max(text.rfind(" ", pos, stop), text.rfind("\n", pos, stop))
            stop = ws + 1 if ws > pos else stop
        for a, b in spans(text[pos:stop]):
            if b > a:
                starts.append(pos + a)
                ends.append(pos + b)
        pos = stop
    out = []
    step = max(1, size - overlap)
    for i in range(0, len(starts), step):
        j = min(len(starts), i + size)
        out.append(text[starts[i]:ends[j - 1]])
        if j == len(starts):
            break
    return out, len(starts)


def streamed(path, spans, size: int, overlap: int, batch: int, max_chars: int = 1 << 20,
             keep: int = 0) -> tuple[list[str], int]:
    """The file's chunks, a step at a time, and the steps taken: each step from the mark the one before gave
    (keep=0), or from the Chunker the one before left, made again from its mark every `keep`-th step."""
    mark, out, steps, chunker = Mark(), [], 0, None
    while True:
        if keep:
            if chunker is None or steps % keep == 0:
                chunker = Chunker(path, chunker.mark if chunker else Mark(), len(out), spans, size, overlap)
            got, ended = chunker.step(batch, max_chars), chunker.done
        else:
            got, mark, ended = next_chunks(path, mark, len(out), spans, size, overlap, batch, max_chars)
        out += got
        steps += 1
        assert steps < 100_000
        if ended:
            return out, steps


def counted(path, spans, limit: int = 10 ** 12, max_chars: int = 1 << 20) -> int:
    mark = Mark()
    while True:
        mark, ended = count_tokens(path, mark, spans, limit, max_chars)
        if ended:
            return mark.tokens


SAMPLE = ("The planets of the solar system orbit the sun. Jupiter is the largest planet, a gas giant!\n\n"
          "Größe, naïve café — 東京は日本の首都です。 Emoji 🙂🚀 and tabs\tand  double  spaces.\n")


@pytest.mark.parametrize("text", [
    SAMPLE * 40,
    "\ufeff" + SAMPLE * 25,  # a BOM: left out, as utf-8-sig did
    "x" * 700 + " " + SAMPLE * 10,  # a run longer than a piece, without a space
    " " * 900 + SAMPLE * 3 + "\n" * 900 + SAMPLE + " " * 500,  # long stretches of spaces
    "one",
    "",
    "   \n\n  ",
    "東京" * 400,  # multi-byte characters and no space at all
])
@pytest.mark.parametrize("size,overlap,batch", [(5, 2, 3), (7, 0, 1), (6, 3, 64), (4, 2, 2)])
def test_streamed_chunks_are_the_whole_texts(tmp_path, monkeypatch, text, size, overlap, batch):
    monkeypatch.setattr(file_chunks, "PIECE", 37)
    monkeypatch.setattr(file_chunks, "BLOCK", 13)  # blocks that end inside a character
    path = tmp_path / "f.txt"
    path.write_bytes(text.encode())
    want, tokens = reference_chunks(text.removeprefix("\ufeff"), words, size, overlap, 37)
    got, steps = streamed(path, words, size, overlap, batch, max_chars=50)
    assert got == want
    for keep in (1 << 30, 3):  # one Chunker throughout; made again every third step
        assert streamed(path, words, size, overlap, batch, max_chars=50, keep=keep)[0] == want
    assert chunk_count(tokens, size, overlap) == len(want)
    assert counted(path, words, max_chars=50) == tokens
    if len(want) > batch:
        assert steps > 1  # resumed from marks, not read at once


def test_streamed_chunks_by_the_models_tokens(tmp_path):
    """With the service's model and the real piece size: the same chunks as the whole text cut at once."""
    from fusionrag.retriever.collection.embedding import get_embedder

    spans = get_embedder("all-MiniLM-L6-v2").token_spans
    text = "\ufeff" + "".join(f"{SAMPLE}({i}) " for i in range(1200))  # ~200 KB: four pieces
    path = tmp_path / "f.txt"
    path.write_bytes(text.encode())
    for size, overlap in ((100, 40), (254, 127)):
        want, tokens = reference_chunks(text[1:], spans, size, overlap, file_chunks.PIECE)
        got, steps = streamed(path, spans, size, overlap, 64, keep=1 << 30)
        assert got == want and steps == -(-len(want) // 64) + (len(want) % 64 == 0)
        assert streamed(path, spans, size, overlap, 64, keep=5)[0] == want
        assert counted(path, spans) == tokens and chunk_count(tokens, size, overlap) == len(want)


def test_count_stops_past_the_limit_and_refuses_what_is_not_text(tmp_path):
    path = tmp_path / "f.txt"
    path.write_bytes(b"word " * 100_000)
    mark, ended = count_tokens(path, Mark(), words, 1000, 1 << 30)
    assert ended and 1000 < mark.tokens <= 1000 + file_chunks.PIECE  # stopped a piece past the limit
    path.write_bytes("é".encode() * 1000 + b"\xff" + b"a" * 10)
    with pytest.raises(BadText, match=r"not UTF-8 text \(byte 2000\)") as e:
        counted(path, words)
    assert e.value.code == "unsupported_file"
    path.write_bytes(b"abc \x00 def")
    with pytest.raises(BadText, match="NUL"):
        counted(path, words)
    path.write_bytes("é".encode()[:1])  # cut inside a character
    with pytest.raises(BadText, match=r"byte 0"):
        counted(path, words)


def _peak(fn) -> int:
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
        fn()
        return tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()


def test_chunking_a_large_file_takes_a_batchs_memory(tmp_path):
    """Counted and chunked a step at a time, a file takes at most a few MiB of Python memory at its peak (the
    chunks of a batch, a piece's tokens), and no more for a file five times larger; the previous algorithm took
    about 24 times the file (its tokens as Python lists of ints, every chunk at once)."""
    unit = "".join(f"{SAMPLE}({i}) " for i in range(200))
    size, overlap = 100, 40

    def peak_of(mib: float):
        path = tmp_path / f"{mib}.txt"
        path.write_bytes((unit * int(mib * 2 ** 20 / len(unit.encode()))).encode())

        def steps():
            mark, ended = Mark(), False
            while not ended:
                mark, ended = count_tokens(path, mark, words, 10 ** 12, 1 << 20)
            chunker, chunks = Chunker(path, Mark(), 0, words, size, overlap), 0
            while not chunker.done:
                chunks += len(chunker.step(64))
            assert chunks == chunk_count(mark.tokens, size, overlap) > 1000
        return path, _peak(steps)

    small_path, small = peak_of(0.5)
    _, large = peak_of(2.5)
    assert large < 6 * 2 ** 20 and large < small + 2 ** 19, (small, large)
    whole = _peak(lambda: reference_chunks(small_path.read_text(), words, size, overlap, 50_000))
    assert whole > 3 * large, (whole, large)


def test_turns_go_round_by_owner_a_step_each():
    from fusionrag.server.vector_stores import FileJob, OwnerTurns

    turns = OwnerTurns()
    steps = {"a1": 3, "a2": 1, "b1": 1, "c1": 2}  # a has two files, the first of three steps
    for name in steps:
        turns.put(FileJob("vs", name, name[0], {}))
    order = []
    while steps:
        job = turns.take()
        order.append(job.fid)
        steps[job.fid] -= 1
        if not steps[job.fid]:
            del steps[job.fid]
        if job.fid == "b1":  # b adds a file while its first one runs: it waits for b's turn
            turns.put(FileJob("vs", "b2", "b", {}))
            steps["b2"] = 1
        turns.back(job, job.fid not in steps)
    assert order == ["a1", "b1", "c1", "a1", "b2", "c1", "a1", "a2"]
    turns.close()
    assert turns.take() is None
