"""``taskboard work``, ``submit`` and ``tasks`` end to end: the real command, as a
subprocess without Django settings, against a live server, running real commands."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from django.contrib.auth.models import User
from django.db import connection, transaction

from board import transitions
from board.access import limit_queues
from board.models import Task, TaskEvent, TaskStatus
from tests.factories import TokenFactory, UserFactory
from tests.live import LiveServer
from tests.processes import ROOT, WorkerProcess, cli_env, eventually

# `taskboard work` against a live server: the agent's side, the same on any PostgreSQL.
pytestmark = pytest.mark.once

WORKER = "worker-bee"

live = pytest.mark.django_db(transaction=True)


def token_of(user: User) -> str:
    """Return the API token of ``user`` (made on first use)."""
    token = TokenFactory.create(user=user)
    return str(token.key)


@pytest.fixture
def token(fast_password_hashing: None) -> str:
    return token_of(UserFactory.create(username=WORKER))


@pytest.fixture
def server(module_server: LiveServer) -> LiveServer:
    """The module's one server: the workers, killed at each test's end, are the processes
    these tests stop, and each test has tasks and agents of its own."""
    return module_server


def taskboard(
    server: LiveServer, token: str, *args: str, stdin: str = ""
) -> subprocess.CompletedProcess[str]:
    """Run ``taskboard ARGS`` to the end."""
    return subprocess.run(
        [sys.executable, "-m", "taskboard_agent.cli", *args],
        cwd=ROOT,
        env=cli_env(server, token),
        input=stdin,
        capture_output=True,
        text=True,
        timeout=30,
    )


@pytest.fixture
def start_worker(
    server: LiveServer, token: str, tmp_path: Path
) -> Iterator[Callable[..., WorkerProcess]]:
    workers: list[WorkerProcess] = []

    def start(*options: str, command: list[str]) -> WorkerProcess:
        log = tmp_path / f"worker-{len(workers)}.log"
        worker = WorkerProcess(server, token, log, list(options), command)
        workers.append(worker)
        return worker

    yield start
    for worker in workers:
        worker.kill()


def python(code: str, *args: str) -> list[str]:
    return [sys.executable, "-c", code, *args]


def status_of(task_id: int) -> str:
    return str(Task.objects.get(id=task_id).status)


def event_types(task_id: int) -> list[str]:
    return list(
        TaskEvent.objects.filter(task_id=task_id).order_by("id").values_list("type", flat=True)
    )


def process_gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


# Writes its pid to argv[1], then sleeps for argv[2] seconds and prints a JSON result.
SLEEPER = """
import json, os, sys, time
with open(sys.argv[1] + ".tmp", "w") as f:
    f.write(str(os.getpid()))
os.rename(sys.argv[1] + ".tmp", sys.argv[1])
time.sleep(float(sys.argv[2]))
print(json.dumps({"slept": float(sys.argv[2])}))
"""


def started_pid(pidfile: Path, timeout: float = 10) -> int:
    eventually(pidfile.exists, timeout, what="the command's start")
    return int(pidfile.read_text())


# -- work --------------------------------------------------------------------------------


@live
def test_a_command_that_succeeds_completes_its_task_with_its_output(
    start_worker: Callable[..., WorkerProcess], agent: Any, server: LiveServer
) -> None:
    command = python(
        """
import json, os, sys
task = json.load(sys.stdin)
if task["payload"].get("text"):
    print("hello,", task["title"])
else:
    env = {k: v for k, v in os.environ.items() if k.startswith("TASKBOARD_")}
    env.pop("TASKBOARD_TOKEN")
    print(json.dumps({"doubled": task["payload"]["n"] * 2, "env": env, "stdin": task}))
