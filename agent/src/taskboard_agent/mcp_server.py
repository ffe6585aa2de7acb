"""The board as MCP tools for LLM agents: ``taskboard mcp`` (stdio), and the tools that
the server's ``/mcp/`` serves over Streamable HTTP (board.mcp.endpoint).

(Named mcp_server, not mcp, so that it never hides the SDK's own ``mcp`` package.)

An MCP server built with the official SDK (``mcp.server.mcpserver.MCPServer``) whose tools
are the board's eleven (docs/reference/mcp-tools.md), each one call of the Python client
(taskboard_agent.client) to the board's REST API, so that both transports answer with the API's
own validation and error codes. ``taskboard mcp`` runs on the agent's machine, as the agent
of ``TASKBOARD_TOKEN``, and needs nothing of the server side (no Django); ``/mcp/`` sends
the same calls to its own process's API, as the agent of the session's Bearer token.

A client that starts ``taskboard mcp`` for every call (the MCP Inspector's CLI does) still
finishes what it claims: the processes of one token and board share their claims through a
:class:`ClaimFile`. Over HTTP the sessions of one token share theirs (board.mcp.endpoint).

Leases are the server's job, not the model's: ``claim_task`` keeps the task's lease token
here, in the session, and a :class:`~taskboard_agent.client.Lease` heartbeats it in the
background every third of the lease until the model completes, fails, releases or
escalates the task, or the lease is lost (the attempt deadline, a human's action). The
model never sees a token. When the session ends (the stdio process exits, the HTTP session
is deleted or times out) the heartbeats stop with it and the lease runs out as usual, so
no task stays held by a session that is gone. A refusal is a tool error that starts with
the API's error code (``lease_lost: ...``) and, for a lost lease, tells the model to stop
working on the task.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import contextvars
import hashlib
import json
import logging
import os
import threading
import time
import weakref
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import fields
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

import anyio
from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp.types import CallToolResult, TextContent
from pydantic import Field

from taskboard_agent.client import (
    NO_LIMIT,
    AskFields,
    AwaitingInput,
    ClaimedTask,
    Client,
    Event,
    Lease,
    LeaseLost,
    Task,
    TaskboardError,
)

T = TypeVar("T")

logger = logging.getLogger(__name__)

# The API's bounds (board.conf, board.models; tests/test_mcp.py checks that they agree), in
# the tools' input schemas, so that a model sees them and the SDK refuses what is outside.
TaskId = Annotated[int, Field(ge=1, le=2**63 - 1)]
Priority = Annotated[int, Field(ge=-1000, le=1000)]
MaxFailures = Annotated[int, Field(ge=1, le=100)]
AttemptSeconds = Annotated[int, Field(ge=1, le=604800)]
Dependencies = Annotated[list[TaskId], Field(max_length=100)]
LeaseSeconds = Annotated[int, Field(ge=1, le=86400)]
WaitSeconds = Annotated[float, Field(ge=0, le=60)]
RetryAfter = Annotated[int, Field(ge=0, le=86400 * 30)]
Title = Annotated[str, Field(min_length=1, max_length=200)]
QueueName = Annotated[str, Field(pattern=r"^[a-z0-9_-]{1,64}$")]
Queues = Annotated[list[QueueName], Field(max_length=100)]
Text = Annotated[str, Field(min_length=1, max_length=10000)]  # a comment, error or reason
Status = Literal["pending", "in_progress", "awaiting_input", "done", "escalated", "cancelled"]
# Asking a person (the API's ask): its bounds.
Options = Annotated[
    list[Annotated[str, Field(min_length=1, max_length=200)]],
    Field(min_length=2, max_length=10, json_schema_extra={"uniqueItems": True}),
]
AnswerWithin = Annotated[int, Field(ge=60, le=2_592_000)]
ActionDigest = Annotated[str, Field(min_length=1, max_length=128)]
AskWait = Annotated[float, Field(ge=0, le=3600)]
Username = Annotated[str, Field(min_length=1, max_length=150)]
Label = Annotated[str, Field(pattern=r"^[a-z0-9][a-z0-9:._-]{0,63}$")]
Labels = Annotated[list[Label], Field(max_length=20)]
# Checked by the API (which refuses duplicates and times without an offset), stated here
# for the model.
UniqueDependencies = Annotated[Dependencies, Field(json_schema_extra={"uniqueItems": True})]
Time = Annotated[str, Field(json_schema_extra={"format": "date-time"})]

INSTRUCTIONS = """\
This server is a shared task board: humans and agents post tasks, and you claim and do them.
The work loop:
1. claim_task (optionally with wait, in seconds, to wait for work). You get one task, or
   nothing. If the task has "progress", an earlier attempt got that far: resume from there.
