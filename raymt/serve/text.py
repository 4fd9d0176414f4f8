"""How `raymt serve` cuts a request's text into the sentences it translates, and puts the
translations back: lines and blank lines kept, sentences split at end punctuation, a sentence
longer than the model's positions cut into chunks at word boundaries (never silently truncated)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Sequence

# End punctuation followed by white space: a sentence boundary (the white space is dropped and
# the translations of one line are joined by one space).
SENTENCE_END = re.compile(r"(?<=[.!?\u2026\u3002\uff01\uff1f])\s+")


@dataclass
class Layout:
    """Where each segment of a text goes: `lines[i]` lists the segment indices of line i (none for
    a blank line); `segments` are the sentences (or chunks of one) to translate, in order."""

    lines: list[list[int]]
    segments: list[str]

    def join(self, translations: Sequence[str]) -> str:
        """The text's translation: each line's segments joined by a space, lines by newlines."""
        return "\n".join(" ".join(translations[i] for i in line) for line in self.lines)


def split_sentences(line: str) -> list[str]:
    """The sentences of one line (none for a blank one)."""
    return [s for s in SENTENCE_END.split(line.strip()) if s]


def chunk(sentence: str, cost: Callable[[str], int], limit: int) -> list[str]:
    """A sentence cut at spaces into chunks of at most `limit` tokens each (`cost` counts a
    text's tokens); a single word over the limit is a chunk of its own (the encoder cuts it)."""
    if cost(sentence) <= limit:
        return [sentence]
    chunks: list[str] = []
    current: list[str] = []
    used = 0
    for word in sentence.split():
        need = cost(word)
        if current and used + need > limit:
            chunks.append(" ".join(current))
            current, used = [], 0
        current.append(word)
        used += need
    return chunks + ([" ".join(current)] if current else [])


def layout(text: str, cost: Callable[[str], int], limit: int) -> Layout:
    """The segments of a text (lines, then sentences, then chunks of `limit` tokens) and where
    their translations go."""
    lines: list[list[int]] = []
    segments: list[str] = []
    for line in text.split("\n"):
        indices = []
        for sentence in split_sentences(line):
            for piece in chunk(sentence, cost, limit):
                indices.append(len(segments))
                segments.append(piece)
        lines.append(indices)
    return Layout(lines, segments)
