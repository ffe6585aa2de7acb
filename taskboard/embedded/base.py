"""A PostgreSQL database engine that starts the embedded server on first connection."""

from __future__ import annotations

import contextlib
import threading
from typing import Any

import psycopg
import psycopg.sql

from taskboard import embedded
from taskboard.postgresql import base

_ensured: set[tuple[str, str]] = set()
_ensured_lock = threading.Lock()


class DatabaseWrapper(base.DatabaseWrapper):
    def get_connection_params(self) -> dict[str, Any]:
        params = super().get_connection_params()
        params.update(embedded.connection_params(params.pop("data_dir")))
        return params

    def get_new_connection(self, conn_params: dict[str, Any]) -> Any:
        self._ensure_database(conn_params)
        return super().get_new_connection(conn_params)

    @staticmethod
    def _ensure_database(conn_params: dict[str, Any]) -> None:
        """Create the application database on the server's first start."""
        dbname = conn_params.get("dbname") or "postgres"
        key = (str(conn_params["host"]), dbname)
        if dbname == "postgres" or key in _ensured:
            return
        admin = {
            k: v for k, v in conn_params.items() if k in {"host", "port", "user", "connect_timeout"}
        }
        with _ensured_lock, psycopg.connect(**admin, dbname="postgres", autocommit=True) as conn:
            exists = conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", [dbname])
            if exists.fetchone() is None:
                # Another process may create it first.
                with contextlib.suppress(psycopg.errors.DuplicateDatabase):
                    conn.execute(
                        psycopg.sql.SQL("CREATE DATABASE {}").format(psycopg.sql.Identifier(dbname))
                    )
            _ensured.add(key)