2. Do the work. Call report_progress now and then with a small JSON value saying how far you
   are, so that if you stop, the next agent resumes instead of starting over. You do not
   need to keep the task alive: this server does that while this session lasts.
3. End every task you claimed with exactly one of: complete_task (done, with a result),
   fail_task (it did not work; it will be retried), release_task (give it back untouched)
   or escalate_task (a human must decide).
If a tool answers "lease_lost", the task is no longer yours: stop working on it at once.
When you need a person's decision or approval, call ask_human on the task instead of failing
or escalating it (with wait, to wait for the answer). A task's "answers" are what people
answered to questions asked about it earlier: follow them.
Use comment_task to leave notes on a task, create_task to add work (parent_id for subtasks,
depends_on for tasks that must be done first), and get_task or list_tasks to look around.
"""

# The lease token sent for a task this session does not hold, so that the API says why it
# refuses (Session.held): no lease is ever given this token.
NOBODYS_TOKEN = "not-held-by-this-session"


def _lost(task_id: int, detail: str) -> ToolError:
    """The tool error for a task this session does not, or no longer, hold."""
    stop = "" if "Stop working on it" in detail else " Stop working on it."
    return ToolError(
        f"lease_lost: you no longer hold task {task_id}. {detail}{stop} Anything you send "
        "about it will be refused."
    )


def _public(task: Task) -> dict[str, Any]:
    """The task as the API rendered it, without its lease token."""
    data = dict(task.raw)
    data.pop("lease_token", None)
    return data


def _answer(value: Any) -> CallToolResult:
    """A tool's answer as the SDK makes one from a plain return (structured content
    ``{"result": value}``), with the value as one JSON text block for hosts that show the
    model only text: the SDK's own conversion gives null and an empty list no text at all,
    and a list one block per item."""
    text = json.dumps(value, indent=2, ensure_ascii=False)
    return CallToolResult(
        content=[TextContent(type="text", text=text)], structured_content={"result": value}
    )


def _event(event: Event) -> dict[str, Any]:
    """An event as the API renders it."""
    return {
        "id": event.id,
        "task_id": event.task_id,
        "type": event.type,
        "status": event.status,
        "actor": event.actor,
        "payload": event.payload,
        # As the API writes times: UTC with a "Z".
        "created_at": event.created_at.isoformat().replace("+00:00", "Z"),
    }


def _refusal(exc: TaskboardError) -> ToolError:
    """The API's refusal as a tool error the model can read: code, then detail."""
    if isinstance(exc, LeaseLost) and "Stop working on it" not in exc.detail:
        return ToolError(f"{exc.code}: {exc.detail} Stop working on it.")
    # The API's detail of an invalid request already names each field and what is wrong.
    return ToolError(f"{exc.code}: {exc.detail}")


# What a session that does not hold a task says of it, when the task is held: over stdio,
# where the processes of ``taskboard mcp`` share their claims through a ClaimFile.
NOT_HELD_HERE = (
    "A taskboard mcp process acts on the tasks that it, or an earlier process with the same "
    "token and board on this machine, claimed, while their leases last; this one is held by "
    "another agent, by another client of this token, or was claimed on another machine."
)
# Claims a ClaimFile keeps at most (those of processes that were killed are never removed
# by them).
MAX_FILED_CLAIMS = 1000


