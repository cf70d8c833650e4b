"""Prometheus scrapes in tests: fetch an endpoint, read its samples."""

from __future__ import annotations

import urllib.error
import urllib.request

import anyio
from prometheus_client.parser import text_string_to_metric_families


def http_get(port: int, path: str) -> tuple[int, str, bytes]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as resp:
            return resp.status, resp.headers["Content-Type"], resp.read()
    except urllib.error.HTTPError as err:
        with err:
            return err.code, err.headers["Content-Type"], err.read()


async def get(port: int, path: str) -> tuple[int, str, bytes]:
    return await anyio.to_thread.run_sync(http_get, port, path)


def samples(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return out


def value(scraped: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str, **labels: str) -> float:
    matches = [v for (n, lab), v in scraped.items() if n == name and set(labels.items()) <= lab]
    assert matches, f"{name} {labels} not in the scrape"
    return sum(matches)
