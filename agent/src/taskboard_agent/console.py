"""The client side of the ``taskboard`` command: ``work``, ``submit`` and ``tasks``.

They talk to a running server over HTTP, as one agent (``--url`` and ``--token``, or
``TASKBOARD_URL`` and ``TASKBOARD_TOKEN``), and never import Django.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Iterable, Sequence
from typing import Any

from taskboard_agent.client import NO_LIMIT, Client, NoLimit, Task, TaskboardError
from taskboard_agent.worker import Display, Worker, WorkerOptions

DEFAULT_URL = "http://127.0.0.1:8000"
COMMANDS = ("work", "submit", "tasks")
STATUSES = ("pending", "in_progress", "awaiting_input", "done", "escalated", "cancelled")

SUMMARY = """\
Agent commands (over HTTP, as the agent of TASKBOARD_TOKEN, on TASKBOARD_URL):
    work        claim tasks and run a command for each: taskboard work --queue Q -- CMD [ARGS]
    submit      create tasks: taskboard submit --queue Q --payload '{"a": 1}' TITLE
    tasks       list tasks: taskboard tasks --status pending [--json]
    mcp         serve the board's tools to an LLM agent's MCP host over stdio
  'taskboard COMMAND --help' describes each.
"""


def _connection_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--url",
        default=os.environ.get("TASKBOARD_URL") or DEFAULT_URL,
        help="the server (default: $TASKBOARD_URL, else %(default)s)",
    )
    parser.add_argument(
        "--token",
        default=os.environ.get("TASKBOARD_TOKEN"),
        help="the agent's API token (default: $TASKBOARD_TOKEN)",
    )


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
    return value


def _attempt_seconds(text: str) -> int | NoLimit:
    return NO_LIMIT if text.strip().lower() == "none" else _positive_int(text)


def _seconds(text: str) -> float:
    value = float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must not be negative, not {text}")
    return value


def _whole_seconds(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must not be negative, not {text}")
    return value


def _task_ids(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not task ids: {text}") from None


def _labels(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="taskboard", description=SUMMARY.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    work = commands.add_parser(
        "work",
        help="claim tasks and run a command for each",
        usage="taskboard work [OPTIONS] -- COMMAND [ARGS ...]",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=(
            "Claim tasks (waiting for work when there is none) and run COMMAND once for\n"
            "each, with the task's JSON on stdin and TASKBOARD_TASK_ID, TASKBOARD_TASK_QUEUE,\n"
            "TASKBOARD_TASK_TITLE, TASKBOARD_LEASE_TOKEN, TASKBOARD_URL, TASKBOARD_TOKEN and\n"
            "TASKBOARD_ATTEMPT in its environment, keeping the lease alive while it runs.\n"
            "Exit 0 completes the task with stdout as the result (JSON when it parses);\n"
            "any other exit fails it with the tail of stderr. A command whose lease is lost\n"
            "(or whose attempt deadline passes) is stopped. SIGINT/SIGTERM: stop claiming,\n"
            "let running commands finish for up to --grace seconds, then stop them and\n"
            "release their tasks.\n"
            "\n"
            "Progress: TASKBOARD_PROGRESS holds the JSON progress the task's previous\n"
            "attempts reported (null when none). Each line of JSON the command writes to\n"
            "the file descriptor TASKBOARD_PROGRESS_FD is its progress so far; the latest\n"
            "goes to the server within a second or so. In any shell:\n"
            "  echo '{\"done\": 40}' > /dev/fd/$TASKBOARD_PROGRESS_FD\n"
            "Lines that are not JSON are logged and ignored.\n"
            "\n"
            "Asking a person: a command that needs a decision writes one line\n"
            '{"ask": {...}} to that file descriptor, with the fields of the API\'s ask\n'
            "(question, options, answer_schema, assignee, answer_within, action_digest),\n"
            "and exits with status 75:\n"
            '  echo \'{"ask": {"question": "Drop t?", "options": ["yes", "no"]}}\' \\\n'
            "    > /dev/fd/$TASKBOARD_PROGRESS_FD; exit 75\n"
            "The question is asked instead of a fail (no strike), and the task waits for\n"
            "the answer. Once answered it is held for this agent for a while, so this\n"
            "worker's next claim takes it. Every attempt gets TASKBOARD_ANSWERS: the JSON\n"
            "list of the task's answered questions, oldest first ([] when none), each with\n"
            "its answer, note, answered_by and the question's fields.\n"
            "\n"
            "Failures: a failed task is due again after --retry-after seconds, or, by\n"
            "default, after a backoff: --backoff seconds after the first strike, doubling\n"
            "with each one, at most --max-backoff, less up to a quarter at random."
        ),
    )
    _connection_options(work)
    work.set_defaults(parser=work)
    work.add_argument(
        "--queue",
        "-q",
        dest="queues",
        action="append",
        metavar="QUEUE",
        help="claim from this queue (repeat for several; default: every queue)",
    )
    work.add_argument(
        "--concurrency",
        "-c",
        type=_positive_int,
        default=1,
        metavar="N",
        help="commands to run at once (default: %(default)s)",
    )
    work.add_argument(
        "--lease",
        type=_positive_int,
        metavar="SECONDS",
        help="lease length to claim for (default: the server's, 120 s unless configured)",
    )
    work.add_argument(
        "--grace",
        type=_seconds,
        default=30.0,
        metavar="SECONDS",
        help="on SIGINT/SIGTERM, how long running commands may finish (default: %(default)g)",
    )
    work.add_argument(
        "--wait",
        type=_seconds,
        default=30.0,
        metavar="SECONDS",
        help="how long each claim waits for work, at most 60 (default: %(default)g)",
    )
    retry = work.add_mutually_exclusive_group()
    retry.add_argument(
        "--retry-after",
        type=_whole_seconds,
        metavar="SECONDS",
        help="a failed task is due again after this long (0: at once), instead of a backoff",
    )
    retry.add_argument(
        "--backoff",
        type=_whole_seconds,
        default=10,
        metavar="SECONDS",
        help="the wait after a task's first failure, doubled for each further one "
        "(default: %(default)s)",
    )
    work.add_argument(
        "--max-backoff",
        type=_whole_seconds,
        default=600,
        metavar="SECONDS",
        help="the longest wait after a failure (default: %(default)s)",
    )
    work.add_argument("cmd", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)

    submit = commands.add_parser(
        "submit",
        help="create tasks",
        description=(
            "Create a task for each TITLE, or, with '-', one for each line of JSON objects "
            "on stdin (fields as in POST /api/v1/tasks/, and idempotency_key; the options "
            "give their defaults). Prints each new task's id, or its JSON with --json. "
            "Each create is sent with an Idempotency-Key (a line's idempotency_key, or a "
            "random one), so that a retry after a lost answer creates nothing twice."
        ),
    )
    _connection_options(submit)
    submit.set_defaults(parser=submit)
    submit.add_argument("titles", nargs="+", metavar="TITLE", help="a title, or '-' for stdin")
    submit.add_argument("--queue", "-q")
    submit.add_argument("--priority", "-p", type=int)
    submit.add_argument("--payload", type=_json_object, metavar="JSON", help="a JSON object")
    submit.add_argument("--description")
    submit.add_argument("--max-failures", type=_positive_int)
    submit.add_argument("--run-after", metavar="TIME", help="ISO 8601, with a UTC offset")
    submit.add_argument(
        "--depends-on",
        type=_task_ids,
        action="extend",
        metavar="ID[,ID...]",
        help="tasks that must be done first (repeat or separate with commas)",
    )
    submit.add_argument("--parent", type=_positive_int, metavar="ID", help="a subtask of this task")
    submit.add_argument(
        "--max-attempt-seconds",
        type=_attempt_seconds,
        metavar="SECONDS",
        help="how long one attempt may hold the task, however often it heartbeats "
        "('none': no limit, whatever the server's default)",
    )
    submit.add_argument(
        "--assignee", metavar="USER", help="only this user (a person or an agent) may claim it"
    )
    submit.add_argument(
        "--requires",
        type=_labels,
        action="extend",
        metavar="LABEL[,LABEL...]",
        help="capabilities a claimant must all have (repeat or separate with commas)",
    )
    submit.add_argument("--json", action="store_true", help="print each task as a JSON line")

    tasks = commands.add_parser(
        "tasks",
        help="list tasks",
        description="List tasks, newest first, as a table or (--json) as JSON lines.",
    )
    _connection_options(tasks)
    tasks.set_defaults(parser=tasks)
    tasks.add_argument("--status", "-s", choices=STATUSES)
    tasks.add_argument("--queue", "-q")
    tasks.add_argument("--leased-by", metavar="USER")
    tasks.add_argument(
        "--assignee", metavar="USER", help="tasks for this user ('me': for the token's user)"
    )
    tasks.add_argument("--requires", metavar="LABEL", help="tasks that require this capability")
    tasks.add_argument("--parent", type=_positive_int, metavar="ID", help="subtasks of this task")
    tasks.add_argument(
        "--depends-on", type=_positive_int, metavar="ID", help="tasks that wait for this one"
    )
    blocked = tasks.add_mutually_exclusive_group()
    blocked.add_argument(
        "--blocked",
        action="store_true",
        default=None,
        help="only tasks waiting for a dependency",
    )
    blocked.add_argument(
        "--not-blocked",
        dest="blocked",
        action="store_false",
        help="only tasks not waiting for one",
    )
    tasks.add_argument(
        "--limit",
        "-n",
        type=int,
        default=100,
        help="show at most this many (default: %(default)s; 0: all)",
    )
    tasks.add_argument("--json", action="store_true", help="print each task as a JSON line")
    return parser


def main(argv: Sequence[str]) -> int:
    """Run ``taskboard work|submit|tasks ARGS``; return the exit status."""
    parser = build_parser()
    argv = list(argv)
    command: list[str] | None = None
    if argv[:1] == ["work"] and "--" in argv:
        # Everything after "--" is the command, its own options included, untouched.
        cut = argv.index("--")
        argv, command = argv[:cut], argv[cut + 1 :]
    args = parser.parse_args(argv)
    if command is not None:
        args.cmd = command
    if not args.token:
        args.parser.error("no API token: pass --token or set TASKBOARD_TOKEN")
    if args.command == "work" and not args.cmd:
        args.parser.error("give the command to run: taskboard work [OPTIONS] -- COMMAND [ARGS]")
    try:
        with Client(args.url, args.token) as client:
            if args.command == "work":
                return work(client, args)
            if args.command == "submit":
                return submit(client, args)
            return list_tasks(client, args)
    except TaskboardError as exc:
        print(f"taskboard: {exc}", file=sys.stderr)
        for name, messages in exc.fields.items():
            print(f"  {name}: {' '.join(messages)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # The reader went away (``taskboard tasks | head``): not an error. Point stdout at
        # /dev/null so that the interpreter's final flush does not complain either.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


def work(client: Client, args: argparse.Namespace) -> int:
    options = WorkerOptions(
        command=list(args.cmd),
        url=args.url,
        token=args.token,
        queues=args.queues,
        concurrency=args.concurrency,
        lease_seconds=args.lease,
        wait=min(args.wait, 60.0),
        grace=args.grace,
        retry_after=args.retry_after,
        backoff=args.backoff,
        max_backoff=args.max_backoff,
    )
    return Worker(client, options, Display()).run()


def submit(client: Client, args: argparse.Namespace) -> int:
    defaults: dict[str, Any] = {
        key: value
        for key, value in {
            "queue": args.queue,
            "priority": args.priority,
            "payload": args.payload,
            "description": args.description,
            "max_failures": args.max_failures,
            "run_after": args.run_after,
            "depends_on": args.depends_on,
            "parent_id": args.parent,
            "max_attempt_seconds": args.max_attempt_seconds,
            "assignee": args.assignee,
            "requires": args.requires,
        }.items()
        if value is not None
    }
    if args.titles == ["-"]:
        specs: Iterable[dict[str, Any]] = _json_lines(sys.stdin)
    elif "-" in args.titles:
        print("taskboard: '-' (stdin) cannot be mixed with titles", file=sys.stderr)
        return 2
    else:
        specs = ({"title": title} for title in args.titles)
    for spec in specs:
        fields = {**defaults, **spec}
        if "max_attempt_seconds" in fields and fields["max_attempt_seconds"] is None:
            fields["max_attempt_seconds"] = NO_LIMIT  # as over the API: null is no limit
        title = fields.pop("title", None)
        if not isinstance(title, str):
            print(f"taskboard: no title in {json.dumps(spec)}", file=sys.stderr)
            return 1
        task = client.create(title, **fields)
        print(json.dumps(task.raw) if args.json else task.id, flush=True)
    return 0


def _json_lines(lines: Iterable[str]) -> Iterable[dict[str, Any]]:
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            value = json.loads(line)
        except ValueError as exc:
            raise SystemExit(f"taskboard: stdin line {number} is not JSON: {exc}") from None
        if not isinstance(value, dict):
            raise SystemExit(f"taskboard: stdin line {number} is not a JSON object")
        yield value


def list_tasks(client: Client, args: argparse.Namespace) -> int:
    limit = args.limit if args.limit > 0 else None
    found = client.iter_tasks(
        status=args.status,
        queue=args.queue,
        leased_by=args.leased_by,
        parent=args.parent,
        blocked=args.blocked,
        depends_on=args.depends_on,
        page_size=min(limit, 1000) if limit else 1000,
        assignee=args.assignee,
        requires=args.requires,
    )
    tasks: list[Task] = []
    for task in found:
        if limit is not None and len(tasks) >= limit:
            break
        if args.json:
            print(json.dumps(task.raw), flush=False)
        tasks.append(task)
    if not args.json:
        print_table(tasks)
    sys.stdout.flush()
    return 0


def print_table(tasks: list[Task]) -> None:
    header = ("ID", "STATUS", "QUEUE", "PRIORITY", "FAILURES", "LEASED BY", "TITLE")
    rows = [
        (
            str(task.id),
            task.status,
            task.queue,
            str(task.priority),
            f"{task.failure_count}/{task.max_failures}",
            task.leased_by or "-",
            task.title,
        )
        for task in tasks
    ]
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header) - 1)]
    for row in [header, *rows]:
        cells = [cell.ljust(width) for cell, width in zip(row, widths, strict=False)]
        print("  ".join([*cells, row[-1]]).rstrip())
