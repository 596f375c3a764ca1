"""The run's configuration: one plain object that `hvd_lars.main` makes from flags.

Each field is one `setting`: its default, help, accepted values and whether it is part of the plan a
checkpoint belongs to live there and nowhere else. The main program defines its flags from these fields;
`validate` checks each field by its own declaration, then the few rules that tie fields together. Units:
images, epochs, learning rates (per update; `base_learning_rate` per 256 images). Imports nothing heavy.
"""

import dataclasses

from hvd_lars.arguments import above, at_least, fraction


def setting(default, help, *, choices=None, check=None, plan=False, item=str):
    """A `TrainConfig` field.

    Args:
        default: the value when the flag is not given (its type is the flag's type: str, int, float, bool,
            or tuple for a list of numbers).
        help: one line for `--help`.
        choices: a tuple of accepted values; an empty string is accepted in addition where the default is
            "".
        check: an `hvd_lars.arguments.Range`, or None.
        plan: True when the setting changes what the remaining updates do (optimizer, schedule, data...):
            a run resumed from a checkpoint refuses a change of it unless `--allow_plan_change` names it.
        item: for a tuple setting (a comma-separated flag), the type of each element.
    """
    return dataclasses.field(
        default=default,
        metadata={"help": help, "choices": choices, "check": check, "plan": plan, "item": item},
    )


def problem(field, value):
    """The one-line error for `value` of `field` (a dataclass field made by `setting`), or None."""
    choices = field.metadata["choices"]
    if choices is not None:
        if value in choices or (value == "" and field.default == ""):
            return None
        empty = f" (empty: {field.default or 'the default'})" if field.default == "" else ""
        return f"--{field.name}={value!r}; valid: {', '.join(map(str, choices))}{empty}."
    check = field.metadata.get("check")
    if check is None:
        return None
    if isinstance(value, tuple):
        bad = [v for v in value if not check.accepts(v)]
        return f"--{field.name}={list(value)}: each must be {check.describe()}." if bad else None
    return None if check.accepts(value) else f"--{field.name} must be {check.describe()}, got {value!r}."


# The names the library's registries hold (hvd_lars.data.DATASETS, hvd_lars.models.MODELS, ...), written
# here so that flags are checked before Keras and TensorFlow are imported (tests/test_config.py compares).
# Each data set with the settings of this table it reads; another data set's setting is refused.
DATASET_SETTINGS = {
    "fashion_mnist": ("validation_examples",),
    "imagenet2012": ("image_size", "preprocessing", "skip_corrupt"),
    "image_folder": ("image_size", "preprocessing", "skip_corrupt"),
    "synthetic": ("image_size",),
}
MODELS = (
    "alexnet",
    "alexnet_bn",
    "resnet18",
    "resnet20",
    "resnet34",
    "resnet50",
    "small_cnn",
    "small_cnn_nobn",
)
PREPROCESSINGS = ("caffe", "caffe_scaled", "inception")
SCHEDULES = ("cosine", "mlperf_poly", "paper_poly", "step")
TRUST_RATIO_MODES = ("paper", "decayed_gradient", "update")
MOMENTUM_CORRECTIONS = ("none", "warmup", "always")
GRADIENT_REDUCTIONS = ("overlap", "grouped")
GRADIENT_COMPRESSIONS = ("none", "fp16")
OPTIMIZERS = ("lars", "momentum", "nesterov")
PRECISIONS = ("auto", "float32", "mixed_bfloat16")
# The --allow_plan_change value that accepts every change of the plan.
ANY_PLAN_CHANGE = "any"
# CPU flags (/proc/cpuinfo) of native bfloat16 arithmetic; without them bfloat16 is emulated and slower.
BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")

_COUNT = at_least(0, whole=True)  # a count where 0 means "derived" or "all"
_RATE = at_least(0.0)


