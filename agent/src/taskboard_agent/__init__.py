"""Taskboard's agent side: the Python client (``taskboard_agent.client``), ``taskboard work``,
``submit``, ``tasks`` and ``mcp``. It runs without the server: nothing here imports Django."""
