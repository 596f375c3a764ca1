"""The run's plan in optimizer steps (`make_plan`, the one place where epochs and rates per 256 images become
steps and a peak rate), what it builds (schedule, optimizer, loss and metrics, input), and the comparison a
resume makes with the plan its checkpoint records (`plan_changes`)."""

import dataclasses
import json
import os

import keras

from hvd_lars import keras_internals
from hvd_lars.data import DATASETS, InputRequest
from hvd_lars.data.preprocessing import DEFAULT_PREPROCESSING
from hvd_lars.metrics import TopKAccuracy
from hvd_lars.optim.lars import LARS, mlperf_exclusions
from hvd_lars.optim.scaling import REFERENCE_BATCH, scaled_learning_rate, steps_in_epochs
from hvd_lars.optim.schedules import goyal_boundaries, make_schedule
from hvd_lars.parallel.optimizer import DistributedOptimizer
from hvd_lars.training import faults, threads
from hvd_lars.training.config import (
    ANY_PLAN_CHANGE,
    DATASET_SETTINGS,
    default_of,
    plan_settings,
    resolve_precision,
)


@dataclasses.dataclass(frozen=True)
class Plan:
    """Batch and step arithmetic of one attempt, in optimizer steps; `precision` as resolved for this CPU;
    `settings` ({name: JSON value}): the plan's settings as the run resolves them, which a checkpoint
    records and a resume compares."""

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
            f"{self.per_rank_batch_size} x accumulation {self.accumulation_steps}; {self.steps_per_epoch} "
            f"steps per epoch x {self.epochs} epochs = {self.total_steps} steps; warmup {self.warmup_steps} "
            f"steps; peak learning rate {self.peak_learning_rate:g}"
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
_FOLDED = "image_size max_train_examples warmup_epochs decay_boundaries_epochs base_learning_rate".split()


def make_plan(config, world_size, num_train_examples, input_shape=None):
    """The `Plan` of `config` at `world_size` ranks. `num_train_examples`: the training images the input
    holds, or an `InputPipeline` / `InputShapes`, whose image shape then joins the settings. Its settings
    are resolved (the data folder as a real path, a default as what it stands for, epochs in steps), so that
    two spellings of one plan are one plan. Raises ValueError: a global batch larger than the training set,
    or `TrainConfig.resolve_batch`'s errors.
    """
    input_shape = getattr(num_train_examples, "input_shape", input_shape)
    examples = getattr(num_train_examples, "num_train_examples", num_train_examples)
    global_batch, per_rank = config.resolve_batch(world_size)
    if global_batch > examples:
        raise ValueError(f"--global_batch_size={global_batch} exceeds the {examples} training examples.")
    steps_per_epoch = config.steps_per_epoch or examples // global_batch
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
    settings = {name: getattr(config, name) for name in plan_settings() if name not in _FOLDED}
    settings.update(figures)
    entry = DATASETS[config.dataset]
    folder = config.data_dir or (entry.default_dir and entry.default_dir())
    settings["data_dir"] = os.path.realpath(folder) if folder else ""
    takes = "preprocessing" in DATASET_SETTINGS[config.dataset]
    settings["preprocessing"] = config.preprocessing or (DEFAULT_PREPROCESSING if takes else "")
    boundaries = [steps_in_epochs(e, steps_per_epoch) for e in config.decay_boundaries_epochs]
    if not boundaries and config.schedule == "step":
        boundaries = goyal_boundaries(steps_per_epoch * epochs)
    settings["decay_boundaries_steps"] = boundaries
    if input_shape is not None:
        settings["input_shape"] = list(input_shape)
    settings["train_examples"] = examples
    return Plan(
        world_size=world_size,
        per_rank_batch_size=per_rank,
        accumulation_steps=config.accumulation_steps,
        total_steps=steps_per_epoch * epochs,
        num_train_examples=examples,
        settings=json.loads(json.dumps(settings)),  # as a checkpoint's record gives them back (lists)
        **figures,
    )


def plan_changes(recorded, plan, allowed=()):
    """["name old -> new", ...]: each resolved setting of `plan` that differs from `recorded` (a checkpoint's
    record; None: not recorded) and that no setting named in `allowed` explains (`SET_BY`;
    `ANY_PLAN_CHANGE`: all of them)."""
    if ANY_PLAN_CHANGE in allowed:
        return []
    changes = []
    for name, new in plan.settings.items():
        by = SET_BY.get(name, (name,))
        if recorded.get(name) != new and not set(by) & set(allowed):
            explained = "" if name in plan_settings() else f" (set by {', '.join(by)})"
            changes.append(f"{name} {recorded.get(name)!r} -> {new!r}{explained}")
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


