"""Recall ranking: pure functions over candidate lists (no I/O).

Hybrid search runs a vector search and a full-text search and fuses the two ranked
lists with reciprocal rank fusion: an item's score is ``sum(weight / (c + rank))`` over
the lists it appears in (rank starting at 1), so agreement between lists matters more
than either list's raw scores, which are not comparable.  An optional recency
half-life then multiplies each score by ``0.5 ** (age / half_life)``.

:func:`explained_rank` says, beside each hit, why it matched: its place in the list by
meaning (with the cosine similarity) and in the list by words (with the query's words found
in its text), so a reader sees more than the fused score.
"""

from __future__ import annotations

import datetime as dt
import math
import re
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from riverbed.events import Hit
from riverbed.memory.store import Candidate

__all__ = [
    "RRF_C",
    "Match",
    "best_per_event",
    "explained_rank",
    "hybrid_rank",
    "matched_words",
    "recency_factor",
    "rrf",
]

RRF_C = 60
T = TypeVar("T")


def rrf(
    rankings: Sequence[Sequence[T]],
    *,
    key: Callable[[T], Hashable],
    c: int = RRF_C,
    weights: Sequence[float] | None = None,
) -> list[tuple[T, float]]:
    """Reciprocal rank fusion of best-first lists; returns ``(item, score)`` best first.

    Items are identified by ``key``; the first occurrence represents the item.  Ties keep
    the order in which items were first seen (earlier lists first).
    """
    if weights is not None and len(weights) != len(rankings):
        raise ValueError("one weight per ranking is needed")
    scores: dict[Hashable, float] = {}
    items: dict[Hashable, T] = {}
    for index, ranking in enumerate(rankings):
        weight = 1.0 if weights is None else weights[index]
        seen: set[Hashable] = set()
        for rank, item in enumerate(ranking, start=1):
            ident = key(item)
            if ident in seen:
                continue
            seen.add(ident)
            items.setdefault(ident, item)
            scores[ident] = scores.get(ident, 0.0) + weight / (c + rank)
    order = sorted(scores, key=lambda ident: -scores[ident])
    return [(items[ident], scores[ident]) for ident in order]


def recency_factor(age_seconds: float, half_life_seconds: float | None) -> float:
    """``0.5 ** (age / half_life)``; 1.0 without a half-life; future timestamps count as age 0."""
    if half_life_seconds is None:
        return 1.0
    if half_life_seconds <= 0:
        raise ValueError("the recency half-life must be positive")
    return math.pow(0.5, max(age_seconds, 0.0) / half_life_seconds)


def best_per_event(scored: Sequence[tuple[Candidate, float]]) -> list[tuple[Candidate, float]]:
    """Keep the best-scoring chunk of each event (input best first)."""
    seen: set[tuple[str, int]] = set()
    out: list[tuple[Candidate, float]] = []
    for cand, score in scored:
        ident = (cand.session, cand.event_id)
        if ident not in seen:
            seen.add(ident)
            out.append((cand, score))
    return out


@dataclass(frozen=True)
class Match:
    """A hit and why it matched: its rank (1: best) among the candidates by meaning and by
    words (None: not among them), the cosine similarity, and the query's words in its text."""

    hit: Hit
    meaning_rank: int | None
    similarity: float | None
    words_rank: int | None
    words: list[str]

    def as_dict(self) -> dict[str, object]:
        return {
            "session": self.hit.session,
            "event_id": self.hit.event_id,
            "kind": self.hit.kind,
            "score": self.hit.score,
            "text": self.hit.text,
            "why": {
                "meaning": None
                if self.meaning_rank is None
                else {"rank": self.meaning_rank, "similarity": round(self.similarity or 0.0, 4)},
                "words": None if self.words_rank is None else {"rank": self.words_rank, "matched": self.words},
            },
        }


_WORD = re.compile(r"[^\W_]+")
_STOP = frozenset(
    [
        "a",
        "an",
        "and",
        "are",
        "as",
        "at",
        "be",
        "by",
        "do",
        "does",
        "for",
        "from",
        "has",
        "have",
        "how",
        "i",
        "in",
        "is",
        "it",
        "of",
        "on",
        "or",
        "that",
        "the",
        "this",
        "to",
        "was",
        "what",
        "when",
        "where",
        "which",
        "who",
        "why",
        "will",
        "with",
    ]
)


def matched_words(query_words: Sequence[str], text: str) -> list[str]:
    """The query's words found in ``text`` as the full-text search finds them, roughly: a word
    of the text that starts like the query word (its stem, as English stemming cuts endings),
    stop words left out."""
    found: list[str] = []
    text_words = {w.casefold() for w in _WORD.findall(text)}
    for word in query_words:
        if word in _STOP or len(word) < 2:
            continue
        stem = word if len(word) <= 4 else word[: max(4, len(word) - 3)]
        if any(t.startswith(stem) for t in text_words):
            found.append(word)
    return found


def explained_rank(
    vector_hits: Sequence[Candidate],
    text_hits: Sequence[Candidate],
    query_words: Sequence[str],
    *,
    k: int,
    now: dt.datetime,
    half_life_seconds: float | None = None,
    c: int = RRF_C,
    weights: Sequence[float] = (1.0, 1.0),
) -> list[Match]:
    """:func:`hybrid_rank`'s hits, each with why it matched."""
    meaning: dict[tuple[str, int], tuple[int, float]] = {}
    for rank, cand in enumerate(vector_hits, start=1):
        meaning.setdefault((cand.session, cand.event_id), (rank, cand.score))
    by_words: dict[tuple[str, int], int] = {}
    for rank, cand in enumerate(text_hits, start=1):
        by_words.setdefault((cand.session, cand.event_id), rank)
    out: list[Match] = []
    for hit in hybrid_rank(
        vector_hits, text_hits, k=k, now=now, half_life_seconds=half_life_seconds, c=c, weights=weights
    ):
        ident = (hit.session, hit.event_id)
        m_rank, similarity = meaning.get(ident, (None, None))
        w_rank = by_words.get(ident)
        words = matched_words(query_words, hit.text) if w_rank is not None else []
        out.append(Match(hit, m_rank, similarity, w_rank, words))
    return out


def hybrid_rank(
    vector_hits: Sequence[Candidate],
    text_hits: Sequence[Candidate],
    *,
    k: int,
    now: dt.datetime,
    half_life_seconds: float | None = None,
    c: int = RRF_C,
    weights: Sequence[float] = (1.0, 1.0),
) -> list[Hit]:
    """Fuse vector and text candidates into at most ``k`` hits, one per event, best first."""
    fused = rrf([vector_hits, text_hits], key=lambda h: (h.session, h.event_id, h.chunk), c=c, weights=weights)
    if half_life_seconds is not None:
        fused = [(h, s * recency_factor((now - h.ts).total_seconds(), half_life_seconds)) for h, s in fused]
        fused.sort(key=lambda pair: -pair[1])
    return [
        Hit(session=h.session, event_id=h.event_id, kind=h.kind, score=round(score, 6), text=h.text)
        for h, score in best_per_event(fused)[:k]
    ]
