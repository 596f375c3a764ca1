"""The run's configuration (one plain object made by `hvd_lars.main` from flags) and its batch/step plan.

Flags speak in epochs and in learning rates per 256 images; the training loop speaks in optimizer steps.
`make_plan` is the one place that converts, and its `describe()` is the run log's first lines.
"""

import dataclasses

from hvd_lars.schedules import REFERENCE_BATCH, epochs_to_steps, scaled_learning_rate

OPTIMIZERS = ("lars", "momentum")


@dataclasses.dataclass
class TrainConfig:
    """Everything a training run needs. Units: images, epochs, learning rates (per update)."""

    dataset: str = "fashion_mnist"
    data_dir: str = ""
    model: str = "small_cnn"
    optimizer: str = "lars"
    global_batch_size: int = 4096
    epochs: float = 10.0
    warmup_epochs: float = 1.0
    base_learning_rate: float = 0.0  # per 256 images (Goyal et al.); used when peak_learning_rate == 0
    peak_learning_rate: float = 0.0
    warmup_start_learning_rate: float = 0.0
    end_learning_rate: float = 0.0
    decay_power: float = 2.0
    momentum: float = 0.9
    weight_decay: float = 5e-4
    eta: float = 0.001
    epsilon: float = 0.0
    workdir: str = "results/runs"
    run_name: str = ""
    seed: int = 0
    resume: bool = True
    max_train_examples: int = 0
    max_eval_examples: int = 0
    steps_per_epoch: int = 0  # 0: the data set's size // global batch
    intra_op_threads: int = 0  # 0: cores on this node / ranks on this node
    inter_op_threads: int = 0  # 0: TensorFlow's default
    verbose: int = 2  # Keras fit verbosity on rank 0 (0 silent, 1 progress bar, 2 one line per epoch)

    def validate(self, world_size):
        """Checks the values that need no data, before any heavy work.

        Raises:
            ValueError: naming the value and what would be accepted.
        """
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"--optimizer={self.optimizer!r}; valid: {', '.join(OPTIMIZERS)}.")
        if self.global_batch_size <= 0:
            raise ValueError(f"--global_batch_size must be > 0, got {self.global_batch_size}.")
        if self.global_batch_size % world_size:
            raise ValueError(
                f"--global_batch_size={self.global_batch_size} does not divide by the world size "
                f"{world_size} ranks; use a multiple of {world_size} "
                f"(e.g. {self.global_batch_size - self.global_batch_size % world_size or world_size})."
            )
        if not self.epochs > 0:
            raise ValueError(f"--epochs must be > 0, got {self.epochs}.")
        if not 0 <= self.warmup_epochs < self.epochs:
            raise ValueError(
                f"--warmup_epochs={self.warmup_epochs} must be >= 0 and shorter than --epochs={self.epochs}."
            )
        if (self.base_learning_rate > 0) == (self.peak_learning_rate > 0):
            raise ValueError(
                "Give exactly one positive learning rate: --base_learning_rate (per 256 images) or "
                f"--peak_learning_rate; got {self.base_learning_rate} and {self.peak_learning_rate}."
            )
        if self.base_learning_rate < 0 or self.peak_learning_rate < 0:
            raise ValueError(
                "Learning rates must be >= 0, got "
                f"base {self.base_learning_rate}, peak {self.peak_learning_rate}."
            )
        if not 0 <= self.momentum < 1:
            raise ValueError(f"--momentum must be in [0, 1), got {self.momentum}.")
        if self.weight_decay < 0:
            raise ValueError(f"--weight_decay must be >= 0, got {self.weight_decay}.")
        if not self.eta > 0:
            raise ValueError(f"--eta must be > 0, got {self.eta}.")
        if self.steps_per_epoch < 0:
            raise ValueError(f"--steps_per_epoch must be >= 0, got {self.steps_per_epoch}.")


@dataclasses.dataclass(frozen=True)
class Plan:
    """Batch and step arithmetic of one run, in optimizer steps."""

    world_size: int
    global_batch_size: int
    per_rank_batch_size: int
    steps_per_epoch: int
    epochs: int
    total_steps: int
    warmup_steps: int
    peak_learning_rate: float

    def describe(self):
        return (
            f"global batch {self.global_batch_size} = {self.world_size} ranks x per-rank batch "
            f"{self.per_rank_batch_size} (accumulation 1); {self.steps_per_epoch} steps per epoch x "
            f"{self.epochs} epochs = {self.total_steps} steps; warmup {self.warmup_steps} steps; "
            f"peak learning rate {self.peak_learning_rate:g}"
        )


def make_plan(config, world_size, num_train_examples):
    """Converts the config's epochs and per-256 rates into steps and a peak rate.

    Raises:
        ValueError: the global batch exceeds the training set, or the epochs are not whole.
    """
    steps_per_epoch = config.steps_per_epoch or epochs_to_steps(
        1, num_train_examples, config.global_batch_size
    )
    if config.global_batch_size > num_train_examples:
        raise ValueError(
            f"--global_batch_size={config.global_batch_size} exceeds the "
            f"{num_train_examples} training examples."
        )
    if float(config.epochs) != int(config.epochs):
        raise ValueError(f"--epochs must be a whole number of epochs, got {config.epochs}.")
    epochs = int(config.epochs)
    peak = config.peak_learning_rate or scaled_learning_rate(
        config.base_learning_rate, config.global_batch_size, REFERENCE_BATCH
    )
    return Plan(
        world_size=world_size,
        global_batch_size=config.global_batch_size,
        per_rank_batch_size=config.global_batch_size // world_size,
        steps_per_epoch=steps_per_epoch,
        epochs=epochs,
        total_steps=steps_per_epoch * epochs,
        warmup_steps=int(round(config.warmup_epochs * steps_per_epoch)),
        peak_learning_rate=peak,
    )
