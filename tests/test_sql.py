"""The named statements of board/sql: a statement planned several ways is written once, as
a template whose variants each fill its slots, and a variant that fills too few or too
many is refused when the file loads."""

from __future__ import annotations

from pathlib import Path

import pytest

from board.sql import QUERIES, load

TEMPLATE = """
-- template: pick
-- Pick up to :limit rows of :kind.
SELECT * FROM t WHERE :kind LIMIT :limit;

-- name: pick_one
-- from: pick
-- with :kind as kind = %(kind)s
-- with :limit as 1
"""


def test_a_variant_is_its_template_with_the_slots_filled(tmp_path: Path) -> None:
    path = tmp_path / "t.sql"
    path.write_text(TEMPLATE)

    assert load(path) == {"pick_one": "SELECT * FROM t WHERE kind = %(kind)s LIMIT 1"}


@pytest.mark.parametrize(
    "slots",
    ["-- with :kind as true\n", "-- with :kind as true\n-- with :limit as 1\n-- with :x as 2\n"],
    ids=["a slot left empty", "a slot the template lacks"],
)
def test_a_variant_that_does_not_fill_its_templates_slots_is_refused(
    tmp_path: Path, slots: str
) -> None:
    path = tmp_path / "t.sql"
    path.write_text(TEMPLATE.split("-- with")[0] + slots)

    with pytest.raises(ValueError, match="pick_one fills"):
        load(path)


def test_the_claims_variants_differ_only_in_their_queue_condition_and_limit() -> None:
    generic = QUERIES["claim"]
    queues = "(%(all_queues)s OR queue = ANY(%(queues)s))"
    for name, condition, limit in [
        ("claim_any_queue", "true", "%(limit)s"),
        ("claim_any_queue_one", "true", "1"),
        ("claim_in_queues", "queue = ANY(%(queues)s)", "%(limit)s"),
        ("claim_in_queues_one", "queue = ANY(%(queues)s)", "1"),
    ]:
        expected = generic.replace(queues, condition).replace("LIMIT %(limit)s", f"LIMIT {limit}")
        assert QUERIES[name] == expected, name
