"""``taskboard work``: claim tasks and run a command for each, keeping its lease alive.

For each claimed task the command runs once, with the task's JSON on stdin and
``TASKBOARD_TASK_ID``, ``TASKBOARD_TASK_QUEUE``, ``TASKBOARD_TASK_TITLE``,
``TASKBOARD_LEASE_TOKEN``, ``TASKBOARD_URL``, ``TASKBOARD_TOKEN``, ``TASKBOARD_ATTEMPT``
(1 on the first try), ``TASKBOARD_PROGRESS``, ``TASKBOARD_PROGRESS_FD`` and
``TASKBOARD_ANSWERS`` in its environment. While it runs, a thread heartbeats the lease.

- Progress: ``TASKBOARD_PROGRESS`` is the JSON of the progress the previous attempts
  reported (``null`` when none), so that the command resumes instead of starting over.
  Each line of JSON the command writes to file descriptor ``TASKBOARD_PROGRESS_FD`` (a
  pipe) is the progress so far: the latest is sent with a heartbeat within a second or
  so, and before the task is completed, failed or released. Lines that are not JSON (or
  null, or over ``MAX_PROGRESS_BYTES``) are logged and ignored.
- Asking a person: a command that needs a decision writes one line
  ``{"ask": {"question": ..., "options": ..., ...}}`` (the fields of the API's ask) to
  ``TASKBOARD_PROGRESS_FD`` and exits with status 75 (``ASK_EXIT_STATUS``): the question
  is asked instead of a fail, the lease ends without a strike, and the task awaits the
  answer. Once answered it is held for this agent a while, so this worker's next claim
  takes it. ``TASKBOARD_ANSWERS`` is the JSON list of every question asked about the task
  and answered (``[]`` when none), oldest first, each with its ``answer``, ``note``,
  ``answered_by`` and the question's fields; the task's JSON on stdin has them too.
- Exit status 0: the task is completed with the command's stdout as its result (the JSON
  value when stdout parses as JSON, else the text; null when it is empty).
- Any other exit: the task fails (a strike) with the exit status and the tail of stderr,
  and is due again after ``--retry-after`` seconds, or by default after a backoff that
  doubles with each strike (``--backoff`` seconds at first, at most ``--max-backoff``,
  less up to a quarter at random), so that a failing command does not spend all its
  strikes at once.
- The lease is lost (it ran out, and another agent claimed the task; or the task's
  attempt deadline passed): the command is stopped at once (SIGTERM, then SIGKILL), and
  nothing is reported; the task is not ours.
- SIGINT or SIGTERM to the worker: it stops claiming, lets running commands finish for up
  to ``grace`` seconds, then stops the rest and releases their tasks (no strike). A second
  signal skips the rest of the grace period.

Each command runs in a session of its own, so a Ctrl-C at the terminal reaches the worker
only, and stopping a command stops the processes it started.

No Django here: this runs on any machine with the client installed.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any, TextIO

from taskboard_agent.client import (
    AuthenticationError,
    ClaimedTask,
    Client,
    ForbiddenQueue,
    Lease,
    LeaseLost,
    PayloadTooLarge,
    PermissionDenied,
    TaskboardError,
    Throttled,
    Unavailable,
    ValidationError,
)

# What of a failed command's stderr goes into the task's last_error.
STDERR_TAIL_CHARS = 4000
# The server refuses bodies over 1 MiB: a larger stdout cannot be a result.
MAX_STDOUT_BYTES = 1024 * 1024
# A progress line longer than this is ignored: progress is a checkpoint, kept on the task
# and in every heartbeat event that reports it, not a second result.
MAX_PROGRESS_BYTES = 64 * 1024
# An ask line may be longer (a question of 10,000 characters and a 64 KiB answer schema).
MAX_ASK_BYTES = 256 * 1024
# The exit status with which a command that wrote an ask line asks (EX_TEMPFAIL).
ASK_EXIT_STATUS = 75
# The fields an ask line may have (POST tasks/{id}/ask/ without the lease token).
ASK_FIELDS = frozenset(
    {"question", "options", "answer_schema", "assignee", "answer_within", "action_digest"}
)
# TASKBOARD_ANSWERS is kept within this many bytes: a variable over 128 KiB cannot be
# passed to a program on Linux (E2BIG), and every attempt would fail to start.
MAX_ANSWERS_BYTES = 96 * 1024
# Malformed progress lines logged for one run; later ones are ignored silently.
MAX_PROGRESS_COMPLAINTS = 10
# Why a command was stopped.
LEASE_LOST = "lease lost"
SHUTDOWN = "shutdown"
# The progress variables set for each command (one inherited from a worker that runs
# this worker is not passed on).
PROGRESS_VARIABLE = "TASKBOARD_PROGRESS"
PROGRESS_FD_VARIABLE = "TASKBOARD_PROGRESS_FD"
ANSWERS_VARIABLE = "TASKBOARD_ANSWERS"


@dataclass(frozen=True)
class WorkerOptions:
    """How ``taskboard work`` claims and runs (see ``taskboard work --help``).

    ``retry_after``: seconds a failed task waits before its next attempt; None: back off,
    ``backoff`` seconds after the first strike, doubling with each, at most
    ``max_backoff`` (see :func:`retry_delay`).
    """

    command: list[str]
    url: str
    token: str | None = None
    queues: list[str] | None = None
    concurrency: int = 1
    lease_seconds: int | None = None
    wait: float = 30.0
    grace: float = 30.0
    kill_grace: float = 5.0
    retry_after: int | None = None
    backoff: int = 10
    max_backoff: int = 600


def retry_delay(strikes: int, options: WorkerOptions, rng: random.Random | None = None) -> int:
    """Return the ``retry_after`` of a task's failure, ``strikes`` counted before it.

    ``options.retry_after`` when set; else ``backoff * 2**strikes`` seconds, at most
    ``max_backoff``, less up to a quarter at random (so that tasks that failed together do
    not come back together), in whole seconds as the API takes them. Below the cap, each
    strike waits longer than the one before.
    """
    if options.retry_after is not None:
        return options.retry_after
    nominal = min(options.max_backoff, options.backoff * 2 ** min(strikes, 32))
    return round(nominal * (rng or random).uniform(0.75, 1.0))


class Display:
    """What the worker tells the person watching it.

    On a terminal: a status line, rewritten in place, with log lines scrolling above it.
    Elsewhere (a file, a pipe, a service manager): plain timestamped log lines.
    """

    def __init__(self, out: TextIO | None = None, *, live: bool | None = None) -> None:
        self.out = out or sys.stdout
        self.live = self.out.isatty() if live is None else live
        self._status = ""
        self._lock = threading.Lock()

    def log(self, message: str) -> None:
        with self._lock:
            if self.live:
                stamp = datetime.now().strftime("%H:%M:%S")
                self.out.write(f"\r\x1b[K{stamp} {message}\n{self._fit(self._status)}")
            else:
                stamp = datetime.now().astimezone().isoformat(timespec="seconds")
                self.out.write(f"{stamp} {message}\n")
            self.out.flush()

    def status(self, text: str) -> None:
        """Show ``text`` as the status line (on a terminal; elsewhere, nothing)."""
        if not self.live:
            return
        with self._lock:
            if text != self._status:
                self._status = text
                self.out.write(f"\r\x1b[K{self._fit(text)}")
                self.out.flush()

    def close(self) -> None:
        """Take the status line away; log lines still work."""
        if self.live:
            with self._lock:
                self._status = ""
                self.out.write("\r\x1b[K")
                self.out.flush()

    @staticmethod
    def _fit(text: str) -> str:
        width = shutil.get_terminal_size((100, 24)).columns - 1
        return text if len(text) <= width else text[: max(0, width - 1)] + "…"


class Output:
    """Feed a command its stdin; collect its stdout and the tail of its stderr.

    Each stream has a thread, so that a command that writes much to one while the other is read
    the other never blocks.
    """

    def __init__(self, proc: subprocess.Popen[bytes], stdin: bytes) -> None:
        self.proc = proc
        self.stdout = bytearray()
        self.stdout_overflow = False
        self._stderr = bytearray()
        self._threads = [
            threading.Thread(target=self._feed, args=(stdin,), daemon=True),
            threading.Thread(target=self._read_stdout, daemon=True),
            threading.Thread(target=self._read_stderr, daemon=True),
        ]
        for thread in self._threads:
            thread.start()

    def wait(self, timeout: float = 5.0) -> None:
        """Wait for the streams to close (a background child may hold them open)."""
        deadline = time.monotonic() + timeout
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))

    @property
    def stderr_tail(self) -> str:
        text = bytes(self._stderr).decode("utf-8", errors="replace")
        return _storable(text[-STDERR_TAIL_CHARS:])

    def _feed(self, data: bytes) -> None:
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(data)
            self.proc.stdin.close()
        except OSError:
            pass  # the command does not read its stdin, or exited already

    def _read_stdout(self) -> None:
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        while chunk := os.read(fd, 65536):
            if len(self.stdout) + len(chunk) > MAX_STDOUT_BYTES:
                self.stdout_overflow = True
            else:
                self.stdout += chunk

    def _read_stderr(self) -> None:
        assert self.proc.stderr is not None
        fd = self.proc.stderr.fileno()
        keep = STDERR_TAIL_CHARS * 4  # UTF-8: at most 4 bytes a character
        while chunk := os.read(fd, 65536):
            self._stderr += chunk
            if len(self._stderr) > 2 * keep:
                del self._stderr[:-keep]


class ProgressPipe:
    """The pipe a command reports its progress on: a line of JSON at a time.

    The command gets the write end (its number in ``TASKBOARD_PROGRESS_FD``); a thread
    reads the other and hands each value to ``report`` (the lease, which heartbeats the
    latest). A line ``{"ask": {...}}`` is no progress but a question to ask: the latest is
    kept in :attr:`ask`. Malformed lines go to ``complain`` and are otherwise ignored.
    """

    def __init__(self, report: Callable[[Any], None], complain: Callable[[str], None]) -> None:
        #: The fields of the last ask line the command wrote, or None.
        self.ask: dict[str, Any] | None = None
        self._read, self.write_fd = os.pipe()
        self._report = report
        self._complain = complain
        self._complaints = 0
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> None:
        """Start reading; call after the command started (the worker's write end is closed)."""
        os.close(self.write_fd)
        self._thread.start()

    def close(self) -> None:
        """Close both ends, for a command that never started."""
        os.close(self.write_fd)
        os.close(self._read)

    def wait(self, timeout: float) -> None:
        """Wait for the lines written before the command ended (a background child may
        hold the pipe open: then do not wait longer than ``timeout``)."""
        self._thread.join(timeout)

    def _run(self) -> None:
        with os.fdopen(self._read, "rb") as pipe:
            while line := pipe.readline(MAX_ASK_BYTES + 1):
                if len(line) > MAX_ASK_BYTES:
                    self._ignore(f"over {MAX_ASK_BYTES} bytes", line)
                    while line and not line.endswith(b"\n"):  # skip the rest of it
                        line = pipe.readline(MAX_ASK_BYTES)
                    continue
                if not line.strip():
                    continue
                try:
                    value = parse_progress(line)
                    ask = parse_ask(value)
                except ValueError as exc:
                    self._ignore(str(exc), line)
                    continue
                if ask is not None:
                    self.ask = ask
                elif len(line) > MAX_PROGRESS_BYTES:
                    self._ignore(f"over {MAX_PROGRESS_BYTES} bytes", line)
                else:
                    self._report(value)

    def _ignore(self, why: str, line: bytes) -> None:
        self._complaints += 1
        if self._complaints > MAX_PROGRESS_COMPLAINTS:
            return
        text = line[:80].decode("utf-8", errors="replace").rstrip("\r\n")
        last = self._complaints == MAX_PROGRESS_COMPLAINTS
        more = " (later ones are not logged)" if last else ""
        self._complain(f"progress line ignored, {why}: {text!r}{more}")


def parse_progress(line: bytes) -> Any:
    """Return the progress value of one line a command wrote; raise ValueError (saying
    why) for a line that cannot be one: not JSON, null, or holding a NUL character."""
    try:
        value = json.loads(line, parse_constant=_refuse_constant)
    except ValueError as exc:
        raise ValueError(f"not JSON ({exc})") from None
    if value is None:
        raise ValueError("null is no progress")
    if _holds_nul(value):
        raise ValueError("PostgreSQL cannot store a NUL character")
    return value


def parse_ask(value: Any) -> dict[str, Any] | None:
    """Return the fields of an ask line's value (``{"ask": {...}}``: an object with that
    one key), or None for a value that is progress; raise ValueError for an ask that is
    not an object."""
    if not (isinstance(value, dict) and list(value) == ["ask"]):
        return None
    fields = value["ask"]
    if not isinstance(fields, dict):
        raise ValueError("an ask must be a JSON object of the question's fields")
    return fields


def answers_variable(answers: list[Any]) -> str:
    """Return ``TASKBOARD_ANSWERS``: the JSON list of ``answers`` (the task's, oldest
    first), within MAX_ANSWERS_BYTES: when they do not fit, without their answer schemas,
    and then only the newest that fit (the task's JSON on stdin has them all)."""
    text = json.dumps(answers)
    if len(text.encode()) <= MAX_ANSWERS_BYTES:
        return text
    lean = [
        {key: value for key, value in answer.items() if key != "answer_schema"}
        if isinstance(answer, dict)
        else answer
        for answer in answers
    ]
    kept: list[Any] = []
    for answer in reversed(lean):
        if len(json.dumps([answer, *kept]).encode()) > MAX_ANSWERS_BYTES:
            break
        kept.insert(0, answer)
    return json.dumps(kept)


def _holds_nul(value: Any) -> bool:
    if isinstance(value, str):
        return "\x00" in value
    if isinstance(value, dict):
        return any(_holds_nul(k) or _holds_nul(v) for k, v in value.items())
    if isinstance(value, list):
        return any(_holds_nul(item) for item in value)
    return False


def _storable(text: str) -> str:
    # PostgreSQL cannot store NUL characters in text or jsonb.
    return text.replace("\x00", "\ufffd")


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def parse_result(stdout: bytes) -> Any:
    """Return a command's result: its stdout as JSON if it parses, else as text.

    Empty (or blank) output is None; text loses its trailing newlines.
    """
    text = _storable(stdout.decode("utf-8", errors="replace"))
    if not text.strip():
        return None
    try:
        return json.loads(text, parse_constant=_refuse_constant)
    except ValueError:
        return text.rstrip("\r\n")


def failure_message(returncode: int, stderr_tail: str) -> str:
    """Return the ``error`` for a command that exited with ``returncode``."""
    if returncode < 0:
        try:
            head = f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            head = f"killed by signal {-returncode}"
    else:
        head = f"exit status {returncode}"
    if not stderr_tail.strip():
        return f"{head} (no stderr)"
    return f"{head}; stderr:\n{stderr_tail}"


def _gist(error: str) -> str:
    # The head of the message and the last line of stderr, for one log line.
    lines = [line.strip() for line in error.splitlines() if line.strip()]
    head = lines[0].removesuffix("; stderr:") if lines else "failed"
    last = lines[-1] if len(lines) > 1 else ""
    gist = f"{head}: {last}" if last else head
    return gist if len(gist) <= 160 else gist[:159] + "…"


class Run:
    """One claimed task and the command running for it."""

    def __init__(self, task: ClaimedTask, kill_grace: float) -> None:
        self.task = task
        self.kill_grace = kill_grace
        self.started = time.monotonic()
        self.proc: subprocess.Popen[bytes] | None = None
        #: Why the command was stopped (LEASE_LOST or SHUTDOWN), or None.
        self.stopped_for: str | None = None
        self.thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def launch(
        self, argv: list[str], env: dict[str, str], pass_fds: tuple[int, ...] = ()
    ) -> subprocess.Popen[bytes] | None:
        """Start the command, unless the run was stopped before it could start."""
        with self._lock:
            if self.stopped_for is not None:
                return None
            self.proc = subprocess.Popen(
                argv,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                env=env,
                start_new_session=True,
                pass_fds=pass_fds,
            )
            return self.proc

    def stop(self, reason: str) -> None:
        """Stop the command: SIGTERM to its process group, SIGKILL after ``kill_grace``."""
        with self._lock:
            proc = self.proc
            if proc is not None and proc.poll() is not None:
                return  # it ended by itself: its outcome stands
            if self.stopped_for is None:
                self.stopped_for = reason
        if proc is None:
            return
        self._signal(proc, signal.SIGTERM)
        timer = threading.Timer(self.kill_grace, self._kill, args=(proc,))
        timer.daemon = True
        timer.start()

    def _kill(self, proc: subprocess.Popen[bytes]) -> None:
        if proc.poll() is None:
            self._signal(proc, signal.SIGKILL)

    @staticmethod
    def _signal(proc: subprocess.Popen[bytes], signum: signal.Signals) -> None:
        try:
            os.killpg(proc.pid, signum)  # the command was started as a group leader
        except ProcessLookupError:
            pass
        except PermissionError:
            proc.send_signal(signum)


class Worker:
    """Claim tasks and run ``options.command`` for each, up to ``concurrency`` at once."""

    def __init__(
        self, client: Client, options: WorkerOptions, display: Display | None = None
    ) -> None:
        self.client = client
        self.options = options
        self.display = display or Display()
        self.done = self.failed = self.lost = self.released = self.asked = 0
        self._runs: dict[int, Run] = {}
        self._changed = threading.Condition()
        self._stopping = threading.Event()
        self._signals = 0
        self._fatal: TaskboardError | None = None
        self._waiting = False

    # -- the main thread -----------------------------------------------------------------

    def run(self) -> int:
        """Work until a signal (or a fatal refusal); return the process exit status."""
        previous = self._install_signal_handlers()
        queues = ", ".join(self.options.queues) if self.options.queues else "every queue"
        self.display.log(
            f"working on {queues}, up to {self.options.concurrency} at once, "
            f"at {self.options.url}: {' '.join(self.options.command)}"
        )
        claimer = threading.Thread(target=self._claim_loop, name="taskboard-claims", daemon=True)
        claimer.start()
        try:
            # Signal handlers only set a counter: they may run while this thread holds a
            # lock, so everything else happens here, on the next tick.
            while not self._signals and self._fatal is None:
                time.sleep(0.1)
                self._show()
            self._shut_down()
        finally:
            self.display.close()
            self._restore_signal_handlers(previous)
        self.display.log(
            f"stopped: {self.done} done, {self.failed} failed, "
            f"{self.released} released, {self.lost} lost, {self.asked} asked"
        )
        return 1 if self._fatal is not None else 0

    def request_stop(self) -> None:
        """Ask the worker to stop, as SIGTERM does (from any thread)."""
        self._signals += 1

    def _shut_down(self) -> None:
        self._stopping.set()
        with self._changed:
            self._changed.notify_all()
            runs = list(self._runs.values())
        grace_ends = time.monotonic() + self.options.grace
        if runs:
            self.display.log(
                f"stopping: letting {len(runs)} running command(s) finish "
                f"(up to {self.options.grace:g} s; signal again to stop them now)"
            )
        signals, why = self._signals, "grace period over"
        while self._running() and time.monotonic() < grace_ends:
            if self._signals > signals or self._signals >= 2:
                why = "signalled again"
                break
            time.sleep(0.1)
            self._show(f"stopping, {max(0.0, grace_ends - time.monotonic()):.0f} s of grace left")
        with self._changed:
            runs = list(self._runs.values())
        for run in runs:
            self.display.log(f"task {run.task.id}: stopping its command ({why})")
            run.stop(SHUTDOWN)
        for run in runs:
            if run.thread is not None:
                run.thread.join()
        # A claim may still be waiting for work. It is not waited for: when this process
        # exits its connection closes, and the server stops waiting without claiming.

    def _running(self) -> bool:
        with self._changed:
            return bool(self._runs)

    def _show(self, state: str | None = None) -> None:
        now = time.monotonic()
        with self._changed:
            runs = sorted(self._runs.values(), key=lambda run: run.task.id)
        if state is None:
            state = "waiting for work" if self._waiting else "busy"
        running = " ".join(f"#{run.task.id} {now - run.started:.0f}s" for run in runs)
        self.display.status(
            f"{len(runs)} running{': ' + running if running else ''} | {self.done} done | "
            f"{self.failed} failed | {state}"
        )

    def _install_signal_handlers(self) -> dict[int, Any]:
        if threading.current_thread() is not threading.main_thread():
            return {}
        previous: dict[int, Any] = {}
        for signum in (signal.SIGINT, signal.SIGTERM):
            previous[signum] = signal.signal(signum, self._on_signal)
        return previous

    @staticmethod
    def _restore_signal_handlers(previous: dict[int, Any]) -> None:
        for signum, handler in previous.items():
            signal.signal(signum, handler)

    def _on_signal(self, signum: int, frame: Any) -> None:
        self._signals += 1

    # -- claiming ------------------------------------------------------------------------

    def _claim_loop(self) -> None:
        pause = 1.0
        while True:
            with self._changed:
                while len(self._runs) >= self.options.concurrency and not self._stopping.is_set():
                    self._changed.wait()
                if self._stopping.is_set():
                    return
                free = self.options.concurrency - len(self._runs)
            self._waiting = True
            try:
                tasks = self.client.claim(
                    queues=self.options.queues,
                    limit=free,
                    lease_seconds=self.options.lease_seconds,
                    wait=self.options.wait,
                )
            except ForbiddenQueue as exc:
                # Retrying cannot help: the agent's token is limited to other queues.
                self.display.log(
                    f"cannot claim: {exc.detail} Choose the queues with --queue; an agent's "
                    "queues are set with 'taskboard create_agent NAME --queues ...'."
                )
                self._fatal = exc
                return
            except (AuthenticationError, PermissionDenied, ValidationError) as exc:
                self.display.log(f"cannot claim: {exc}")
                self._fatal = exc
                return
            except TaskboardError as exc:
                if isinstance(exc, Throttled) and exc.retry_after:
                    pause = max(pause, exc.retry_after)  # nothing gets through before that
                self.display.log(f"claim failed: {exc}; trying again in {pause:.0f} s")
                self._stopping.wait(pause)
                pause = min(pause * 2, 30.0)
                continue
            finally:
                self._waiting = False
            pause = 1.0
            if not tasks and self.options.wait < 1:
                self._stopping.wait(1.0)  # the server did not wait: do not spin
            for task in tasks:
                self._start(task)

    def _start(self, task: ClaimedTask) -> None:
        with self._changed:
            if not self._stopping.is_set():
                run = Run(task, self.options.kill_grace)
                run.thread = threading.Thread(
                    target=self._work, args=(run,), name=f"taskboard-task-{task.id}", daemon=True
                )
                self._runs[task.id] = run
                run.thread.start()
                return
        # Claimed while stopping: give it straight back.
        try:
            self.client.release(task)
            self.display.log(f"task {task.id}: released (stopping)")
        except TaskboardError as exc:
            self.display.log(f"task {task.id}: could not release it: {exc}")

    # -- running a task ------------------------------------------------------------------

    def _work(self, run: Run) -> None:
        task = run.task

        def lease_lost(lease: Lease) -> None:
            self.display.log(f"task {task.id}: lease lost ({lease.error}); stopping its command")
            run.stop(LEASE_LOST)

        lease = self.client.lease(task, on_lost=lease_lost)
        outcome = "lost"
        try:
            self.display.log(
                f"task {task.id}: started (queue {task.queue}, attempt "
                f"{task.failure_count + 1}): {task.title}"
            )
            outcome = self._execute(run, lease)
        except Exception as exc:  # a bug here must not leave the worker waiting forever
            self.display.log(f"task {task.id}: worker error: {exc!r}")
            outcome = "failed"
        finally:
            lease.stop()
            with self._changed:
                self._runs.pop(task.id, None)
                if outcome == "done":
                    self.done += 1
                elif outcome == "failed":
                    self.failed += 1
                elif outcome == "released":
                    self.released += 1
                elif outcome == "asked":
                    self.asked += 1
                else:
                    self.lost += 1
                self._changed.notify_all()

    def _execute(self, run: Run, lease: Lease) -> str:
        """Run the command for ``run.task``; report its outcome; return what happened."""
        task = run.task
        progress = ProgressPipe(
            lease.report_progress, lambda message: self.display.log(f"task {task.id}: {message}")
        )
        try:
            proc = run.launch(
                self.options.command,
                self._environment(task, progress.write_fd),
                pass_fds=(progress.write_fd,),
            )
        except OSError as exc:
            progress.close()
            return self._report(
                lease, "failed", error=f"cannot run {self.options.command[0]!r}: {exc}"
            )
        if proc is None:
            progress.close()
            return "lost"
        progress.start()
        raw = {key: value for key, value in task.raw.items() if key != "lease_token"}
        output = Output(proc, json.dumps(raw).encode())
        returncode = proc.wait()
        output.wait()
        # Its last progress goes out before the complete, fail or release.
        progress.wait(timeout=1.0)
        elapsed = time.monotonic() - run.started

        if run.stopped_for == LEASE_LOST or lease.lost:
            self.display.log(f"task {task.id}: command stopped after the lease was lost")
            return "lost"
        if run.stopped_for == SHUTDOWN:
            return self._report(lease, "released")
        if returncode == ASK_EXIT_STATUS and progress.ask is not None:
            return self._report(lease, "asked", ask=progress.ask, elapsed=elapsed)
        if returncode != 0:
            error = failure_message(returncode, output.stderr_tail)
            return self._report(lease, "failed", error=error, elapsed=elapsed)
        if output.stdout_overflow:
            error = f"exit status 0, but stdout is over {MAX_STDOUT_BYTES} bytes"
            return self._report(lease, "failed", error=error, elapsed=elapsed)
        return self._report(
            lease, "done", result=parse_result(bytes(output.stdout)), elapsed=elapsed
        )

    def _report(
        self,
        lease: Lease,
        outcome: str,
        *,
        result: Any = None,
        error: str = "",
        ask: dict[str, Any] | None = None,
        elapsed: float | None = None,
    ) -> str:
        """Complete, fail, release the task or ask about it; return the outcome that
        took effect."""
        task_id = lease.task.id
        took = f" in {elapsed:.1f} s" if elapsed is not None else ""
        try:
            if outcome == "done":
                try:
                    self._complete(lease, result)
                except (ValidationError, PayloadTooLarge) as exc:
                    # The lease is still ours: a result the server refuses is a failure.
                    error = f"exit status 0, but the result was refused: {exc}"
                    after = self._fail(lease, error)
                    self.display.log(f"task {task_id}: failed{took}: {error}; {after}")
                    return "failed"
                self.display.log(f"task {task_id}: done{took}")
            elif outcome == "asked":
                return self._ask(lease, ask or {}, took)
            elif outcome == "failed":
                after = self._fail(lease, error)
                self.display.log(f"task {task_id}: failed{took}: {_gist(error)}; {after}")
            else:
                lease.release()
                self.display.log(f"task {task_id}: released")
        except LeaseLost:
            self.display.log(f"task {task_id}: lease lost before it could be reported")
            return "lost"
        except TaskboardError as exc:
            self.display.log(f"task {task_id}: could not report it: {exc}")
            return "lost"
        return outcome

    def _ask(self, lease: Lease, ask: dict[str, Any], took: str) -> str:
        """Send the command's ask instead of a fail; return the outcome that took effect:
        an ask the server refuses fails the task, saying why (the lease is still ours)."""
        task_id = lease.task.id
        status = f"exit status {ASK_EXIT_STATUS} to ask"
        if unknown := sorted(set(ask) - ASK_FIELDS):
            error = f"{status}, but the ask has unknown fields: {', '.join(unknown)}"
        else:
            fields = {key: value for key, value in ask.items() if key != "question"}
            try:
                lease.send_ask(ask.get("question"), **fields)  # type: ignore[arg-type]
            except (ValidationError, PayloadTooLarge) as exc:
                why = "; ".join(f"{name}: {' '.join(text)}" for name, text in exc.fields.items())
                error = f"{status}, but the ask was refused: {exc}" + (f" ({why})" if why else "")
            else:
                question = str(ask.get("question"))
                gist = question if len(question) <= 120 else question[:119] + "…"
                self.display.log(f"task {task_id}: asked a person{took}, awaiting input: {gist}")
                return "asked"
        after = self._fail(lease, error)
        self.display.log(f"task {task_id}: failed{took}: {error}; {after}")
        return "failed"

    def _complete(self, lease: Lease, result: Any) -> None:
        """Complete the task, trying again while the board does not answer (a restart, a
        dropped connection), for as long as the lease lasts: the lease heartbeats again
        meanwhile (taskboard_agent.client.Lease), so the task stays ours. A complete whose answer
        was lost may have taken effect; if so, the next one (or a heartbeat) is refused
        ``lease_lost``, and the task itself shows it done by this agent.
        """
        pause = 1.0
        unanswered: Unavailable | None = None
        while True:
            try:
                lease.complete(result)
                return
            except Unavailable as exc:
                unanswered = exc
                if not lease.lost:
                    self.display.log(
                        f"task {lease.task.id}: could not report it ({exc}); "
                        f"trying again in {pause:g} s"
                    )
                    time.sleep(pause)
                    pause = min(pause * 2, 30.0)
                    continue
            except LeaseLost:
                if unanswered is None:
                    raise
            # Refused lease_lost, or the lease lost, after a complete that went unanswered.
            if self._completed_by_this_agent(lease.task):
                return
            raise LeaseLost(f"The lease was lost before the complete got through ({unanswered}).")

    def _completed_by_this_agent(self, task: ClaimedTask) -> bool:
        """Whether ``task`` is done, by a complete of this agent since its claim (one whose
        answer was lost on the way)."""
        try:
            if self.client.get(task.id).status != "done":
                return False
            completed = self.client.events(task=task.id, type="completed", limit=1000).results
        except TaskboardError:
            return False
        if not completed or completed[-1].actor != task.leased_by:
            return False
        started = task.attempt_started_at
        return started is None or completed[-1].created_at >= started

    def _fail(self, lease: Lease, error: str) -> str:
        """Fail the task (due again after the retry delay); return what became of it."""
        retry_after = retry_delay(lease.task.failure_count, self.options)
        after = lease.fail(error[:10000], retry_after=retry_after)
        if after.status == "pending" and retry_after:
            return f"pending, due again in {retry_after} s"
        return str(after.status)

    def _environment(self, task: ClaimedTask, progress_fd: int) -> dict[str, str]:
        env = dict(os.environ)
        # A worker run by a command of another worker does not pass that one's progress on.
        env.pop(PROGRESS_VARIABLE, None)
        env.update(
            TASKBOARD_TASK_ID=str(task.id),
            TASKBOARD_TASK_QUEUE=task.queue,
            TASKBOARD_TASK_TITLE=task.title,
            TASKBOARD_LEASE_TOKEN=task.lease_token,
            TASKBOARD_URL=self.options.url,
            TASKBOARD_ATTEMPT=str(task.failure_count + 1),
        )
        env[PROGRESS_FD_VARIABLE] = str(progress_fd)
        env[ANSWERS_VARIABLE] = answers_variable(list(task.raw.get("answers") or []))
        if "progress" in task.raw:  # a server older than progress sends none
            env[PROGRESS_VARIABLE] = json.dumps(task.progress)
        if self.options.token:
            env["TASKBOARD_TOKEN"] = self.options.token
        return env
