from __future__ import annotations

from django.urls import path

from board import views

app_name = "board"

urlpatterns = [
    path("", views.home, name="home"),
]