@dataclasses.dataclass
class TrainConfig:
    """Everything a training run needs (one field per flag of `python -m hvd_lars.main`)."""

    dataset: str = setting(
        "fashion_mnist",
        "The data set (synthetic: random images, for timing).",
        choices=tuple(sorted(DATASET_SETTINGS)),
        plan=True,
    )
    data_dir: str = setting("", "Data folder; empty: the dataset's default location.", plan=True)
    image_size: int = setting(
        0,
        "Crop side in pixels (0: the dataset's own, 224 for ImageNet; 227 for AlexNet).",
        check=_COUNT,
        plan=True,
    )
    preprocessing: str = setting(
        "",
        "ImageNet-style image views: inception (default: Inception crops of 8-100 percent of the area), "
        "caffe "
        "(256x256, random 227 crop + mirror, centre crop for eval, channel means subtracted: AlexNet), "
        "caffe_scaled (the same times 1/256: the released AlexNet-BN).",
        choices=PREPROCESSINGS,
        plan=True,
    )
    deterministic: bool = setting(True, "Fixed input order (exact resume); off: faster.", plan=True)
    skip_corrupt: bool = setting(False, "Skip and count unreadable training images.")
    input_threads: int = setting(0, "Input pipeline threads (0: this rank's cores).", check=_COUNT)
    model: str = setting("small_cnn", "The network (hvd_lars.models.MODELS).", choices=MODELS, plan=True)
    optimizer: str = setting(
        "lars",
        "lars, momentum (SGD with coupled L2 decay) or nesterov (the same with Nesterov momentum).",
        choices=OPTIMIZERS,
        plan=True,
    )
    global_batch_size: int = setting(
        0, "Images per update over all ranks and micro-batches (0: derived).", check=_COUNT, plan=True
    )
    per_rank_batch_size: int = setting(
        0, "Images per micro-batch on one rank (0: derived from global).", check=_COUNT
    )
    accumulation_steps: int = setting(
        1,
        "Micro-batches per optimizer update. Batch norm normalises each micro-batch on its own and updates "
        "its "
        "moving averages once per micro-batch (the run log says how often per update).",
        check=at_least(1, whole=True),
        plan=True,
    )
    gradient_reduction: str = setting(
        "overlap",
        "overlap: allreduce each gradient as backprop produces it; grouped: one allreduce after backprop.",
        choices=GRADIENT_REDUCTIONS,
    )
    gradient_compression: str = setting(
        "none",
        "fp16: gradients travel as float16 (divided by the world size before the sum).",
        choices=GRADIENT_COMPRESSIONS,
        plan=True,
    )
    precision: str = setting(
        "auto",
        "Keras dtype policy; auto: mixed_bfloat16 on CPUs with native bf16 (a resume compares it as "
        "resolved).",
        choices=PRECISIONS,
        plan=True,
    )
    label_smoothing: float = setting(
        0.0, "Label smoothing of the cross-entropy (0: none).", check=fraction(), plan=True
    )
    epochs: float = setting(10.0, "Training epochs (whole number).", check=above(0, whole=True), plan=True)
    warmup_epochs: float = setting(1.0, "Linear warmup length in epochs.", check=at_least(0.0), plan=True)
    base_learning_rate: float = setting(
        0.0,
        "Peak learning rate per 256 images (scaled linearly to the global batch).",
        check=_RATE,
        plan=True,
    )
    peak_learning_rate: float = setting(0.0, "Peak learning rate (instead of base).", check=_RATE, plan=True)
    warmup_start_learning_rate: float = setting(0.0, "Rate at step 0.", check=_RATE, plan=True)
    end_learning_rate: float = setting(0.0, "Rate at the last step.", check=_RATE, plan=True)
    schedule: str = setting(
        "mlperf_poly",
        "Learning-rate policy: mlperf_poly (warmup from 0, poly decay after warmup), paper_poly (the paper's "
        "solver: poly decay counted from step 0), cosine, step (Goyal et al.).",
        choices=SCHEDULES,
        plan=True,
    )
    decay_power: float = setting(2.0, "Polynomial decay power after warmup.", check=above(0.0), plan=True)
    decay_boundaries_epochs: tuple = setting(
        (),
        "Epochs at which the step schedule multiplies the rate by --decay_factor (empty: Goyal et al.'s 30, "
        "60, 80 of 90 epochs).",
        check=at_least(0.0),
        plan=True,
        item=float,
    )
    decay_factor: float = setting(
        0.1, "Step schedule: multiplier at each boundary.", check=above(0.0), plan=True
    )
    momentum: float = setting(0.9, "Momentum.", check=fraction(), plan=True)
    weight_decay: float = setting(5e-4, "L2 weight decay (beta).", check=at_least(0.0), plan=True)
    eta: float = setting(0.001, "LARS trust coefficient.", check=above(0.0), plan=True)
    trust_ratio_mode: str = setting(
        "paper",
        "LARS convention: paper (||g|| + beta ||w|| in the trust ratio), decayed_gradient (||g + beta w||), "
        "update (trust ratio on the momentum update).",
        choices=TRUST_RATIO_MODES,
        plan=True,
    )
    momentum_correction: str = setting(
        "none",
        "LARS velocity rescaled by lr_t / lr_{t-1}: none (Intel Caffe's fused update, the paper's runs), "
        "warmup (its non-fused update: during warmup only), always (Goyal et al. eq. 10).",
        choices=MOMENTUM_CORRECTIONS,
        plan=True,
    )
    exclude_bn_and_bias: bool = setting(
        False,
        "Leave batch-norm parameters and biases out of LARS adaptation and weight decay (MLPerf recipe).",
        plan=True,
    )
    epsilon: float = setting(0.0, "LARS epsilon in the trust ratio's denominator.", check=_RATE, plan=True)
    workdir: str = setting("results/runs", "Parent folder of the run directory.")
    run_name: str = setting("", "Run directory name; empty: derived from the flags.")
    seed: int = setting(0, "Random seed (weights, shuffling).", check=_COUNT, plan=True)
    resume: bool = setting(True, "Resume from the run directory's latest checkpoint.")
    allow_plan_change: tuple = setting(
        (),
        "Settings of the plan a resumed run may change from the plan its checkpoint records, by name "
        "(e.g. weight_decay,schedule); any other change is refused. any: every change.",
    )
    eval_every_epochs: int = setting(
        1, "Evaluate every N epochs (and after the last).", check=at_least(1, whole=True)
    )
    checkpoint_every_steps: int = setting(0, "Checkpoint every N updates (0: epoch ends only).", check=_COUNT)
    checkpoint_at_epoch_end: bool = setting(True, "Checkpoint at each epoch end (after evaluation).")
    async_checkpoints: bool = setting(
        True,
        "Rank 0 writes checkpoints in a background thread (the index is replaced when the files are "
        "complete).",
    )
    keep_checkpoints: int = setting(3, "How many recent checkpoints to keep.", check=at_least(1, whole=True))
    # 3, as --keep_checkpoints: a fresh start by mistake, or two, still leaves the run before them.
    keep_earlier_runs: int = setting(
        3,
        "How many earlier runs a run directory keeps under earlier_runs/, where a fresh start moves the run "
        "it replaces: the newest by start time; older ones are removed, each named in the log (0: none).",
        check=_COUNT,
    )
    elastic: bool = setting(
        False,
        "Elastic training under horovodrun --min-np/--max-np --host-discovery-script (launch/elastic.sh): "
        "workers may leave and join; the global batch and schedule stay, the per-rank batch adapts.",
    )
    hang_timeout_s: float = setting(
        900.0,
        "A rank that completes no update, evaluation batch or checkpoint for this many seconds ends its "
        "process "
        "(exit status 4), so that a silent host or link cannot hang the job; 0: never.",
        check=at_least(0.0),
    )
    elastic_commit_every_steps: int = setting(
        10,
        "Elastic: updates between commits of the state in memory (what a dead worker costs; when a "
        "membership "
        "change is taken up).",
        check=at_least(1, whole=True),
    )
    max_train_examples: int = setting(
        0, "Use only the first N training images (0: all).", check=_COUNT, plan=True
    )
    max_eval_examples: int = setting(0, "Use only the first N evaluation images (0: all).", check=_COUNT)
    validation_examples: int = setting(
        0,
        "Hold out the last N training images (never trained on) and evaluate them like the test set as "
        "val_top1/val_top5/val_loss, for choosing hyperparameters (0: none; fashion_mnist only).",
        check=_COUNT,
        plan=True,
    )
    steps_per_epoch: int = setting(
        0, "Override steps per epoch (0: data size // batch).", check=_COUNT, plan=True
    )
    intra_op_threads: int = setting(0, "TF intra-op threads (0: this rank's cores).", check=_COUNT)
    inter_op_threads: int = setting(0, "TF inter-op threads (0: this rank's cores).", check=_COUNT)
    verbose: int = setting(
        1,
        "Rank 0's lines, as Keras's fit counts them: 0 (none), 1 (each epoch's and a progress line every "
        "--progress_every_s within it), 2 (each epoch's only).",
        choices=(0, 1, 2),
    )
    # 30 s: a stall shows within half a minute, and a batch log gets 2 lines a minute however long the epoch.
    progress_every_s: float = setting(
        30.0,
        "Seconds between rank 0's progress lines within an epoch (micro-batch k/n, images/s, loss, time "
        "left; 0: after every micro-batch).",
        check=at_least(0.0),
    )

    def resolve_batch(self, world_size):
        """Returns (global batch, per-rank micro-batch) at `world_size` ranks: one of the two settings may be
        0 and is derived from the other. global batch = per-rank batch x world size x accumulation steps.

        Raises:
            ValueError: a global batch that does not divide by ranks x accumulation, or contradicts the
                per-rank batch.
        """
        divisor = world_size * self.accumulation_steps
        if not self.global_batch_size:
            return self.per_rank_batch_size * divisor, self.per_rank_batch_size
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

    def validate(self):
        """Checks every setting by its declaration, then the rules between settings: what can be checked
        before any rank starts (`resolve_batch` checks the batch against the world size).

        Raises:
            ValueError: one line naming the flag, its value and what would be accepted.
        """
        for field in dataclasses.fields(self):
            message = problem(field, getattr(self, field.name))
            if message:
                raise ValueError(message)
        unknown = sorted(set(self.allow_plan_change) - set(plan_settings()) - {ANY_PLAN_CHANGE})
        if unknown:
            raise ValueError(
                f"--allow_plan_change names {', '.join(unknown)}, which are not settings of the plan; valid: "
                f"{', '.join(plan_settings())}, or {ANY_PLAN_CHANGE}."
            )
        for rule in _RULES:
            message = rule(self)
            if message:
                raise ValueError(message)


