"""Images for vision models: a ``message``'s images and the images a Python cell saved.

::

    images = WorkspaceImages(Path(settings.workspace) / workspace_name("s-1"), max_bytes=5 << 20)
    images("plots/loss.png")          # 'data:image/png;base64,...' (or None: missing, too big, refused)
    images("https://example.com/a.png")  # passed through

A workspace file is read by :func:`riverbed.runtime.files.read_bytes`, through
:mod:`riverbed.confine` (no symlink or ``..`` out of the workspace, no hard links), at most
``max_bytes`` bytes; anything else is ``None``, and the prompt says the image was left out
instead.  :func:`vision` reads ``RIVERBED_LLM_VISION``: ``0`` (off, the default), ``1`` (on
for every model) or a comma-separated list of the models that see images.
"""

from __future__ import annotations

import base64
from collections.abc import Callable
from pathlib import Path, PurePosixPath

from riverbed.runtime.files import read_bytes

__all__ = ["IMAGE_TYPES", "ImageSource", "WorkspaceImages", "is_image", "vision"]

ImageSource = Callable[[str], str | None]
"""An image reference (URL or workspace path) to the URL a model is sent, or None."""

IMAGE_TYPES = {".png": "image/png", ".jpg": "image/jpeg", ".jpeg": "image/jpeg", ".gif": "image/gif",
               ".webp": "image/webp"}  # fmt: skip


def is_image(path: str) -> bool:
    return PurePosixPath(path).suffix.lower() in IMAGE_TYPES


def vision(setting: str, model: str) -> bool:
    """Whether ``model`` is sent images under ``RIVERBED_LLM_VISION`` (``0``, ``1`` or a model list)."""
    value = setting.strip()
    if value in ("", "0"):
        return False
    if value == "1":
        return True
    return model in {name.strip() for name in value.split(",") if name.strip()}


class WorkspaceImages:
    """Resolves image references against one session's workspace (see the module docstring)."""

    def __init__(self, root: Path, *, max_bytes: int) -> None:
        self.root = root
        self.max_bytes = max_bytes

    def __call__(self, ref: str) -> str | None:
        if ref.startswith(("https://", "http://")):
            return ref
        if ref.startswith("data:image/"):
            return ref if len(ref) <= self.max_bytes * 4 // 3 + 100 else None
        mime = IMAGE_TYPES.get(PurePosixPath(ref).suffix.lower())
        if mime is None:
            return None
        data = read_bytes(self.root, ref, self.max_bytes)
        if data is None:
            return None
        return f"data:{mime};base64,{base64.b64encode(data).decode('ascii')}"
