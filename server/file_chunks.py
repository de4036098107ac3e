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

Cut at whole words (whole_words, what the vector stores use), a cut falls only before a token that starts a
word, never inside a word that a model's tokens split ("compression" as "com", "##pression"): a token starts a
word when whitespace lies before it, or the characters either side of the cut are not both within a word
(starts_word: letters, digits, '_', combining marks; punctuation, symbols and CJK ideographs or kana stand
alone). A chunk starting at token s (the first at 0) ends before the last token starting a word among
s + 1 .. s + size (at s + size where none does: only a word longer than a chunk is cut), and is the last one
where the tokens left are no more than `size`. The next one starts at the last token starting a word at or
before its window's start (chunk number x (size - overlap), as the windows put it) and this chunk's end, else
the first one after, up to that end; but no earlier than where it can still reach past the word after this
chunk (that word's end less `size`), and at this chunk's end where that word alone is longer than a chunk.
So no chunk has more than `size` tokens, none is empty, each ends past the one before, two in a row overlap
by about `overlap` tokens (the tokens of a word or two more or less) with at most whitespace between them, and
there are about as many chunks as windows.
"""

from __future__ import annotations

import codecs
import unicodedata
from array import array
from collections import deque
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

# Characters tokenized at a time. A tokenizer call holds the GIL throughout (Hugging Face tokenizers' encode):
# 50,000 characters held it 18-35 ms (70 ms on a niced thread of a busy machine), every request of the service
# waiting; 4,000 hold it ~2 ms.
PIECE = 4_000
BLOCK = 1 << 18  # bytes read at a time
Spans = Callable[[str], "list[tuple[int, int]]"]


class BadText(Exception):
    """The file is not text: `code` and `message` are the file's last_error."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code, self.message = code, message


@dataclass(frozen=True)
class Mark:
    """Where a step starts: the byte offset of a piece's start (0: the file's start) and the tokens before it;
    cutting at whole words, also the next chunk's first token (None: the window's, the chunk x size - overlap)."""
    byte: int = 0
    tokens: int = 0
    first: int | None = None


def _nospace(c: str) -> bool:
    """A character of a script written without spaces between words (CJK ideographs, kana): a cut may fall
    before any of them."""
    o = ord(c)
    return 0x3040 <= o <= 0x30FF or 0x3400 <= o <= 0x4DBF or 0x4E00 <= o <= 0x9FFF or 0xF900 <= o <= 0xFAFF \
        or 0x20000 <= o <= 0x3134F


def _in_word(c: str) -> bool:
    """A character that a word goes on through: a letter, a digit, '_' or a combining mark."""
    return (c.isalnum() or c == "_" or unicodedata.category(c)[0] == "M") and not _nospace(c)


def starts_word(before: str, at: str) -> bool:
    """Whether a cut between the characters `before` and `at` (adjacent in the text) falls between words: not
    both of them within a word."""
    return not (_in_word(before) and _in_word(at))


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
    """How many chunks a text of `tokens` tokens makes cut at the windows (cut at whole words: about as many)."""
    step = max(1, size - overlap)
    return 0 if tokens <= 0 else 1 + -(-max(0, tokens - size) // step)


class Chunker:
    """Chunks `chunk`, `chunk` + 1, ... of a file, a batch at a time (step()), read from `mark` (one a Chunker's
    `mark` gave, or Mark() for the file's start). Between steps it holds what it read past its last chunk (about
    a piece, a block and a window: under a MiB of text) and no open file; `mark` is where a new Chunker would
    take up from, reading again at most the piece of the next chunk's first token. whole_words: cut only between
    words (the module's docstring), a window more held (where the word after a chunk ends); `mark` then says
    where the next chunk starts too."""

    def __init__(self, path: Path, mark: Mark, chunk: int, spans: Spans, size: int, overlap: int,
                 whole_words: bool = False):
        self.spans, self.size, self.step_tokens = spans, size, max(1, size - overlap)
        self.whole_words = whole_words
        self.chunk = chunk  # the next chunk
        # its first token, counted from the file's start
        self.first = mark.first if whole_words and mark.first is not None else chunk * self.step_tokens
        # A window is taken once its tokens are read; cutting at whole words, once a window more is read too (where
        # the next word ends: the next chunk must reach past it), or the file's end.
        self._need = 2 * size + 1 if whole_words else size
        self.done = False
        self._pieces = _Pieces(path, mark.byte)
        self._base = mark.tokens  # the token at starts[0], counted from the file's start
        self._starts, self._ends = array("q"), array("q")  # each kept token's characters, from the start
        self._text, self._at, self._pos = "", 0, 0  # the text kept (from the first kept token), where it starts
        # and where the next piece starts, counted in characters from where this Chunker started
        self._marks = deque([mark])  # piece starts; the first the last one before the next chunk's first token

    @property
    def mark(self) -> Mark:
        return replace(self._marks[0], first=self.first) if self.whole_words else self._marks[0]

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

    def _starts_word(self, t: int) -> bool:
        """Whether token t (counted from the file's start; the one before it kept) starts a word: it does not
        share a character with the token before, and whitespace or a cut between words (starts_word) lies
        between them. The end of the file (t the tokens read, all of them) counts as one."""
        k = t - self._base
        if k >= len(self._starts):
            return True
        a, b = self._starts[k], self._ends[k - 1]
        return a > b or (a == b and starts_word(self._text[a - 1 - self._at], self._text[a - self._at]))

    def _cuts(self) -> tuple[int, int]:
        """Cutting at whole words, where the next chunk (not the last) ends and the one after it starts (the
        module's docstring), with a window more read (or the file's end). Each search stops at the first token
        starting a word it meets: a token or two in prose."""
        s, size, starts = self.first, self.size, self._starts_word
        # This chunk ends before the last token starting a word within `size` of its start (a word longer than
        # a chunk is cut after `size` tokens).
        end = next((t for t in range(s + size, s, -1) if starts(t)), s + size)
        # The next one ends past it, at least at the end of the word after it: it starts no earlier than that
        # end less `size`; a word after this chunk longer than a chunk starts it.
        after = next((t for t in range(end + 1, end + size + 1) if starts(t)), None)
        if after is None:
            return end, end
        low = max(s + 1, after - size)
        # It starts near its window's start (where the windows' starts, size - overlap apart, put it), at most
        # where this chunk ends: at the last token starting a word there, else the first one after.
        window = max(s + 1, min((self.chunk + 1) * self.step_tokens, end))
        nxt = next((t for t in range(window, low - 1, -1) if starts(t)), None)
        if nxt is None:
            nxt = next((t for t in range(max(low, window + 1), end + 1) if starts(t)), max(window, low))
        return end, nxt

    def _take(self, end: int, last: bool = False) -> str:
        """The next chunk, to token `end` (counted from the file's start, exclusive); cutting at whole words, one
        not the last one ends instead where _cuts says, and says where the one after it starts."""
        s = self.first
        nxt = s + self.step_tokens
        if self.whole_words and not last:
            end, nxt = self._cuts()
        i, j = s - self._base, end - self._base
        text = self._text[self._starts[i] - self._at:self._ends[j - 1] - self._at]
        self.chunk, self.first = self.chunk + 1, nxt
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
            if seen >= self.first + self._need:  # a whole window read
                out.append(self._take(self.first + self.size))
                continue
            if read >= max_chars and (out or self._marks[-1].tokens <= self.first):
                break
            piece = self._pieces.next()
            if piece is None:  # the end: the last chunk ends at the last token
                if self.whole_words and seen - self.first > self.size:  # chunks before the last one, at the end
                    out.append(self._take(seen))
                    continue
                self.done = True
                if self.whole_words:  # a chunk not the last one never reaches the last token
                    if seen > self.first:
                        out.append(self._take(seen, last=True))
                elif (seen > 0) if self.chunk == 0 else (self.first - self.step_tokens + self.size < seen):
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
                max_chars: int = 1 << 20, whole_words: bool = False) -> tuple[list[str], Mark, bool]:
    """One step of a Chunker made for it: (the chunks, the mark the next step starts from, whether the last
    chunk is among them)."""
    chunker = Chunker(path, mark, chunk, spans, size, overlap, whole_words)
    out = chunker.step(batch, max_chars)
    return out, chunker.mark, chunker.done
