"""The training loop: data-parallel `model.fit` with LARS (or momentum SGD) and a warmup schedule.

`run(config)` trains on every rank of the job and returns the run summary (also written by rank 0 to
`<workdir>/<run_name>/summary.json`). Library code: reads no flags.
"""

import os

from hvd_lars.parallel import collectives
from hvd_lars.training.config import make_plan, resolve_precision
from hvd_lars.training.threads import describe_cores, placement


def configure_threads(config, world_size):
    """Sizes TensorFlow's intra-op and inter-op pools to the cores this rank may use
    (`hvd_lars.training.threads.threads_per_rank`: its affinity mask when the launcher bound it, else the node's
    usable CPUs / Horovod's local_size()), unless `config.intra_op_threads` / `inter_op_threads` say.

    Must run after `collectives.init()` and before TensorFlow executes its first op; afterwards
    TensorFlow keeps the pools it has (then `applied_threads()` reports those, not the request).

    Returns:
        (intra, inter): the requested pool sizes.
    """
    import tensorflow as tf

    from hvd_lars.training.threads import threads_per_rank

    local_ranks = max(1, min(world_size, collectives.local_size()))
    per_rank = threads_per_rank(local_ranks)
    intra = config.intra_op_threads or per_rank
    inter = config.inter_op_threads or per_rank
    try:
        tf.config.threading.set_intra_op_parallelism_threads(intra)
        tf.config.threading.set_inter_op_parallelism_threads(inter)
    except RuntimeError:
        pass  # TensorFlow already initialised by the caller: it keeps its pools (reported by the run).
    return intra, inter


def applied_threads(dataset=None):
    """The thread settings in force, read back from TensorFlow (not from the flags).

    Args:
        dataset: optional `tf.data.Dataset` (the training input) whose private pool is reported.

    Returns:
        dict: `intra_op` and `inter_op`, the pool sizes TensorFlow's context was initialised with (0 means
        TensorFlow's own default, one thread per core), `input`, the private thread pool of `dataset`'s
        options (None without a dataset; 0: tf.data's shared pool), and `omp_num_threads`, the
        OMP_NUM_THREADS environment variable (None when unset) that OpenMP code in this process reads.
    """
    import tensorflow as tf

    tf.constant(0.0) + 0.0  # TensorFlow fixes its pools when it first runs an op; make sure it has
    threads = {
        "intra_op": tf.config.threading.get_intra_op_parallelism_threads(),
        "inter_op": tf.config.threading.get_inter_op_parallelism_threads(),
        "input": None,
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
    }
    if dataset is not None:
        threads["input"] = dataset.options().threading.private_threadpool_size or 0
    return threads


def describe_placements(placements):
    """One log line from every rank's `hvd_lars.training.threads.placement()` joined with its `applied_threads`:
    host, the CPUs the rank may use (bound by the launcher or not) and the threads TensorFlow and the
    input pipeline run with, e.g. "cores per rank: rank 0 on node1: CPUs 0 (bound), 1 intra-op / 1
    inter-op / 1 input threads; ..."."""
    parts = []
    for rank, p in enumerate(placements):
        how = "bound" if p["bound"] else f"unbound, {p['local_size']} ranks on the host"
        parts.append(
            f"rank {rank} on {p['host']}: CPUs {describe_cores(p['cores'])} ({how}), "
            f"{p['intra_op']} intra-op / {p['inter_op']} inter-op / {p['input']} input threads"
        )
    return "cores per rank: " + "; ".join(parts)