"""
    )
    as_json = transitions.create(actor=agent, title="double it", queue="math", payload={"n": 21})
    as_text = transitions.create(actor=agent, title="world", queue="math", payload={"text": 1})
    elsewhere = transitions.create(actor=agent, title="not mine", queue="other")

    worker = start_worker("--queue", "math", "--concurrency", "2", command=command)
    eventually(lambda: status_of(as_json.id) == status_of(as_text.id) == "done", what="both done")
    assert worker.stop() == 0

    result: Any = Task.objects.get(id=as_json.id).result
    assert result["doubled"] == 42
    lease_token = result["env"].pop("TASKBOARD_LEASE_TOKEN")
    assert lease_token and lease_token not in json.dumps(result["stdin"])
    assert result["env"].pop("TASKBOARD_PROGRESS_FD").isdigit()
    assert result["env"] == {
        "TASKBOARD_TASK_ID": str(as_json.id),
        "TASKBOARD_TASK_QUEUE": "math",
        "TASKBOARD_TASK_TITLE": "double it",
        "TASKBOARD_URL": server.url,
        "TASKBOARD_ATTEMPT": "1",
        "TASKBOARD_PROGRESS": "null",
        "TASKBOARD_ANSWERS": "[]",
    }
    assert result["stdin"]["id"] == as_json.id
    assert result["stdin"]["payload"] == {"n": 21}
    assert result["stdin"]["leased_by"] == WORKER
    assert Task.objects.get(id=as_text.id).result == "hello, world"
    assert status_of(elsewhere.id) == "pending"
    assert event_types(as_json.id)[-1] == "completed"
    assert f"task {as_json.id}: done" in worker.output
    assert "stopped: 2 done, 0 failed" in worker.output


@live
def test_a_command_that_fails_fails_its_task_with_the_tail_of_its_stderr(
    start_worker: Callable[..., WorkerProcess], agent: Any
) -> None:
    command = python(
        """
