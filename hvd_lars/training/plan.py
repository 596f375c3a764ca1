"""The run's plan in optimizer steps (`make_plan`), what is built from it, and a resume's `plan_changes`."""

import dataclasses
import json
import os

import keras

from hvd_lars import keras_internals
from hvd_lars.arguments import counted
from hvd_lars.data import DATASETS, InputRequest
from hvd_lars.data.preprocessing import DEFAULT_PREPROCESSING
from hvd_lars.metrics import TopKAccuracy
from hvd_lars.optim.lars import LARS, mlperf_exclusions
from hvd_lars.optim.scaling import scaled_learning_rate, steps_in_epochs
from hvd_lars.optim.schedules import goyal_boundaries, make_schedule
from hvd_lars.parallel.optimizer import DistributedOptimizer
from hvd_lars.training import faults, threads
from hvd_lars.training.config import ANY_PLAN_CHANGE, DATASET_SETTINGS, PLAN_SETTINGS, resolve_precision


@dataclasses.dataclass(frozen=True)
class Plan:
    """Batch and step arithmetic of one attempt; `settings`: the resolved settings a checkpoint records."""

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
    settings: dict = dataclasses.field(default_factory=dict, compare=False)

    def finished(self, step):
        return step >= self.total_steps

    def describe(self):
        return (
            f"global batch {self.global_batch_size} = {counted(self.world_size, 'rank')} x per-rank batch "
            f"{self.per_rank_batch_size} x accumulation {self.accumulation_steps}; "
            f"{counted(self.steps_per_epoch, 'step')} per epoch x {counted(self.epochs, 'epoch')} = "
            f"{counted(self.total_steps, 'step')}; warmup {counted(self.warmup_steps, 'step')}; "
            f"peak learning rate {self.peak_learning_rate:g}"
        )


# Resolved settings set by several flags: the settings whose change explains theirs (--allow_plan_change).
_DATA_SIZE = ("dataset", "data_dir", "max_train_examples", "validation_examples")
_STEPS = ("steps_per_epoch", "global_batch_size", *_DATA_SIZE)
SET_BY = {
    "data_dir": ("data_dir", "dataset"),
    "train_examples": _DATA_SIZE,
    "input_shape": ("image_size", "dataset", "model"),
    "preprocessing": ("preprocessing", "dataset"),
    "steps_per_epoch": _STEPS,
    "warmup_steps": ("warmup_epochs", *_STEPS),
    "decay_boundaries_steps": ("decay_boundaries_epochs", "schedule", "epochs", *_STEPS),
    "peak_learning_rate": ("peak_learning_rate", "base_learning_rate", "global_batch_size"),
}
# Settings that appear in the resolved settings only through an entry above.
_FOLDED = "image_size max_train_examples warmup_epochs decay_boundaries_epochs base_learning_rate".split()


def make_plan(config, world_size, num_train_examples, input_shape=None, batch=None):
    """The `Plan` of `config` at `world_size` ranks (`batch`: its resolve_batch) over `num_train_examples`."""
    input_shape = getattr(num_train_examples, "input_shape", input_shape)
    examples = getattr(num_train_examples, "num_train_examples", num_train_examples)
    global_batch, per_rank = batch or config.resolve_batch(world_size)
    if global_batch > examples:
        raise ValueError(f"--global_batch_size={global_batch} exceeds the {examples} training examples.")
    steps, epochs = config.steps_per_epoch or examples // global_batch, config.epochs
    peak = config.peak_learning_rate or scaled_learning_rate(config.base_learning_rate, global_batch)
    warmup, precision = steps_in_epochs(config.warmup_epochs, steps), resolve_precision(config.precision)
    figures = dict(global_batch_size=global_batch, steps_per_epoch=steps, epochs=epochs, warmup_steps=warmup)
    figures.update(peak_learning_rate=peak, precision=precision)
    entry, takes = DATASETS[config.dataset], DATASET_SETTINGS[config.dataset]
    folder = config.data_dir or (entry.default_dir and entry.default_dir())
    boundaries = [steps_in_epochs(e, steps) for e in config.decay_boundaries_epochs]
    if not boundaries and config.schedule == "step":
        boundaries = goyal_boundaries(steps * epochs)
    settings = _named(config, *(name for name in PLAN_SETTINGS if name not in _FOLDED))
    settings.update(
        figures,
        data_dir=os.path.realpath(folder) if folder else "",
        preprocessing=config.preprocessing or (DEFAULT_PREPROCESSING if "preprocessing" in takes else ""),
        decay_boundaries_steps=boundaries,
        train_examples=examples,
    )
    if input_shape is not None:
        settings["input_shape"] = list(input_shape)
    sizes = dict(world_size=world_size, per_rank_batch_size=per_rank, total_steps=steps * epochs)
    settings = json.loads(json.dumps(settings))  # as a checkpoint's record gives them back (lists)
    return Plan(accumulation_steps=config.accumulation_steps, settings=settings, **sizes, **figures)