class ClaimFile:
    """The claims of one token on one board, shared by the ``taskboard mcp`` processes of
    this machine, so that a client that starts one for every call (the MCP Inspector's CLI
    does) finishes in one process what it claimed in another.

    A JSON file, readable by its user only (it holds lease tokens), under
    ``$XDG_STATE_HOME/taskboard`` (default ``~/.local/state/taskboard``), named by a
    digest of the board's URL and the token; each change is made under an exclusive lock.
    A process files each claim as it gets it and removes it once it has finished or lost
    it; a process that acts on a task it does not hold takes its claim from the file.
    """

    def __init__(self, url: str, token: str, directory: Path | None = None) -> None:
        if directory is None:
            state = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
            directory = Path(state) / "taskboard"
        name = hashlib.sha256(f"{url.rstrip('/')}\n{token}".encode()).hexdigest()[:32]
        self.path = directory / f"mcp-claims-{name}.json"

    @contextlib.contextmanager
    def _claims(self) -> Iterator[dict[str, Any]]:
        """The filed claims by task id, to read and change; written back on leaving."""
        import fcntl  # POSIX only: elsewhere (ImportError) each process keeps its own

        self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        with os.fdopen(fd, "r+", encoding="utf-8") as file:
            fcntl.flock(file, fcntl.LOCK_EX)
            try:
                claims = json.loads(file.read() or "{}")
            except ValueError:
                claims = {}  # torn by a crash mid-write: the claims in it run out
            if not isinstance(claims, dict):
                claims = {}
            before = json.dumps(claims, sort_keys=True)
            yield claims
            for extra in list(claims)[: max(0, len(claims) - MAX_FILED_CLAIMS)]:
                del claims[extra]  # the oldest first: dicts keep their order
            if json.dumps(claims, sort_keys=True) != before:
                file.seek(0)
                file.truncate()
                file.write(json.dumps(claims))

    @contextlib.contextmanager
    def _changing(self) -> Iterator[dict[str, Any]]:
        """:meth:`_claims`, or an empty dict when the file cannot be used (a read-only
        home): the tools work on, each process with its own claims."""
        used = False
        try:
            with self._claims() as claims:
                used = True
                yield claims
        except (OSError, ImportError) as exc:
            logger.warning("mcp: cannot use %s: %s", self.path, exc)
            if not used:
                yield {}

    def add(self, task: ClaimedTask) -> None:
        with self._changing() as claims:
            claims.pop(str(task.id), None)
            claims[str(task.id)] = {
                "task": task.raw,
                "lease_seconds": task.lease_seconds,
                "claimed_at": task.claimed_at,
            }

    def remove(self, task_id: int) -> None:
        with self._changing() as claims:
            claims.pop(str(task_id), None)

    def take(self, task_id: int) -> ClaimedTask | None:
        """The claim on ``task_id`` another process filed (it stays filed, for this one)."""
        with self._changing() as claims:
            filed = claims.get(str(task_id))
        if not isinstance(filed, dict):
            return None
        try:
            task = Task.from_json(filed["task"])
            return ClaimedTask(
                **{field.name: getattr(task, field.name) for field in fields(Task)},
                lease_token=str(filed["task"]["lease_token"]),
                lease_seconds=float(filed["lease_seconds"]),
                # time.monotonic() of the claim, as the process that filed it saw it: one
                # clock for every process of this machine, until it restarts (then the
                # claims have run out anyway).
                claimed_at=float(filed["claimed_at"]),
            )
        except (KeyError, TypeError, ValueError):
            return None