import os, sys
sys.stderr.write("noise " * 2000)
sys.stderr.write("\\nattempt " + os.environ["TASKBOARD_ATTEMPT"] + ": disk full\\n")
sys.exit(3)
"""
    )
    task = transitions.create(actor=agent, title="doomed", queue="q", max_failures=2)

    worker = start_worker("--queue", "q", "--retry-after", "0", command=command)
    eventually(lambda: status_of(task.id) == "escalated", what="the escalation")
    assert worker.stop() == 0

    failed = Task.objects.get(id=task.id)
    assert failed.failure_count == 2
    assert failed.last_error is not None
    assert failed.last_error.startswith("exit status 3; stderr:\n")
    assert failed.last_error.endswith("noise \nattempt 2: disk full")  # the server trims it
    assert len(failed.last_error) <= 4000 + len("exit status 3; stderr:\n")
    assert event_types(task.id) == [
        "created",
        "claimed",
        "failed",
        "claimed",
        "failed",
        "escalated",
    ]
    first_failure = TaskEvent.objects.filter(task_id=task.id, type="failed").first()
    assert first_failure is not None
    assert "attempt 1: disk full" in first_failure.payload["error"]
    assert f"task {task.id}: failed" in worker.output


@live
def test_a_command_whose_lease_is_lost_is_killed_and_nothing_is_reported(
    start_worker: Callable[..., WorkerProcess], agent: Any, other_agent: Any, tmp_path: Path
) -> None:
    pidfile = tmp_path / "pid"
    task = transitions.create(actor=agent, title="slow", queue="slow")

    worker = start_worker(
        "--queue", "slow", "--lease", "2", command=python(SLEEPER, str(pidfile), "60")
    )
    pid = started_pid(pidfile)
    eventually(lambda: "heartbeat" in event_types(task.id), what="a heartbeat")

    # The lease runs out (as if the heartbeats had not got through) and another agent
    # claims the task, in one transaction: the worker cannot take it back in between.
    with transaction.atomic():
        with connection.cursor() as cursor:
            cursor.execute(
                "UPDATE tasks SET leased_until = now() - interval '1 second' WHERE id = %s",
                [task.id],
            )
        [claim] = transitions.claim(actor=other_agent, queues=["slow"])
    assert claim.task.id == task.id
    expired_at = time.monotonic()

    eventually(lambda: process_gone(pid), timeout=5, what="the kill")
    # At the next heartbeat (every 2/3 s), not at the end of a 60 s command.
    assert time.monotonic() - expired_at < 3.5

    assert worker.stop() == 0
    now = Task.objects.get(id=task.id)
    assert (now.status, now.leased_by_id) == (TaskStatus.IN_PROGRESS, other_agent.username)
    types = event_types(task.id)
    assert "completed" not in types and "failed" not in types and "released" not in types
    assert f"task {task.id}: lease lost" in worker.output
    assert "stopped: 0 done, 0 failed, 0 released, 1 lost" in worker.output


@live
def test_a_command_past_its_attempt_deadline_is_stopped_though_its_lease_is_long(
    start_worker: Callable[..., WorkerProcess], agent: Any, tmp_path: Path
) -> None:
    pidfile = tmp_path / "pid"
    task = transitions.create(actor=agent, title="spins", queue="spin", max_attempt_seconds=2)

    worker = start_worker(
        "--queue", "spin", "--lease", "60", "--grace", "1",
        command=python(SLEEPER, str(pidfile), "60"),
    )  # fmt: skip
    pid = started_pid(pidfile)
    started = time.monotonic()

    eventually(lambda: process_gone(pid), timeout=5, what="the kill")
    # At the deadline, 2 s after the claim, not at the end of a 60 s lease or command.
    assert time.monotonic() - started < 3.5
    assert f"task {task.id}: lease lost" in worker.output
    types = event_types(task.id)
    assert "completed" not in types and "failed" not in types and "released" not in types

    # The lease ends at the deadline too: the worker's waiting claim takes the task again,
    # recording why the previous attempt expired.
    expired = eventually(
        lambda: TaskEvent.objects.filter(task_id=task.id, type="expired").first(),
        timeout=10,
        what="the expiry",
    )
    assert expired.payload["reason"] == "attempt_deadline"
    assert worker.stop() == 0
    assert Task.objects.get(id=task.id).failure_count == 1


@live
def test_a_task_that_came_after_a_wait_longer_than_the_lease_is_run(
    start_worker: Callable[..., WorkerProcess], agent: Any
) -> None:
    worker = start_worker("--queue", "late", "--lease", "2", "--wait", "10", command=["true"])
    time.sleep(3.5)  # the worker's claim waits longer than its lease: the test's subject
    task = transitions.create(actor=agent, title="late", queue="late")

    eventually(lambda: status_of(task.id) == "done", what="the task done")
    assert worker.stop() == 0
    assert "lost" not in event_types(task.id) and "expired" not in event_types(task.id)
    assert "stopped: 1 done, 0 failed, 0 released, 0 lost" in worker.output


@live
def test_a_failing_command_waits_longer_after_each_strike(
    start_worker: Callable[..., WorkerProcess], agent: Any
) -> None:
    task = transitions.create(actor=agent, title="flaky", queue="q", max_failures=3)

    worker = start_worker("--queue", "q", "--backoff", "1", command=python("exit(1)"))
    eventually(lambda: status_of(task.id) == "escalated", timeout=20, what="the escalation")
    assert worker.stop() == 0

    events = list(TaskEvent.objects.filter(task_id=task.id).order_by("id"))
    failed = [event for event in events if event.type == "failed"]
    claimed = [event for event in events if event.type == "claimed"]
    waits = [event.payload["retry_after"] for event in failed]
    # 1, 2 and 4 s, each less up to a quarter at random.
    assert waits[:2] == [1, 2] and 3 <= waits[2] <= 4
    for failure, next_claim, wait in zip(failed, claimed[1:], waits, strict=False):
        assert (next_claim.created_at - failure.created_at).total_seconds() >= wait
    assert "pending, due again in 1 s" in worker.output


@live
def test_retry_after_makes_every_failed_task_wait_that_long(
    start_worker: Callable[..., WorkerProcess], agent: Any
) -> None:
    task = transitions.create(actor=agent, title="flaky", queue="q", max_failures=3)

    worker = start_worker("--queue", "q", "--retry-after", "30", command=python("exit(1)"))
    eventually(lambda: "failed" in event_types(task.id), what="the failure")
    assert worker.stop() == 0

    failed = Task.objects.get(id=task.id)
    assert (failed.status, failed.failure_count) == ("pending", 1)
    assert failed.run_after is not None
    event = TaskEvent.objects.get(task_id=task.id, type="failed")
    assert event.payload["retry_after"] == 30
    assert (failed.run_after - event.created_at).total_seconds() == 30


# Reports progress on TASKBOARD_PROGRESS_FD. The first attempt reports a flood of values,
# a malformed line and {"step": 1}, waits for the file argv[1], reports {"step": 2} and
# fails at once; the next attempt prints what it resumed from.
PROGRESSING = """
import json, os, sys, time
previous = json.loads(os.environ["TASKBOARD_PROGRESS"])
if previous is not None:
    print(json.dumps({"resumed_from": previous}))
    sys.exit(0)
