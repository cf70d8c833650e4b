"""Pure parts of memory: reciprocal rank fusion, recency, hybrid ranking and chunking."""

from __future__ import annotations

import datetime as dt
import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from riverbed import events
from riverbed.memory.chunking import ChunkPolicy, chunk_text, event_chunks, searchable
from riverbed.memory.ranking import (
    best_per_event,
    explained_rank,
    hybrid_rank,
    matched_words,
    recency_factor,
    rrf,
)
from riverbed.memory.store import Candidate

NOW = dt.datetime(2026, 11, 20, 12, 0, tzinfo=dt.UTC)


def cand(event_id: int, *, chunk: int = 0, session: str = "s", age_hours: float = 0.0, text: str = "") -> Candidate:
    ts = NOW - dt.timedelta(hours=age_hours)
    return Candidate(session=session, event_id=event_id, chunk=chunk, kind="message", ts=ts, text=text, score=0.0)


# --- RRF ---------------------------------------------------------------------------------------


def test_rrf_scores_and_order() -> None:
    fused = rrf([["a", "b", "c"], ["c", "a", "d"]], key=lambda x: x, c=60)
    scores = dict(fused)
    assert scores["a"] == pytest.approx(1 / 61 + 1 / 62)
    assert scores["c"] == pytest.approx(1 / 63 + 1 / 61)
    assert scores["b"] == pytest.approx(1 / 62)
    assert scores["d"] == pytest.approx(1 / 63)
    assert [x for x, _ in fused] == ["a", "c", "b", "d"]


def test_rrf_agreement_beats_a_single_top_rank() -> None:
    fused = rrf([["solo", "both"], ["other", "both"]], key=lambda x: x)
    assert fused[0][0] == "both"


def test_rrf_weights_duplicates_and_empty() -> None:
    assert rrf([[], []], key=lambda x: x) == []
    fused = rrf([["x", "x", "y"]], key=lambda x: x)
    assert dict(fused)["y"] == pytest.approx(1 / 63)  # a repeated item keeps its first rank only
    weighted = rrf([["a"], ["b"]], key=lambda x: x, weights=[1.0, 2.0])
    assert [x for x, _ in weighted] == ["b", "a"]
    with pytest.raises(ValueError, match="one weight per ranking"):
        rrf([["a"]], key=lambda x: x, weights=[1.0, 1.0])


@given(st.lists(st.lists(st.integers(0, 30), max_size=15), min_size=1, max_size=4))
def test_rrf_properties(rankings: list[list[int]]) -> None:
    fused = rrf(rankings, key=lambda x: x)
    items = [x for x, _ in fused]
    assert sorted(items) == sorted({x for r in rankings for x in r})
    scores = [s for _, s in fused]
    assert scores == sorted(scores, reverse=True)
    assert all(0 < s <= len(rankings) / 61 + 1e-12 for s in scores)


# --- recency -----------------------------------------------------------------------------------


def test_recency_factor() -> None:
    assert recency_factor(1e9, None) == 1.0
    assert recency_factor(0, 3600) == 1.0
    assert recency_factor(3600, 3600) == pytest.approx(0.5)
    assert recency_factor(7200, 3600) == pytest.approx(0.25)
    assert recency_factor(-50, 3600) == 1.0
    with pytest.raises(ValueError, match="positive"):
        recency_factor(1, 0)


def test_hybrid_rank_fuses_dedupes_and_applies_recency() -> None:
    vector = [cand(1, age_hours=48, text="old"), cand(2, text="new"), cand(1, chunk=1, age_hours=48)]
    text = [cand(1, age_hours=48, text="old"), cand(3, age_hours=1)]
    hits = hybrid_rank(vector, text, k=5, now=NOW)
    assert [h.event_id for h in hits] == [1, 2, 3]  # one hit per event, agreement first
    assert hits[0].text == "old"
    assert all(isinstance(h, events.Hit) for h in hits)
    recent = hybrid_rank(vector, text, k=2, now=NOW, half_life_seconds=3600)
    assert [h.event_id for h in recent] == [2, 3]  # two days old loses to fresh
    assert len(hybrid_rank(vector, text, k=1, now=NOW)) == 1


def test_best_per_event_keeps_first() -> None:
    pairs = [(cand(1, chunk=2), 0.9), (cand(1, chunk=0), 0.5), (cand(1, session="other"), 0.4)]
    assert [(c.session, c.chunk) for c, _ in best_per_event(pairs)] == [("s", 2), ("other", 0)]


# --- chunking ----------------------------------------------------------------------------------


def test_chunk_text_windows_overlap_and_cap() -> None:
    assert chunk_text("   ") == []
    assert chunk_text("short text") == ["short text"]
    words = " ".join(f"word{i:04d}" for i in range(1000))  # 9,000 characters
    pieces = chunk_text(words, size=1000, overlap=150)
    assert all(len(p) <= 1000 for p in pieces)
    assert len(pieces) >= 9
    for a, b in itertools.pairwise(pieces):
        assert a.split()[-1] in b.split()[:30]  # consecutive windows overlap
        assert not b.startswith("ord")  # cuts fall on whitespace
    assert {w for p in pieces for w in p.split()} == set(words.split())
    capped = chunk_text(words, size=200, overlap=20, max_chunks=6)
    assert len(capped) == 6
    assert capped[0].startswith("word0000")
    assert capped[-1].endswith("word0999")


