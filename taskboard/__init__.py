"""Taskboard: a shared task board on PostgreSQL for humans and autonomous agents."""
