"""Strict JSON (RFC 8259) for files holding measured numbers: non-finite values as named strings.

JSON has no NaN or infinity; Python's `json` writes them as the bare tokens `NaN` and `Infinity`, which
most other readers (JavaScript's `JSON.parse`, `jq`, Go, Rust's serde) reject. A non-finite float (the
loss of a diverged run) is therefore written as the string "NaN", "Infinity" or "-Infinity" (the names
JavaScript gives them), so every reader accepts the file and still sees that the value was not finite;
`read` turns those strings back into floats.
"""

import json
import math

_NON_FINITE = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}


def strict(value):
    """`value` (nested dicts, lists, tuples, numbers, strings) with every non-finite float replaced by
    "NaN", "Infinity" or "-Infinity", so that `json.dump(..., allow_nan=False)` accepts it."""
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    if isinstance(value, dict):
        return {k: strict(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [strict(v) for v in value]
    return value


def _floats(value):
    if isinstance(value, str):
        return _NON_FINITE.get(value, value)
    if isinstance(value, dict):
        return {k: _floats(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_floats(v) for v in value]
    return value


def read(path):
    """The JSON file at `path`, with the strings "NaN", "Infinity" and "-Infinity" read back as floats.

    Raises:
        OSError: the file cannot be read. json.JSONDecodeError: it is not JSON.
    """
    with open(path) as f:
        return _floats(json.load(f))
