"""riverbed: an event-sourced runtime for AI agents on Redis Streams and Postgres + pgvector."""

from riverbed.agent.define import Agent, RunLimits, StuckLimits
from riverbed.agent.mcp import MCPServer
from riverbed.agent.tooling import Tool, ToolContext, ToolError, tool
from riverbed.client.session import Bus, Session, connect
from riverbed.errors import (
    ActTimeout,
    AlreadyAnswered,
    AppendConflict,
    ConfigError,
    DecodeError,
    FencedError,
    IdempotencyKeyReused,
    InputError,
    NotFoundError,
    QuotaExceeded,
    RiverbedError,
    SystemEventRefused,
    TenantMismatch,
    UnavailableError,
)

__all__ = [
    "ActTimeout",
    "Agent",
    "AlreadyAnswered",
    "AppendConflict",
    "Bus",
    "ConfigError",
    "DecodeError",
    "FencedError",
    "IdempotencyKeyReused",
    "InputError",
    "MCPServer",
    "NotFoundError",
    "QuotaExceeded",
    "RiverbedError",
    "RunLimits",
    "Session",
    "StuckLimits",
    "SystemEventRefused",
    "TenantMismatch",
    "Tool",
    "ToolContext",
    "ToolError",
    "UnavailableError",
    "connect",
    "tool",
]
__version__ = "0.1.0"
