"""``riverbed serve``: the HTTP API for agents in any language, and the web console.

==============  ===========================================================================
module          what
==============  ===========================================================================
app             the Starlette app, security headers, probes, and :func:`serve` (uvicorn)
routes          the ``/v1`` handlers and their bounds (:class:`ServeConfig`)
auth            API keys: create, list, revoke, check (stored hashed in Redis)
sessions        a session's tenant, and the session list with owners and lag
sse             a session's log as Server-Sent Events, resumable with ``Last-Event-ID``
follow          one reader per followed session, fanning out to every event stream
limits          per key: request rate (a token bucket in Redis), open streams, revocation
problems        errors as ``application/problem+json``, translated in one place
openapi         the OpenAPI document, with the event schemas msgspec generates
static/         the console: plain HTML, CSS and JavaScript, no build step
==============  ===========================================================================
"""

from riverbed.serve.app import create_app, serve
from riverbed.serve.auth import KeyStore, Principal
from riverbed.serve.routes import Api, ServeConfig

__all__ = ["Api", "KeyStore", "Principal", "ServeConfig", "create_app", "serve"]
