"""A vector store's file chunked between words (server/file_chunks.py, whole_words; #67 item 3): every chunk
starts and ends between two words (a word longer than a chunk alone is cut), has at most `size` tokens and some;
two chunks in a row overlap by about `overlap` tokens and leave at most whitespace between them, so the chunks
less their overlaps give the text back; and streamed step by step from marks (pieces, blocks and steps cut
anywhere, a Chunker made again from its mark) they are the chunks of the whole text cut at once."""

from __future__ import annotations

import bisect
import gzip
import json
import re
import unicodedata
from pathlib import Path

import pytest

from fusionrag.server import file_chunks
from fusionrag.server.file_chunks import Chunker, Mark, next_chunks

_PIECES = re.compile(r"\w{1,3}|[^\w\s]")  # a model's tokens in miniature: a word cut every three characters
PARAGRAPHS = Path(__file__).resolve().parents[3] / "shared" / "data" / "python311-docs-paragraphs" / \
    "paragraphs.jsonl.gz"


def pieces3(text: str) -> list[tuple[int, int]]:
    return [m.span() for m in _PIECES.finditer(text)]


def in_word(c: str) -> bool:
    """Written here, not taken from the service: a letter, digit or '_' of a script that puts spaces between
    words, or a combining mark."""
    cjk = 0x3040 <= ord(c) <= 0x30FF or 0x3400 <= ord(c) <= 0x9FFF or 0xF900 <= ord(c) <= 0xFAFF or \
        0x20000 <= ord(c) <= 0x3134F
    return (c.isalnum() or c == "_" or unicodedata.category(c)[0] == "M") and not cjk


def between_words(text: str, at: int) -> bool:
    """Whether a cut at character `at` of the text falls between words."""
    return at <= 0 or at >= len(text) or not (in_word(text[at - 1]) and in_word(text[at]))


def tokens_of(text: str, spans, piece: int) -> list[tuple[int, int]]:
    """The text's tokens (those of a character or more), tokenized a piece at a time as file_chunks does (each
    piece cut after its last space or newline)."""
    out, pos = [], 0
    while pos < len(text):
        stop = len(text) if len(text) - pos <= piece else pos + piece
        if stop < len(text):
            ws = max(text.rfind(" ", pos, stop), text.rfind("\n", pos, stop))
            stop = ws + 1 if ws > pos else stop
        out += [(pos + a, pos + b) for a, b in spans(text[pos:stop]) if b > a]
        pos = stop
    return out


def reference(text: str, tok: list[tuple[int, int]], size: int, overlap: int) -> list[tuple[int, int]]:
    """Where the chunks of the whole text cut at once lie (their first and last characters, +1), as
    file_chunks' docstring says they are cut, from its tokens."""
    n = len(tok)

    def starts_word(t: int) -> bool:
        return t >= n or tok[t][0] > tok[t - 1][1] or (tok[t][0] == tok[t - 1][1] and between_words(text, tok[t][0]))

    step = max(1, size - overlap)
    out, s, i = [], 0, 0
    while n:
        if n - s <= size:
            out.append((tok[s][0], tok[n - 1][1]))
            return out
        words = [t for t in range(s + 1, n + 1) if starts_word(t)]
        e = max((t for t in words if t <= s + size), default=s + size)
        out.append((tok[s][0], tok[e - 1][1]))
        i += 1
        after = min(t for t in words if t > e)  # n at least
        if after - e > size:
            s = e
            continue
        low, w = max(s + 1, after - size), max(s + 1, min(i * step, e))
        back = [t for t in words if low <= t <= w]
        fore = [t for t in words if max(low, w + 1) <= t <= e]
        s = back[-1] if back else fore[0] if fore else max(w, low)
    return out


