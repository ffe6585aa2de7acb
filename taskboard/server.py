"""How ``taskboard serve`` runs uvicorn, so that every server process stops cleanly.

On SIGTERM or SIGINT uvicorn shuts down gracefully: it stops accepting connections, waits
up to ``timeout_graceful_shutdown`` for the responses in progress, runs the application's
lifespan shutdown, and finally raises the signal again with the handler that was in place
before it started. One part of that does not suit this application:

- The handler in place before uvicorn, for SIGTERM, is the default one: it ends the
  process on the spot, without running the ``atexit`` functions. The embedded PostgreSQL
  package releases a process's hold on the server in one, and stops the server after the
  last process (taskboard.embedded). :class:`Config` installs a SIGTERM handler that
  exits normally instead, with status 0, in every server process.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from types import FrameType

import uvicorn
from uvicorn.config import STARTUP_FAILURE
from uvicorn.supervisors import Multiprocess

EXIT_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Config(uvicorn.Config):
    """uvicorn's configuration, plus the preparation of each server process."""

    def configure_logging(self) -> None:
        # uvicorn calls this first in every process that serves, before it takes over the
        # signals: in this process (Config.__init__) and in each worker process that
        # ``--workers`` spawns (uvicorn._subprocess.subprocess_started), which is handed
        # this Config. It is the one hook that runs in each of them at that point.
        super().configure_logging()
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, _exit_normally)


def _exit_normally(signum: int, frame: FrameType | None) -> None:
    sys.exit(0)


def run(config: Config) -> None:
    """Serve ``config`` as ``uvicorn.run`` does, in one process or with workers.

    (``uvicorn.run`` takes keyword arguments and makes its own Config; this takes ours.)
    """
    server = uvicorn.Server(config)
    try:
        if config.workers > 1:
            Multiprocess(config, sockets=[config.bind_socket()]).run()
        else:
            server.run()
    except KeyboardInterrupt:
        pass
    finally:
        if config.uds and os.path.exists(config.uds):
            os.remove(config.uds)
    if config.workers == 1 and not server.started:
        sys.exit(STARTUP_FAILURE)
