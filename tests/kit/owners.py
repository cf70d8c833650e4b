"""An echoing role handler and owners of it, for the ownership tests."""

from __future__ import annotations

from riverbed import events
from riverbed.bus.consumer import Entry, Owner, SessionContext
from riverbed.client.session import Bus


class EchoHandler:
    """Answers file_read with the path as content; raises on paths starting with 'boom'."""

    role = "runtime"
    ignores_own_answers = False

    def __init__(self) -> None:
        self.seen: list[tuple[str, int]] = []

    async def open(self, ctx: SessionContext) -> None:
        return None

    async def close(self, ctx: SessionContext) -> None:
        return None

    async def recover(self, ctx: SessionContext, entries: list[Entry]) -> None:
        await self.handle(ctx, entries)

    async def handle(self, ctx: SessionContext, entries: list[Entry]) -> None:
        for entry in entries:
            self.seen.append((ctx.session, entry.id))
            if isinstance(entry.event, events.FileRead):
                if entry.event.path.startswith("boom"):
                    raise ValueError("handler bug")
                await self.echo(ctx, entry, entry.event)
            else:
                await ctx.ack([entry.id])

    async def echo(self, ctx: SessionContext, entry: Entry, read: events.FileRead) -> None:
        """Answer ``read`` with its path and this worker's name as the content."""
        await ctx.answer(entry, events.FileContent(path=read.path, content=ctx.worker))


def make_owner(bus: Bus, name: str, **kw: object) -> tuple[Owner, EchoHandler]:
    handler = EchoHandler()
    owner = Owner(bus.redis, bus.keys, handler, worker=name, url=bus.url, **kw)  # type: ignore[arg-type]
    return owner, handler
