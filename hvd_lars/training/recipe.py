"""What a configuration builds for training: the schedule, the optimizer, the loss and metrics, the input.

Each function reads a `TrainConfig` and a `Plan` (steps, not epochs) and returns library objects.
"""

import keras

from hvd_lars import keras_internals
from hvd_lars.data import InputRequest
from hvd_lars.metrics import TopKAccuracy
from hvd_lars.optim.lars import LARS, mlperf_exclusions
from hvd_lars.optim.schedules import make_schedule
from hvd_lars.parallel.optimizer import DistributedOptimizer
from hvd_lars.training import faults, threads
from hvd_lars.training.config import DATASET_SETTINGS, default_of


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
        # Noted, not raised: every rank then stops at the same update (file_failures).
        on_unreadable=faults.note_unreadable,
    )


def input_options(config):
    """The options of `config.dataset` taken from the configuration: the settings `DATASET_SETTINGS` lists for
    it, by name (`TrainConfig.validate` refuses the other data sets' settings when set: nothing given is
    dropped)."""
    return {name: getattr(config, name) for name in DATASET_SETTINGS[config.dataset]}