out = open(int(os.environ["TASKBOARD_PROGRESS_FD"]), "w", buffering=1)
for n in range(50):
    out.write(json.dumps({"step": 0, "n": n}) + "\\n")
out.write("{not json\\n")
out.write(json.dumps({"step": 1, "saw": os.environ["TASKBOARD_PROGRESS"]}) + "\\n")
while not os.path.exists(sys.argv[1]):
    time.sleep(0.05)
out.write(json.dumps({"step": 2}) + "\\n")
sys.exit(1)
"""


@live
def test_progress_written_to_the_fd_reaches_the_server_and_the_next_attempt(
    start_worker: Callable[..., WorkerProcess], agent: Any, tmp_path: Path
) -> None:
    go_on = tmp_path / "go-on"
    task = transitions.create(actor=agent, title="resumable", queue="q")

    # A 60 s lease heartbeats every 20 s: progress must not wait for that.
    worker = start_worker(
        "--queue", "q", "--lease", "60", "--retry-after", "0",
        command=python(PROGRESSING, str(go_on)),
    )  # fmt: skip
    claimed = time.monotonic()

    def progress() -> Any:
        return Task.objects.get(id=task.id).progress

    assert eventually(lambda: progress() == {"step": 1, "saw": "null"}, timeout=5)
    assert time.monotonic() - claimed < 4
    go_on.touch()
    eventually(lambda: status_of(task.id) == "done", timeout=10, what="the second attempt")
    assert worker.stop() == 0

    assert Task.objects.get(id=task.id).result == {"resumed_from": {"step": 2}}
    heartbeats = TaskEvent.objects.filter(task_id=task.id, type="heartbeat").order_by("id")
    reported = [event.payload.get("progress") for event in heartbeats]
    assert reported[-2:] == [{"step": 1, "saw": "null"}, {"step": 2}]
    # Fifty values within a second went out as one or two heartbeats, not fifty.
    assert len(reported) <= 4
    assert event_types(task.id)[-3:] == ["failed", "claimed", "completed"]
    assert "progress line ignored, not JSON" in worker.output and "{not json" in worker.output


@live
def test_the_last_progress_before_a_successful_exit_is_on_the_done_task(
    start_worker: Callable[..., WorkerProcess], agent: Any
) -> None:
    # Step 2 follows step 1 at once, within the second that paces progress heartbeats,
    # and the command exits straight after it: only the finish can send it.
    command = python(
        """
