"""The run's configuration (one plain object made by `hvd_lars.main` from flags) and its batch/step plan.

Flags speak in epochs and in learning rates per 256 images; the training loop speaks in optimizer steps.
`make_plan` is the one place that converts, and its `describe()` is the run log's first lines.
"""

import dataclasses

from hvd_lars.optim.schedules import REFERENCE_BATCH, epochs_to_steps, scaled_learning_rate
from hvd_lars.parallel.collectives import GRADIENT_COMPRESSIONS, GRADIENT_REDUCTIONS

OPTIMIZERS = ("lars", "momentum")
PRECISIONS = ("auto", "float32", "mixed_bfloat16")
# CPU flags (/proc/cpuinfo) of native bfloat16 arithmetic. With them, mixed_bfloat16 trained ResNet-50
# 1.8x faster than float32 here and used less memory (results/models_throughput.md); without them
# bfloat16 is emulated and slower.
BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")


@dataclasses.dataclass
class TrainConfig:
    """Everything a training run needs. Units: images, epochs, learning rates (per update)."""

    dataset: str = "fashion_mnist"
    data_dir: str = ""
    manual_dir: str = ""  # imagenet2012: folder with ILSVRC2012_img_{train,val}.tar (first run prepares)
    image_size: int = 0  # 0: the dataset's own (224 for ImageNet-style data); AlexNet flagfiles give 227
    # Image views of ImageNet-style data (hvd_lars.data.preprocessing.PREPROCESSINGS); "": inception.
    preprocessing: str = ""
    deterministic: bool = True  # fixed input order (exact resume); False: faster out-of-order decoding
    skip_corrupt: bool = False  # skip and count unreadable training images instead of failing
    input_threads: int = 0  # 0: the cores this rank may use (hvd_lars.training.threads)
    model: str = "small_cnn"
    optimizer: str = "lars"
    global_batch_size: int = 0  # images per optimizer update, all ranks and micro-batches; 0: derived
    per_rank_batch_size: int = 0  # images per micro-batch on one rank; 0: derived from the global batch
    # Micro-batches per update (gradients averaged before one update). Batch norm then normalises each
    # micro-batch by its own statistics and updates its moving averages once per micro-batch
    # (hvd_lars.training.train.batch_norm_note; tests/test_accumulation.py); the paper's workers accumulated nothing.
    accumulation_steps: int = 1
    gradient_reduction: str = "overlap"  # overlap: allreduce each gradient as backprop produces it
    gradient_compression: str = "none"  # fp16: gradients travel as float16, divided by ranks before the sum
    precision: str = "auto"  # auto: mixed_bfloat16 where the CPU has native bf16, else float32
    label_smoothing: float = 0.0
    epochs: float = 10.0
    warmup_epochs: float = 1.0
    base_learning_rate: float = 0.0  # per 256 images (Goyal et al.); used when peak_learning_rate == 0
    peak_learning_rate: float = 0.0
    warmup_start_learning_rate: float = 0.0
    end_learning_rate: float = 0.0
    schedule: str = "mlperf_poly"  # a key of hvd_lars.optim.schedules.SCHEDULES
    decay_power: float = 2.0
    decay_boundaries_epochs: tuple = ()  # "step" schedule; empty: Goyal et al.'s 30, 60, 80 of 90 epochs
    decay_factor: float = 0.1  # "step" schedule: rate multiplier at each boundary
    momentum: float = 0.9
    weight_decay: float = 5e-4
    eta: float = 0.001
    trust_ratio_mode: str = "paper"  # a value of hvd_lars.optim.lars.TRUST_RATIO_MODES
    # Velocity rescaled by lr_t / lr_{t-1}: "none" (Intel Caffe's fused update, the paper's runs),
    # "warmup" (its non-fused update: during warmup only) or "always" (Goyal et al. 2017, eq. 10).
    momentum_correction: str = "none"
    exclude_bn_and_bias: bool = False  # MLPerf: batch norm and biases get plain momentum, no decay
    epsilon: float = 0.0
    workdir: str = "results/runs"
    run_name: str = ""
    seed: int = 0
    resume: bool = True
    eval_every_epochs: int = 1
    checkpoint_every_steps: int = 0  # 0: only at epoch ends
    checkpoint_at_epoch_end: bool = True
    async_checkpoints: bool = True  # rank 0 writes in a background thread; training goes on meanwhile
    keep_checkpoints: int = 3
    # Workers may leave and join (horovodrun --min-np/--max-np --host-discovery-script; hvd_lars.parallel.elastic):
    # the global batch and schedule stay, the per-rank batch adapts; state committed every N updates.
    elastic: bool = False
    # A rank with no progress for this long ends its process (faults.ProgressWatchdog); 0: never.
    hang_timeout_s: float = 900.0
    elastic_commit_every_steps: int = 10
    max_train_examples: int = 0
    max_eval_examples: int = 0
    validation_examples: int = 0  # hold out the last N training images as a validation split (0: none)
    steps_per_epoch: int = 0  # 0: the data set's size // global batch
    intra_op_threads: int = 0  # 0: the cores this rank may use (hvd_lars.training.threads)
    inter_op_threads: int = 0  # 0: the cores this rank may use (hvd_lars.training.threads)
    verbose: int = 2  # Keras fit verbosity on rank 0 (0 silent, 1 progress bar, 2 one line per epoch)

    def resolve_batch(self, world_size):
        """Returns (global batch, per-rank micro-batch): one may be 0 and is derived from the other.

        global batch = per-rank batch x world size x accumulation steps.

        Raises:
            ValueError: both 0, inconsistent, or a global batch that does not divide by ranks x accumulation.
        """
        if self.accumulation_steps < 1:
            raise ValueError(f"--accumulation_steps must be >= 1, got {self.accumulation_steps}.")
        if self.global_batch_size < 0 or self.per_rank_batch_size < 0:
            raise ValueError(
                f"Batch sizes must be > 0, got --global_batch_size={self.global_batch_size}, "
                f"--per_rank_batch_size={self.per_rank_batch_size}."
            )
        divisor = world_size * self.accumulation_steps
        if self.per_rank_batch_size and not self.global_batch_size:
            return self.per_rank_batch_size * divisor, self.per_rank_batch_size
        if not self.global_batch_size:
            raise ValueError("Give --global_batch_size or --per_rank_batch_size (both are 0).")
        if self.global_batch_size % divisor:
            raise ValueError(
                f"--global_batch_size={self.global_batch_size} does not divide by the world size "
                f"{world_size} ranks x {self.accumulation_steps} accumulation steps = {divisor}; use a "
                f"multiple of {divisor} (e.g. {self.global_batch_size // divisor * divisor or divisor})."
            )
        per_rank = self.global_batch_size // divisor
        if self.per_rank_batch_size and self.per_rank_batch_size != per_rank:
            raise ValueError(
                f"--per_rank_batch_size={self.per_rank_batch_size} contradicts --global_batch_size="
                f"{self.global_batch_size} over {world_size} ranks x {self.accumulation_steps} accumulation "
                f"steps (which gives {per_rank}); give only one of them."
            )
        return self.global_batch_size, per_rank

    def validate(self, world_size):
        """Checks the values that need no data, before any heavy work.

        Raises:
            ValueError: naming the value and what would be accepted.
        """
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"--optimizer={self.optimizer!r}; valid: {', '.join(OPTIMIZERS)}.")
        if self.precision not in PRECISIONS:
            raise ValueError(f"--precision={self.precision!r}; valid: {', '.join(PRECISIONS)}.")
        if self.gradient_reduction not in GRADIENT_REDUCTIONS:
            raise ValueError(
                f"--gradient_reduction={self.gradient_reduction!r}; valid: {', '.join(GRADIENT_REDUCTIONS)}."
            )
        if self.gradient_compression not in GRADIENT_COMPRESSIONS:
            raise ValueError(
                f"--gradient_compression={self.gradient_compression!r}; valid: "
                f"{', '.join(GRADIENT_COMPRESSIONS)}."
            )
        self.resolve_batch(world_size)
        if self.elastic_commit_every_steps < 1:
            raise ValueError(
                f"--elastic_commit_every_steps={self.elastic_commit_every_steps}; give an int >= 1 "
                "(updates between commits of the elastic state)."
            )
        if not self.hang_timeout_s >= 0:
            raise ValueError(f"--hang_timeout_s={self.hang_timeout_s}; give seconds >= 0 (0: no watchdog).")
        from hvd_lars.data import DATASETS
        from hvd_lars.data.preprocessing import PREPROCESSINGS
        from hvd_lars.models import MODELS
        from hvd_lars.optim.lars import MOMENTUM_CORRECTIONS, TRUST_RATIO_MODES
        from hvd_lars.optim.schedules import SCHEDULES

        if self.preprocessing and self.preprocessing not in PREPROCESSINGS:
            raise ValueError(
                f"--preprocessing={self.preprocessing!r}; valid: {', '.join(sorted(PREPROCESSINGS))} "
                "(empty: inception)."
            )
        if self.trust_ratio_mode not in TRUST_RATIO_MODES:
            raise ValueError(
                f"--trust_ratio_mode={self.trust_ratio_mode!r}; valid: {', '.join(TRUST_RATIO_MODES)}."
            )
        if self.momentum_correction not in MOMENTUM_CORRECTIONS:
            raise ValueError(
                f"--momentum_correction={self.momentum_correction!r}; valid: "
                f"{', '.join(MOMENTUM_CORRECTIONS)}."
            )
        for flag, value, registry in (("model", self.model, MODELS), ("dataset", self.dataset, DATASETS)):
            if value not in registry:
                raise ValueError(
                    f"Unknown {flag} {value!r} (--{flag}); valid names: {', '.join(sorted(registry))}."
                )

        if self.schedule not in SCHEDULES:
            raise ValueError(f"--schedule={self.schedule!r}; valid: {', '.join(sorted(SCHEDULES))}.")
        if not 0 <= self.label_smoothing < 1:
            raise ValueError(f"--label_smoothing must be in [0, 1), got {self.label_smoothing}.")
        if self.eval_every_epochs < 1:
            raise ValueError(f"--eval_every_epochs must be >= 1, got {self.eval_every_epochs}.")
        if self.checkpoint_every_steps < 0 or self.keep_checkpoints < 1:
            raise ValueError(
                f"--checkpoint_every_steps must be >= 0 and --keep_checkpoints >= 1, got "
                f"{self.checkpoint_every_steps} and {self.keep_checkpoints}."
            )
        if not self.checkpoint_at_epoch_end and self.checkpoint_every_steps == 0:
            raise ValueError(
                "--nocheckpoint_at_epoch_end with --checkpoint_every_steps=0 would save no checkpoint at "
                "all (a killed job could not resume): give --checkpoint_every_steps=N > 0, or keep "
                "epoch-end saves."
            )
        if not self.epochs > 0 or float(self.epochs) != int(self.epochs):
            raise ValueError(f"--epochs must be a whole number > 0, got {self.epochs}.")
        for name in ("decay_power", "decay_factor"):
            if not getattr(self, name) > 0:
                raise ValueError(f"--{name} must be > 0, got {getattr(self, name)}.")
        for name in ("end_learning_rate", "warmup_start_learning_rate", "epsilon"):
            if getattr(self, name) < 0:
                raise ValueError(f"--{name} must be >= 0, got {getattr(self, name)}.")
        if self.optimizer == "momentum":
            lars_only = {"eta": 0.001, "epsilon": 0.0, "trust_ratio_mode": "paper"}
            changed = [f"--{k}={getattr(self, k)}" for k, v in lars_only.items() if getattr(self, k) != v]
            if changed:
                raise ValueError(f"{', '.join(changed)} only apply to --optimizer=lars, not momentum.")
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
        # The upper bound (the training set's size) is the input pipeline's to check.
        if self.validation_examples < 0:
            raise ValueError(
                f"--validation_examples must be >= 0 (0: no validation split), got "
                f"{self.validation_examples}."
            )


