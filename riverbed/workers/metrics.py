"""Prometheus metrics of one worker process, in a registry of its own.

====================================  =========  ===============================================
metric                                type       labels / meaning
====================================  =========  ===============================================
riverbed_lag_events                   gauge      role, worker: events not yet delivered, summed
                                                 over the sessions this worker owns
riverbed_pending_entries              gauge      role, worker: delivered, not yet acknowledged
riverbed_oldest_pending_seconds       gauge      role, worker: idle time of the oldest of them
riverbed_owned_sessions               gauge      role, worker: sessions held right now
riverbed_handled_total                counter    role, worker: entries handled
riverbed_redeliveries_total           counter    role, worker: entries recovered from a dead owner
riverbed_dead_letters_total           counter    role, worker: entries moved to the dead letters
riverbed_takeovers_total              counter    role, worker: sessions taken over from a peer
riverbed_append_conflicts_total       counter    role, worker: appends refused by expected_last
riverbed_handler_seconds              histogram  role, worker: one handler call (a batch)
riverbed_embedding_cache_hit_ratio    gauge      role, worker, level (``lru`` | ``shared``)
riverbed_llm_tokens_total             counter    worker, model, kind (``prompt`` | ``cached`` |
                                                 ``completion``): tokens of the ``llm_response``
                                                 events the memory role indexed
riverbed_llm_cost_usd_total           counter    worker, model: their cost (``RIVERBED_PRICES``;
                                                 models without a price are left out)
riverbed_agent_runs_ended_total       counter    worker, reason: runs the agent role ended here
riverbed_agent_model_calls_total      counter    worker: model calls (every try); also
                                                 ``_failures_total`` and ``_call_seconds_total``
riverbed_agent_runs_taken_over_total  counter    worker: open runs picked up after a crash or drain
riverbed_agent_sessions_taken_total   counter    worker: sessions the agent role took; also
                                                 ``_taken_kept_total``, those taken again from the
                                                 fold it kept when it let them go, and
                                                 ``riverbed_agent_take_events_read_total``, the
                                                 events their takes read from the logs
riverbed_agent_runs                   gauge      worker, state: ``running``: open runs this worker owns
                                                 now; ``finished``, ``failed``, ``cancelled``: runs
                                                 it ended since it started
riverbed_agent_pace_runs              gauge      worker: how many runs this worker takes on at once
                                                 now (``workers/agent_pace.py``; absent when
                                                 ``RIVERBED_AGENT_PACE=0``); also
                                                 ``riverbed_agent_step_own_seconds``, the last
                                                 look's median time a step cost the role itself
riverbed_agent_model_latency_seconds  histogram  worker, model: one model call (every try)
riverbed_agent_tokens_total           counter    worker, tenant, model, kind (``prompt`` | ``cached``
                                                 | ``completion``): tokens of the responses the
                                                 agent role appended (tenant ``""``: none)
riverbed_agent_cost_usd_total         counter    worker, tenant, model: their cost (``RIVERBED_PRICES``);
                                                 ``model`` is the worker's or a priced one, else
                                                 ``other`` (a run's model is its client's choice)
riverbed_gc_frozen_objects            gauge      worker: objects the garbage collector leaves out
                                                 (the heap frozen once the worker started:
                                                 :func:`~riverbed.workers.main.tune_collector`)
python_gc_collections_total           counter    generation: the collector's runs (``2``: full
                                                 ones); also ``python_gc_objects_collected_total``
                                                 and ``python_gc_objects_uncollectable_total``
====================================  =========  ===============================================

Counters and ``owned_sessions`` are read from each :class:`~riverbed.bus.consumer.OwnerStats`
at scrape time, so they are never stale and cost nothing between scrapes.  The three backlog
gauges need Redis reads; :meth:`WorkerMetrics.refresh` updates them (the HTTP server calls it
every few seconds, see :mod:`riverbed.workers.http`).

Handler latency reaches the histogram through the owner's observer callbacks
(``OwnerStats.observers``), called once per handler call.

Embedding cache ratios: ``lru`` is the share of all lookups answered by the in-process LRU;
``shared`` is the share of the lookups that reached the shared Postgres level and were
answered there.  A cache is any object with ``lru_hits``, ``db_hits`` and ``misses``
counters (:class:`~riverbed.memory.embedcache.CachedEmbedder`), given with
:meth:`WorkerMetrics.watch_cache` or found as a handler's ``embedder`` or ``cache`` attribute.
"""

from __future__ import annotations