def plan_changes(recorded, plan, allowed=()):
    """["name old -> new", ...]: each setting of `plan` off `recorded` and not `allowed`."""
    changes = []
    for name, new in plan.settings.items():
        by = SET_BY.get(name, (name,))
        if recorded.get(name) != new and not set(by) & {*allowed} and ANY_PLAN_CHANGE not in allowed:
            explained = "" if name in PLAN_SETTINGS else f" (set by {', '.join(by)})"
            changes.append(f"{name} {recorded.get(name)!r} -> {new!r}{explained}")
    return changes


def changed_settings(recorded, plan):
    return any(recorded.get(name) != new for name, new in plan.settings.items())


def refuse_plan_changes(changes, run_dir, checkpoint):
    """The error for `plan_changes`' list, or None when it is empty."""
    if changes:
        return (
            f"{run_dir} holds a run with another plan ({'; '.join(changes)}), the plan of its checkpoint "
            f"{checkpoint}. Resume it with its own flags, name the settings to change in "
            "--allow_plan_change, or start afresh with another --run_name."
        )


def build_schedule(config, plan):
    return make_schedule(
        config.schedule,
        power=config.decay_power,
        boundaries=plan.settings["decay_boundaries_steps"] or None,
        **_named(plan, "peak_learning_rate", "total_steps", "warmup_steps"),
        **_named(config, "warmup_start_learning_rate", "end_learning_rate", "decay_factor"),
    )


def build_optimizer(config, plan):
    """`config.optimizer` on `build_schedule` in a `DistributedOptimizer` (momentum, nesterov: SGD)."""
    lars = config.optimizer == "lars"
    excluded = mlperf_exclusions() if config.exclude_bn_and_bias else None
    optimizer = LARS(
        build_schedule(config, plan),
        nesterov=config.optimizer == "nesterov",
        exclude_from_weight_decay=excluded,
        exclude_from_layer_adaptation=excluded if lars else [""],
        name=None if lars else f"{config.optimizer}_sgd",
        momentum_correction=config.momentum_correction,
        **_named(config, "momentum", "weight_decay", "eta", "epsilon", "trust_ratio_mode"),
    )
    return DistributedOptimizer(
        optimizer, plan.accumulation_steps, config.gradient_compression, config.gradient_reduction
    )


def batch_norm_note(model, plan):
    """What accumulation does to the model's batch norm, for the run log (None: no accumulation or no BN)."""
    norm, steps = keras.layers.BatchNormalization, plan.accumulation_steps
    layers = [layer for layer in keras_internals.flatten_layers(model) if isinstance(layer, norm)]
    if steps > 1 and layers:
        momenta = sorted({float(layer.momentum) for layer in layers})
        momenta = ", ".join(f"{m:g}^{steps} = {m**steps:.3g}" for m in momenta)
        return (
            f"batch norm with accumulation: {len(layers)} layers normalise each micro-batch of "
            f"{plan.per_rank_batch_size} images per rank with its own statistics and update their moving "
            f"averages {steps} times per update (momentum per update {momenta})"
        )


def loss_and_metrics(config, num_classes):
    """The loss and top-1 / top-5 metrics. Label smoothing takes one-hot targets (mapped in `run`)."""
    if config.label_smoothing:
        loss = keras.losses.CategoricalCrossentropy(from_logits=True, label_smoothing=config.label_smoothing)
    else:
        loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    return loss, [TopKAccuracy(1, name="top1"), TopKAccuracy(5, name="top5")]


def input_request(config, per_rank_batch, rank, world_size, run_dir):
    """The `InputRequest` of this rank's shard of `config.dataset`."""
    return InputRequest(
        per_rank_batch=per_rank_batch,
        rank=rank,
        world_size=world_size,
        input_threads=config.input_threads or threads.threads_per_rank(),
        run_dir=run_dir,
        on_unreadable=faults.note_unreadable,  # noted, not raised: every rank stops at the same update
        **_named(config, "seed", "data_dir", "max_train_examples", "max_eval_examples", "deterministic"),
    )


def input_options(config):
    return _named(config, *DATASET_SETTINGS[config.dataset])


def _named(settings, *names):
    return {name: getattr(settings, name) for name in names}
