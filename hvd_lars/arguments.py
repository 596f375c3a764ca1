"""The one check of a numeric argument, and its one wording: "<name> must be <accepted>, got <value>."; and
the count of a noun in the run's lines ("1 rank", "2 ranks")."""

import dataclasses
import math
import numbers


@dataclasses.dataclass(frozen=True)
class Range:
    """A number accepted when finite, not a bool, `low <= value` (`<` with `low_open`) and `value < high`
    (`<=` without `high_open`), and whole where `whole`."""

    low: float = -math.inf
    high: float = math.inf
    low_open: bool = False
    high_open: bool = True
    whole: bool = False

    def accepts(self, value):
        return not (
            isinstance(value, bool)
            or not isinstance(value, numbers.Real)
            or not math.isfinite(value)
            or (self.whole and float(value) != int(value))
            or (value <= self.low if self.low_open else value < self.low)
            or (value >= self.high if self.high_open else value > self.high)
        )

    def describe(self):
        """What is accepted, as a phrase: "a whole number >= 1", "a finite number >= 0 and < 1"."""
        parts = []
        if self.low != -math.inf:
            parts.append(f"{'>' if self.low_open else '>='} {self.low:g}")
        if self.high != math.inf:
            parts.append(f"{'<' if self.high_open else '<='} {self.high:g}")
        kind = "a whole number" if self.whole else "a finite number"
        return f"{kind} {' and '.join(parts)}".strip()


def is_number(value):
    """True for what `float()` takes that is not a bool or a string: numbers, NumPy and tensor scalars."""
    if isinstance(value, (bool, str, bytes)):
        return False
    try:
        float(value)
    except (TypeError, ValueError):
        return False
    return True


def at_least(low, whole=False):
    return Range(low=low, whole=whole)


def above(low, whole=False):
    return Range(low=low, low_open=True, whole=whole)


def fraction():
    """[0, 1)."""
    return Range(low=0.0, high=1.0)


def refusal(name, value, accepted):
    """The one wording, `accepted` a phrase ("a bool", "one of 'a', 'b'")."""
    return f"{name} must be {accepted}, got {value!r}."


def refuse(name, value, accepted):
    """Raises ValueError in the one wording (`refusal`)."""
    raise ValueError(refusal(name, value, accepted))


def check(name, value, accepted: Range):
    """Returns `value` when `accepted` holds it, else raises ValueError naming both."""
    if not accepted.accepts(value):
        refuse(name, value, accepted.describe())
    return value


# The image-folder pipeline's one setting without a default: said by the flags' check and the pipeline's.
IMAGE_FOLDER_NEEDS_DATA_DIR = (
    "--dataset=image_folder needs --data_dir=<folder holding train/ and validation/>."
)


def counted(number, noun):
    """ "1 rank", "2 ranks": `number` and `noun`, plural unless `number` is 1."""
    return f"{number} {noun}{'s' * (number != 1)}"