import gc
import math
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, Protocol, runtime_checkable

import anyio
from prometheus_client import CollectorRegistry, Gauge, GCCollector, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from riverbed.agent.usage import UsageCounters
from riverbed.bus.consumer import Owner
from riverbed.bus.keys import Keys
from riverbed.bus.redis_client import RedisClient
from riverbed.bus.status import session_backlogs

__all__ = ["CONTENT_TYPE", "METRIC_NAMES", "USAGE_METRIC_NAMES", "CacheCounters", "Observed", "WorkerMetrics"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
HANDLER_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
LABELS = ("role", "worker")

_COUNTERS = {
    "riverbed_handled": ("handled", "Entries handled by a role's handler."),
    "riverbed_redeliveries": ("redeliveries", "Entries recovered after their previous owner died."),
    "riverbed_dead_letters": ("dead_letters", "Entries moved to the dead-letter stream."),
    "riverbed_takeovers": ("takeovers", "Sessions taken over from an owner whose lease expired."),
    "riverbed_append_conflicts": ("append_conflicts", "Appends refused because the log moved (expected_last)."),
}

#: The model-call series: in a memory worker's scrape once it indexed an ``llm_response``.
USAGE_METRIC_NAMES = frozenset({"riverbed_llm_tokens_total", "riverbed_llm_cost_usd_total"})

#: Every series name every worker's scrape contains (histograms and counters with their suffixes).
METRIC_NAMES = frozenset(
    {
        "riverbed_lag_events",
        "riverbed_pending_entries",
        "riverbed_oldest_pending_seconds",
        "riverbed_owned_sessions",
        "riverbed_embedding_cache_hit_ratio",
        *(f"{name}_total" for name in _COUNTERS),
        *(f"riverbed_handler_seconds{suffix}" for suffix in ("_bucket", "_sum", "_count")),
        "riverbed_gc_frozen_objects",
        "python_gc_collections_total",
    }
)


@runtime_checkable
class CacheCounters(Protocol):
    """Hit and miss counters of a two-level embedding cache."""

    lru_hits: int
    db_hits: int
    misses: int


class Observed(Protocol):
    """What the metrics read from a worker (:class:`riverbed.workers.main.Worker` has it all)."""

    @property
    def name(self) -> str: ...

    @property
    def client(self) -> RedisClient: ...

    @property
    def keys(self) -> Keys: ...

    @property
    def owners(self) -> Mapping[str, Owner]: ...


class WorkerMetrics:
    """The registry of one worker; :meth:`bind` it to the worker, then scrape :meth:`render`."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self._worker: Observed | None = None
        self._caches: dict[str, list[CacheCounters]] = {}
        self._observing: set[int] = set()
        self.registry.register(_ScrapeCollector(self))
        GCCollector(registry=self.registry)
        self.lag = Gauge(
            "riverbed_lag_events",
            "Events appended but not yet delivered to the role, summed over the sessions this worker owns.",
            LABELS,
            registry=self.registry,
        )
        self.pending = Gauge(
            "riverbed_pending_entries",
            "Entries delivered to the role and not yet acknowledged, on the sessions this worker owns.",
            LABELS,
            registry=self.registry,
        )
        self.oldest_pending = Gauge(
            "riverbed_oldest_pending_seconds",
            "How long the oldest unacknowledged entry of an owned session has waited.",
            LABELS,
            registry=self.registry,
        )
        self.handler_seconds = Histogram(
            "riverbed_handler_seconds",
            "Duration of one handler call (one batch of entries of one session).",
            LABELS,
            buckets=HANDLER_BUCKETS,
            registry=self.registry,
        )

    # --- wiring ----------------------------------------------------------------------------

    def bind(self, worker: Observed) -> None:
        """Read counters from ``worker``'s owners; hook handler timing where the owner allows it."""
        self._worker = worker
        for role, owner in worker.owners.items():
            for cache in _discover_caches(owner.handler):
                self.watch_cache(role, cache)
            if id(owner.stats) not in self._observing:
                owner.stats.observers.append(self.handler_seconds.labels(role, worker.name).observe)
                self._observing.add(id(owner.stats))
        for label in self._label_sets():
            for gauge in (self.lag, self.pending, self.oldest_pending):
                gauge.labels(*label)
            self.handler_seconds.labels(*label)

    def watch_cache(self, role: str, cache: CacheCounters) -> None:
        caches = self._caches.setdefault(role, [])
        if all(c is not cache for c in caches):
            caches.append(cache)

    # --- reading ---------------------------------------------------------------------------

    async def refresh(self, worker: Observed | None = None, *, timeout: float = 5.0) -> None:
        """Update the backlog gauges from Redis; raises (UnavailableError, TimeoutError) on failure."""
        if worker is not None and worker is not self._worker:
            self.bind(worker)
        bound = self._worker
        if bound is None:
            return
        with anyio.fail_after(timeout):
            now = await bound.client.time()  # also proves Redis answers when nothing is owned
            for role, owner in list(bound.owners.items()):
                sessions = list(owner.owned)
                backlogs = await session_backlogs(bound.client, bound.keys, role, sessions, now=now)
                self.lag.labels(role, bound.name).set(sum(b.lag for b in backlogs))
                self.pending.labels(role, bound.name).set(sum(b.pending for b in backlogs))
                self.oldest_pending.labels(role, bound.name).set(
                    max((b.oldest_pending_seconds for b in backlogs), default=0.0)
                )

    def render(self) -> bytes:
        """The Prometheus text exposition of this worker."""
        return generate_latest(self.registry)

    # --- scrape-time families --------------------------------------------------------------

    def _label_sets(self) -> list[tuple[str, str]]:
        bound = self._worker
        if bound is None:
            return []
        return [(role, bound.name) for role in bound.owners]

    def scrape(self) -> Iterator[Metric]:
        """The families read at scrape time (counters, owned sessions, cache ratios)."""
        bound = self._worker
        owners = dict(bound.owners) if bound is not None else {}
        worker = bound.name if bound is not None else ""
        for name, (attr, doc) in _COUNTERS.items():
            family = CounterMetricFamily(name, doc, labels=LABELS)
            for role, owner in owners.items():
                family.add_metric([role, worker], float(getattr(owner.stats, attr, 0)))
            yield family
        owned = GaugeMetricFamily("riverbed_owned_sessions", "Sessions this worker owns for a role.", labels=LABELS)
        for role, owner in owners.items():
            owned.add_metric([role, worker], float(len(owner.owned)))
        yield owned
        ratio = GaugeMetricFamily(
            "riverbed_embedding_cache_hit_ratio",
            "Share of embedding lookups answered by a cache level (lru: of all lookups; "
            "shared: of the lookups that reached the shared Postgres level).",
            labels=(*LABELS, "level"),
        )
        for role, caches in self._caches.items():
            lru, shared = _ratios(caches)
            ratio.add_metric([role, worker, "lru"], lru)
            ratio.add_metric([role, worker, "shared"], shared)
        yield ratio
        yield from self._usage(owners, worker)
        yield from self._agent(owners, worker)
        frozen = GaugeMetricFamily(
            "riverbed_gc_frozen_objects", "Objects the garbage collector leaves out (frozen).", labels=("worker",)
        )
        frozen.add_metric([worker], float(gc.get_freeze_count()))
        yield frozen

    @staticmethod
    def _agent(owners: Mapping[str, Any], worker: str) -> Iterator[Metric]:
        """The agent role's runs and model calls, from its handler's counters."""
        counters = getattr(owners["agent"].handler, "counters", None) if "agent" in owners else None
        if counters is None:
            return
        ended = CounterMetricFamily(
            "riverbed_agent_runs_ended", "Runs this worker ended, by reason.", labels=("worker", "reason")
        )
        for reason, count in sorted(counters.ended.items()):
            ended.add_metric([worker, reason], float(count))
        yield ended
        for name, attr, doc in (
            ("riverbed_agent_model_calls", "model_calls", "Model calls the agent role made (every try)."),
            ("riverbed_agent_model_failures", "model_failures", "Model calls that failed (every try)."),
            ("riverbed_agent_model_call_seconds", "model_seconds", "Time the model calls took, summed."),
            ("riverbed_agent_runs_taken_over", "taken_over", "Open runs picked up from a lost or drained owner."),
            ("riverbed_agent_sessions_taken", "taken", "Sessions the agent role took."),
            ("riverbed_agent_sessions_taken_kept", "taken_kept", "Sessions taken again from the fold kept of them."),
            ("riverbed_agent_take_events_read", "taken_events", "Events read from the logs of sessions taken."),
        ):
            family = CounterMetricFamily(name, doc, labels=("worker",))
            family.add_metric([worker], float(getattr(counters, attr)))
            yield family
        yield from WorkerMetrics._agent_runs(owners["agent"].handler, counters, worker)

    @staticmethod
    def _agent_runs(handler: Any, counters: Any, worker: str) -> Iterator[Metric]:
        """Runs by state, model-call latency, and tokens and cost by tenant and model."""
        runs = GaugeMetricFamily(
            "riverbed_agent_runs",
            "Runs by state: running, the open runs this worker owns; the others, the runs it ended since it started.",
            labels=("worker", "state"),
        )
        by_state = {"running": 0, "finished": 0, "failed": 0, "cancelled": 0}
        open_runs = getattr(handler, "open_runs", None)
        by_state["running"] = open_runs() if callable(open_runs) else 0
        for reason, count in counters.ended.items():
            state = "finished" if reason == "finish" else "cancelled" if reason == "cancelled" else "failed"
            by_state[state] += count
        for state, count in by_state.items():
            runs.add_metric([worker, state], float(count))
        yield runs
        pace = getattr(handler, "pace", None)
        if pace is not None:
            limit = GaugeMetricFamily(
                "riverbed_agent_pace_runs", "How many runs this worker takes on at once now.", labels=("worker",)
            )
            limit.add_metric([worker], float(math.floor(pace.limit)))
            yield limit
            if pace.median is not None:
                own = GaugeMetricFamily(
                    "riverbed_agent_step_own_seconds",
                    "The median time a step cost the agent role itself (the model's wait left out), lately.",
                    labels=("worker",),
                )
                own.add_metric([worker], pace.median)
                yield own
        latency = HistogramMetricFamily(
            "riverbed_agent_model_latency_seconds",
            "How long one model call took (every try).",
            labels=("worker", "model"),
        )
        for model, seen in sorted(counters.latency.items()):
            cumulative, buckets = 0, []
            for bound, count in zip(seen.bounds, seen.counts, strict=True):
                cumulative += count
                buckets.append((repr(float(bound)), float(cumulative)))
            buckets.append(("+Inf", float(seen.count)))
            latency.add_metric([worker, model], buckets, sum_value=seen.total)
        yield latency
        tokens = CounterMetricFamily(
            "riverbed_agent_tokens",
            "Tokens of the model responses the agent role appended, by tenant and model.",
            labels=("worker", "tenant", "model", "kind"),
        )
        for (tenant, model, kind), count in sorted(counters.tokens.items()):
            tokens.add_metric([worker, tenant, model, kind], float(count))
        yield tokens
        cost = CounterMetricFamily(
            "riverbed_agent_cost_usd",
            "Cost in USD of those responses (RIVERBED_PRICES), by tenant and model.",
            labels=("worker", "tenant", "model"),
        )
        for (tenant, model), usd in sorted(counters.cost.items()):
            cost.add_metric([worker, tenant, model], usd)
        yield cost

    @staticmethod
    def _usage(owners: Mapping[str, Any], worker: str) -> Iterator[Metric]:
        """The model calls' tokens and cost, from the memory role's :class:`UsageCounters`."""
        counters = getattr(owners["memory"].handler, "usage", None) if "memory" in owners else None
        if not isinstance(counters, UsageCounters):
            return
        tokens = CounterMetricFamily(
            "riverbed_llm_tokens", "Tokens of the model calls recorded in the logs.", labels=("worker", "model", "kind")
        )
        for (model, kind), count in sorted(counters.tokens.items()):
            tokens.add_metric([worker, model, kind], float(count))
        yield tokens
        cost = CounterMetricFamily(
            "riverbed_llm_cost_usd", "Cost of those calls in USD, by RIVERBED_PRICES.", labels=("worker", "model")
        )
        for model, usd in sorted(counters.cost.items()):
            cost.add_metric([worker, model], usd)
        yield cost


class _ScrapeCollector(Collector):
    def __init__(self, metrics: WorkerMetrics) -> None:
        self._metrics = metrics

    def collect(self) -> Iterable[Metric]:
        return list(self._metrics.scrape())


def _ratios(caches: list[CacheCounters]) -> tuple[float, float]:
    lru_hits = sum(c.lru_hits for c in caches)
    db_hits = sum(c.db_hits for c in caches)
    misses = sum(c.misses for c in caches)
    lookups = lru_hits + db_hits + misses
    reached_shared = db_hits + misses
    return (lru_hits / lookups if lookups else 0.0, db_hits / reached_shared if reached_shared else 0.0)


def _discover_caches(handler: Any) -> list[CacheCounters]:
    found: list[CacheCounters] = []
    for attr in ("embedder", "cache"):
        candidate = getattr(handler, attr, None)
        if isinstance(candidate, CacheCounters):
            found.append(candidate)
    return found
