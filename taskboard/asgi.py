"""The ASGI application that ``manage.py serve`` runs under uvicorn.

Django serves HTTP; the lifespan protocol is handled here so that the process's event
relay (board.relay) closes its connections and ends open streams on shutdown.
"""

from __future__ import annotations

import os
from typing import Any

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "taskboard.settings")

django_application = get_asgi_application()


async def application(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] != "lifespan":
        await django_application(scope, receive, send)
        return
    from board.relay import stop_relays

    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await stop_relays()
            await send({"type": "lifespan.shutdown.complete"})
            return
