"""Indexing and recall end to end: real embedded Postgres, the real local embedder."""

from __future__ import annotations

import contextlib
import datetime as dt
import socket
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import parse_qs, urlparse

import anyio
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from structlog.testing import capture_logs

from riverbed import events
from riverbed.errors import UnavailableError
from riverbed.memory.chunking import ChunkPolicy
from riverbed.memory.embedcache import CachedEmbedder
from riverbed.memory.embedders import LocalEmbedder, OpenAIEmbedder
from riverbed.memory.recall import Memory
from riverbed.memory.store import Store
from tests.kit.embedder import LOCAL
from tests.kit.memory import numbered

T0 = dt.datetime(2026, 11, 20, 9, 0, tzinfo=dt.UTC)
_shared_cache = CachedEmbedder(LOCAL)  # LRU only, reused across event loops


def work_session() -> list[events.Event]:
    """A realistic agent session: messages, commands and their output, edits."""
    items: list[events.Event] = [
        events.Message(
            source="user", content="The login page shows a blank screen after the last deploy, please fix it"
        ),
        events.CmdRun(command="git log --oneline -5"),
        events.CmdOutput(
            command="git log --oneline -5",
            content="a1b2c3d Bump react-router to 6.22\n9f8e7d6 Add dark mode toggle\n5c4b3a2 Fix typo in README",
            exit_code=0,
        ),
        events.CmdRun(command="python -m pytest tests/ -q"),
        events.CmdOutput(
            command="python -m pytest tests/ -q",
            content=(
                "FAILED tests/test_orders.py::test_checkout - psycopg.OperationalError: connection to server at "
                '"10.0.0.5", port 5432 failed: Connection refused\n1 failed, 41 passed in 3.2s'
            ),
            exit_code=1,
        ),
        events.CmdRun(command="cat config/settings.yaml"),
        events.CmdOutput(
            command="cat config/settings.yaml",
            content="server:\n  host: 0.0.0.0\n  listen: 8443\n  workers: 4\nlogging:\n  level: info",
            exit_code=0,
        ),
        events.FileEdit(
            command="str_replace",
            path="src/http/client.py",
            old_str="MAX_RETRIES = 3",
            new_str="MAX_RETRIES = 8  # the payment gateway drops connections under load",
        ),
        events.FileEdited(path="src/http/client.py", diff="-MAX_RETRIES = 3\n+MAX_RETRIES = 8"),
        events.Think(thought="The blank screen is probably the router upgrade breaking the lazy-loaded routes"),
        events.CmdRun(command="npm run build"),
        events.CmdOutput(
            command="npm run build",
            content="vite v5.1.0 building for production...\n✓ 812 modules transformed.\ndist/index.html 0.46 kB",
            exit_code=0,
        ),
        events.CmdRun(command="docker compose ps"),
        events.CmdOutput(
            command="docker compose ps",
            content=(
                "NAME      IMAGE          STATUS\n"
                "web       shop-web:1.4   Up 2 hours\n"
                "redis     redis:7        Up 2 hours"
            ),
            exit_code=0,
        ),
        events.FileWrite(
            path="docs/oncall.md", content="Page the payments team in #payments-oncall when refunds fail."
        ),
        events.Message(source="agent", content="I pinned react-router back to 6.21 and the login page renders again."),
        events.CmdRun(command="ls"),
        events.CmdOutput(command="ls", content="README.md\nconfig\ndocs\npackage.json\nsrc\ntests", exit_code=0),
    ]
    return numbered(items)


@pytest.mark.anyio
async def test_semantic_recall_finds_the_right_event(local: LocalEmbedder, database_url: str, prefix: str) -> None:
    async with Store(database_url, schema=prefix) as store:
        memory = Memory.cached(store, local)
        log = work_session()
        assert await memory.index("s-work", log, tenant="acme") == len(log)
        # some noise from other sessions of the same tenant
        await memory.index(
            "s-other", numbered([events.Message(content="lunch at noon?", source="user")]), tenant="acme"
        )
        by_id = {e.id: e for e in log}
        questions = {
            "which test failed because the database could not be reached?": 5,
            "where did we raise the number of times a request is retried?": 8,
            "what port does the server listen on?": 7,
            "what was the user's original complaint?": 1,
            "who should be contacted when refunds break?": 15,
            "which containers are running?": 14,
        }
        for question, expected in questions.items():
            result = await memory.recall(
                events.Recall(id=99, query=question, recall_type="semantic", k=3),
                session="s-work",
                tenant="acme",
                workspace=None,
            )
            assert result.recall_type == "semantic"
            assert result.cause == 99
            ranked = [h.event_id for h in result.hits]
            assert expected in ranked, f"{question!r}: expected event {expected} ({by_id[expected].kind}) in {ranked}"
            assert all(h.session == "s-work" for h in result.hits)
        hit = result.hits[ranked.index(14)]
        assert (hit.kind, hit.session) == ("cmd_output", "s-work")
        assert "docker compose ps" in hit.text
        assert hit.score > 0
        # tenant scope reaches the other session; session scope does not
        lunch = events.Recall(query="when is lunch?", scope="tenant", k=2)
        found = await memory.recall(lunch, session="s-work", tenant="acme", workspace=None)
        assert found.hits[0].session == "s-other"