class Session:
    """The leases one MCP session holds, each kept alive by its own heartbeat thread.

    ``owns_client``: :meth:`close` closes the client too. ``not_held``: what a refusal
    says of a task held elsewhere. Over HTTP, board.mcp.endpoint sets :attr:`take_over` and
    :attr:`park`, so that the sessions of one token share their claims.
    """

    def __init__(
        self, client: Client, *, owns_client: bool = False, not_held: str = NOT_HELD_HERE
    ) -> None:
        self.client = client
        self.leases: dict[int, Lease] = {}
        self.closed = False
        self.not_held = not_held
        #: The claim on a task that another session of this token holds, or held and
        #: ended with, taken from it (its heartbeats stopped); None when there is none.
        self.take_over: Callable[[int], ClaimedTask | None] | None = None
        #: Where :meth:`close` leaves the claims it still holds, for :attr:`take_over`.
        self.park: Callable[[ClaimedTask], None] | None = None
        #: Over stdio: where each claim is filed while held, for the next process.
        self.claim_file: ClaimFile | None = None
        # Tasks that another session of this token took over from this one.
        self._taken: set[int] = set()
        self._owns_client = owns_client
        self._claims = 0  # claims under way, for which the client stays open
        self._lock = threading.Lock()
        # Whether the session's client is there (board.mcp.endpoint says), and whether the
        # heartbeats are paused for its absence; settle() makes the second follow the first.
        self.present = True
        self._paused = False
        self._attending = threading.Lock()
        #: Set when the session ends: a wait for an answer stops then.
        self.ended = threading.Event()

    def attend(self, present: bool) -> None:
        """Say whether the session's client is there; :meth:`settle` acts on it."""
        self.present = present

    def settle(self) -> None:
        """Pause the heartbeats while the client is away, and resume them once it is back:
        a client that is gone for good (killed) leaves its tasks to run out within a lease,
        as they would with no MCP in between, rather than for as long as its session is
        kept. Blocks while heartbeats stop (never on the event loop that answers them)."""
        with self._attending:
            present = self.present
            if present != self._paused:
                return
            with self._lock:
                leases = list(self.leases.values())
                self._paused = not present
            for lease in leases:
                if present:
                    lease.resume()
                else:
                    lease.pause()

    @contextlib.contextmanager
    def claiming(self) -> Iterator[None]:
        """Keep the client open while a claim is under way, even past :meth:`close`: a
        claim that comes back after its session ended gives its task back through it
        (:meth:`hold`); a closed client would leave the task held by nobody until its
        lease ran out, with a strike."""
        with self._lock:
            if self.closed:
                raise ToolError("This session has ended: connect again.")
            self._claims += 1
        try:
            yield
        finally:
            with self._lock:
                self._claims -= 1
                last = self.closed and self._claims == 0
            if last:
                self._close_client()

    def _close_client(self) -> None:
        if self._owns_client:
            self.client.close()

    def hold(self, task: ClaimedTask) -> None:
        self.settle()
        lease = self.client.lease(task)
        with self._lock:
            kept = not self.closed
            if kept:
                self.leases[task.id] = lease
            away = self._paused
        if kept:
            if away:  # the client left while its claim waited: as its other leases
                lease.pause()
            if self.claim_file is not None:
                self.claim_file.add(task)
            return
        # The session ended while the claim was on its way (its host gone mid-wait): nobody
        # will ever see this task, so give it back at once, without a strike, rather than
        # let its lease run out and count one against it.
        try:
            lease.release()
        except TaskboardError:
            lease.stop()  # it runs out instead
        raise _lost(task.id, "This session ended; the task was released.")

    def lease(self, task_id: int) -> Lease:
        """The live lease on ``task_id``, or a tool error that says it is not held."""
        self.settle()
        with self._lock:
            lease = self.leases.get(task_id)
        if lease is None:
            raise _lost(task_id, "This session did not claim it, or has ended it.")
        if lease.lost:
            self.forget(task_id)
            error = lease.error
            detail = error.detail if error is not None else "Its attempt deadline passed."
            raise _lost(task_id, detail)
        return lease

    def forget(self, task_id: int) -> None:
        with self._lock:
            lease = self.leases.pop(task_id, None)
        if lease is not None:
            lease.stop()
        if self.claim_file is not None:
            self.claim_file.remove(task_id)

    def give_up(self, task_id: int) -> ClaimedTask | None:
        """Hand the claim on ``task_id`` to another session of this token: stop renewing
        it here and return it (None when this session does not hold it live)."""
        with self._lock:
            lease = self.leases.pop(task_id, None)
            if lease is None:
                return None
            self._taken.add(task_id)
        lease.stop()
        return None if lease.lost or lease.finished else lease.task

    def _adopt(self, task_id: int) -> bool:
        """Take over the claim on ``task_id`` from another session of this token, if one
        holds it: renew it at once (which says whether it is still live) and keep it."""
        task = self.take_over(task_id) if self.take_over is not None else None
        if task is None:
            return False
        lease = Lease(self.client, task)
        try:
            lease.heartbeat()
        except LeaseLost as exc:
            if self.claim_file is not None:
                self.claim_file.remove(task_id)
            detail = exc.detail
            if "attempt deadline" not in detail:  # the token was right: the lease was not
                status = (exc.task_status or "no longer held").replace("_", " ")
                detail = (
                    "Its lease ran out before this session took it over from the one that "
                    f"claimed it (it is {status} now)."
                )
            raise _lost(task_id, detail) from exc
        except TaskboardError as exc:
            raise _refusal(exc) from exc
        lease.start()
        with self._lock:
            self.leases[task_id] = lease
            self._taken.discard(task_id)
            away = self._paused
        if away:
            lease.pause()
        return True

    def held(self, task_id: int, unheld: Callable[[str], Any]) -> Lease:
        """The live lease on ``task_id`` (taken over from another session of this token
        if that one holds it); for a task held by nobody here, the API's own refusal of
        ``unheld`` (the action, sent with a token that is nobody's): ``not_found``,
        ``forbidden_queue`` or ``lease_lost``, as the REST API answers, with what the
        ``lease_lost`` means here."""
        with self._lock:
            held = task_id in self.leases
            taken = task_id in self._taken
        if held or self._adopt(task_id):
            return self.lease(task_id)
        if taken:
            raise _lost(
                task_id,
                "Another MCP session of this token took it over (it acted on the task "
                "after this session claimed it), and has finished it or let it go.",
            )
        try:
            unheld(NOBODYS_TOKEN)
        except LeaseLost as exc:
            raise _lost(task_id, self._not_held(task_id, exc)) from exc
        except TaskboardError as exc:
            raise _refusal(exc) from exc
        return self.lease(task_id)  # never accepted; if it were, still not held here

    def _not_held(self, task_id: int, refusal: LeaseLost) -> str:
        """Why this session cannot act on ``task_id``, by the task's status: the API's
        own words (a wrong token, ...) would blame the token this session sent for it."""
        status = refusal.task_status
        if status == "in_progress":
            return (
                f"This MCP session did not claim task {task_id}, and holds no lease on it: "
                f"it is in progress, held elsewhere. {self.not_held}"
            )
        if status == "pending":
            return f"Task {task_id} is pending: nobody holds it (claim it with claim_task)."
        if status:
            return f"Task {task_id} is {status.replace('_', ' ')}: nobody holds it."
        return refusal.detail

    def end(
        self, task_id: int, action: Callable[[Lease], Task], unheld: Callable[[str], Any]
    ) -> dict[str, Any]:
        """Finish the task with ``action`` (complete, fail, ...), forgetting its lease once
        it is finished; a refusal that leaves the task held (an invalid body, no answer)
        keeps it, heartbeating, for the model to try again."""
        lease = self.held(task_id, unheld)
        try:
            return _public(action(lease))
        except LeaseLost as exc:
            raise _lost(task_id, exc.detail) from exc
        except TaskboardError as exc:
            raise _refusal(exc) from exc
        finally:
            if lease.finished or lease.lost:
                self.forget(task_id)

    def close(self) -> None:
        """Stop every heartbeat (the session is over); the leases run out as usual.

        Blocks until the heartbeat threads end: never call it from an event loop whose
        requests those threads may be waiting for (board.mcp.endpoint).
        """
        with self._lock:
            self.closed = True
            leases, self.leases = list(self.leases.values()), {}
            idle = self._claims == 0
        self.ended.set()
        for lease in leases:
            lease.stop()
            if self.park is not None and not (lease.lost or lease.finished):
                self.park(lease.task)
        if idle:  # else the last claim under way closes it (claiming)
            self._close_client()


