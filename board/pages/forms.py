"""The forms people post on the board's pages and in the admin (each calls a transition)."""

from __future__ import annotations

from django import forms

# The contract's limit on a comment's body (POST tasks/{id}/comments/).
MAX_COMMENT_LENGTH = 10000
MAX_NOTE_LENGTH = 1000


class CommentForm(forms.Form):
    """A comment on a task: board.transitions.comment."""

    body = forms.CharField(
        label="Comment",
        max_length=MAX_COMMENT_LENGTH,
        widget=forms.Textarea(attrs={"rows": 3}),
        error_messages={"required": "The comment is empty: write something to post."},
    )


class QueueNoteForm(forms.Form):
    """The optional note on a pause or a resume of a queue."""

    note = forms.CharField(
        required=False,
        max_length=MAX_NOTE_LENGTH,
        widget=forms.Textarea(attrs={"rows": 3, "cols": 60}),
        help_text="Optional; recorded with the pause or resume.",
    )

    def clean_note(self) -> str | None:
        # An empty note is no note.
        return self.cleaned_data["note"] or None