import os
out = open(int(os.environ["TASKBOARD_PROGRESS_FD"]), "w", buffering=1)
out.write('{"step": 1}\\n')
out.write('{"step": 2}\\n')
print('"ok"')
"""
    )
    task = transitions.create(actor=agent, title="two steps", queue="q")
    worker = start_worker("--queue", "q", "--lease", "60", command=command)
    eventually(lambda: status_of(task.id) == "done", timeout=10, what="the complete")
    assert worker.stop() == 0

    done = Task.objects.get(id=task.id)
    assert (done.result, done.progress) == ("ok", {"step": 2})
    heartbeats = TaskEvent.objects.filter(task_id=task.id, type="heartbeat").order_by("id")
    assert heartbeats.last().payload["progress"] == {"step": 2}  # type: ignore[union-attr]
    assert event_types(task.id)[-2:] == ["heartbeat", "completed"]


@live
def test_sigterm_lets_a_running_command_finish_within_the_grace_and_claims_nothing_more(
    start_worker: Callable[..., WorkerProcess], agent: Any, tmp_path: Path
) -> None:
    pidfile = tmp_path / "pid"
    task = transitions.create(actor=agent, title="finish me", queue="q")

    worker = start_worker(
        "--queue", "q", "--grace", "20", command=python(SLEEPER, str(pidfile), "1.5")
    )
    started_pid(pidfile)
    worker.terminate()
    later = transitions.create(actor=agent, title="after the signal", queue="q")

    assert worker.wait(15) == 0
    done = Task.objects.get(id=task.id)
    assert (done.status, done.result) == (TaskStatus.DONE, {"slept": 1.5})
    assert status_of(later.id) == "pending"
    assert "stopping: letting 1 running command(s) finish" in worker.output


@live
def test_sigterm_releases_a_task_whose_command_outlasts_the_grace(
    start_worker: Callable[..., WorkerProcess], agent: Any, tmp_path: Path
) -> None:
    pidfile = tmp_path / "pid"
    task = transitions.create(actor=agent, title="too long", queue="q")

    worker = start_worker(
        "--queue", "q", "--grace", "1", command=python(SLEEPER, str(pidfile), "60")
    )
    pid = started_pid(pidfile)
    signalled = time.monotonic()
    worker.terminate()

    assert worker.wait(10) == 0
    assert time.monotonic() - signalled < 5
    assert process_gone(pid)
    released = Task.objects.get(id=task.id)
    assert (released.status, released.failure_count, released.leased_by_id) == ("pending", 0, None)
    last = TaskEvent.objects.filter(task_id=task.id).order_by("-id").first()
    assert last is not None and (last.type, last.actor) == ("released", WORKER)
    assert "stopped: 0 done, 0 failed, 1 released" in worker.output


@live
def test_concurrency_runs_up_to_that_many_commands_at_once(
    start_worker: Callable[..., WorkerProcess], agent: Any, tmp_path: Path
) -> None:
    command = python(
        """