@pytest.mark.anyio
async def test_index_is_exactly_once_and_tracks_empty_events(
    local: LocalEmbedder, database_url: str, prefix: str
) -> None:
    async with Store(database_url, schema=prefix) as store:
        memory = Memory(store, CachedEmbedder(local, store=store), policy=ChunkPolicy(size=200, overlap=20))
        log = numbered(
            [
                events.Message(content="hello", source="user"),
                events.CmdOutput(command="seq 1 400", content="\n".join(str(i) for i in range(400))),
                events.SessionConfig(env={"A": "1"}),  # nothing to index
                events.Recall(query="anything"),  # nothing to index
            ]
        )
        assert await memory.index("s", log, tenant=None) == 4
        counts = await store.counts("s")
        assert counts["indexed"] == 4
        assert counts["chunks"] > 5  # the long output was chunked
        assert await memory.index("s", log, tenant=None) == 0
        assert await memory.index("s", log[:2], tenant=None) == 0
        assert await store.counts("s") == counts
        more = numbered([*log, events.Think(thought="new")])
        assert await memory.index("s", more, tenant=None) == 1
        assert (await store.counts("s"))["indexed"] == 5


@pytest.mark.anyio
async def test_session_scope_recall_returns_k_among_many_sessions(
    local: LocalEmbedder, database_url: str, prefix: str
) -> None:
    texts = [f"deploy step {i}: rolled out service number {i} to the cluster" for i in range(8)]
    async with Store(database_url, schema=prefix) as store:
        memory = Memory.cached(store, local)
        for s in range(60):
            log = numbered([events.Message(content=t, source="agent") for t in texts])
            await memory.index(f"s{s:02d}", log, tenant="acme")
        result = await memory.recall(
            events.Recall(query="which services were rolled out?", k=6), session="s42", tenant="acme", workspace=None
        )
        assert len(result.hits) == 6
        assert {h.session for h in result.hits} == {"s42"}


owners: dict[str, str | None] = {}
SENTENCES = [
    "the build failed with a missing header",
    "customer asked for a refund on order 66",
    "rotated the database password",
    "kubernetes pod restarted twice",
    "updated the changelog for version 2",
]


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    layout=st.lists(
        st.tuples(
            st.sampled_from(["acme", "globex", None]), st.lists(st.sampled_from(SENTENCES), min_size=1, max_size=4)
        ),
        min_size=1,
        max_size=5,
    ),
    query=st.sampled_from(SENTENCES),
)
def test_tenant_never_sees_another_tenants_events(
    local: LocalEmbedder, database_url: str, prefix: str, layout: list[tuple[str | None, list[str]]], query: str
) -> None:
    async def example() -> None:
        async with Store(database_url, schema=prefix, max_size=2) as store:
            memory = Memory(store, _shared_cache)
            sessions: list[str] = []
            for tenant, texts in layout:
                session = uuid.uuid4().hex[:10]
                owners[session] = tenant
                sessions.append(session)
                log = numbered([events.Message(content=t, source="user") for t in texts])
                await memory.index(session, log, tenant=tenant)
            for tenant in ("acme", "globex", None):
                wide = await memory.search(query, session=sessions[0], tenant=tenant, k=20, scope="tenant")
                assert all(owners[h.session] == tenant for h in wide)
                for session in sessions:
                    narrow = await memory.search(query, session=session, tenant=tenant, k=20, scope="session")
                    if owners[session] == tenant:
                        assert narrow
                        assert {h.session for h in narrow} == {session}
                    else:
                        assert narrow == []

    anyio.run(example)


# --- workspace context and knowledge --------------------------------------------------------


def git(repo: Path, *args: str) -> None:
    subprocess.run(["git", *args], cwd=repo, check=True, capture_output=True)


