"""`detected(who, detect_s, bound_s)`: one failure test's detection, recorded when asked (the test asserts it).

The failure tests promise that a dead or hung process is named within a bound (faults.detect_s, at most 5 s) on a
busy machine too. Asserting the bound says only that each run kept it; the issue's figure is the distribution under
load. So every detection a test asserts also goes, when PSLAB_TEST_DETECT_LOG names a file, into that file as one
JSON line {"test", "who", "detect_s", "bound_s", "load"} (load: the 1-minute load average then). The repeat script
(tests run N times beside the hog) reads the medians and maxima from it. Unset (CI, a user): nothing is written."""

from __future__ import annotations

import json
import os


def detected(who: str, detect_s: float, bound_s: float) -> None:
    """Record one detection of `who` after `detect_s` seconds (if PSLAB_TEST_DETECT_LOG is set); the caller asserts
    the bound (so pytest shows its own message)."""
    path = os.environ.get("PSLAB_TEST_DETECT_LOG")
    if not path:
        return
    test = os.environ.get("PYTEST_CURRENT_TEST", "?").split(" ")[0]
    rec = {"test": test, "who": who, "detect_s": round(float(detect_s), 4), "bound_s": bound_s,
           "load": round(os.getloadavg()[0], 2)}
    with open(path, "a") as f:
        f.write(json.dumps(rec) + "\n")
