"""One NOTIFY per statement against one per row: a synthetic measurement.

100-row INSERT statements into two event tables, one with the old per-row NOTIFY trigger
(a distinct payload per row, as board/migrations/0002 had it) and one with the statement
trigger of board/migrations/0009, with a LISTEN session present; 200 statements a side per
round, six rounds, alternating. Run it with any Python that has psycopg, against a
PostgreSQL where it may create and drop a database ``notify_bench``:

    .venv/bin/python benchmarks/measurements/notify_per_statement.py [postgresql://...]

It prints the time per 100-row statement of each and the notifications the listener heard.
"""

from __future__ import annotations

import statistics
import sys
import threading
import time

import psycopg

SERVER = sys.argv[1] if len(sys.argv) > 1 else "postgresql://postgres@127.0.0.1:5432/postgres"
DATABASE = SERVER.rsplit("/", 1)[0] + "/notify_bench"
ROUNDS, STATEMENTS, ROWS = 6, 200, 100

SCHEMA = """
CREATE TABLE ev_row (id bigserial PRIMARY KEY, task_id bigint, payload jsonb);
CREATE TABLE ev_stmt (id bigserial PRIMARY KEY, task_id bigint, payload jsonb);
CREATE FUNCTION n_row() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('task_events', NEW.id::text);
    RETURN NULL;
END $$;
CREATE FUNCTION n_stmt() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    last_id bigint;
BEGIN
    SELECT max(id) INTO last_id FROM new_events;
    IF last_id IS NOT NULL THEN
        PERFORM pg_notify('task_events', last_id::text);
    END IF;
    RETURN NULL;
END $$;
CREATE TRIGGER t AFTER INSERT ON ev_row FOR EACH ROW EXECUTE FUNCTION n_row();
CREATE TRIGGER t AFTER INSERT ON ev_stmt REFERENCING NEW TABLE AS new_events
    FOR EACH STATEMENT EXECUTE FUNCTION n_stmt();
"""


def main() -> None:
    with psycopg.connect(SERVER, autocommit=True) as admin:
        admin.execute("DROP DATABASE IF EXISTS notify_bench")
        admin.execute("CREATE DATABASE notify_bench")
    try:
        measure()
    finally:
        with psycopg.connect(SERVER, autocommit=True) as admin:
            admin.execute("DROP DATABASE notify_bench WITH (FORCE)")


def measure() -> None:
    with psycopg.connect(DATABASE, autocommit=True) as conn:
        conn.execute(SCHEMA)
    heard = [0]
    stop = threading.Event()

    def listen() -> None:
        with psycopg.connect(DATABASE, autocommit=True) as listener:
            listener.execute("LISTEN task_events")
            while not stop.is_set():
                heard[0] += sum(1 for _ in listener.notifies(timeout=0.2))

    thread = threading.Thread(target=listen)
    thread.start()
    time.sleep(0.5)
    times: dict[str, list[float]] = {"row": [], "stmt": []}
    insert = "INSERT INTO ev_{} (task_id, payload) SELECT g, '{{}}' FROM generate_series(1, {}) g"
    with psycopg.connect(DATABASE, autocommit=True) as conn:
        for _round in range(ROUNDS):
            for name in times:
                started = time.perf_counter()
                for _statement in range(STATEMENTS):
                    conn.execute(insert.format(name, ROWS))
                times[name].append((time.perf_counter() - started) / STATEMENTS * 1000)
                time.sleep(0.5)
    stop.set()
    thread.join()
    for name, values in times.items():
        print(
            f"{name}: {statistics.median(values):.2f} ms per {ROWS}-row statement "
            f"(min {min(values):.2f}, max {max(values):.2f})"
        )
    expected = ROUNDS * STATEMENTS * (ROWS + 1)
    print(f"notifications heard: {heard[0]} (expected {expected}: one per row + one per statement)")


if __name__ == "__main__":
    main()