@given(st.text(max_size=3000), st.integers(50, 400))
def test_chunk_text_never_exceeds_size(text: str, size: int) -> None:
    for piece in chunk_text(text, size=size, overlap=size // 4):
        assert 0 < len(piece) <= size


def test_event_chunks_per_kind() -> None:
    out = events.CmdOutput(command="pytest -q", content="2 failed, 10 passed", exit_code=1)
    assert event_chunks(out) == ["$ pytest -q (exit 1)\n2 failed, 10 passed"]
    assert event_chunks(events.CmdRun(command="ls -la")) == []  # its output carries the command
    assert event_chunks(events.CmdRun(command="ls -la"), ChunkPolicy(skip=())) == ["$ ls -la"]
    assert event_chunks(events.Message(content="deploy to staging", source="user")) == ["user:\ndeploy to staging"]
    edit = events.FileEdit(command="str_replace", path="app.py", old_str="retries = 3", new_str="retries = 5")
    assert event_chunks(edit) == ["edit (str_replace) app.py\nreplaced: retries = 3\nretries = 5"]
    assert event_chunks(events.FileWrite(path="a.txt", content="hello")) == ["wrote file a.txt\nhello"]
    assert event_chunks(events.Think(thought="check the logs")) == ["thought:\ncheck the logs"]
    assert event_chunks(events.Finish(final_thought="done", outputs={"pr": 7})) == ["finished:\ndone\npr: 7"]
    assert event_chunks(events.Condensation(forgotten=[(1, 5)], summary="we set up CI")) == [
        "summary of earlier events:\nwe set up CI"
    ]
    py = events.PythonOutput(content="hi", result="42", exception=None)
    assert event_chunks(py) == ["python output:\nhi\nresult: 42"]
    result = events.RecallResult(
        recall_type="knowledge", knowledge=[events.Knowledge(name="git", trigger="git", content="use rebase")]
    )
    # a recall result is a copy of what it found: not indexed, and by reference only when asked to
    assert event_chunks(result) == []
    assert event_chunks(result, ChunkPolicy(skip=())) == ["recalled:\nknowledge: git"]
    hits = events.RecallResult(
        recall_type="semantic",
        hits=[events.Hit(session="s", event_id=4, kind="message", score=0.9, text="deploy to staging")],
    )
    assert event_chunks(hits, ChunkPolicy(skip=())) == ["recalled:\nmessage 4 of s"]
    # nothing to index
    assert event_chunks(events.Recall(query="where is the config?")) == []
    assert event_chunks(events.CmdOutput(command="true", content="")) == []
    assert event_chunks(events.SessionConfig(env={"A": "1"})) == []


def test_chunks_hold_no_nul_and_no_lone_surrogate() -> None:
    """Postgres text holds no NUL and UTF-8 no lone surrogate: both are cleaned from the
    searchable text (the event itself is not changed)."""
    every_char = "".join(chr(i) for i in range(256))
    out = events.CmdOutput(command="find . -print0", content=f"a\x00b{every_char}\ud800 tail", exit_code=0)
    (chunk,) = event_chunks(out)
    assert "\x00" not in chunk
    assert "\ud800" not in chunk
    assert "ab" in chunk
    assert "\ufffd tail" in chunk
    assert "\x00" in out.content
    (path,) = event_chunks(events.FileWrite(path="dir\x00/f\udcff", content="x"))
    assert path == "wrote file dir/f\ufffd\nx"
    assert searchable("plain") == "plain"


def test_event_chunks_long_output_and_skip_policy() -> None:
    log = "\n".join(f"step {i}: building target number {i} ok" for i in range(300))
    chunks = event_chunks(events.CmdOutput(command="make all", content=log))
    assert len(chunks) > 5
    assert all(c.startswith("$ make all\n") and len(c) <= 1000 for c in chunks)
    policy = ChunkPolicy(skip={"cmd_output"})
    assert event_chunks(events.CmdOutput(command="make", content="x"), policy) == []
    assert event_chunks(events.Recall(query="q"), policy) == []  # ("recall" is not in this skip set but has no text)
    with pytest.raises(ValueError, match="ChunkPolicy"):
        ChunkPolicy(size=10)


def test_explained_rank_says_by_what_each_hit_matched() -> None:
    now = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)

    def cand(event_id: int, text: str, score: float) -> Candidate:
        return Candidate(session="s", event_id=event_id, chunk=0, kind="message", ts=now, text=text, score=score)

    by_meaning = [cand(1, "print a warm hello", 0.81), cand(2, "the greeting script", 0.62)]
    by_words = [cand(2, "the greeting script", 0.3)]
    matches = explained_rank(by_meaning, by_words, ["which", "greeting", "scripts"], k=5, now=now)
    assert [m.hit.event_id for m in matches] == [2, 1]
    both, meaning = matches
    assert (both.meaning_rank, both.similarity, both.words_rank, both.words) == (2, 0.62, 1, ["greeting", "scripts"])
    assert (meaning.meaning_rank, meaning.words_rank, meaning.words) == (1, None, [])
    assert meaning.as_dict()["why"] == {"meaning": {"rank": 1, "similarity": 0.81}, "words": None}
    assert matched_words(["the", "greetings", "x"], "Greeting!") == ["greetings"]  # stop words left out
