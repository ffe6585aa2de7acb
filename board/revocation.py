"""What a change of an account's credentials does in this server process, at once.

The database announces the change at commit (migration 0014; a logout, from the access
app), and each process's relay hears it (board.relay). Then:

- the API's token cache forgets the user (board.api.authentication), so their next request
  is looked up again instead of being trusted for up to TASKBOARD_TOKEN_CACHE_SECONDS;
- this process's open streams are checked again now (board.stream), and those whose
  credentials are no longer valid end; the others take up their current queue limit;
- streams held in Pushpin are not reached at once: their credentials are looked up again
  (the cache above is emptied) when Pushpin next asks their ``next`` link, every
  TASKBOARD_HELD_STREAM_RECHECK_SECONDS. Closing them at once through a per-user channel
  was tried and taken out: with that second channel on every held stream, a CI run saw
  300 of 500 streams behind Pushpin receive no event at all. The symptom came back
  without it, from another cause since fixed (streams now open with their position: see
  board.stream.preamble_of), which may have been this one's too.

Each step also has a slower backstop that needs no notification: the cache's expiry, the
periodic re-check of open streams, and Pushpin's re-check of held streams.
"""

from __future__ import annotations


def credentials_changed(user_id: int | None) -> None:
    """Relay listener: ``user_id``'s credentials changed (None: anyone's may have)."""
    from board import stream
    from board.api import authentication

    authentication.forget(user_id)
    stream.recheck_now()