def streamed(path, spans, size: int, overlap: int, batch: int, max_chars: int, keep: int = 0) -> list[str]:
    """The file's chunks, a step at a time: each step from the mark the one before gave (keep=0), or from the
    Chunker the one before left, made again from its mark every `keep`-th step."""
    mark, out, steps, chunker = Mark(), [], 0, None
    while True:
        if keep:
            if chunker is None or steps % keep == 0:
                chunker = Chunker(path, chunker.mark if chunker else Mark(), len(out), spans, size, overlap,
                                  whole_words=True)
            got, ended = chunker.step(batch, max_chars), chunker.done
        else:
            got, mark, ended = next_chunks(path, mark, len(out), spans, size, overlap, batch, max_chars,
                                           whole_words=True)
        out += got
        steps += 1
        assert steps < 100_000
        if ended:
            return out


def placed(text: str, chunks: list[str]) -> list[tuple[int, int]]:
    """Where each chunk lies in the text: each one found from just after where the one before starts."""
    spans, at = [], 0
    for ch in chunks:
        p = text.find(ch, at)
        assert p >= 0, (ch[:60], at)
        spans.append((p, p + len(ch)))
        at = p + 1
    return spans


def check_chunks(text: str, where: list[tuple[int, int]], tokens, size: int, overlap: int) -> None:
    """Every property asked of chunks that lie at `where` in the text, checked from the text and the tokens
    alone."""
    if not text.strip():
        assert where == []
        return
    chunks = [text[a:b] for a, b in where]
    assert chunks and all(chunks)
    words = [m.span() for m in re.finditer(r"\S+", text)]
    starts, ends = [a for a, _ in tokens], [b for _, b in tokens]
    word_starts = [a for a, _ in words]

    def tokens_in(a: int, b: int) -> int:
        return max(0, bisect.bisect_right(ends, b) - bisect.bisect_left(starts, a))

    def word_at(at: int) -> tuple[int, int]:
        a, b = words[bisect.bisect_left(word_starts, at) - 1]
        assert a < at < b
        return a, b

    def words_over(a: int, b: int) -> list[tuple[int, int]]:
        return words[max(0, bisect.bisect_right(word_starts, a) - 1):bisect.bisect_left(word_starts, b)]

    for (a, b), ch in zip(where, chunks):
        assert 1 <= tokens_in(a, b) <= size, (ch[:60], tokens_in(a, b))
        assert text[a:b] == text[a:b].strip()
        for cut in (a, b):  # a cut inside a word only in one longer than a chunk
            if not between_words(text, cut):
                wa, wb = word_at(cut)
                assert tokens_in(wa, wb) > size, (text[wa:wb][:60], cut)
    # The whole text: the first chunk at its first token, the last one at its last, nothing but whitespace
    # between two chunks, and the chunks less their overlaps give it back.
    assert where[0][0] == len(text) - len(text.lstrip()) and where[-1][1] == len(text.rstrip())
    rebuilt = chunks[0]
    for (a, b), (c, d), ch in zip(where, where[1:], chunks[1:]):
        assert a < c and b < d
        if c >= b:
            assert not text[b:c].strip(), text[b:c]
            rebuilt += text[b:c] + ch
        else:
            rebuilt += ch[b - c:]
        if overlap and c < b:  # about the overlap asked: the tokens of a word or two more or less
            near = [tokens_in(wa, wb) for wa, wb in words_over(c, d)]
            assert abs(tokens_in(c, b) - overlap) <= 2 * max(near) + 1, (tokens_in(c, b), overlap, near)
    assert rebuilt == text.strip()


SAMPLE = ("The planets of the solar system orbit the sun. Jupiter is the largest planet, a gas giant!\n\n"
          "Größe, naïve café — 東京は日本の首都です。 Emoji 🙂🚀 and tabs\tand  double  spaces; "
          "antidisestablishmentarianism, floccinaucinihilipilification.\n")