def _some_batch(config):
    if not config.global_batch_size and not config.per_rank_batch_size:
        return "Give --global_batch_size or --per_rank_batch_size (both are 0)."
    return None


def _lars_only(config):
    # Settings that only LARS reads: their declared defaults, compared by field.
    changed = [
        f"--{name}={getattr(config, name)}"
        for name in ("eta", "epsilon", "trust_ratio_mode")
        if getattr(config, name) != _FIELDS[name].default
    ]
    if config.optimizer != "lars" and changed:
        return f"{', '.join(changed)} only apply to --optimizer=lars, not {config.optimizer}."
    return None


def _one_learning_rate(config):
    if (config.base_learning_rate > 0) == (config.peak_learning_rate > 0):
        return (
            "Give exactly one positive learning rate: --base_learning_rate (per 256 images) or "
            f"--peak_learning_rate; got {config.base_learning_rate} and {config.peak_learning_rate}."
        )
    return None


def _warmup_within_training(config):
    if not config.warmup_epochs < config.epochs:
        return (
            f"--warmup_epochs={config.warmup_epochs} must be >= 0 and shorter than --epochs={config.epochs}."
        )
    return None


def _some_checkpoint(config):
    if not config.checkpoint_at_epoch_end and config.checkpoint_every_steps == 0:
        return (
            "--nocheckpoint_at_epoch_end with --checkpoint_every_steps=0 would save no checkpoint at all (a "
            "killed job could not resume): give --checkpoint_every_steps=N > 0, or keep epoch-end saves."
        )
    return None


