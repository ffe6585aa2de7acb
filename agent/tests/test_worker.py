"""taskboard_agent.worker's parts that need no server: the backoff, the progress pipe and
its lines, the display and the result. ``taskboard work`` against a live server is tested in
the repository's tests/test_work.py."""

from __future__ import annotations

import io
import json
import os
import random
from typing import Any

import pytest

from taskboard_agent.worker import (
    MAX_ANSWERS_BYTES,
    MAX_ASK_BYTES,
    MAX_PROGRESS_BYTES,
    Display,
    ProgressPipe,
    WorkerOptions,
    answers_variable,
    failure_message,
    parse_ask,
    parse_progress,
    parse_result,
    retry_delay,
)


def test_the_backoff_doubles_with_each_strike_up_to_its_cap_and_retry_after_replaces_it() -> None:
    options = WorkerOptions(command=["true"], url="http://board.test", backoff=10, max_backoff=60)
    rng = random.Random(9)
    for _ in range(200):
        waits = [retry_delay(strikes, options, rng) for strikes in range(6)]
        assert 7 <= waits[0] <= 10 and 15 <= waits[1] <= 20 and 30 <= waits[2] <= 40
        assert waits[0] < waits[1] < waits[2] < waits[3]
        assert all(45 <= wait <= 60 for wait in waits[3:])
    assert retry_delay(99, options, rng) <= 60  # no overflow however many strikes
    fixed = WorkerOptions(command=["true"], url="http://board.test", retry_after=0)
    assert [retry_delay(strikes, fixed) for strikes in range(3)] == [0, 0, 0]


def test_the_progress_pipe_reports_each_value_and_skips_what_is_not_one() -> None:
    reported: list[Any] = []
    complaints: list[str] = []
    pipe = ProgressPipe(reported.append, complaints.append)
    writer = os.fdopen(os.dup(pipe.write_fd), "wb")
    pipe.start()  # closes the pipe's own write end: the dup keeps it open

    writer.write(b'{"n": 1}\n\n')
    writer.write(b'{"big": "' + b"x" * MAX_PROGRESS_BYTES + b'"}\n')
    writer.write(b"[2]\n")
    writer.write(b"oops\n" * 12)
    writer.write(b'{"n": 3}')  # the last line needs no newline
    writer.close()
    pipe.wait(timeout=5)

    assert reported == [{"n": 1}, [2], {"n": 3}]
    assert len(complaints) == 10  # one over the limit and the first nine of twelve
    assert complaints[0].startswith(f"progress line ignored, over {MAX_PROGRESS_BYTES} bytes")
    assert complaints[1].startswith("progress line ignored, not JSON") and "'oops'" in complaints[1]
    assert complaints[-1].endswith("(later ones are not logged)")


def test_an_ask_line_is_kept_apart_from_progress_and_may_be_longer() -> None:
    reported: list[Any] = []
    complaints: list[str] = []
    pipe = ProgressPipe(reported.append, complaints.append)
    writer = os.fdopen(os.dup(pipe.write_fd), "wb")
    pipe.start()
    schema = {"type": "object", "description": "x" * (2 * MAX_PROGRESS_BYTES)}

    writer.write(b'{"n": 1}\n{"ask": {"question": "First?"}}\n')
    writer.write(json.dumps({"ask": {"question": "Which?", "answer_schema": schema}}).encode())
    writer.write(b'\n{"ask": "not an object"}\n')
    writer.write(b'{"ask": {"question": "' + b"y" * MAX_ASK_BYTES + b'"}}\n')
    writer.write(b'{"ask": {}, "and": "more"}\n')  # an object with more keys is progress
    writer.close()
    pipe.wait(timeout=5)

    assert reported == [{"n": 1}, {"ask": {}, "and": "more"}]
    assert pipe.ask == {"question": "Which?", "answer_schema": schema}  # the latest that is one
    assert len(complaints) == 2
    assert "an ask must be a JSON object" in complaints[0]
    assert f"over {MAX_ASK_BYTES} bytes" in complaints[1]
    assert parse_ask([{"ask": {}}]) is None and parse_ask({"ask": {"a": 1}}) == {"a": 1}


def test_the_answers_variable_fits_the_environment_newest_first() -> None:
    answers = [
        {"event_id": n, "question": "q" * 10_000, "answer": n, "answer_schema": {"n": n}}
        for n in range(5)
    ]
    assert json.loads(answers_variable(answers)) == answers
    assert answers_variable([]) == "[]"

    big = [answer | {"answer_schema": {"x": "s" * 60_000}} for answer in answers]
    lean = json.loads(answers_variable(big))
    assert lean == [{k: v for k, v in a.items() if k != "answer_schema"} for a in answers]

    many = [answer | {"answer": "a" * 9_000} for answer in answers * 4]
    kept = json.loads(answers_variable(many))
    assert 0 < len(kept) < len(many)
    assert [a["event_id"] for a in kept] == [a["event_id"] for a in many[-len(kept) :]]
    assert len(answers_variable(many).encode()) <= MAX_ANSWERS_BYTES


def test_a_progress_line_is_any_json_value_but_null() -> None:
    assert parse_progress(b'{"done": 40}\n') == {"done": 40}
    assert parse_progress(b"[1, 2]") == [1, 2]
    assert parse_progress(b"0.5\n") == 0.5
    for line, why in [
        (b"{oops\n", "not JSON"),
        (b"NaN\n", "not JSON"),
        (b"null\n", "null"),
        (b'{"a": ["\\u0000"]}\n', "NUL"),
    ]:
        with pytest.raises(ValueError, match=why):
            parse_progress(line)


def test_the_status_line_is_redrawn_in_place_on_a_terminal() -> None:
    out = io.StringIO()
    display = Display(out, live=True)

    display.status("1 running: #7 0s | 0 done")
    display.log("task 7: done")
    display.status("0 running | 1 done")
    display.close()

    text = out.getvalue()
    assert text.startswith("\r\x1b[K1 running: #7 0s | 0 done")
    assert "\r\x1b[K" in text and "task 7: done\n1 running: #7 0s | 0 done" in text
    assert text.endswith("\r\x1b[K0 running | 1 done\r\x1b[K")


def test_off_a_terminal_it_writes_plain_timestamped_lines() -> None:
    out = io.StringIO()
    display = Display(out, live=False)

    display.status("1 running")
    display.log("task 7: done")

    [line] = out.getvalue().splitlines()
    assert line.endswith(" task 7: done") and line[:4].isdigit() and "\r" not in line


def test_a_result_is_json_when_it_parses_and_text_otherwise() -> None:
    assert parse_result(b'{"a": [1, 2]}\n') == {"a": [1, 2]}
    assert parse_result(b"12\n") == 12
    assert parse_result(b"hello\nworld\n\n") == "hello\nworld"
    assert parse_result(b"NaN\n") == "NaN"  # not JSON, though Python would take it
    assert parse_result(b"  \n") is None
    assert failure_message(-9, "") == "killed by SIGKILL (no stderr)"
