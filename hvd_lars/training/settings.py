"""How a setting of the run is declared: its default, help, accepted values and place in the plan, in one
field.

`setting(...)` makes a dataclass field of `TrainConfig` whose metadata carries everything the main program
needs to define its flag and everything `TrainConfig.validate` needs to check it, so that no default,
help text or list of choices is written twice.
"""

import dataclasses
import math
import numbers


def setting(default, help, *, choices=None, check=None, plan=False, item=str):
    """A `TrainConfig` field.

    Args:
        default: the value when the flag is not given (its type is the flag's type: str, int, float, bool,
            or tuple for a list of numbers).
        help: one line for `--help`.
        choices: a tuple of accepted values; an empty string is accepted in addition where the default is
            "".
        check: a `Check` (below), or None.
        plan: True when the setting changes what the remaining updates do (optimizer, schedule, data...):
            a run resumed from a checkpoint refuses a change of it unless `--allow_plan_change` names it.
        item: for a tuple setting (a comma-separated flag), the type of each element.
    """
    return dataclasses.field(
        default=default,
        metadata={"help": help, "choices": choices, "check": check, "plan": plan, "item": item},
    )


@dataclasses.dataclass(frozen=True)
class Check:
    """A numeric range: finite, `low <= value` (or `<` with `low_open`), `value < high` (or `<=`)."""

    low: float = -math.inf
    high: float = math.inf
    low_open: bool = False
    high_open: bool = True
    whole: bool = False

    def problem(self, value):
        """None when `value` is accepted, else what would be ("a whole number >= 1")."""
        if (
            isinstance(value, bool)
            or not isinstance(value, numbers.Real)
            or not math.isfinite(value)
            or (self.whole and float(value) != int(value))
            or (value <= self.low if self.low_open else value < self.low)
            or (value >= self.high if self.high_open else value > self.high)
        ):
            return self.describe()
        return None

    def describe(self):
        kind = "a whole number" if self.whole else "a finite number"
        parts = []
        if self.low != -math.inf:
            parts.append(f"{'>' if self.low_open else '>='} {self.low:g}")
        if self.high != math.inf:
            parts.append(f"{'<' if self.high_open else '<='} {self.high:g}")
        return f"{kind} {' and '.join(parts)}".strip()


def at_least(low, whole=False):
    """Finite and >= `low`."""
    return Check(low=low, whole=whole)


def above(low, whole=False):
    """Finite and > `low`."""
    return Check(low=low, low_open=True, whole=whole)


def fraction():
    """Finite, in [0, 1)."""
    return Check(low=0.0, high=1.0)


def problem(field, value):
    """The one-line error for `value` of `field` (a dataclass field made by `setting`), or None."""
    choices = field.metadata["choices"]
    if choices is not None:
        if value in choices or (value == "" and field.default == ""):
            return None
        empty = f" (empty: {field.default or 'the default'})" if field.default == "" else ""
        return f"--{field.name}={value!r}; valid: {', '.join(map(str, choices))}{empty}."
    check = field.metadata.get("check")
    if check is None:
        return None
    if isinstance(value, tuple):
        bad = [v for v in value if check.problem(v)]
        return f"--{field.name}={list(value)}: each must be {check.describe()}." if bad else None
    accepted = check.problem(value)
    return f"--{field.name} must be {accepted}, got {value!r}." if accepted else None