def resolve_precision(precision, cpuinfo_path="/proc/cpuinfo"):
    """The Keras dtype policy for `precision`: "auto" becomes "mixed_bfloat16" when the CPU lists a flag of
    `BF16_CPU_FLAGS` in `cpuinfo_path`, else "float32"; other values are returned as they are."""
    if precision != "auto":
        return precision
    try:
        with open(cpuinfo_path) as f:
            flags = {word for line in f if line.startswith("flags") for word in line.split()}
    except OSError:
        return "float32"
    return "mixed_bfloat16" if flags & set(BF16_CPU_FLAGS) else "float32"


@dataclasses.dataclass(frozen=True)
class Plan:
    """Batch and step arithmetic of one run, in optimizer steps."""

    world_size: int
    global_batch_size: int
    per_rank_batch_size: int
    accumulation_steps: int
    steps_per_epoch: int
    epochs: int
    total_steps: int
    warmup_steps: int
    peak_learning_rate: float

    def describe(self):
        return (
            f"global batch {self.global_batch_size} = {self.world_size} ranks x per-rank batch "
            f"{self.per_rank_batch_size} x accumulation {self.accumulation_steps}; "
            f"{self.steps_per_epoch} steps per epoch x "
            f"{self.epochs} epochs = {self.total_steps} steps; warmup {self.warmup_steps} steps; "
            f"peak learning rate {self.peak_learning_rate:g}"
        )


def make_plan(config, world_size, num_train_examples):
    """Converts the config's epochs and per-256 rates into steps and a peak rate.

    Raises:
        ValueError: the global batch exceeds the training set, or the epochs are not whole.
    """
    global_batch, per_rank = config.resolve_batch(world_size)
    if global_batch > num_train_examples:
        raise ValueError(
            f"--global_batch_size={global_batch} exceeds the {num_train_examples} training examples."
        )
    steps_per_epoch = config.steps_per_epoch or epochs_to_steps(1, num_train_examples, global_batch)
    if float(config.epochs) != int(config.epochs):
        raise ValueError(f"--epochs must be a whole number of epochs, got {config.epochs}.")
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
        warmup_steps=int(round(config.warmup_epochs * steps_per_epoch)),
        peak_learning_rate=peak,
    )
