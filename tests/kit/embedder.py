"""One local embedder for the whole test process: the ONNX model loads once, not per module."""

from __future__ import annotations

from riverbed.memory.embedders import LocalEmbedder

#: The instance (loaded on first use, or by :func:`shared_local`).
LOCAL = LocalEmbedder()


def shared_local() -> LocalEmbedder:
    """The process's loaded :class:`LocalEmbedder` (it holds no per-test state)."""
    LOCAL.load()
    return LOCAL
