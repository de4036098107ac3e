"""A vector store's file cut into chunks by the embedding model's tokens, as a stream: a step reads the file from
a mark (a byte offset where the text was cut into pieces, and the tokens before it), tokenizes piece by piece and
gives one batch of chunks and the mark the next step starts from; what a step holds is about a batch's text, so a
file of any size takes a batch's memory, and a worker may go to another owner's file between two batches
(server/vector_stores.py), keeping a Chunker between its steps or making one again from its mark.

The chunks are those of cutting the whole text at once: the text, with a leading BOM left out, is tokenized a
piece of at most PIECE characters at a time, each piece cut after the last space or newline in it; the tokens
(those of at least one character) are cut into windows of `size` tokens, each starting `size - overlap` tokens
after the one before, the last one ending at the last token; a chunk is the text from its first token's start to
its last one's end. Pieces start where the one before stopped, so a step that starts at a piece's start cuts
the same pieces, and the same tokens, as one that read the file from its start.
"""

from __future__ import annotations

import codecs
from array import array
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

PIECE = 50_000  # characters tokenized at a time
BLOCK = 1 << 18  # bytes read at a time
Spans = Callable[[str], "list[tuple[int, int]]"]


class BadText(Exception):
    """The file is not text: `code` and `message` are the file's last_error."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code, self.message = code, message


@dataclass(frozen=True)
class Mark:
    """Where a step starts: the byte offset of a piece's start (0: the file's start) and the tokens before it."""
    byte: int = 0
    tokens: int = 0


class _Pieces:
    """The file's text from a piece's start on, decoded a block at a time and cut into pieces; the file is open
    only while a block is read."""

    def __init__(self, path: Path, byte: int):
        self.path = path
        if byte == 0:
            with open(path, "rb") as fh:
                byte = 3 if fh.read(3) == codecs.BOM_UTF8 else 0
        self.byte = byte  # where the next piece starts
        self.fed = byte  # bytes given to the decoder
        self.decoder = codecs.getincrementaldecoder("utf-8")()
        self.buf, self.at, self.eof = "", 0, False

    def _fill(self) -> None:
        with open(self.path, "rb") as fh:
            fh.seek(self.fed)
            block = fh.read(BLOCK)
        held = len(self.decoder.getstate()[0])  # the start of a character the block before ended in
        try:
            text = self.decoder.decode(block, final=not block)
        except UnicodeDecodeError as err:
            raise BadText("unsupported_file", f"not UTF-8 text (byte {self.fed - held + err.start}); fusionrag "
                                              "reads text files only") from None
        if "\x00" in text:
            raise BadText("unsupported_file", "a binary file (it holds NUL characters); fusionrag reads text "
                                              "files only")
        self.fed += len(block)
        self.buf = self.buf[self.at:] + text
        self.at, self.eof = 0, not block

    def next(self) -> str | None:
        """The next piece, or None at the end."""
        while len(self.buf) - self.at <= PIECE and not self.eof:
            self._fill()
        left = len(self.buf) - self.at
        if not left:
            return None
        stop = left
        if left > PIECE:  # cut after the last space or newline of the piece (one at its first place does not count)
            ws = max(self.buf.rfind(" ", self.at, self.at + PIECE), self.buf.rfind("\n", self.at, self.at + PIECE))
            stop = ws + 1 - self.at if ws > self.at else PIECE
        piece = self.buf[self.at:self.at + stop]
        self.at += stop
        self.byte += len(piece.encode("utf-8"))
        return piece


def count_tokens(path: Path, mark: Mark, spans: Spans | None, limit: int, max_chars: int) -> tuple[Mark, bool]:
    """The file read from `mark` for about max_chars characters (whole pieces), its tokens counted (spans None:
    only read, the text checked): (the mark after them, whether the file ended or its tokens passed `limit`).
    BadText where it is not UTF-8 text."""
    pieces = _Pieces(path, mark.byte)
    tokens, read = mark.tokens, 0
    while read < max_chars:
        piece = pieces.next()
        if piece is None:
            return Mark(pieces.byte, tokens), True
        if spans is not None:
            tokens += sum(1 for a, b in spans(piece) if b > a)
        read += len(piece)
        if tokens > limit:
            return Mark(pieces.byte, tokens), True
    return Mark(pieces.byte, tokens), False


def chunk_count(tokens: int, size: int, overlap: int) -> int:
    """How many chunks a text of `tokens` tokens makes."""
    step = max(1, size - overlap)
    return 0 if tokens <= 0 else 1 + -(-max(0, tokens - size) // step)


class Chunker:
    """Chunks `chunk`, `chunk` + 1, ... of a file, a batch at a time (step()), read from `mark` (one a Chunker's
    `mark` gave, or Mark() for the file's start). Between steps it holds what it read past its last chunk (about
    a piece, a block and a window: under a MiB of text) and no open file; `mark` is where a new Chunker would
    take up from, reading again at most the piece of the next chunk's first token."""

    def __init__(self, path: Path, mark: Mark, chunk: int, spans: Spans, size: int, overlap: int):
        self.spans, self.size, self.step_tokens = spans, size, max(1, size - overlap)
        self.chunk = chunk  # the next chunk
        self.first = chunk * self.step_tokens  # its first token, counted from the file's start
        self.done = False
        self._pieces = _Pieces(path, mark.byte)
        self._base = mark.tokens  # the token at starts[0], counted from the file's start
        self._starts, self._ends = array("q"), array("q")  # each kept token's characters, from the start
        self._text, self._at, self._pos = "", 0, 0  # the text kept (from the first kept token), where it starts
        # and where the next piece starts, counted in characters from where this Chunker started
        self._marks = deque([mark])  # piece starts; the first the last one before the next chunk's first token

    @property
    def mark(self) -> Mark:
        return self._marks[0]

    def _drop(self) -> None:
        """The tokens before the next chunk's first, and their text, let go."""
        k = min(len(self._starts), self.first - self._base)
        if k > 0:
            del self._starts[:k], self._ends[:k]
            self._base += k
        keep = self._starts[0] if self._starts else self._pos
        self._text, self._at = self._text[keep - self._at:], keep
        while len(self._marks) > 1 and self._marks[1].tokens <= self.first:
            self._marks.popleft()

    def _take(self, end: int) -> str:
        """The next chunk, to token `end` (counted from the file's start, exclusive)."""
        i, j = self.first - self._base, end - self._base
        text = self._text[self._starts[i] - self._at:self._ends[j - 1] - self._at]
        self.chunk, self.first = self.chunk + 1, self.first + self.step_tokens
        self._drop()
        return text

    def step(self, batch: int, max_chars: int = 1 << 20) -> list[str]:
        """The next chunks, at most `batch` of them (`done` says whether the last one is among them). A step
        stops after about max_chars characters read once it has given a chunk or moved `mark` (a long stretch
        of spaces is read a part at a time)."""
        out: list[str] = []
        read = 0
        while len(out) < batch and not self.done:
            seen = self._base + len(self._starts)
            if seen >= self.first + self.size:  # a whole window read
                out.append(self._take(self.first + self.size))
                continue
            if read >= max_chars and (out or self._marks[-1].tokens <= self.first):
                break
            piece = self._pieces.next()
            if piece is None:  # the end: the last chunk ends at the last token
                self.done = True
                if (seen > 0) if self.chunk == 0 else (self.first - self.step_tokens + self.size < seen):
                    out.append(self._take(seen))
                break
            for a, b in self.spans(piece):
                if b > a:
                    self._starts.append(self._pos + a)
                    self._ends.append(self._pos + b)
            self._text += piece
            self._pos += len(piece)
            read += len(piece)
            self._marks.append(Mark(self._pieces.byte, self._base + len(self._starts)))
            self._drop()
        return out


def next_chunks(path: Path, mark: Mark, chunk: int, spans: Spans, size: int, overlap: int, batch: int,
                max_chars: int = 1 << 20) -> tuple[list[str], Mark, bool]:
    """One step of a Chunker made for it: (the chunks, the mark the next step starts from, whether the last
    chunk is among them)."""
    chunker = Chunker(path, mark, chunk, spans, size, overlap)
    out = chunker.step(batch, max_chars)
    return out, chunker.mark, chunker.done
