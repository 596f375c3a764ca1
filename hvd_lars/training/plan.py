"""The run's plan in optimizer steps, made once per attempt from the configuration and the world size, and
the comparison a resume makes between the plan a checkpoint was written under and this one.

Flags speak in epochs and in learning rates per 256 images; the training loop speaks in optimizer steps.
`make_plan` is the one place that converts, and its `describe()` is the run log's first line. Its
`settings` are the plan's settings as the run resolves them (the global batch, the precision, the warmup in
steps, the data folder as a real path, ...): what each checkpoint records and what a resume compares, so
that two spellings of one plan are one plan and one spelling of two plans is not. A setting whose default
stands for a value (an empty --data_dir, --global_batch_size=0, --precision=auto, ...) is recorded as
that value, resolved here once.
"""

import dataclasses
import json
import os

from hvd_lars.data import DATASETS
from hvd_lars.data.preprocessing import DEFAULT_PREPROCESSING
from hvd_lars.optim.scaling import REFERENCE_BATCH, scaled_learning_rate, steps_in_epochs
from hvd_lars.optim.schedules import goyal_boundaries
from hvd_lars.training.config import ANY_PLAN_CHANGE, DATASET_SETTINGS, plan_settings, resolve_precision


@dataclasses.dataclass(frozen=True)
class Plan:
    """Batch and step arithmetic of one attempt, in optimizer steps; `precision` as resolved for this CPU;
    `settings` ({name: JSON value}) the plan's settings as resolved (`resolved_settings`)."""

    world_size: int
    global_batch_size: int
    per_rank_batch_size: int
    accumulation_steps: int
    steps_per_epoch: int
    epochs: int
    total_steps: int
    warmup_steps: int
    peak_learning_rate: float
    precision: str = "float32"
    num_train_examples: int = 0
    settings: dict = dataclasses.field(default_factory=dict, compare=False)

    def describe(self):
        return (
            f"global batch {self.global_batch_size} = {self.world_size} ranks x per-rank batch "
            f"{self.per_rank_batch_size} x accumulation {self.accumulation_steps}; "
            f"{self.steps_per_epoch} steps per epoch x "
            f"{self.epochs} epochs = {self.total_steps} steps; warmup {self.warmup_steps} steps; "
            f"peak learning rate {self.peak_learning_rate:g}"
        )

    def epoch_steps(self, epochs):
        """Optimizer steps in `epochs` of this plan (`steps_in_epochs`: a positive fraction is >= 1 step)."""
        return steps_in_epochs(epochs, self.steps_per_epoch)


def batch_sizes(config, world_size):
    """(global batch, per-rank micro-batch) of `config` on `world_size` ranks: the one place the plan's
    batch is resolved (`TrainConfig.resolve_batch`; its errors)."""
    return config.resolve_batch(world_size)


def make_plan(config, world_size, num_train_examples, input_shape=None):
    """Converts the config's epochs and per-256 rates into steps and a peak rate, for `world_size` ranks.

    Args:
        num_train_examples: the training images the input holds (after --max_train_examples and
            --validation_examples), or anything with `num_train_examples` and `input_shape` (an
            `InputPipeline` or `InputShapes`), whose image shape then joins the settings.

    Raises:
        ValueError: the global batch exceeds the training set (or `batch_sizes`' errors).
    """
    if hasattr(num_train_examples, "num_train_examples"):
        input_shape = num_train_examples.input_shape
        num_train_examples = num_train_examples.num_train_examples
    global_batch, per_rank = batch_sizes(config, world_size)
    if global_batch > num_train_examples:
        raise ValueError(
            f"--global_batch_size={global_batch} exceeds the {num_train_examples} training examples."
        )
    steps_per_epoch = config.steps_per_epoch or num_train_examples // global_batch
    epochs = int(config.epochs)
    peak = config.peak_learning_rate or scaled_learning_rate(
        config.base_learning_rate, global_batch, REFERENCE_BATCH
    )
    figures = dict(
        global_batch_size=global_batch,
        steps_per_epoch=steps_per_epoch,
        epochs=epochs,
        warmup_steps=steps_in_epochs(config.warmup_epochs, steps_per_epoch),
        peak_learning_rate=peak,
        precision=resolve_precision(config.precision),
    )
    settings = resolved_settings(vars(config), figures, input_shape, num_train_examples)
    return Plan(
        world_size=world_size,
        per_rank_batch_size=per_rank,
        accumulation_steps=config.accumulation_steps,
        total_steps=steps_per_epoch * epochs,
        num_train_examples=num_train_examples,
        settings=settings,
        **figures,
    )


