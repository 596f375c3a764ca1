"""The run's plan in optimizer steps, made once per attempt from the configuration and the world size, what
it builds (schedule, optimizer, loss and metrics, input), and the comparison a resume makes between the
plan a checkpoint was written under and this one.

Flags speak in epochs and in learning rates per 256 images; the loop speaks in optimizer steps. `make_plan`
is the one place that converts, and its `describe()` is the run log's first line. Its `settings` are the
plan's settings as the run resolves them (the global batch, the precision, the warmup in steps, the data
folder as a real path, ...): what each checkpoint records and a resume compares, so two spellings of one
plan are one plan.
"""

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


def make_plan(config, world_size, num_train_examples, input_shape=None):
    """Converts the config's epochs and per-256 rates into steps and a peak rate, for `world_size` ranks.

    Args:
        num_train_examples: the training images the input holds (after --max_train_examples and
            --validation_examples), or anything with `num_train_examples` and `input_shape` (an
            `InputPipeline` or `InputShapes`), whose image shape then joins the settings.

    Raises:
        ValueError: the global batch exceeds the training set (or `TrainConfig.resolve_batch`'s errors).
    """
    if hasattr(num_train_examples, "num_train_examples"):
        input_shape = num_train_examples.input_shape
        num_train_examples = num_train_examples.num_train_examples
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


def build_schedule(config, plan):
    """The learning-rate schedule `config.schedule` over the steps of `plan` (a callable of the update
    count; `hvd_lars.optim.schedules.make_schedule`)."""
    return make_schedule(
        config.schedule,
        peak_learning_rate=plan.peak_learning_rate,
        total_steps=plan.total_steps,
        warmup_steps=plan.warmup_steps,
        warmup_start_learning_rate=config.warmup_start_learning_rate,
        end_learning_rate=config.end_learning_rate,
        power=config.decay_power,
        **_step_decay_arguments(config, plan),
    )


def build_optimizer(config, plan):
    """LARS, momentum SGD or Nesterov momentum SGD on the learning-rate schedule `config.schedule` over the
    steps of `plan`, held by a `DistributedOptimizer` that averages each update's gradients over
    micro-batches and ranks.

    `momentum` and `nesterov` are Keras's `SGD(momentum=m, nesterov=...)` update (velocity
    `v = m * v - lr_t * d`, step `w += v`, Nesterov `w += m * v - lr_t * d`; Sutskever et al. 2013) on
    the L2-decayed gradient `d = g + weight_decay * w`, both run by TensorFlow's `ResourceApplyKerasMomentum`
    kernel, the one `keras.optimizers.SGD` runs. Keras's own `weight_decay` would be decoupled
    (`w -= lr_t * weight_decay * w`, outside the momentum), a second difference from the momentum arm.
    """

    schedule = build_schedule(config, plan)
    if config.optimizer == "lars":
        excluded = mlperf_exclusions() if config.exclude_bn_and_bias else None
        optimizer = LARS(
            schedule,
            momentum=config.momentum,
            weight_decay=config.weight_decay,
            eta=config.eta,
            epsilon=config.epsilon,
            exclude_from_weight_decay=excluded,
            exclude_from_layer_adaptation=excluded,
            trust_ratio_mode=config.trust_ratio_mode,
            momentum_correction=config.momentum_correction,
        )
    else:
        # Momentum SGD with L2 weight decay added to the gradient (coupled), as in Caffe and Goyal et al.:
        # exactly LARS with every tensor left out of layer adaptation (trust ratio 1). Nesterov: the same,
        # with the look-ahead step (Nado et al. 2021's strongest momentum baseline).
        nesterov = config.optimizer == "nesterov"
        optimizer = LARS(
            schedule,
            momentum=config.momentum,
            weight_decay=config.weight_decay,
            nesterov=nesterov,
            exclude_from_weight_decay=mlperf_exclusions() if config.exclude_bn_and_bias else None,
            exclude_from_layer_adaptation=[""],
            momentum_correction=config.momentum_correction,
            name="nesterov_sgd" if nesterov else "momentum_sgd",
        )
    # Micro-batch gradients are averaged on the rank, then over ranks once per update; the schedule
    # follows applied updates.
    return DistributedOptimizer(
        optimizer,
        backward_passes_per_step=plan.accumulation_steps,
        compression=config.gradient_compression,
        gradient_reduction=config.gradient_reduction,
        average_aggregated_gradients=True,
        op="average",
    )


def batch_norm_note(model, plan):
    """What gradient accumulation does to the model's batch normalisation, for the run log; None when the
    plan does not accumulate or the model has no batch norm.

    Under `--accumulation_steps=A` every micro-batch runs forward in training mode: it is normalised
    with its own statistics (per-rank batch B images, not the global batch) and updates the moving mean
    and variance, so they move A times per optimizer update, with momentum m per micro-batch (m^A per
    update). With A = 512 and B = 16 (32K on 4 ranks) they follow the last few dozen micro-batches of
    16 images. tests/test_accumulation.py quantifies both effects.
    """
    layers = [
        layer
        for layer in keras_internals.flatten_layers(model)
        if isinstance(layer, keras.layers.BatchNormalization)
    ]
    if plan.accumulation_steps == 1 or not layers:
        return None
    momenta = sorted({float(layer.momentum) for layer in layers})
    per_update = ", ".join(
        f"{m:g}^{plan.accumulation_steps} = {m**plan.accumulation_steps:.3g}" for m in momenta
    )
    return (
        f"batch norm with accumulation: {len(layers)} layers normalise each micro-batch of "
        f"{plan.per_rank_batch_size} images per rank with its own statistics and update their moving "
        f"averages {plan.accumulation_steps} times per update (momentum per update {per_update})"
    )


def _step_decay_arguments(config, plan):
    # Only the step schedule takes boundaries; make_schedule refuses arguments a schedule would ignore.
    arguments = {}
    if config.decay_boundaries_epochs:
        arguments["boundaries"] = [plan.epoch_steps(e) for e in config.decay_boundaries_epochs]
    if config.decay_factor != default_of("decay_factor"):
        arguments["decay_factor"] = config.decay_factor
    return arguments


def loss_and_metrics(config, num_classes):
    """The loss and the top-1 / top-5 metrics of training (`hvd_lars.metrics.TopKAccuracy`: ties broken by
    class index, the rule `ExactEvaluation` applies to the test set)."""
    metrics = [TopKAccuracy(1, name="top1"), TopKAccuracy(min(5, num_classes), name="top5")]
    if config.label_smoothing:
        # Label smoothing needs one-hot targets; the training data are mapped to one-hot in `run`.
        loss = keras.losses.CategoricalCrossentropy(from_logits=True, label_smoothing=config.label_smoothing)
        return loss, metrics
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics


def input_request(config, per_rank_batch, rank, world_size, run_dir):
    """The `hvd_lars.data.InputRequest` of this rank's shard of `config.dataset`: what every data set
    reads from the configuration (its own options: `input_options`)."""
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
        # Noted, not raised: every rank then stops at the same update (`faults.note`).
        on_unreadable=faults.note_unreadable,
    )


def input_options(config):
    """The options of `config.dataset` taken from the configuration: the settings `DATASET_SETTINGS` lists for
    it, by name (`TrainConfig.validate` refuses the other data sets' settings when set: nothing given is
    dropped)."""
    return {name: getattr(config, name) for name in DATASET_SETTINGS[config.dataset]}
