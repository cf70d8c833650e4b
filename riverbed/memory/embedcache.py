"""Embedding micro-batching and the two-level embedding cache.

:class:`MicroBatcher` gathers the texts of concurrent callers into one call of the
wrapped embedder: a batch closes when it holds ``max_batch`` texts, or ``max_wait``
seconds after it opened once the embedder is free; the first caller of a batch runs it
(no background task), the others wait for its result.

:class:`CachedEmbedder` keys vectors by the sha256 of the text: an in-process LRU first,
then the store's ``embedding_cache`` table shared by every worker, then the embedder.
Its ``lru_hits`` / ``db_hits`` / ``misses`` counters are there for metrics.

Vectors are rounded to half precision before they are cached or returned, so a text
gets the same vector whichever level answers.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import TYPE_CHECKING

import anyio
import numpy as np
from cachetools import LRUCache

from riverbed.errors import ConfigError, RiverbedError, UnavailableError
from riverbed.memory.embedders import Embedder, Vectors

if TYPE_CHECKING:
    from riverbed.memory.store import Store

__all__ = ["CachedEmbedder", "MicroBatcher", "content_hash", "embedding_pipeline"]


def content_hash(text: str) -> bytes:
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).digest()


class _Batch:
    __slots__ = ("done", "error", "full", "result", "texts")

    def __init__(self) -> None:
        self.texts: list[str] = []
        self.full = anyio.Event()
        self.done = anyio.Event()
        self.result: Vectors | None = None
        self.error: BaseException | None = None


class _Layer:
    """An :class:`Embedder` in front of ``inner``: its model and dimension, and an empty call
    answered at once; a subclass embeds the texts of every other call in ``_embed``."""

    def __init__(self, inner: Embedder) -> None:
        self.inner = inner

    @property
    def model(self) -> str:
        return self.inner.model

    @property
    def dim(self) -> int:
        return self.inner.dim

    async def embed(self, texts: Sequence[str]) -> Vectors:
        items = list(texts)
        if not items:
            return np.zeros((0, self.inner.dim), dtype=np.float32)
        return await self._embed(items)

    async def _embed(self, items: list[str]) -> Vectors:
        raise NotImplementedError


class MicroBatcher(_Layer):
    """An :class:`Embedder` that merges concurrent ``embed`` calls into batches."""

    def __init__(self, inner: Embedder, *, max_batch: int = 64, max_wait: float = 0.005, concurrency: int = 1) -> None:
        super().__init__(inner)
        self.max_batch = max_batch
        self.max_wait = max_wait
        self._limiter = anyio.CapacityLimiter(concurrency)
        self._open: _Batch | None = None
        self.batches = 0
        self.texts = 0

    async def _embed(self, items: list[str]) -> Vectors:
        batch = self._open
        leader = batch is None
        if batch is None:
            batch = self._open = _Batch()
        offset = len(batch.texts)
        batch.texts.extend(items)
        if len(batch.texts) >= self.max_batch:
            self._close(batch)
        if leader:
            await self._lead(batch)
        else:
            await batch.done.wait()
        if batch.error is not None:  # the leader re-raised its own error in _lead
            raise _relay(batch.error)
        assert batch.result is not None
        return batch.result[offset : offset + len(items)]

    def _close(self, batch: _Batch) -> None:
        batch.full.set()
        if self._open is batch:
            self._open = None

    async def _lead(self, batch: _Batch) -> None:
        try:
            with anyio.move_on_after(self.max_wait):
                await batch.full.wait()
            async with self._limiter:
                self._close(batch)
                self.batches += 1
                self.texts += len(batch.texts)
                batch.result = await self.inner.embed(batch.texts)
        except BaseException as exc:
            batch.error = exc
            raise
        finally:
            self._close(batch)
            batch.done.set()


def _relay(error: BaseException) -> Exception:
    """The error a follower raises for a failed batch it was part of."""
    if isinstance(error, ConfigError):
        relayed: RiverbedError = ConfigError(str(error))
    elif isinstance(error, Exception):
        relayed = UnavailableError(f"embedding failed: {error}")
    else:
        relayed = UnavailableError("embedding was cancelled before it finished; try again")
    relayed.__cause__ = error
    return relayed


class CachedEmbedder(_Layer):
    """An :class:`Embedder` with an LRU and a shared Postgres level in front of ``inner``."""

    def __init__(self, inner: Embedder, *, store: Store | None = None, lru_size: int = 10_000) -> None:
        super().__init__(inner)
        self.store = store
        self._lru: LRUCache[bytes, Vectors] = LRUCache(maxsize=lru_size)
        self.lru_hits = 0
        self.db_hits = 0
        self.misses = 0

    def stats(self) -> dict[str, int]:
        return {"lru_hits": self.lru_hits, "db_hits": self.db_hits, "misses": self.misses, "lru_size": len(self._lru)}

    async def _embed(self, items: list[str]) -> Vectors:
        hashes = [content_hash(t) for t in items]
        first_text = dict(zip(hashes, items, strict=True))
        found: dict[bytes, Vectors] = {}
        for h in first_text:
            vector = self._lru.get(h)
            if vector is not None:
                found[h] = vector
        self.lru_hits += len(found)
        missing = [h for h in first_text if h not in found]
        if missing and self.store is not None:
            shared = await self.store.cache_get(self.model, missing)
            self.db_hits += len(shared)
            for h, vector in shared.items():
                self._lru[h] = found[h] = vector
            missing = [h for h in missing if h not in found]
        if missing:
            computed = await self.inner.embed([first_text[h] for h in missing])
            computed = computed.astype(np.float16).astype(np.float32)
            self.misses += len(missing)
            for h, vector in zip(missing, computed, strict=True):
                self._lru[h] = found[h] = vector
            if self.store is not None:
                await self.store.cache_put(self.model, missing, computed)
        return np.stack([found[h] for h in hashes])

    async def embed_query(self, text: str) -> Vectors:
        """One recall query's vector: from the LRU, else straight from the model.

        A recall is latency-bound and a query is seldom asked twice across workers, so this
        skips the micro-batcher's wait and the shared level's two round trips.
        """
        key = content_hash(text)
        vector = self._lru.get(key)
        if vector is not None:
            self.lru_hits += 1
            return vector
        model = self.inner.inner if isinstance(self.inner, MicroBatcher) else self.inner
        computed: Vectors = (await model.embed([text]))[0].astype(np.float16).astype(np.float32)
        self.misses += 1
        self._lru[key] = computed
        return computed


def embedding_pipeline(
    embedder: Embedder,
    store: Store | None,
    *,
    lru_size: int = 10_000,
    max_batch: int = 64,
    max_wait: float = 0.005,
) -> CachedEmbedder:
    """``embedder`` behind a micro-batcher and the two-level cache (the memory worker's stack)."""
    return CachedEmbedder(
        MicroBatcher(embedder, max_batch=max_batch, max_wait=max_wait), store=store, lru_size=lru_size
    )
