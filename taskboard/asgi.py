"""The ASGI application that ``manage.py serve`` runs under uvicorn."""

import os

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "taskboard.settings")

application = get_asgi_application()