# Claims that wait for work hold a worker thread each for up to a minute: they get threads
# of their own (up to this many at once, per event loop), so that many of them (one per MCP
# session over HTTP) never hold up other tools, which share anyio's default 40.
WAITING_CLAIMS = 1000
_waiting_claims: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, anyio.CapacityLimiter] = (
    weakref.WeakKeyDictionary()
)


def _waiting_limiter() -> anyio.CapacityLimiter:
    loop = asyncio.get_running_loop()
    limiter = _waiting_claims.get(loop)
    if limiter is None:
        limiter = _waiting_claims[loop] = anyio.CapacityLimiter(WAITING_CLAIMS)
    return limiter


async def _call(
    function: Callable[..., T],
    *args: Any,
    limiter: anyio.CapacityLimiter | None = None,
    **kwargs: Any,
) -> T:
    """Run a blocking client call in a worker thread, turning refusals into tool errors.

    Everything that may wait for the board (a request, a heartbeat thread to stop) runs
    in a worker thread, never on the event loop: over HTTP (board.mcp.endpoint) the board's
    answers come from that very loop.
    """

    def run() -> T:
        try:
            return function(*args, **kwargs)
        except TaskboardError as exc:
            raise _refusal(exc) from exc

    return await anyio.to_thread.run_sync(run, limiter=limiter)


# A tool call waits at most about 25 s for the board (plus a claim's own wait): 10 s a
# request, one retry of those that may be retried. A model's host has timeouts of its own
# (often 60 s), and an answer it never sees helps nobody; the client's defaults (30 s,
# four retries) are for agents that can wait minutes.
TOOL_CALL_LIMITS: dict[str, Any] = {"timeout": 10.0, "retries": 1, "max_backoff": 5.0}

