"""What a change of an account's credentials does in this server process, at once.

The database announces the change at commit (migration 0014; a logout, from the access
app), and each process's relay hears it (board.live.relay). Then:

- the API's token cache forgets the user (board.api.authentication), so their next request
  is looked up again instead of being trusted for up to TASKBOARD_TOKEN_CACHE_SECONDS;
- this process's open streams are checked again now (board.live.stream), and those whose
  credentials are no longer valid end; the others take up their current queue limit;
- behind Pushpin, every process publishes a close on the user's channel (board.live.grip),
  which ends the user's held streams. Each client reconnects and resumes after its last
  event: refused (401) if revoked, under its new queue limit if that changed. A valid
  stream closed with the rest loses nothing. (The user's channel was tried once before
  and taken out after a CI run saw 300 of 500 streams behind Pushpin receive no event;
  the same symptom came back without it and had another cause, since fixed: streams now
  open with their position, board.live.stream.preamble_of.)

Each step also has a slower backstop that needs no notification: the cache's expiry, the
periodic re-check of open streams, and Pushpin's re-check of held streams.
"""

from __future__ import annotations


def credentials_changed(user_id: int | None) -> None:
    """Relay listener: ``user_id``'s credentials changed (None: anyone's may have)."""
    from board.api import authentication
    from board.live import grip, stream

    authentication.forget(user_id)
    stream.recheck_now()
    if user_id is not None:
        grip.close_streams_of(user_id)
