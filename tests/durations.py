"""Write tests/durations.json from a run's junit XML: ``pytest --junitxml=run.xml`` then
``python -m tests.durations run.xml``. The figures order the tests (tests/conftest.py)."""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

DURATIONS = Path(__file__).with_name("durations.json")


def main(junit_xml: str) -> None:
    seconds = {}
    for case in ET.parse(junit_xml).iter("testcase"):
        path = case.get("classname", "").replace(".", "/") + ".py"
        name = case.get("name", "")
        if name.rfind("@") > name.rfind("]"):  # xdist's suffix: the test's xdist_group
            name = name.rpartition("@")[0]
        took = float(case.get("time", "0"))
        if took >= 1.0:  # the rest all count as short
            seconds[f"{path}::{name}"] = round(took, 1)
    DURATIONS.write_text(json.dumps(dict(sorted(seconds.items())), indent=0) + "\n")


if __name__ == "__main__":
    main(sys.argv[1])
