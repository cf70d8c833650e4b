"""Recall ranking: pure functions over candidate lists (no I/O).

Hybrid search runs a vector search and a full-text search and fuses the two ranked
lists with reciprocal rank fusion: an item's score is ``sum(weight / (c + rank))`` over
the lists it appears in (rank starting at 1), so agreement between lists matters more
than either list's raw scores, which are not comparable.  An optional recency
half-life then multiplies each score by ``0.5 ** (age / half_life)``.
"""

from __future__ import annotations

import datetime as dt
import math
from collections.abc import Callable, Hashable, Sequence
from typing import TypeVar

from riverbed.events import Hit
from riverbed.memory.store import Candidate

__all__ = ["RRF_C", "best_per_event", "hybrid_rank", "recency_factor", "rrf"]

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