def build_schedule(config, plan):
    """The learning-rate schedule `config.schedule` over the steps of `plan` (`make_schedule`)."""
    step_decay = {}  # only the step schedule takes these: make_schedule refuses what a schedule would ignore
    if config.decay_boundaries_epochs:
        step_decay["boundaries"] = [
            steps_in_epochs(e, plan.steps_per_epoch) for e in config.decay_boundaries_epochs
        ]
    if config.decay_factor != default_of("decay_factor"):
        step_decay["decay_factor"] = config.decay_factor
    return make_schedule(
        config.schedule,
        peak_learning_rate=plan.peak_learning_rate,
        total_steps=plan.total_steps,
        warmup_steps=plan.warmup_steps,
        warmup_start_learning_rate=config.warmup_start_learning_rate,
        end_learning_rate=config.end_learning_rate,
        power=config.decay_power,
        **step_decay,
    )


def build_optimizer(config, plan):
    """`config.optimizer` on `build_schedule`, held by a `DistributedOptimizer` that averages each update's
    gradients over micro-batches, then over ranks. momentum and nesterov are LARS without layer adaptation:
    Keras's `SGD(momentum=m, nesterov=...)` update (Sutskever et al. 2013) on the L2-decayed gradient
    `g + weight_decay * w`, as in Caffe and Goyal et al. (Keras's own `weight_decay` is decoupled)."""
    lars = config.optimizer == "lars"
    excluded = mlperf_exclusions() if config.exclude_bn_and_bias else None
    optimizer = LARS(
        build_schedule(config, plan),
        momentum=config.momentum,
        weight_decay=config.weight_decay,
        eta=config.eta,
        epsilon=config.epsilon,
        nesterov=config.optimizer == "nesterov",
        exclude_from_weight_decay=excluded,
        exclude_from_layer_adaptation=excluded if lars else [""],
        trust_ratio_mode=config.trust_ratio_mode,
        momentum_correction=config.momentum_correction,
        name=None if lars else f"{config.optimizer}_sgd",
    )
    return DistributedOptimizer(
        optimizer,
        backward_passes_per_step=plan.accumulation_steps,
        compression=config.gradient_compression,
        gradient_reduction=config.gradient_reduction,
    )


def batch_norm_note(model, plan):
    """What gradient accumulation does to the model's batch normalisation, for the run log (docs/training.md);
    None when the plan does not accumulate or the model has no batch norm."""
    norm = keras.layers.BatchNormalization
    layers = [layer for layer in keras_internals.flatten_layers(model) if isinstance(layer, norm)]
    if plan.accumulation_steps == 1 or not layers:
        return None
    steps = plan.accumulation_steps
    per_update = ", ".join(
        f"{m:g}^{steps} = {m**steps:.3g}" for m in sorted({float(layer.momentum) for layer in layers})
    )
    return (
        f"batch norm with accumulation: {len(layers)} layers normalise each micro-batch of "
        f"{plan.per_rank_batch_size} images per rank with its own statistics and update their moving "
        f"averages {steps} times per update (momentum per update {per_update})"
    )


def loss_and_metrics(config, num_classes):
    """The loss and the top-1 / top-5 metrics of training (`TopKAccuracy`: ties broken by class index, as
    `ExactEvaluation` counts the test set). Label smoothing takes one-hot targets (mapped in `run`)."""
    metrics = [TopKAccuracy(1, name="top1"), TopKAccuracy(min(5, num_classes), name="top5")]
    if config.label_smoothing:
        loss = keras.losses.CategoricalCrossentropy(from_logits=True, label_smoothing=config.label_smoothing)
    else:
        loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    return loss, metrics


def input_request(config, per_rank_batch, rank, world_size, run_dir):
    """The `InputRequest` of this rank's shard of `config.dataset` (its own options: `input_options`)."""
    return InputRequest(
        per_rank_batch=per_rank_batch,
        rank=rank,
        world_size=world_size,
        seed=config.seed,
        data_dir=config.data_dir or None,
        max_train_examples=config.max_train_examples,
        max_eval_examples=config.max_eval_examples,
        deterministic=config.deterministic,
        input_threads=config.input_threads or threads.threads_per_rank(),
        run_dir=run_dir,
        on_unreadable=faults.note_unreadable,  # noted, not raised: every rank stops at the same update
    )


def input_options(config):
    """The options of `config.dataset`: the settings `DATASET_SETTINGS` lists for it."""
    return {name: getattr(config, name) for name in DATASET_SETTINGS[config.dataset]}