import os, sys, time
name = os.path.join(sys.argv[1], os.environ["TASKBOARD_TASK_ID"])
open(name + ".start", "w").write(repr(time.time()))
time.sleep(1)
open(name + ".end", "w").write(repr(time.time()))
""",
        str(tmp_path),
    )
    tasks = [transitions.create(actor=agent, title=f"t{n}", queue="q").id for n in range(3)]

    worker = start_worker("--queue", "q", "--concurrency", "2", command=command)
    eventually(lambda: all(status_of(t) == "done" for t in tasks), what="all done")
    assert worker.stop() == 0

    spans = [
        (float((tmp_path / f"{t}.start").read_text()), float((tmp_path / f"{t}.end").read_text()))
        for t in tasks
    ]
    most = max(sum(1 for start, end in spans if start <= at < end) for at, _ in spans)
    assert most == 2


@live
def test_a_worker_for_queues_its_agent_may_not_use_stops_and_says_why(
    server: LiveServer, tmp_path: Path, agent: Any
) -> None:
    limited = UserFactory.create(username="images-only")
    limit_queues(limited, ["images"])
    task = transitions.create(actor=agent, title="not for it", queue="video")
    log = tmp_path / "worker.log"

    worker = WorkerProcess(server, token_of(limited), log, ["--queue", "video"], ["true"])

    assert worker.wait(timeout=30) == 1
    assert "cannot claim" in worker.output
    assert "video" in worker.output and "--queue" in worker.output
    assert status_of(task.id) == "pending"


# -- submit and tasks --------------------------------------------------------------------


@live
def test_submit_creates_tasks_from_arguments_and_from_json_lines(
    server: LiveServer, token: str
) -> None:
    done = taskboard(
        server, token, "submit", "--queue", "images", "--priority", "5",
        "--payload", '{"a": 1}', "resize",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    task = Task.objects.get(id=int(done.stdout))
    assert (task.title, task.queue, task.priority, task.payload) == (
        "resize",
        "images",
        5,
        {"a": 1},
    )
    assert task.created_by_id == WORKER

    lines = '{"title": "crop", "priority": 7}\n\n{"title": "rotate", "payload": {"b": 2}}\n'
    done = taskboard(server, token, "submit", "--queue", "images", "--json", "-", stdin=lines)
    assert done.returncode == 0, done.stderr
    crop, rotate = (json.loads(line) for line in done.stdout.splitlines())
    assert (crop["title"], crop["queue"], crop["priority"]) == ("crop", "images", 7)
    assert (rotate["title"], rotate["payload"], rotate["priority"]) == ("rotate", {"b": 2}, 0)

    refused = taskboard(server, token, "submit", "--priority", "5000", "too important")
    assert refused.returncode == 1
    assert "400 invalid" in refused.stderr and "priority:" in refused.stderr


@live
def test_submit_takes_dependencies_a_parent_and_an_attempt_limit_and_tasks_filters_by_them(
    server: LiveServer, token: str
) -> None:
    def ids(*args: str, stdin: str = "") -> list[int]:
        done = taskboard(server, token, *args, stdin=stdin)
        assert done.returncode == 0, done.stderr
        return [int(line) for line in done.stdout.split()]

    plan, fetch = ids("submit", "--queue", "q", "plan", "fetch")
    [build] = ids(
        "submit", "--depends-on", f"{plan},{fetch}", "--parent", str(plan),
        "--max-attempt-seconds", "600", "build",
    )  # fmt: skip
    line = json.dumps({"title": "keyed", "idempotency_key": "k-1"})
    [keyed] = ids("submit", "-", stdin=line)
    assert ids("submit", "-", stdin=line) == [keyed]  # the key makes the repeat a no-op

    task = Task.objects.get(id=build)
    assert (task.parent_id, task.max_attempt_seconds) == (plan, 600)
    assert sorted(task.dependencies.values_list("depends_on_id", flat=True)) == [plan, fetch]
    assert Task.objects.get(id=keyed).idempotency_key == "k-1"

    def listed(*filters: str) -> list[int]:
        done = taskboard(server, token, "tasks", "--json", *filters)
        assert done.returncode == 0, done.stderr
        return [json.loads(row)["id"] for row in done.stdout.splitlines()]

    assert listed("--blocked") == [build]
    assert listed("--not-blocked") == [keyed, fetch, plan]
    assert listed("--parent", str(plan)) == [build]
    assert listed("--depends-on", str(fetch)) == [build]


@live
def test_submit_asks_for_no_attempt_limit_with_none_or_a_null(
    server: LiveServer, token: str, settings: Any
) -> None:
    settings.TASKBOARD_MAX_ATTEMPT_SECONDS = 900

    def limit_of(*args: str, stdin: str = "") -> int | None:
        done = taskboard(server, token, "submit", *args, stdin=stdin)
        assert done.returncode == 0, done.stderr
        return Task.objects.get(id=int(done.stdout)).max_attempt_seconds

    assert limit_of("default") == 900
    assert limit_of("--max-attempt-seconds", "none", "unbounded") is None
    assert limit_of("-", stdin='{"title": "unbounded", "max_attempt_seconds": null}\n') is None
    capped = '{"title": "capped", "max_attempt_seconds": 60}\n'
    assert limit_of("--max-attempt-seconds", "none", "-", stdin=capped) == 60
    refused = taskboard(server, token, "submit", "--max-attempt-seconds", "0", "zero")
    assert refused.returncode == 2 and "at least 1" in refused.stderr


@live
def test_tasks_lists_by_filter_as_json_lines_or_a_table(
    server: LiveServer, token: str, agent: Any
) -> None:
    worker = UserFactory.create(username=WORKER)
    first = transitions.create(actor=agent, title="first", queue="q")
    second = transitions.create(actor=agent, title="second one", queue="q")
    transitions.create(actor=agent, title="elsewhere", queue="other")
    transitions.claim(actor=worker, queues=["q"])  # takes "first"

    done = taskboard(server, token, "tasks", "--queue", "q", "--json")
    assert done.returncode == 0, done.stderr
    assert [json.loads(line)["id"] for line in done.stdout.splitlines()] == [second.id, first.id]

    done = taskboard(server, token, "tasks", "--queue", "q", "--json", "--limit", "1")
    assert [json.loads(line)["id"] for line in done.stdout.splitlines()] == [second.id]

    done = taskboard(server, token, "tasks", "--status", "in_progress", "--leased-by", WORKER)
    header, row = done.stdout.splitlines()
    assert header.split() == [
        "ID",
        "STATUS",
        "QUEUE",
        "PRIORITY",
        "FAILURES",
        "LEASED",
        "BY",
        "TITLE",
    ]
    assert row.split() == [str(first.id), "in_progress", "q", "0", "0/3", WORKER, "first"]

    stranger = taskboard(server, "not-a-token", "tasks")
    assert stranger.returncode == 1 and "401" in stranger.stderr


def test_taskboard_help_names_the_agent_commands_and_the_server_commands() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "taskboard_agent.cli", "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 0, done.stderr
    for name in ("work", "submit", "tasks", "createsuperuser", "create_agent", "serve"):
        assert f" {name}" in done.stdout


class AnswerLostProxy:
    """A TCP proxy to a server that forwards everything, except that the answer to the
    first complete never arrives: once the server has answered it (the task is done),
    the proxy resets the client's connection, as a server restarting under it can."""

    def __init__(self, upstream: LiveServer) -> None:
        import socket

        self.upstream_port = int(upstream.url.rsplit(":", 1)[1])
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self.cut = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: Any) -> None:
        import socket
        import struct

        upstream = socket.create_connection(("127.0.0.1", self.upstream_port))
        cutting = threading.Event()

        def up() -> None:
            with contextlib.suppress(OSError):
                while data := client.recv(65536):
                    if not self.cut.is_set() and b"/complete/ HTTP" in data:
                        self.cut.set()
                        cutting.set()
                    upstream.sendall(data)

        threading.Thread(target=up, daemon=True).start()
        with contextlib.suppress(OSError):
            while data := upstream.recv(65536):
                if cutting.is_set():  # the server has answered the complete: lose it
                    client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    break
                client.sendall(data)
        for end in (client, upstream):
            with contextlib.suppress(OSError):
                end.shutdown(socket.SHUT_RDWR)  # wakes the other thread's recv
            end.close()

    def close(self) -> None:
        self.listener.close()


@live
def test_a_complete_whose_answer_was_lost_is_not_lost(
    server: LiveServer, token: str, agent: Any, tmp_path: Path
) -> None:
    """The complete reached the server, but its answer did not reach the worker (the
    connection reset, as when a server restarts): the worker tries again while its lease
    lasts, finds the task done by itself, and reports it done, rather than leaving it
    in progress until the lease runs out and the task is done a second time."""
    task = transitions.create(actor=agent, title="once", queue="lost-answer")
    proxy = AnswerLostProxy(server)
    worker = WorkerProcess(
        proxy,
        token,
        tmp_path / "worker.log",
        ["--queue", "lost-answer", "--lease", "30"],
        python("print(42)"),
    )
    try:
        eventually(lambda: f"task {task.id}: done" in worker.output, timeout=20, what="done")
        assert proxy.cut.is_set(), "the complete's answer was never cut"
        assert worker.stop() == 0
    finally:
        worker.kill()
        proxy.close()
    assert status_of(task.id) == "done"
    assert event_types(task.id).count("completed") == 1
    assert "could not report it" in worker.output
    assert "stopped: 1 done, 0 failed" in worker.output
