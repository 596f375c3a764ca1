"""The run's plan in optimizer steps, made from the configuration's epochs and rates, and the check that a
resumed run follows the plan its checkpoint belongs to.

Flags speak in epochs and in learning rates per 256 images; the training loop speaks in optimizer steps.
`make_plan` is the one place that converts, and its `describe()` is the run log's first line.
"""

import dataclasses

from hvd_lars.optim.scaling import REFERENCE_BATCH, scaled_learning_rate, steps_in_epochs
from hvd_lars.training.config import plan_settings, resolve_precision


@dataclasses.dataclass(frozen=True)
class Plan:
    """Batch and step arithmetic of one run, in optimizer steps; `precision` as resolved for this CPU."""

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


def make_plan(config, world_size, num_train_examples):
    """Converts the config's epochs and per-256 rates into steps and a peak rate.

    Raises:
        ValueError: the global batch exceeds the training set.
    """
    global_batch, per_rank = config.resolve_batch(world_size)
    if global_batch > num_train_examples:
        raise ValueError(
            f"--global_batch_size={global_batch} exceeds the {num_train_examples} training examples."
        )
    steps_per_epoch = config.steps_per_epoch or num_train_examples // global_batch
    epochs = int(config.epochs)
    peak = config.peak_learning_rate or scaled_learning_rate(
        config.base_learning_rate, global_batch, REFERENCE_BATCH
    )
    return Plan(
        world_size=world_size,
        global_batch_size=global_batch,
        per_rank_batch_size=per_rank,
        accumulation_steps=config.accumulation_steps,
        steps_per_epoch=steps_per_epoch,
        epochs=epochs,
        total_steps=steps_per_epoch * epochs,
        warmup_steps=steps_in_epochs(config.warmup_epochs, steps_per_epoch),
        peak_learning_rate=peak,
        precision=resolve_precision(config.precision),
    )


# Figures derived from the settings and the data that a resumed run must share too (a data set of another
# size changes them); a change explained by a setting named in --allow_plan_change is accepted.
_DERIVED = ("global_batch_size", "steps_per_epoch", "total_steps", "warmup_steps", "peak_learning_rate")


def plan_changes(previous, config, plan):
    """What differs, in the settings of the plan, between the run that wrote a checkpoint and this one.

    Args:
        previous: the earlier run's summary dict (`RunSummary.load`), with its "config" and "plan".
        config: this run's `TrainConfig`; its `allow_plan_change` names the settings that may change.
        plan: this run's `Plan`.

    Returns:
        list of "name old -> new", one per setting of the plan (`plan_settings()`; `precision` compared as
        resolved) and per derived figure that changed and is not allowed to; [] without a previous summary.
    """
    if not previous:
        return []
    allowed = set(config.allow_plan_change)
    old_config, old_plan = previous.get("config") or {}, previous.get("plan") or {}
    changes, allowed_changed = [], False
    for name in plan_settings():
        source, new = (
            (old_plan, plan.precision) if name == "precision" else (old_config, getattr(config, name))
        )
        if name not in source:
            continue  # a summary written before the setting existed
        old = tuple(source[name] or ()) if isinstance(new, tuple) else source[name]
        if old != new:
            if name in allowed:
                allowed_changed = True
            else:
                changes.append(f"{name} {old!r} -> {new!r}")
    if not allowed_changed:
        new_plan = vars(plan)
        for name in _DERIVED:
            if name in old_plan and old_plan[name] != new_plan[name]:
                changes.append(f"{name} {old_plan[name]!r} -> {new_plan[name]!r}")
    return changes


def refuse_plan_changes(changes, run_dir):
    """The error for `plan_changes`' list, or None when it is empty."""
    if not changes:
        return None
    return (
        f"{run_dir} holds a run with another plan ({'; '.join(changes)}). Resume it with its own "
        "flags, name the settings to change in --allow_plan_change, or start afresh with another "
        "--run_name or "
        "--noresume."
    )
