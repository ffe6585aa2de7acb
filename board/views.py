"""The board's HTML pages."""

from __future__ import annotations

from django.contrib.auth.decorators import login_required
from django.db.models import Count
from django.http import HttpRequest, HttpResponse
from django.shortcuts import render

from board.models import Task, TaskStatus


@login_required
def home(request: HttpRequest) -> HttpResponse:
    """Show counts per status and the newest tasks."""
    counts = dict(Task.objects.values_list("status").annotate(n=Count("id")).order_by())
    return render(
        request,
        "board/home.html",
        {
            "counts": [(status.label, counts.get(status.value, 0)) for status in TaskStatus],
            "tasks": Task.objects.order_by("-id")[:50],
        },
    )