TEXTS = [
    SAMPLE * 30,
    "\ufeff" + SAMPLE * 20,  # a BOM: left out
    "x" * 700 + " " + SAMPLE * 8,  # a word longer than a chunk (and than a piece): cut
    " " * 900 + SAMPLE * 3 + "\n" * 900 + SAMPLE + " " * 500,  # long stretches of spaces
    "one",
    "",
    "   \n\n  ",
    "東京" * 400,  # no space at all: a cut may come before any ideograph
    "word " * 3 + "y" * 40 + " tail",
]


@pytest.mark.parametrize("text", TEXTS, ids=range(len(TEXTS)))
@pytest.mark.parametrize("size,overlap,batch", [(5, 2, 3), (7, 0, 1), (6, 3, 64), (4, 2, 2), (12, 5, 4)])
def test_chunks_fall_between_words_and_stream_as_the_whole_text(tmp_path, monkeypatch, text, size, overlap,
                                                                 batch):
    monkeypatch.setattr(file_chunks, "PIECE", 37)
    monkeypatch.setattr(file_chunks, "BLOCK", 13)  # blocks that end inside a character
    path = tmp_path / "f.txt"
    path.write_bytes(text.encode())
    body = text.removeprefix("\ufeff")
    tokens = tokens_of(body, pieces3, 37)
    where = reference(body, tokens, size, overlap)
    check_chunks(body, where, tokens, size, overlap)
    want = [body[a:b] for a, b in where]
    assert streamed(path, pieces3, size, overlap, batch, max_chars=50) == want
    for keep in (1 << 30, 3):  # one Chunker throughout; made again every third step
        assert streamed(path, pieces3, size, overlap, batch, max_chars=50, keep=keep) == want


def prose(chars: int) -> str:
    """Real prose: paragraphs of the Python docs (../shared/data), or English written here where absent."""
    if PARAGRAPHS.exists():
        out, n = [], 0
        with gzip.open(PARAGRAPHS, "rt") as fh:
            for line in fh:
                p = json.loads(line)
                if p["doc"].startswith("tutorial/"):
                    out.append(p["text"])
                    n += len(p["text"]) + 2
                    if n >= chars:
                        break
        return "\n\n".join(out)
    base = ("Compression speed matters when archives are rebuilt nightly; decompression speed matters more "
            "when they are read constantly. Interoperability, reproducibility and maintainability are "
            "characteristics that engineers underestimate until a migration forces the question.\n\n")
    return (base * (chars // len(base) + 1))[:chars]


@pytest.mark.parametrize("size,overlap", [(254, 127), (100, 40), (100, 0), (800, 400)])
def test_real_prose_by_the_models_tokens(tmp_path, size, overlap):
    from fusionrag.retriever.collection.embedding import get_embedder

    spans = get_embedder("all-MiniLM-L6-v2").token_spans
    text = prose(120_000)
    path = tmp_path / "f.txt"
    path.write_bytes(text.encode())
    got = streamed(path, spans, size, overlap, 64, max_chars=1 << 20, keep=1 << 30)
    tokens = tokens_of(text, spans, file_chunks.PIECE)
    where = placed(text, got)  # prose: no chunk found anywhere but where it was cut
    check_chunks(text, where, tokens, size, overlap)
    assert streamed(path, spans, size, overlap, 16, max_chars=20_000) == got  # from marks, in small steps
    assert where == reference(text, tokens, size, overlap)
    # The windows alone would have cut inside words here (what the chunks were before).
    windows = streamed_windows(path, spans, size, overlap)
    assert any(not between_words(text, a) or not between_words(text, b) for a, b in placed(text, windows))
    assert abs(len(got) - len(windows)) <= max(2, len(windows) // 50)  # about as many chunks


def streamed_windows(path, spans, size, overlap) -> list[str]:
    """The chunks cut at the windows alone (whole_words not asked)."""
    chunker, out = Chunker(path, Mark(), 0, spans, size, overlap), []
    while not chunker.done:
        out += chunker.step(64)
    return out
