"""The issue's "done when", end to end on real processes: a plan of 50 tasks with
dependencies, worked by ``taskboard work`` agents that split some tasks into subtasks and
comment as they go, beside a spinning agent that heartbeats on schedule but never finishes.

Every task is claimed only after its dependencies are done and is done exactly once; the
spinner loses its task at each attempt deadline and the task escalates after three; a
stream follower sees every event of it exactly once.
"""

from __future__ import annotations

import json
import random
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from board import transitions
from board.models import Task, TaskEvent, TaskStatus
from tests.processes import ServeProcess, StreamFollower, WorkerProcess, eventually

pytestmark = [pytest.mark.slow, pytest.mark.once, pytest.mark.django_db(transaction=True)]

PLAN = 50
SPLIT_EVERY = 7  # every 7th task of the plan is split into subtasks by its agent

# The agents' command. It reports progress, comments on its task, splits it into
# subtasks when the payload says so (through the agent's own client and token), and the
# spinner task never ends: its runner heartbeats until the attempt deadline stops it.
COMMAND = """
import json, os, sys, time
from taskboard_agent.client import Client
task = json.load(sys.stdin)
progress = os.fdopen(int(os.environ["TASKBOARD_PROGRESS_FD"]), "w", buffering=1)
if task["payload"].get("spin"):
    while True:
        progress.write(json.dumps({"spinning": time.time()}) + "\\n")
        time.sleep(0.3)
client = Client(os.environ["TASKBOARD_URL"], os.environ["TASKBOARD_TOKEN"])
progress.write(json.dumps({"step": "started"}) + "\\n")
for n in range(task["payload"].get("split", 0)):
    client.create(f"part {n} of {task['id']}", queue=task["queue"], parent_id=task["id"])
if task["payload"].get("split"):
    client.comment(task["id"], f"split into {task['payload']['split']} subtasks")
time.sleep(1.2)  # long enough for the runner to send the progress with a heartbeat
print(json.dumps({"done": task["id"]}))
"""


def test_agents_work_a_plan_in_dependency_order_and_a_spinner_escalates(
    start_serve: Callable[..., ServeProcess],
    token_for: Callable[[str], str],
    agent: Any,
    tmp_path: Path,
) -> None:
    rng = random.Random(50)
    plan: list[int] = []
    for n in range(PLAN):
        depends_on = rng.sample(plan[-10:], k=min(len(plan), rng.randint(0, 2)))
        payload = {"split": 2} if n % SPLIT_EVERY == 3 else {}
        plan.append(
            transitions.create(
                actor=agent, title=f"step {n}", queue="plan", depends_on=depends_on, payload=payload
            ).id
        )
    spinner = transitions.create(
        actor=agent,
        title="spins forever",
        queue="spin",
        payload={"spin": True},
        max_attempt_seconds=2,
    ).id
    server = start_serve()
    token = token_for("plan-agent")
    follower = StreamFollower(server.url, token, last_event_id=0).start()
    workers = [
        WorkerProcess(
            server,
            token,
            tmp_path / f"worker-{n}.log",
            ["--queue", "plan", "--concurrency", "2", "--wait", "2", "--retry-after", "0"],
            [sys.executable, "-c", COMMAND],
        )
        for n in range(3)
    ]
    workers.append(
        WorkerProcess(
            server,
            token_for("spin-agent"),
            tmp_path / "spinner.log",
            ["--queue", "spin", "--lease", "30", "--wait", "2", "--retry-after", "0"],
            [sys.executable, "-c", COMMAND],
        )
    )
    try:

        def finished() -> bool:
            open_tasks = Task.objects.filter(queue="plan").exclude(status=TaskStatus.DONE)
            return (
                not open_tasks.exists()
                and Task.objects.get(pk=spinner).status == TaskStatus.ESCALATED
            )

        eventually(finished, timeout=120, what="the plan and the spinner's escalation")
        last = TaskEvent.objects.order_by("-id").values_list("id", flat=True).first()
        assert last is not None
        eventually(lambda: follower.ids and follower.ids[-1] >= last, timeout=20, what="the stream")
    finally:
        for worker in workers:
            worker.kill()
        follower.close()

    tasks = {task.pk: task for task in Task.objects.all()}
    events = list(TaskEvent.objects.order_by("id"))
    first: dict[tuple[int, str], int] = {}
    for event in events:
        first.setdefault((event.task_id, event.type), event.pk)
    completed = Counter(event.task_id for event in events if event.type == "completed")

    # Every task of the plan and every subtask: done exactly once, after its dependencies.
    subtasks = [task for task in tasks.values() if task.parent_id is not None]
    assert len(subtasks) == 2 * sum(1 for n in range(PLAN) if n % SPLIT_EVERY == 3)
    for task in tasks.values():
        if task.pk == spinner:
            continue
        assert completed[task.pk] == 1, f"task {task.pk} completed {completed[task.pk]} times"
        for dependency in task.depends_on:
            assert first[(task.pk, "claimed")] > first[(dependency, "completed")]
        assert task.progress == {"step": "started"}
    for parent in {task.parent_id for task in subtasks}:
        assert parent is not None
        assert TaskEvent.objects.filter(task_id=parent, type="commented").count() == 1
    assert TaskEvent.objects.filter(type="unblocked").exists()

    # The spinner: three attempts ended by the deadline, then escalated.
    history = [(e.type, e.payload.get("reason")) for e in events if e.task_id == spinner]
    expiries = [reason for kind, reason in history if kind == "expired"]
    assert expiries == ["attempt_deadline"] * 3, history
    assert history[-1][0] == "escalated"
    spun = tasks[spinner].progress
    assert spun is not None and "spinning" in spun

    # The stream delivered every event exactly once (in commit order, which may differ from
    # id order between transactions that ran at the same time).
    assert len(follower.ids) == len(set(follower.ids)), "the stream repeated an event"
    assert set(follower.ids) == {event.pk for event in events}, "the stream missed an event"
    assert server.server_errors() == []
    print(
        json.dumps(
            {
                "tasks": len(tasks),
                "subtasks": len(subtasks),
                "events": len(events),
                "unblocked": sum(1 for e in events if e.type == "unblocked"),
            }
        )
    )