@pytest.mark.anyio
async def test_workspace_context_from_a_git_repo(workspace: Path, database_url: str, prefix: str) -> None:
    git(workspace, "init", "-q", "-b", "feature/login-fix")
    git(workspace, "remote", "add", "origin", "git@github.com:acme/shop-web.git")
    (workspace / "AGENTS.md").write_text("Run `make test` before committing.\n")
    agents_dir = workspace / ".openhands" / "microagents"
    agents_dir.mkdir(parents=True)
    (agents_dir / "repo.md").write_text("---\nname: repo\ntype: repo\n---\nThe frontend lives in web/.\n")
    sub = workspace / "src"
    sub.mkdir()
    async with Store(database_url, schema=prefix) as store:
        memory = Memory(store, _shared_cache)
        result = await memory.recall(
            events.Recall(id=3, recall_type="workspace_context"),
            session="s",
            tenant="acme",
            workspace=workspace,
            conversation_instructions="Answer in French.",
        )
    assert result.recall_type == "workspace_context"
    assert result.cause == 3
    assert result.repo_name == "acme/shop-web"
    assert result.repo_branch == "feature/login-fix"
    assert result.repo_directory == str(workspace)
    assert result.repo_instructions is not None
    assert "make test" in result.repo_instructions
    assert "frontend lives in web/" in result.repo_instructions
    assert result.conversation_instructions == "Answer in French."
    assert set(result.runtime_info) >= {"hostname", "platform", "python"}
    assert result.date == dt.datetime.now(dt.UTC).date().isoformat()

    # nothing above the workspace is read: a workspace inside a repository reports itself only
    inner = await Memory(Store(database_url, schema=prefix), _shared_cache).recall(
        events.Recall(recall_type="workspace_context"), session="s", tenant=None, workspace=sub
    )
    assert (inner.repo_name, inner.repo_branch, inner.repo_instructions) == ("src", None, None)
    assert inner.repo_directory == str(sub)
    # detached HEAD, no remote, no repository at all
    (workspace / ".git" / "HEAD").write_text("0123456789abcdef0123456789abcdef01234567\n")
    git(workspace, "remote", "remove", "origin")
    detached = await Memory(Store(database_url, schema=prefix), _shared_cache).recall(
        events.Recall(recall_type="workspace_context"), session="s", tenant=None, workspace=workspace
    )
    assert (detached.repo_name, detached.repo_branch) == (workspace.name, "0123456789ab")
    plain = await Memory(Store(database_url, schema=prefix), _shared_cache).recall(
        events.Recall(recall_type="workspace_context"), session="s", tenant=None, workspace=None
    )
    assert plain.repo_name is None
    assert plain.date is not None


@pytest.mark.anyio
async def test_knowledge_microagents(tmp_path: Path, workspace: Path, database_url: str) -> None:
    global_dir = tmp_path / "global"
    global_dir.mkdir()
    (global_dir / "docker.md").write_text(
        "---\nname: docker\ntype: knowledge\ntriggers: [docker, container]\n---\nUse `docker compose` v2.\n"
    )
    (global_dir / "k8s.md").write_text(
        "---\nname: kubernetes\ntriggers:\n  - kubectl\n  - Helm Chart\n---\nUse kubectl.\n"
    )
    (global_dir / "broken.md").write_text("---\nname: broken\ntriggers: [oops\n---\nnever loaded\n")
    (global_dir / "unclosed.md").write_text("---\nname: unclosed\n")
    (global_dir / "README.md").write_text("not a microagent")
    ws_dir = workspace / ".riverbed" / "microagents"
    ws_dir.mkdir(parents=True)
    (ws_dir / "docker.md").write_text(
        "---\nname: docker\ntriggers: [docker]\n---\nThis repo builds with `make image`.\n"
    )
    memory = Memory(Store(database_url, schema="unused"), _shared_cache, microagent_dirs=[global_dir])

    with capture_logs() as logs:
        result = await memory.recall(
            events.Recall(
                id=8, query="How do I build the DOCKER image and install the helm chart?", recall_type="knowledge"
            ),
            session="s",
            tenant=None,
            workspace=workspace,
        )
    assert result.recall_type == "knowledge"
    assert {(k.name, k.trigger) for k in result.knowledge} == {("docker", "docker"), ("kubernetes", "Helm Chart")}
    docker = next(k for k in result.knowledge if k.name == "docker")
    assert docker.content == "This repo builds with `make image`."  # the workspace's file wins
    skipped = {Path(entry["path"]).name for entry in logs if entry["event"] == "microagent_skipped"}
    assert skipped == {"broken.md", "unclosed.md"}

    none = await memory.recall(
        events.Recall(query="dockerfile linting", recall_type="knowledge"), session="s", tenant=None, workspace=None
    )
    assert none.knowledge == []  # triggers match whole words only


# --- failures -----------------------------------------------------------------------------------


