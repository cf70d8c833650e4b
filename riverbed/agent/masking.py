"""Masking secrets' values in text and events before anything is appended (pure, no I/O).

::

    masker = Masker({"GITHUB_TOKEN": token})
    masker.mask("push with ghp_abc... failed")    # "push with [secret GITHUB_TOKEN] failed"
    event = masker.mask_event(event)               # every string field of an event, masked
    stream = masker.stream()                       # one command's output, chunk by chunk:
    stream.feed(chunk) + ... + stream.flush()      #   a value across two chunks is masked too

Each value is looked for as itself and in the forms a program most often prints it in: base64
(standard and URL-safe, with and without padding), URL-encoded (``quote``, ``quote`` with no safe
characters, ``quote_plus``) and hex (lower and upper case) of its UTF-8 bytes.  Every form is
replaced with ``[secret NAME]``; the longest forms are tried first, so a value inside a longer
form leaves no part of that form behind.  One regular expression holds every form of every value.

What it cannot catch: a value the program transforms otherwise (reversed, split across lines on
purpose, another encoding, compressed, encrypted, one character at a time), and base64 of the
value inside a longer base64 text that does not start at it (its characters depend on what comes
before).  A value that is part of a marker (``[secret NAME]`` itself) is removed rather than
marked, so the output never holds a form of a value.
"""

from __future__ import annotations

import base64
import re
import urllib.parse
from collections.abc import Mapping
from typing import Any, TypeVar

import msgspec

__all__ = ["Masker", "StreamMasker", "forms"]

E = TypeVar("E", bound=msgspec.Struct)


def forms(value: str) -> set[str]:
    """``value`` and the encoded forms of it that masking replaces."""
    raw = value.encode()
    found = {value}
    for encoded in (base64.b64encode(raw), base64.urlsafe_b64encode(raw)):
        text = encoded.decode()
        found |= {text, text.rstrip("=")}
    found |= {
        urllib.parse.quote(value),
        urllib.parse.quote(value, safe=""),
        urllib.parse.quote_plus(value),
        raw.hex(),
        raw.hex().upper(),
    }
    return {form for form in found if form}


class Masker:
    """Replaces the values of ``secrets`` (name -> value), and their encoded forms, in text."""

    def __init__(self, secrets: Mapping[str, str]) -> None:
        self.secrets = dict(secrets)
        owner: dict[str, str] = {}
        for name, value in sorted(self.secrets.items()):
            for form in forms(value):
                owner.setdefault(form, name)
        self._marker = {form: f"[secret {name}]" for form, name in owner.items()}
        ordered = sorted(owner, key=lambda form: (-len(form), form))
        self._pattern = re.compile("|".join(re.escape(form) for form in ordered)) if ordered else None
        self.max_len = len(ordered[0]) if ordered else 0
        """The longest form: a stream keeps ``max_len - 1`` characters back."""

    def _mark(self, match: re.Match[str]) -> str:
        return self._marker[match.group()]

    def mask(self, text: str) -> str:
        """``text`` with every value and encoded form replaced by ``[secret NAME]``."""
        if self._pattern is None or not text:
            return text
        masked = self._pattern.sub(self._mark, text)
        # A value that is (part of) a marker could be formed by a marker and its neighbours:
        # then remove forms until none is left (each pass shortens the text, so this ends).
        while self._pattern.search(masked):
            masked = self._pattern.sub("", masked)
        return masked

    def mask_value(self, value: Any) -> Any:
        """Every string in ``value`` (nested lists and dicts, keys too) masked."""
        if isinstance(value, str):
            return self.mask(value)
        if isinstance(value, list):
            return [self.mask_value(item) for item in value]
        if isinstance(value, dict):
            return {self.mask_value(key): self.mask_value(item) for key, item in value.items()}
        return value

    def mask_event(self, event: E) -> E:
        """``event`` with every string field masked (the same object when nothing changed).

        Raises :class:`msgspec.ValidationError` only when a form sits in a field of a fixed shape
        (the timestamp, a literal such as ``kind``), which a value of 8 characters or more set
        by a person does not: no event with a value in it is ever rebuilt silently."""
        if self._pattern is None:
            return event
        plain = msgspec.to_builtins(event, builtin_types=(bytes, bytearray, memoryview))
        masked = self.mask_value(plain)
        if masked == plain:
            return event
        return msgspec.convert(masked, type=type(event), builtin_types=(bytes, bytearray, memoryview))

    def stream(self) -> StreamMasker:
        """A masker for one output that arrives in chunks."""
        return StreamMasker(self)


class StreamMasker:
    """Masks one output chunk by chunk: what :meth:`feed` returns is final, and a value that
    straddles two chunks is masked, since the last ``max_len - 1`` characters wait for the next
    chunk (or :meth:`flush`)."""

    def __init__(self, masker: Masker) -> None:
        self.masker = masker
        self._pending = ""

    def feed(self, chunk: str) -> str:
        """The masked text that is certain now (possibly empty)."""
        pattern = self.masker._pattern
        if pattern is None:
            return chunk
        text = self._pending + chunk
        cut = len(text) - (self.masker.max_len - 1)
        if cut <= 0:
            self._pending = text
            return ""
        out: list[str] = []
        at = 0
        for match in pattern.finditer(text):
            # Every form starting before ``cut`` ends within ``text``, so the matches found
            # there are the ones the whole output would give.
            if match.start() >= cut:
                break
            out.append(text[at : match.start()])
            out.append(self.masker._marker[match.group()])
            at = match.end()
        if at < cut:
            out.append(text[at:cut])
            at = cut
        self._pending = text[at:]
        return self.masker.mask("".join(out))

    def flush(self) -> str:
        """The rest of the output, masked (the stream is empty afterwards)."""
        rest, self._pending = self._pending, ""
        return self.masker.mask(rest)