def build_schedule(config, plan):
    """The learning-rate schedule `config.schedule` over the steps of `plan` (a callable of the update
    count; `hvd_lars.optim.schedules.make_schedule`)."""
    from hvd_lars.optim.schedules import make_schedule

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
    """LARS or momentum SGD on the learning-rate schedule `config.schedule` over the steps of `plan`, held
    by a `DistributedOptimizer` that averages each update's gradients over micro-batches and ranks."""
    from hvd_lars.optim.lars import LARS, mlperf_exclusions
    from hvd_lars.parallel.optimizer import DistributedOptimizer

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
        # exactly LARS with every tensor left out of layer adaptation (trust ratio 1).
        optimizer = LARS(
            schedule,
            momentum=config.momentum,
            weight_decay=config.weight_decay,
            exclude_from_weight_decay=mlperf_exclusions() if config.exclude_bn_and_bias else None,
            exclude_from_layer_adaptation=[""],
            momentum_correction=config.momentum_correction,
            name="momentum_sgd",
        )
    # Micro-batch gradients are averaged on the rank, then over ranks once per update; the schedule
    # follows applied updates.
    return DistributedOptimizer(
        optimizer,
        backward_passes_per_step=plan.accumulation_steps,
        compression=config.gradient_compression,
        gradient_reduction=config.gradient_reduction,
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
    import keras

    layers = [
        layer for layer in model._flatten_layers() if isinstance(layer, keras.layers.BatchNormalization)
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
        arguments["boundaries"] = [
            int(round(e * plan.steps_per_epoch)) for e in config.decay_boundaries_epochs
        ]
    if config.decay_factor != 0.1:
        arguments["decay_factor"] = config.decay_factor
    return arguments


# What a resumed run must share with the run that wrote its checkpoints.
_PLAN_KEYS = ("global_batch_size", "steps_per_epoch", "total_steps", "warmup_steps", "peak_learning_rate")


def _check_same_plan(previous, plan, run_dir):
    """Refuses to continue a checkpoint under another schedule (changed epochs, batch or rates).

    Raises:
        ValueError: quoting the saved and the new values.
    """
    if not previous:
        return
    old, new = previous.get("plan", {}), vars(plan)
    changed = [f"{k} {old.get(k)} -> {new[k]}" for k in _PLAN_KEYS if old.get(k) != new[k]]
    if changed:
        raise ValueError(
            f"{run_dir} holds a run with another plan ({'; '.join(changed)}). Resume it with its own flags, "
            "or start afresh with another --run_name or --noresume."
        )


def _loss_and_metrics(config, num_classes):
    """The loss and the top-1 / top-5 metrics of training (`hvd_lars.metrics.TopKAccuracy`: ties broken by
    class index, the rule `ExactEvaluation` applies to the test set)."""
    import keras

    from hvd_lars.metrics import TopKAccuracy

    metrics = [TopKAccuracy(1, name="top1"), TopKAccuracy(min(5, num_classes), name="top5")]
    if config.label_smoothing:
        # Label smoothing needs one-hot targets; the training data are mapped to one-hot in `run`.
        loss = keras.losses.CategoricalCrossentropy(from_logits=True, label_smoothing=config.label_smoothing)
        return loss, metrics
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics


def _input_kwargs(config, per_rank_batch, rank, world_size, run_dir):
    return dict(
        per_rank_batch=per_rank_batch,
        rank=rank,
        world_size=world_size,
        seed=config.seed,
        data_dir=config.data_dir or None,
        max_train_examples=config.max_train_examples,
        max_eval_examples=config.max_eval_examples,
        # Dataset-specific: get_input drops those the dataset does not take while they are unset.
        manual_dir=config.manual_dir or None,
        image_size=config.image_size,
        preprocessing=config.preprocessing or None,
        deterministic=config.deterministic,
        skip_corrupt=config.skip_corrupt,
        input_threads=config.input_threads,
        validation_examples=config.validation_examples,
        # The image-folder listing, made once per run by rank 0 and kept for the run's later starts.
        index_dir=os.path.join(run_dir, "image_folder_index"),
    )


def _fit(model, data, plan, config, callbacks, step, chief):
    """`model.fit` from update `step` to the plan's last. A run resumed mid-epoch first finishes that epoch,
    then runs the remaining whole epochs. The training stream is a function of the seed and the position,
    so starting it at the micro-batches already consumed puts every rank exactly where the interrupted run
    was, without reading or decoding any of them (InputPipeline.train_from)."""
    import tensorflow as tf

    micro_batches_per_epoch = plan.steps_per_epoch * plan.accumulation_steps
    while step < plan.total_steps:
        train = data.train_from(step * plan.accumulation_steps)
        if config.label_smoothing:
            train = train.map(lambda x, y, n=data.num_classes: (x, tf.one_hot(y, n)))
        epoch = step // plan.steps_per_epoch
        done_in_epoch = step - epoch * plan.steps_per_epoch
        model.fit(
            train,
            initial_epoch=epoch,
            epochs=plan.epochs if done_in_epoch == 0 else epoch + 1,
            steps_per_epoch=micro_batches_per_epoch - done_in_epoch * plan.accumulation_steps,
            callbacks=callbacks,
            verbose=config.verbose if chief else 0,
            shuffle=False,  # the tf.data pipeline shuffles each rank's shard itself
        )
        step = int(model.optimizer.iterations)


def run(config, extra_callbacks=()):
    """Trains according to `config` on every rank; returns the summary dict.

    Args:
        config: `TrainConfig`.
        extra_callbacks: Keras callbacks run on every rank after the built-in ones (rank averaging,
            evaluation, checkpoints) and before the loggers (metrics.csv, TensorBoard, summary.json), so
            what they add to the epoch logs is recorded.

    With `config.elastic` (launched by `horovodrun --min-np/--max-np --host-discovery-script`), workers
    may leave and join: each attempt (the first, and one after every membership change) rebuilds this
    rank's shard of the input for the new world size with the plan's global batch, and goes on from the
    last commit (`hvd_lars.parallel.elastic`).

    Raises:
        ValueError: bad configuration (before any data is read or model built), or a run directory that
            is not writable or lacks the space for a few checkpoints (before training).
        FileNotFoundError: missing data.
        hvd_lars.training.faults.TrainingDiverged: a non-finite loss or weights on some rank (every rank raises it
            after the same update; summary.json records it).
        hvd_lars.training.faults.Preempted: SIGTERM or SIGUSR1 reached a rank; every rank stopped after the same
            update, whose checkpoint rank 0 wrote.
        hvd_lars.training.checkpoints.CheckpointWriteError: rank 0 could not write a checkpoint (every rank raises it).
        hvd_lars.parallel.elastic.ElasticBatchError: an elastic job's new worker count does not divide the global
            batch (every rank raises it at the change).
    """
    rank, world_size = collectives.init()
    if config.elastic:
        from hvd_lars.parallel import elastic

        elastic.check_launched(config)
        # The world size is checked against the global batch in each attempt, on every rank together.
        config.validate(1)
    else:
        config.validate(world_size)
    requested_threads = configure_threads(config, world_size)

    import keras
    import tensorflow as tf

    from hvd_lars.data import get_input
    from hvd_lars.models import get_model
    from hvd_lars.training import faults

    # Per-rank seeds: dropout masks differ across ranks (as each Caffe process had its own RNG); the
    # initial weights are rank 0's, broadcast below. Input shuffling is seeded per rank in the pipeline.
    keras.utils.set_random_seed(config.seed + rank)
    keras.mixed_precision.set_global_policy(resolve_precision(config.precision))
    global_batch, per_rank_batch = config.resolve_batch(1 if config.elastic else world_size)
    run_name = config.run_name or f"{config.dataset}_{config.model}_{config.optimizer}_b{global_batch}"
    run_dir = os.path.join(config.workdir, run_name)

    if config.elastic:
        # No collective may come before the elastic loop's first sync: a worker that joins later runs
        # this code while the others wait in that sync. This rank's shard is built in each attempt; the
        # model needs only the data's shapes, read here from a one-process view of the data.
        data = None
        shapes = get_input(config.dataset, **_input_kwargs(config, global_batch, 0, 1, run_dir))
    else:
        data = shapes = get_input(
            config.dataset, **_input_kwargs(config, per_rank_batch, rank, world_size, run_dir)
        )
    # The schedule and the optimizer depend on the global batch, not on how it is split over ranks.
    plan = make_plan(config, 1 if config.elastic else world_size, shapes.num_train_examples)

    model = get_model(config.model, num_classes=shapes.num_classes, input_shape=shapes.input_shape)
    optimizer = build_optimizer(config, plan)
    loss, metrics = _loss_and_metrics(config, shapes.num_classes)
    # Horovod's collectives must stay outside XLA clusters (its XLA ops are not built).
    model.compile(optimizer=optimizer, loss=loss, metrics=metrics, jit_compile=False)
    optimizer.build(model.trainable_variables)

    checkpoint = tf.train.Checkpoint(model=model, optimizer=optimizer)
    manager = tf.train.CheckpointManager(
        checkpoint, os.path.join(run_dir, "checkpoints"), max_to_keep=config.keep_checkpoints
    )
    if config.resume and collectives.is_chief() and manager.latest_checkpoint:
        checkpoint.restore(manager.latest_checkpoint).expect_partial()
        print(
            f"[hvd_lars] resumed from {manager.latest_checkpoint} (step {int(optimizer.iterations)})",
            flush=True,
        )
    signals = faults.StopSignals()
    watchdog = faults.ProgressWatchdog(config.hang_timeout_s)
    session = _Session(config, run_name, run_dir, model, manager, signals, extra_callbacks, requested_threads)
    session.watchdog = watchdog
    # SIGTERM / SIGUSR1 stop every rank at the next update boundary, with a checkpoint (faults.FaultGuard);
    # a rank without progress for --hang_timeout_s ends itself (faults.ProgressWatchdog).
    with signals, watchdog:
        if not config.elastic:
            return session.attempt(data)
        state = elastic.KerasState(model, step=int(optimizer.iterations)).state()
        session.commit = lambda: elastic.CommitState(state, config.elastic_commit_every_steps)
        return elastic.run(lambda state: session.attempt(None))(state)


class _Session:
    """One run's training attempts: one for a fixed world size, one per membership change of an elastic
    job. Everything here that talks to other ranks happens inside `attempt`."""

    def __init__(
        self, config, run_name, run_dir, model, manager, signals, extra_callbacks, requested_threads
    ):
        self.config, self.run_name, self.run_dir = config, run_name, run_dir
        self.model, self.manager, self.signals = model, manager, signals
        self.extra_callbacks = list(extra_callbacks)
        self.requested_threads = requested_threads
        self.commit = None  # elastic: makes the callback that commits the elastic state
        self.watchdog = None  # faults.ProgressWatchdog of the run
        self.attempts = 0

    def attempt(self, data):
        """Trains from the optimizer's update count to the plan's end with the current world size;
        `data`: this rank's input, or None to build it for the current rank and world size."""
        import keras

        from hvd_lars.data import get_input
        from hvd_lars.parallel import elastic
        from hvd_lars.parallel.callbacks import MetricAverageCallback, broadcast_model_and_optimizer
        from hvd_lars.training import callbacks as cb
        from hvd_lars.training import epoch_logs, faults
        from hvd_lars.training.run_summary import RunSummary

        config, model, run_dir = self.config, self.model, self.run_dir
        optimizer = model.optimizer
        rank, world_size = collectives.rank(), collectives.size()
        chief = collectives.is_chief()
        self.attempts += 1
        if data is None:
            _, per_rank_batch = elastic.resolve_batch(config, world_size)
            data = get_input(
                config.dataset, **_input_kwargs(config, per_rank_batch, rank, world_size, run_dir)
            )
            # Traced anew: the last graph holds the last world size's decisions (elastic module).
            model.train_function = None
        plan = make_plan(config, world_size, data.num_train_examples)
        threads = applied_threads(data.train)
        # The cores each rank may use (its affinity mask) and what TensorFlow applied, gathered for one line.
        placements = collectives.gather_objects(
            {**placement(), "host": os.uname().nodename, **threads},
            name="hvd_lars.placement",
        )
        threads["cores_per_rank"] = [p["cores"] for p in placements]
        if chief:
            if config.elastic:
                print(
                    f"[hvd_lars] elastic attempt {self.attempts}: {world_size} worker(s) from update "
                    f"{int(optimizer.iterations)}, {plan.per_rank_batch_size} images per rank per "
                    f"micro-batch (global batch {plan.global_batch_size})",
                    flush=True,
                )
            print(f"[hvd_lars] {plan.describe()}", flush=True)
            print(f"[hvd_lars] {describe_placements(placements)}", flush=True)
            if (threads["intra_op"], threads["inter_op"]) != self.requested_threads:
                print(
                    f"[hvd_lars] TensorFlow runs {threads['intra_op']} intra-op / {threads['inter_op']} "
                    f"inter-op threads (0: its default), not the {self.requested_threads[0]} / "
                    f"{self.requested_threads[1]} asked for: it was initialised before hvd_lars could size "
                    "its pools.",
                    flush=True,
                )
            print(f"[hvd_lars] run directory {run_dir}", flush=True)
        # Before anything is written: the run directory is writable and holds a few checkpoints.
        faults.check_run_dir(
            run_dir, faults.checkpoint_bytes(model.variables + optimizer.variables), config.keep_checkpoints
        )
        note = batch_norm_note(model, plan)
        if note and chief and self.attempts == 1:
            print(f"[hvd_lars] {note}", flush=True)
        if not config.elastic:
            # Rank 0's weights, optimizer slots and step counter become every rank's (not its dropout
            # seed state), before the step counter below plans the run. (Elastic: the loop's sync did.)
            broadcast_model_and_optimizer(model)
        start_step = int(optimizer.iterations)
        if start_step and chief and self.attempts == 1:
            _check_same_plan(RunSummary.load(run_dir), plan, run_dir)

        checkpointer = cb.PeriodicCheckpoint(
            self.manager,
            config.checkpoint_every_steps,
            plan.accumulation_steps,
            at_epoch_end=config.checkpoint_at_epoch_end,
            asynchronous=config.async_checkpoints,
        )
        guard = faults.FaultGuard(self.signals, checkpointer, plan.accumulation_steps, plan.total_steps)
        callbacks = [
            # First: nothing of a diverged update is evaluated, logged or saved.
            guard,
            self.watchdog,
            MetricAverageCallback(),
            cb.ImagesPerSecond(plan.per_rank_batch_size * world_size),
            cb.LearningRateLogger(),
            cb.ExactEvaluation(
                data.eval,
                data.num_eval_examples,
                every_epochs=config.eval_every_epochs,
                last_epoch=plan.epochs,
            ),
            checkpointer,
        ]
        if data.validation is not None:
            # The held-out training images (--validation_examples), evaluated as the test set is, as val_*.
            callbacks.insert(
                -1,
                cb.ExactEvaluation(
                    data.validation,
                    data.num_validation_examples,
                    every_epochs=config.eval_every_epochs,
                    last_epoch=plan.epochs,
                    prefix="val",
                ),
            )
        if data.skipped_corrupt is not None:
            # Corrupt training files skipped (--skip_corrupt), summed over ranks, into the epoch logs.
            def count_skipped(epoch, logs):
                local = int(data.skipped_corrupt.numpy())
                logs["skipped_corrupt_images"] = float(
                    collectives.allreduce_sum([local], "hvd_lars.skipped")[0]
                )

            callbacks.insert(3, keras.callbacks.LambdaCallback(on_epoch_end=count_skipped))
        if self.commit is not None:
            # After the guard and the checkpoint: a diverged update is never committed.
            callbacks.append(self.commit())
        callbacks += self.extra_callbacks
        if chief:
            # Aligned in any evaluation schedule and across resumes (epoch_logs says why not Keras's own).
            callbacks += [
                epoch_logs.MetricsCSV(os.path.join(run_dir, "metrics.csv"), start_step, plan.steps_per_epoch),
                epoch_logs.TensorBoardScalars(os.path.join(run_dir, "tensorboard"), start_step),
            ]

        if start_step >= plan.total_steps:
            if chief and self.attempts == 1:
                print(
                    f"[hvd_lars] {run_dir} complete ({start_step} of {plan.total_steps} steps); nothing to "
                    "do. Train again with another --run_name or --noresume.",
                    flush=True,
                )
            return RunSummary.load(run_dir)
        summary = RunSummary(run_dir, self.run_name, config, plan, start_step, threads=threads)
        callbacks += [summary, guard.after_epoch()]

        try:
            _fit(model, data, plan, config, callbacks, start_step, chief)
        except (faults.TrainingDiverged, faults.Preempted) as e:
            summary.record_stop(type(e).__name__, e.step, str(e))
            raise

        result = summary.summary
        if chief:
            rate = f"{result['images_per_second']:.0f}" if result["images_per_second"] else "n/a"
            val = (
                f"validation top-1 {result['final_val_top1']}, "
                if result["final_val_top1"] is not None
                else ""
            )
            print(
                f"[hvd_lars] final test top-1 {result['final_test_top1']}, {val}{rate} images/s, "
                f"wall time {result['wall_time_s']:.0f} s; summary in {summary.path}",
                flush=True,
            )
        return result