# Seconds between two progress notifications while a tool call waits for a person, to a
# client that asked for them: a host that times tool calls out, and counts from the last
# progress, keeps waiting.
PROGRESS_EVERY = 15.0


async def _telling_progress(ctx: Context, call: Callable[[], Awaitable[T]], total: float) -> T:
    """Await ``call()``, notifying the seconds waited so far every PROGRESS_EVERY."""
    started = time.monotonic()

    async def tell() -> None:
        while True:
            await anyio.sleep(PROGRESS_EVERY)
            try:
                await ctx.report_progress(
                    time.monotonic() - started, total, "waiting for a person's answer"
                )
            except Exception as exc:  # a client gone mid-wait: the wait goes on
                logger.debug("mcp: progress not sent: %s", exc)

    outcome: list[T] = []
    failure: list[Exception] = []
    async with anyio.create_task_group() as group:
        group.start_soon(tell)
        try:
            outcome.append(await call())
        except Exception as exc:  # raised below, not wrapped in the group's ExceptionGroup
            failure.append(exc)
        finally:
            group.cancel_scope.cancel()
    if failure:
        raise failure[0]
    return outcome[0]


SessionOf = Callable[[Context], Session]

# The arguments a tool call named as null, where null means something other than leaving
# the argument out (the SDK hands a tool None for both).
_given_null: contextvars.ContextVar[frozenset[str]] = contextvars.ContextVar(
    "given_null", default=frozenset()
)


class BoardServer(MCPServer):
    """The SDK's server, which tells a tool which of its arguments were given as null."""

    async def call_tool(self, name: str, arguments: dict[str, Any], *args: Any) -> Any:
        nulls = frozenset(key for key, value in arguments.items() if value is None)
        token = _given_null.set(nulls)
        try:
            return await super().call_tool(name, arguments, *args)
        finally:
            _given_null.reset(token)