# The entries of a plan's settings resolved from more than one flag, with the settings whose change explains
# theirs (what --allow_plan_change must name); every other entry is the setting of its own name.
_DATA_SIZE = ("dataset", "data_dir", "max_train_examples", "validation_examples")
_STEPS = ("steps_per_epoch", "global_batch_size", *_DATA_SIZE)
SET_BY = {
    "data_dir": ("data_dir", "dataset"),
    "global_batch_size": ("global_batch_size",),
    "train_examples": _DATA_SIZE,
    "input_shape": ("image_size", "dataset", "model"),
    "preprocessing": ("preprocessing", "dataset"),
    "steps_per_epoch": _STEPS,
    "warmup_steps": ("warmup_epochs", *_STEPS),
    "decay_boundaries_steps": ("decay_boundaries_epochs", "schedule", "epochs", *_STEPS),
    "peak_learning_rate": ("peak_learning_rate", "base_learning_rate", "global_batch_size"),
}
# Settings that appear in the resolved settings only through an entry above.
_RESOLVED_INTO = ("image_size", "max_train_examples", "warmup_epochs", "decay_boundaries_epochs")
_RESOLVED_INTO += ("base_learning_rate",)


def resolved_settings(config, figures, input_shape=None, train_examples=None):
    """The plan's settings as resolved: {name: JSON value}, one entry per setting of the plan
    (`plan_settings()`), the global batch, steps, warmup, peak rate and precision as the plan resolved them
    (`figures`), the data folder the data set reads as its real path (its `default_dir` for an empty
    one), the preprocessing as the input pipeline reads it, the step schedule's boundaries in steps (Goyal
    et al.'s for none given), the image shape and the training images the input holds (left out when None).

    Args:
        config: dict of `TrainConfig` fields (`vars(config)`).
        figures: dict with global_batch_size, steps_per_epoch, epochs, warmup_steps, peak_learning_rate and
            precision (a `Plan`'s).
    """
    settings = {name: config[name] for name in plan_settings() if name not in _RESOLVED_INTO}
    names = ("global_batch_size", "steps_per_epoch", "epochs", "warmup_steps", "peak_learning_rate")
    settings.update({name: figures[name] for name in (*names, "precision")})
    entry = DATASETS.get(config["dataset"])
    folder = settings["data_dir"] or (entry and entry.default_dir and entry.default_dir())
    settings["data_dir"] = os.path.realpath(folder) if folder else ""
    if entry is not None:
        takes = "preprocessing" in DATASET_SETTINGS[config["dataset"]]
        settings["preprocessing"] = settings["preprocessing"] or (DEFAULT_PREPROCESSING if takes else "")
    boundaries = [
        steps_in_epochs(e, figures["steps_per_epoch"]) for e in config["decay_boundaries_epochs"] or ()
    ]
    if not boundaries and config["schedule"] == "step":
        boundaries = goyal_boundaries(figures["steps_per_epoch"] * figures["epochs"])
    settings["decay_boundaries_steps"] = boundaries
    if input_shape is not None:
        settings["input_shape"] = list(input_shape)
    if train_examples is not None:
        settings["train_examples"] = train_examples
    return json.loads(json.dumps(settings))  # as a checkpoint's record gives them back (lists, not tuples)


def plan_changes(recorded, plan, allowed=()):
    """What differs between the plan a checkpoint was written under and this one, and is not allowed.

    Args:
        recorded: the earlier run's resolved settings (a checkpoint's record).
        plan: this run's `Plan`.
        allowed: the setting names of --allow_plan_change (`ANY_PLAN_CHANGE`: all of them).

    Returns:
        list of "name old -> new", one per resolved setting that changed (None: not recorded) and that no
        allowed setting explains (`SET_BY`).
    """
    if ANY_PLAN_CHANGE in allowed:
        return []
    changes = []
    for name, new in plan.settings.items():
        old = recorded.get(name)
        if old == new:
            continue
        by = SET_BY.get(name, (name,))
        if set(by) & set(allowed):
            continue
        explained = "" if name in plan_settings() else f" (set by {', '.join(by)})"
        changes.append(f"{name} {old!r} -> {new!r}{explained}")
    return changes


def changed_settings(recorded, plan):
    """True when any resolved setting differs from `recorded` (allowed or not)."""
    return any(recorded.get(name) != new for name, new in plan.settings.items())


def refuse_plan_changes(changes, run_dir, checkpoint):
    """The error for `plan_changes`' list, or None when it is empty."""
    if not changes:
        return None
    return (
        f"{run_dir} holds a run with another plan ({'; '.join(changes)}), the plan of its checkpoint "
        f"{checkpoint}. Resume it with its own flags, name the settings to change in --allow_plan_change, "
        "or start afresh with another --run_name or --noresume (which moves the earlier run under "
        f"{os.path.join(run_dir, 'earlier_runs')}, where the newest --keep_earlier_runs runs are kept)."
    )
