"""The client an agent process needs: :class:`~riverbed.client.session.Bus` and its sessions.

``session`` (connect, append, act, read and follow a session's log), ``answers`` (many waits
for answers on a few connections) and ``context`` (a user's control of what the agent sees).
It imports the bus and the pure parts of memory, never the runtime, the workers or serve, so
``pip install riverbed`` alone is enough for it.
"""
