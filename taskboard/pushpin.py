"""Pushpin in front of ``taskboard serve`` (``serve --pushpin``): the board's processes
behind one public port, in one command.

Pushpin (Debian's ``pushpin`` package) is started with the configuration kept in the
repository (``deploy/pushpin/``), rendered into ``TASKBOARD_DATA_DIR/pushpin``, and kept
running for as long as the server runs: if it dies, it is started again (what a process
manager would do for the system service). Browsers' streams then resume with
``Last-Event-ID`` through the new Pushpin, so nothing is missed or repeated.

Pushpin is the public listener; the board's N processes (``--workers N``) share one
private port behind it. Streams are held in Pushpin (board.live.grip): ``serve`` gives its
processes ``GRIP_URL`` (:attr:`Pushpin.grip_url`), with the publish port and signing key
chosen here once, so that they stay the same when Pushpin is started again.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import logging
import os
import secrets
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import httpx
import psutil

logger = logging.getLogger(__name__)

TEMPLATES = Path(__file__).resolve().parent.parent / "deploy" / "pushpin"
# Pushpin's internal TCP ports (the handler's), before the offset: 5560 to 5563.
INTERNAL_PORTS = range(5560, 5564)
SETTLE_SECONDS = 1.0
PUBLISH_PORT = 5561  # push_in_http_port: where events are published (board.live.grip)
# The longest run directory whose sockets' paths fit: the longest socket name in
# pushpin.conf and its services (condure: "pushpin-condure-out-stream") is under 40 bytes.
MAX_RUN_DIRECTORY = 60


class PushpinUnavailable(RuntimeError):
    """Pushpin is not installed, or could not start."""


def render(
    directory: Path,
    *,
    http_port: int,
    origin: str,
    port_offset: int,
    sig_key: str,
    proxies_in_front: bool = False,
) -> Path:
    """Write ``pushpin.conf`` and ``routes`` for one board into ``directory``; return the
    configuration's path.

    Pushpin appends its client's address to X-Forwarded-For, and the board believes that
    header from Pushpin (127.0.0.1). Without ``proxies_in_front`` it first drops what the
    client sent: else a client on the board's own host, itself at 127.0.0.1, could name
    any address there."""
    for sub in ("run", "log"):
        (directory / sub).mkdir(parents=True, exist_ok=True)
    values = {
        "rundir": str(run_directory(directory)),
        "logdir": str(directory / "log"),
        "http_port": str(http_port),
        "port_offset": str(port_offset),
        "sig_key": sig_key,
        "origin": origin,
        "x_forwarded_for": "append" if proxies_in_front else "truncate:0,append",
    }
    for name in ("pushpin.conf", "routes"):
        text = (TEMPLATES / name).read_text()
        for key, value in values.items():
            text = text.replace("{{" + key + "}}", value)
        (directory / name).write_text(text)
    return directory / "pushpin.conf"


def run_directory(directory: Path) -> Path:
    """Where Pushpin's services put their unix sockets (``ipc://`` in pushpin.conf):
    ``directory/run``, or, when that path is too long for a socket's (the kernel caps one
    at 107 bytes, and condure fails with "File name too long"), a private directory of this
    user's under the system's temporary directory, named after ``directory`` so that a
    restarted Pushpin finds the same one."""
    run = directory / "run"
    if len(str(run)) <= MAX_RUN_DIRECTORY:
        return run
    name = hashlib.sha256(str(directory.resolve()).encode()).hexdigest()[:16]
    short = Path(tempfile.gettempdir()) / f"taskboard-pushpin-{name}"
    short.mkdir(mode=0o700, exist_ok=True)
    if short.stat().st_uid != os.getuid() or short.stat().st_mode & 0o077:
        raise PushpinUnavailable(f"{short} is not this user's private directory")
    return short


def free_port_offset(host: str = "127.0.0.1") -> int:
    """Return an offset (a multiple of 10 from 100) at which Pushpin's internal ports are
    free, so that several boards (or a system Pushpin) can share a host. The search starts
    at a random offset, so that boards started at the same moment rarely pick the same."""
    offsets = list(range(100, 10_000, 10))
    start = secrets.randbelow(len(offsets))
    for offset in offsets[start:] + offsets[:start]:
        if all(_is_free(host, port + offset) for port in INTERNAL_PORTS):
            return offset
    raise PushpinUnavailable("no free ports for Pushpin's internal sockets")


def _is_free(host: str, port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind((host, port))
        except OSError:
            return False
    return True


class Pushpin:
    """One Pushpin (its runner starts condure, zurl, the proxy and the handler), started
    again when it dies, stopped with :meth:`stop`."""

    def __init__(
        self, directory: Path, *, http_port: int, origin: str, proxies_in_front: bool = False
    ) -> None:
        executable = shutil.which("pushpin")
        if executable is None:
            raise PushpinUnavailable("pushpin is not installed (Debian: apt-get install pushpin)")
        self.executable = executable
        self.directory = directory
        self.http_port = http_port
        self.origin = origin
        self.proxies_in_front = proxies_in_front
        # Chosen once: the server processes publish to this port and check this key
        # (grip_url), across restarts of Pushpin.
        self.port_offset = free_port_offset()
        self.sig_key = secrets.token_urlsafe(32)
        self.process: subprocess.Popen[bytes] | None = None
        self.restarts = 0
        self._stopping = threading.Event()
        self._watcher: threading.Thread | None = None

    @property
    def grip_url(self) -> str:
        """``GRIP_URL`` for the board's processes (board.live.grip): Pushpin's publish endpoint,
        and the issuer and key of the signature it puts on each request."""
        publish_port = PUBLISH_PORT + self.port_offset
        return (
            f"http://127.0.0.1:{publish_port}?verify-iss=pushpin"
            f"&verify-key=base64:{base64.b64encode(self.sig_key.encode()).decode()}"
        )

    def ready(self) -> bool:
        """Whether Pushpin's handler answers on its publish endpoint: until then, a stream
        that the proxy passes to it (a GRIP hold) fails."""
        url = f"http://127.0.0.1:{PUBLISH_PORT + self.port_offset}/publish/"
        try:
            return httpx.post(url, json={"items": []}, timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    def wait_ready(self, timeout: float = 30) -> Pushpin:
        deadline = time.monotonic() + timeout
        while not self.ready():
            if time.monotonic() > deadline:
                raise PushpinUnavailable(f"Pushpin did not start: see {self.directory / 'log'}")
            time.sleep(0.1)
        # The proxy hands each held stream to the handler over ZeroMQ, whose connections
        # settle a moment after the handler answers: a stream held before then is a 500.
        time.sleep(SETTLE_SECONDS)
        return self

    def start(self) -> Pushpin:
        self._kill_services()  # left behind by a server that was killed
        self._spawn()
        self._watcher = threading.Thread(target=self._watch, name="pushpin-watcher", daemon=True)
        self._watcher.start()
        return self

    def _spawn(self) -> None:
        config = render(
            self.directory,
            http_port=self.http_port,
            origin=self.origin,
            port_offset=self.port_offset,
            sig_key=self.sig_key,
            proxies_in_front=self.proxies_in_front,
        )
        with (self.directory / "log" / "pushpin.out").open("ab") as out:
            self.process = subprocess.Popen(
                [self.executable, "--config", str(config)],
                cwd=self.directory,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )

    def _watch(self) -> None:
        while not self._stopping.is_set():
            process = self.process
            assert process is not None
            code = process.wait()
            if self._stopping.is_set():
                return
            logger.warning("pushpin exited (status %s); starting it again", code)
            self._kill_services()
            self.restarts += 1
            time.sleep(0.5)
            if not self._stopping.is_set():
                self._spawn()

    def stop(self, timeout: float = 10) -> None:
        """Stop Pushpin and every process it started."""
        self._stopping.set()
        process = self.process
        if process is not None:
            with contextlib.suppress(ProcessLookupError):
                process.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout)
        self._kill_services()

    def _kill_services(self) -> None:
        """Kill the runner and the services it started for this board (condure, zurl, the
        proxy, the handler), found by their configuration's directory on their command
        line: the runner puts them in process groups of their own, and a killed runner
        leaves them behind, holding the port."""
        # condure's command line names only the run directory, the others' the directory.
        mine = (str(self.directory), str(run_directory(self.directory)))
        found = []
        for process in psutil.process_iter(["cmdline"]):
            with contextlib.suppress(psutil.Error):
                if any(m in part for part in process.info["cmdline"] or () for m in mine):
                    found.append(process)
        for process in found:
            with contextlib.suppress(psutil.Error):
                process.terminate()
        _, alive = psutil.wait_procs(found, timeout=5)
        for process in alive:
            with contextlib.suppress(psutil.Error):
                process.kill()
        psutil.wait_procs(alive, timeout=5)
