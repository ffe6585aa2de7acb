"""Which data directories the running ``taskboard serve`` processes keep their embedded
database in, so that a server command run from another directory finds that database.

``taskboard serve`` on the embedded database registers its data directory (a file named
after its pid, in the user's runtime directory) while it runs. A command that uses a
database but never makes one (``create_agent``, ``createsuperuser``, ...), run where there
is no database, takes the one a running ``serve`` uses, when exactly one does; otherwise it
refuses in one line (:class:`NoDatabase`) rather than make a new, empty database beside
it.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from pathlib import Path

import platformdirs
import psutil

# Set by the taskboard command before the settings are read, for a command that uses a
# database but never makes one: the settings then look for a served database
# (taskboard.settings), and the embedded engine refuses to make a new one
# (taskboard.embedded.server).
only_existing = False

# The data directory the settings took from a running serve (None: the usual one).
found: Path | None = None


class NoDatabase(Exception):
    """There is no embedded database where the command looked, and it may not make one."""


def registry() -> Path:
    """Return the directory that holds one file per running ``serve`` on the embedded
    database (the user's runtime directory: XDG_RUNTIME_DIR where it is set)."""
    return platformdirs.user_runtime_path("taskboard") / "serving"


@contextlib.contextmanager
def registered(data_dir: Path) -> Iterator[None]:
    """Register ``data_dir`` as served by this process for as long as the block runs."""
    directory = registry()
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    entry = directory / str(os.getpid())
    record = {"data_dir": str(data_dir), "started": psutil.Process().create_time()}
    entry.write_text(json.dumps(record))
    try:
        yield
    finally:
        entry.unlink(missing_ok=True)


def served() -> list[Path]:
    """Return the data directories that running ``serve`` processes use, each once.

    An entry whose process is gone (killed with SIGKILL: it could not unregister), or
    whose pid now belongs to a later process, is removed.
    """
    directories: set[Path] = set()
    with contextlib.suppress(FileNotFoundError):
        for entry in registry().iterdir():
            try:
                record = json.loads(entry.read_text())
                alive = psutil.Process(int(entry.name)).create_time() == record["started"]
            except (OSError, ValueError, KeyError, psutil.Error):
                alive = False
            if alive:
                directories.add(Path(record["data_dir"]))
            else:
                entry.unlink(missing_ok=True)
    return sorted(directories)


def missing(data_dir: Path) -> NoDatabase:
    """Return the error that says there is no database in ``data_dir`` and what to do."""
    others = served()
    if data_dir in others:
        return NoDatabase(
            f"no database in {data_dir} yet: the `taskboard serve` on it is making it; try "
            "again once it serves"
        )
    if others:
        which = ", ".join(str(path) for path in others)
        return NoDatabase(
            f"no database in {data_dir}; `taskboard serve` runs on {which}: set "
            "TASKBOARD_DATA_DIR to the one to use"
        )
    return NoDatabase(
        f"no database in {data_dir}, and no `taskboard serve` runs on an embedded database: "
        "run this where `taskboard serve` ran, or set TASKBOARD_DATA_DIR to the directory its "
        "banner names (`taskboard migrate` makes a new database here)"
    )
