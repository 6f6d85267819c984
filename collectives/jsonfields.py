"""A frozen dataclass of numbers as JSON, for the small machine descriptions (Topology, the planner's Cluster).

Infinite floats (an unlimited bandwidth) are written as null and read back as inf; reading refuses text that is not
JSON, anything but an object, and unknown fields, each with a one-line message of the caller's error type. The
dataclass's own __post_init__ validates the values.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, fields
from typing import Any, TypeVar

T = TypeVar("T")


def dumps(obj: Any, **kw: Any) -> str:
    """JSON of a dataclass instance, inf as null."""
    return json.dumps({k: (None if isinstance(v, float) and math.isinf(v) else v) for k, v in asdict(obj).items()},
                      **kw)


def loads(cls: type[T], text: str, what: str, error: type[Exception]) -> dict[str, Any]:
    """The fields of a `cls` in `text`, null read as inf for float fields; `error` (one line naming `what`) for text
    that is not a JSON object or names unknown fields."""
    try:
        d = json.loads(text)
    except ValueError as e:
        raise error(f"{what} JSON does not parse ({e}): {text!r:.80}") from None
    if not isinstance(d, dict):
        raise error(f"{what} JSON must be an object, got {text!r:.80}")
    known = {f.name: f for f in fields(cls)}
    unknown = sorted(set(d) - set(known))
    if unknown:
        raise error(f"unknown {what} field(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
    return {k: (math.inf if v is None and known[k].type in ("float", float) else v) for k, v in d.items()}