@contextlib.contextmanager
def unix_proxy(target: str, directory: Path) -> Iterator[tuple[str, threading.Event]]:
    """A unix-socket forwarder to Postgres's socket; setting the event cuts every connection."""
    listen_path = directory / ".s.PGSQL.5432"
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(listen_path))
    server.listen(16)
    server.settimeout(0.1)
    cut = threading.Event()
    open_socks: list[socket.socket] = [server]

    def pump(a: socket.socket, b: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := a.recv(65536):
                b.sendall(data)
        for s in (a, b):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)

    def accept() -> None:
        while not cut.is_set():
            try:
                client, _ = server.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            upstream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            upstream.connect(target)
            open_socks.extend([client, upstream])
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=pump, args=(a, b), daemon=True).start()
        for s in open_socks:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()
        listen_path.unlink(missing_ok=True)

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield str(directory), cut
    finally:
        cut.set()
        thread.join(5)


@pytest.mark.anyio
async def test_database_going_down_makes_recall_and_index_unavailable(
    local: LocalEmbedder, database_url: str, prefix: str
) -> None:
    parsed = urlparse(database_url)
    host = parse_qs(parsed.query).get("host", [""])[0]
    if not host.startswith("/"):
        pytest.skip("needs the embedded Postgres on a unix socket")
    proxy_dir = Path("/tmp") / f"rbproxy-{uuid.uuid4().hex[:8]}"  # short: unix socket paths are limited
    proxy_dir.mkdir()
    try:
        with unix_proxy(f"{host}/.s.PGSQL.5432", proxy_dir) as (proxy_host, cut):
            url = f"postgresql://postgres:@/postgres?host={proxy_host}"
            async with Store(url, schema=prefix, connect_timeout=1.0) as store:
                memory = Memory(store, CachedEmbedder(local), recall_timeout=3.0)
                log = numbered([events.Message(content="the cache server is redis", source="user")])
                assert await memory.index("s", log, tenant=None) == 1
                cut.set()
                await anyio.sleep(0.3)
                started = time.monotonic()
                with pytest.raises(UnavailableError):
                    await memory.recall(
                        events.Recall(query="which cache server?"), session="s", tenant=None, workspace=None
                    )
                assert time.monotonic() - started < 10  # the 3 s recall timeout, not a hang
                more = numbered([*log, events.Message(content="new", source="user")])
                with pytest.raises(UnavailableError):
                    await memory.index("s", more, tenant=None)
    finally:
        for leftover in proxy_dir.iterdir():
            leftover.unlink()
        proxy_dir.rmdir()


@pytest.mark.anyio
async def test_failing_embedder_makes_recall_unavailable(database_url: str, prefix: str) -> None:
    broken = OpenAIEmbedder("fake", api_key="k", base_url="http://127.0.0.1:9/v1", dim=8, max_retries=0, timeout=1)
    async with Store(database_url, schema=prefix) as store:
        memory = Memory.cached(store, broken, recall_timeout=3.0)
        started = time.monotonic()
        with pytest.raises(UnavailableError):
            await memory.recall(events.Recall(query="anything at all"), session="s", tenant=None, workspace=None)
        assert time.monotonic() - started < 10  # the 3 s recall timeout, not a hang
        with pytest.raises(UnavailableError):
            await memory.index("s", numbered([events.Think(thought="x")]), tenant=None)
    await broken.aclose()


@pytest.mark.anyio
async def test_reembed_moves_rows_to_the_current_model(local: LocalEmbedder, database_url: str, prefix: str) -> None:
    async with Store(database_url, schema=prefix) as store:
        log = numbered([events.Message(content=f"note {i} about the staging cluster", source="user") for i in range(5)])
        memory = Memory(store, CachedEmbedder(local))
        await memory.index("s", log, tenant=None)
        # pretend those rows came from an older model of another width
        rows = await store.stale_rows("nothing-matches", 10)
        assert len(rows) == 5
        await store.replace_embeddings("old-model", rows, np.full((5, 8), 0.35, dtype=np.float32))
        assert await store.models() == {"old-model": 5}
        assert await memory.search("staging cluster", session="s", tenant=None, k=5) != []  # full text still finds
        hits_before = await store.vector_search(
            (await memory.embedder.embed(["staging"]))[0], model=local.model, k=5, tenant=None, session="s"
        )
        assert hits_before == []  # no vectors of the current model yet: nothing mixed
        assert await memory.reembed(batch_size=2, max_batches=1) == 2
        assert await store.models() == {"old-model": 3, local.model: 2}
        assert await memory.reembed(batch_size=2) == 3
        assert await store.models() == {local.model: 5}
        result = await memory.search("staging cluster notes", session="s", tenant=None, k=5)
        assert len(result) == 5