def _read_by_the_dataset(config):
    # The settings some data set reads (`DATASET_SETTINGS`), given a value other than their declared
    # default for a data set that does not read them: refused rather than ignored.
    takes = DATASET_SETTINGS[config.dataset]
    everyone = sorted({name for names in DATASET_SETTINGS.values() for name in names})
    ignored = [
        f"--{name}={getattr(config, name)!r}"
        for name in everyone
        if name not in takes and getattr(config, name) != _FIELDS[name].default
    ]
    if ignored:
        return (
            f"Dataset {config.dataset!r} does not take {', '.join(ignored)}; of the data-set settings it "
            f"takes {', '.join(f'--{name}' for name in takes) or 'none'}."
        )
    return None


# --help's groups, in order: every setting in one.
HELP_GROUPS = (
    (
        "Data",
        ("dataset", "data_dir", "image_size", "preprocessing", "validation_examples", "max_train_examples"),
    ),
    ("Model", ("model", "precision", "label_smoothing", "seed")),
    (
        "Optimizer and schedule",
        (
            "optimizer",
            "base_learning_rate",
            "peak_learning_rate",
            "schedule",
            "epochs",
            "warmup_epochs",
            "warmup_start_learning_rate",
            "end_learning_rate",
            "decay_power",
            "decay_boundaries_epochs",
            "decay_factor",
            "momentum",
            "weight_decay",
            "eta",
            "trust_ratio_mode",
            "momentum_correction",
            "exclude_bn_and_bias",
            "epsilon",
        ),
    ),
    (
        "Batch and scale",
        ("global_batch_size", "per_rank_batch_size", "accumulation_steps", "steps_per_epoch", "elastic"),
    ),
    (
        "Checkpoints and resume",
        (
            "workdir",
            "run_name",
            "resume",
            "allow_plan_change",
            "checkpoint_every_steps",
            "checkpoint_at_epoch_end",
            "keep_checkpoints",
            "keep_earlier_runs",
            "async_checkpoints",
        ),
    ),
    ("Evaluation and logs", ("eval_every_epochs", "max_eval_examples", "verbose", "progress_every_s")),
    (
        "Performance",
        (
            "gradient_reduction",
            "gradient_compression",
            "deterministic",
            "input_threads",
            "intra_op_threads",
            "inter_op_threads",
        ),
    ),
    ("Faults", ("skip_corrupt", "hang_timeout_s", "elastic_commit_every_steps")),
)
# The rules between settings, checked after each setting on its own.
_RULES = (
    _some_batch,
    _lars_only,
    _one_learning_rate,
    _warmup_within_training,
    _some_checkpoint,
    _read_by_the_dataset,
)
_FIELDS = {f.name: f for f in dataclasses.fields(TrainConfig)}


def default_of(name):
    """The declared default of setting `name`."""
    return _FIELDS[name].default


def plan_settings():
    """The settings that are part of the plan a checkpoint belongs to (`setting(..., plan=True)`)."""
    return [name for name, f in _FIELDS.items() if f.metadata["plan"]]


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
