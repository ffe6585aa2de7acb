"""Agents killed with ``kill -9`` (and stopped with SIGSTOP past their lease) mid-task,
while others keep working: every task ends done exactly once, or escalated after three
expired leases; no completion is accepted after a lease was lost."""

from __future__ import annotations

import json
import random
import signal
import sys
import time
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from board import transitions
from board.models import Task, TaskEvent
from tests.processes import ServeProcess, WorkerProcess

pytestmark = [pytest.mark.slow, pytest.mark.once, pytest.mark.django_db(transaction=True)]

QUEUE = "chaos"
LEASE_SECONDS = 2
WORKERS = 4
NORMAL_TASKS = 30
CRASH_LOOPS = 2
CHAOS_SECONDS = 10

# The agent's command: sleep as the payload says and print a result; a crash-loop task
# instead kills the agent running it (kill -9 of its parent), every time it is claimed.
COMMAND = """
import json, os, signal, sys, time
task = json.load(sys.stdin)
if task["payload"].get("crash"):
    os.kill(os.getppid(), signal.SIGKILL)
    sys.exit(0)
time.sleep(task["payload"]["seconds"])
print(json.dumps({"slept": task["payload"]["seconds"]}))
"""


class Agents:
    """A crew of ``taskboard work`` processes, replaced as they die."""

    def __init__(self, server: ServeProcess, token: str, logs: Path) -> None:
        self.server, self.token, self.logs = server, token, logs
        self.crew: list[WorkerProcess] = []
        self.started = 0
        self.stopped: dict[WorkerProcess, float] = {}  # SIGSTOPped, until
        self.kills = self.stops = 0

    def keep(self, count: int) -> None:
        """Continue those stopped long enough, and start agents until ``count`` run."""
        now = time.monotonic()
        for agent, until in list(self.stopped.items()):
            if now >= until:
                agent.proc.send_signal(signal.SIGCONT)
                del self.stopped[agent]
        self.crew = [agent for agent in self.crew if agent.proc.poll() is None]
        while len(self.crew) < count:
            self.started += 1
            self.crew.append(
                WorkerProcess(
                    self.server,
                    self.token,
                    self.logs / f"agent-{self.started}.log",
                    ["--queue", QUEUE, "--lease", str(LEASE_SECONDS), "--concurrency", "2"],
                    [sys.executable, "-c", COMMAND],
                )
            )

    def strike(self, rng: random.Random) -> None:
        """kill -9 a running agent, or now and then stop one for longer than its lease."""
        candidates = [agent for agent in self.crew if agent not in self.stopped]
        if not candidates:
            return
        agent = rng.choice(candidates)
        if rng.random() < 0.8:
            agent.kill()
            self.kills += 1
        else:
            agent.proc.send_signal(signal.SIGSTOP)
            self.stopped[agent] = time.monotonic() + LEASE_SECONDS * 2 + 0.5
            self.stops += 1

    def stop_all(self) -> None:
        for agent in self.crew:
            agent.proc.send_signal(signal.SIGCONT)
            agent.terminate()
        for agent in self.crew:
            try:
                agent.wait(15)
            except AssertionError:
                agent.kill()


def unfinished() -> int:
    return Task.objects.filter(queue=QUEUE, status__in=["pending", "in_progress"]).count()


def lease_until(event: TaskEvent) -> datetime:
    return datetime.fromisoformat(event.payload["lease_until"])


def check_history(task: Task, events: list[TaskEvent]) -> None:
    """Check one task's log: done exactly once under a live lease, or escalated after
    exactly three expired leases, and nothing else."""
    types = [event.type for event in events]
    assert set(types) <= {"created", "claimed", "heartbeat", "completed", "expired", "escalated"}
    if task.status == "done":
        assert types.count("completed") == 1 and types[-1] == "completed", types
        assert "escalated" not in types
        completed = events[-1]
        # Back to the claim that completed it: the lease was never lost in between...
        holder = [event for event in events[:-1] if event.type in {"claimed", "expired"}][-1]
        assert holder.type == "claimed", f"completed after its lease expired: {types}"
        since = events[events.index(holder) : -1]
        assert {event.type for event in since} <= {"claimed", "heartbeat"}, types
        assert all(event.actor == completed.actor for event in since)
        # ...and the completion came before the lease's last deadline.
        assert completed.created_at < max(lease_until(event) for event in since), types
    else:
        assert task.status == "escalated", f"task {task.id} ended {task.status}: {types}"
        assert "completed" not in types
        assert types.count("expired") == 3 and types[-1] == "escalated", types
        assert task.failure_count == 3


def test_agents_killed_mid_task_leave_every_task_done_once_or_escalated(
    start_serve: Callable[..., ServeProcess],
    token_for: Callable[[str], str],
    agent: Any,
    tmp_path: Path,
) -> None:
    rng = random.Random(8)
    normal = [
        transitions.create(
            actor=agent,
            title=f"work {n}",
            queue=QUEUE,
            payload={"seconds": round(rng.uniform(0.2, 0.8), 2)},
        ).id
        for n in range(NORMAL_TASKS)
    ]
    crash_loops = [
        transitions.create(actor=agent, title=f"crash {n}", queue=QUEUE, payload={"crash": True}).id
        for n in range(CRASH_LOOPS)
    ]
    server = start_serve()
    agents = Agents(server, token_for("chaos-agent"), tmp_path)

    started = time.monotonic()
    next_strike = started + 1.0
    try:
        while unfinished():
            now = time.monotonic()
            assert now - started < 120, f"{unfinished()} tasks still open after 120 s"
            chaos = now - started < CHAOS_SECONDS
            agents.keep(WORKERS if chaos else 2)
            if chaos and now >= next_strike:
                agents.strike(rng)
                next_strike = now + rng.uniform(0.4, 1.0)
            time.sleep(0.1)
    finally:
        agents.stop_all()

    tasks = {task.id: task for task in Task.objects.filter(queue=QUEUE)}
    events: dict[int, list[TaskEvent]] = {task_id: [] for task_id in tasks}
    for event in TaskEvent.objects.filter(task_id__in=tasks).order_by("id"):
        events[event.task_id].append(event)
    for task_id, task in tasks.items():
        check_history(task, events[task_id])
    for task_id in crash_loops:
        assert tasks[task_id].status == "escalated"
    done = sum(1 for task_id in normal if tasks[task_id].status == "done")
    expired = sum(1 for task_id in normal for event in events[task_id] if event.type == "expired")
    assert agents.kills >= 5, "the chaos did too little to prove anything"
    assert done >= NORMAL_TASKS // 2, f"only {done} of {NORMAL_TASKS} tasks done"
    assert server.server_errors() == []
    print(
        json.dumps(
            {
                "agents started": agents.started,
                "killed": agents.kills,
                "stopped": agents.stops,
                "done": done,
                "escalated": NORMAL_TASKS - done,
                "expired leases of normal tasks": expired,
                "seconds": round(time.monotonic() - started, 1),
            }
        )
    )