def build_server(session_of: SessionOf) -> MCPServer:
    """Return the MCP server whose tools act on the board through the :class:`Session`
    that ``session_of`` returns for the request's context (its MCP session's)."""
    server = BoardServer("taskboard", instructions=INSTRUCTIONS, version="1", title="Taskboard")

    @server.tool()
    async def create_task(
        title: Title,
        description: str | None = None,
        payload: dict[str, Any] | None = None,
        queue: QueueName | None = None,
        priority: Priority | None = None,
        depends_on: UniqueDependencies | None = None,
        parent_id: TaskId | None = None,
        max_failures: MaxFailures | None = None,
        run_after: Time | None = None,
        max_attempt_seconds: AttemptSeconds | None = None,
        assignee: Username | None = None,
        requires: Labels | None = None,
        *,
        ctx: Context,
    ) -> dict[str, Any]:
        """Create a task on the board and return it.

        Use parent_id to split the task you hold into subtasks, and depends_on (ids of
        existing tasks) for work that may start only once those are done. run_after is an
        ISO 8601 time with a UTC offset. max_attempt_seconds caps one attempt however
        often its holder heartbeats (null: no limit; left out: the board's default).
        assignee: the one user (a person or an agent) who may claim it; requires: the
        capabilities a claimant must all have. Each call makes a new task (a call whose
        answer was lost on the way is retried for you without making a second one).
        """
        if "max_attempt_seconds" in _given_null.get():  # as over the API: no limit
            max_attempt_seconds = NO_LIMIT  # type: ignore[assignment]
        task = await _call(
            session_of(ctx).client.create,
            title,
            description=description,
            payload=payload,
            queue=queue,
            priority=priority,
            depends_on=depends_on,
            parent_id=parent_id,
            max_failures=max_failures,
            run_after=run_after,
            max_attempt_seconds=max_attempt_seconds,
            assignee=assignee,
            requires=requires,
        )
        return _public(task)

    @server.tool()
    async def claim_task(
        queues: Queues | None = None,
        lease_seconds: LeaseSeconds | None = None,
        wait: WaitSeconds | None = None,
        *,
        ctx: Context,
    ) -> Annotated[CallToolResult, dict[str, Any] | None]:
        """Claim the next task to work on, or nothing (null) when there is none.

        wait (0..60 seconds) waits for work to come. The task's "progress" is how far an
        earlier attempt got: resume from there; its "answers" are what people answered
        to questions asked about it (ask_human): follow them. While this session lasts
        the lease is kept alive for you, however long you think. You must end the task
        with complete_task, fail_task, release_task, escalate_task or ask_human.
        """
        session = session_of(ctx)

        def claim() -> dict[str, Any] | None:
            with session.claiming():
                claimed = session.client.claim(
                    queues=queues, limit=1, lease_seconds=lease_seconds, wait=wait or 0
                )
                if not claimed:
                    return None
                session.hold(claimed[0])
                return _public(claimed[0])

        return _answer(await _call(claim, limiter=_waiting_limiter() if wait else None))

    @server.tool()
    async def report_progress(task_id: TaskId, progress: Any, *, ctx: Context) -> dict[str, Any]:
        """Record how far you are on a task you hold (any small JSON value, such as
        {"step": 3, "of": 10, "note": "..."}). Report after each meaningful step: if you
        stop, the next agent gets this progress and resumes from it. Answers the task, or
        a lease_lost error: then stop working on the task."""
        session = session_of(ctx)

        def beat() -> dict[str, Any]:
            lease = session.held(
                task_id,
                lambda token: session.client.heartbeat(
                    task_id, lease_token=token, progress=progress
                ),
            )
            try:
                return _public(lease.heartbeat(progress))
            except LeaseLost as exc:
                session.forget(task_id)
                raise _lost(task_id, exc.detail) from exc

        return await _call(beat)

    @server.tool()
    async def complete_task(task_id: TaskId, result: Any = None, *, ctx: Context) -> dict[str, Any]:
        """Finish a task you hold as done, with its result (any JSON value)."""
        session = session_of(ctx)
        return await anyio.to_thread.run_sync(
            lambda: session.end(
                task_id,
                lambda lease: lease.complete(result),
                lambda token: session.client.complete(task_id, lease_token=token, result=result),
            )
        )

    @server.tool()
    async def fail_task(
        task_id: TaskId, error: Text, retry_after: RetryAfter | None = None, *, ctx: Context
    ) -> dict[str, Any]:
        """Give up on a task you hold because it did not work, saying why (error). It counts
        a strike: the task is retried (after retry_after seconds, if given) and goes to a
        human after its last strike."""
        session = session_of(ctx)
        return await anyio.to_thread.run_sync(
            lambda: session.end(
                task_id,
                lambda lease: lease.fail(error, retry_after=retry_after),
                lambda token: session.client.fail(
                    task_id, error, lease_token=token, retry_after=retry_after
                ),
            )
        )

    @server.tool()
    async def release_task(task_id: TaskId, *, ctx: Context) -> dict[str, Any]:
        """Give a task you hold back to the board untouched, without a strike (you cannot
        do it now; someone else may)."""
        session = session_of(ctx)
        return await anyio.to_thread.run_sync(
            lambda: session.end(
                task_id,
                lambda lease: lease.release(),
                lambda token: session.client.release(task_id, lease_token=token),
            )
        )

    @server.tool()
    async def escalate_task(task_id: TaskId, reason: Text, *, ctx: Context) -> dict[str, Any]:
        """Hand a task you hold to the humans, with the reason: when it needs a decision or
        access you do not have. They will requeue, resolve or cancel it."""
        session = session_of(ctx)
        return await anyio.to_thread.run_sync(
            lambda: session.end(
                task_id,
                lambda lease: lease.escalate(reason),
                lambda token: session.client.escalate(task_id, reason, lease_token=token),
            )
        )

    @server.tool()
    async def ask_human(
        task_id: TaskId,
        question: Text,
        options: Options | None = None,
        answer_schema: dict[str, Any] | None = None,
        assignee: Username | None = None,
        answer_within: AnswerWithin | None = None,
        action_digest: ActionDigest | None = None,
        wait: AskWait | None = None,
        *,
        ctx: Context,
    ) -> dict[str, Any]:
        """Ask a person a question about a task you hold, when you need a decision or an
        approval you cannot make yourself, instead of failing or escalating the task.

        options: the answers to choose from (such as ["approve", "deny"]); or
        answer_schema: a JSON Schema the answer must match; neither: a free-text answer.
        assignee: the username of the person who should answer. answer_within: seconds
        before an unanswered question is escalated to the humans (default: a day).
        action_digest: for an approval, a digest of exactly what you will do (the SHA-256
        of the command, say); the answer repeats it. The task leaves your hands while the
        person thinks (no strike). wait (0..3600 seconds): wait for the answer; when it
        comes you hold the task again and get {"task", "answer"}. Otherwise you get
        {"status": "awaiting_input"}: do other work; a later claim_task gives you the
        task back with its "answers" (it is kept for you for a while after the answer).
        """
        session = session_of(ctx)
        fields: AskFields = {
            "options": options,
            "answer_schema": answer_schema,
            "assignee": assignee,
            "answer_within": answer_within,
            "action_digest": action_digest,
        }
        lengths: list[float] = []

        def send(lease: Lease) -> Task:
            lengths.append(lease.lease_seconds)
            return lease.send_ask(question, **fields)

        asked = Task.from_json(
            await anyio.to_thread.run_sync(
                lambda: session.end(
                    task_id,
                    send,
                    lambda token: session.client.ask(
                        task_id, question, lease_token=token, **fields
                    ),
                )
            )
        )
        if not wait:
            return {"status": "awaiting_input", "task": _public(asked)}

        def answered() -> dict[str, Any]:
            with session.claiming():
                try:
                    claimed = session.client.await_answer(
                        asked,
                        wait=wait,
                        lease_seconds=min(max(1, round(lengths[0])), 86400),
                        stop=session.ended,
                    )
                except AwaitingInput as exc:
                    return {"status": "awaiting_input", "task": _public(exc.task or asked)}
                session.hold(claimed)
                answer = claimed.answer_to(asked.question) if asked.question else None
                return {
                    "task": _public(claimed),
                    "answer": answer.answer if answer is not None else None,
                }

        return await _telling_progress(
            ctx, lambda: _call(answered, limiter=_waiting_limiter()), wait
        )

    @server.tool()
    async def comment_task(task_id: TaskId, body: Text, *, ctx: Context) -> dict[str, Any]:
        """Add a comment to a task's history (any task, held or not): notes for the humans
        and agents who read it. Answers the comment's event."""
        event = await _call(session_of(ctx).client.comment, task_id, body)
        return _event(event)

    @server.tool()
    async def get_task(task_id: TaskId, *, ctx: Context) -> dict[str, Any]:
        """Read a task and its history (events, oldest first)."""
        client = session_of(ctx).client
        task = await _call(client.get, task_id)
        events = await _call(lambda: [_event(e) for e in client.iter_task_events(task_id)])
        return {"task": _public(task), "events": events}

    @server.tool()
    async def list_tasks(
        status: Status | None = None,
        queue: QueueName | None = None,
        parent: TaskId | None = None,
        blocked: bool | None = None,
        assignee: Username | None = None,
        *,
        ctx: Context,
    ) -> Annotated[CallToolResult, list[dict[str, Any]]]:
        """List tasks, newest first (up to 100): by status (pending, in_progress,
        awaiting_input, done, escalated, cancelled), queue, parent (subtasks of a task),
        blocked (waiting for a dependency) or assignee (the tasks for that user; "me": for
        you)."""
        client = session_of(ctx).client
        page = await _call(
            client.list_tasks,
            status=status,
            queue=queue,
            parent=parent,
            blocked=blocked,
            assignee=assignee,
        )
        return _answer([_public(task) for task in page.results])

    return server


def main(argv: list[str] | None = None) -> int:
    """``taskboard mcp``: serve the tools over stdio until the MCP host closes it."""
    parser = argparse.ArgumentParser(
        prog="taskboard mcp",
        description=(
            "Serve the board's tools to an MCP host (an LLM agent) over stdio, as the agent "
            "of TASKBOARD_TOKEN on TASKBOARD_URL. The host starts this command; it ends when "
            "the host closes its stdin, and the leases it held then run out."
        ),
    )
    parser.add_argument("--url", default=os.environ.get("TASKBOARD_URL") or "http://127.0.0.1:8000")
    parser.add_argument("--token", default=os.environ.get("TASKBOARD_TOKEN"))
    args = parser.parse_args(argv)
    if not args.token:
        parser.error("no API token: pass --token or set TASKBOARD_TOKEN")
    # stdout is the protocol; stderr is the host's log: one line per HTTP call is noise.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    with Client(args.url, args.token, **TOOL_CALL_LIMITS) as client:
        session = Session(client)
        session.claim_file = ClaimFile(args.url, args.token)
        session.take_over = session.claim_file.take
        try:
            build_server(lambda ctx: session).run()
        finally:
            session.close()
    return 0
