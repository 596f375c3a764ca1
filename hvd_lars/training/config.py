"""The run's configuration: one `TrainConfig` field per flag of `hvd_lars.main`, each declared once by
`setting` (default, help, accepted values, --help group, part of the plan or not). Units: images, epochs,
learning rates per update (`base_learning_rate`: per 256 images). Imports nothing heavy."""

import dataclasses

from hvd_lars import arguments
from hvd_lars.arguments import above, at_least, fraction


def setting(default, help, accepted=None, *, plan=False, item=str, group=None):
    """A `TrainConfig` field. `accepted`: a tuple of the accepted values ("" too where the default is "") or
    an `hvd_lars.arguments.Range` (of each element, of type `item`, for a tuple: a comma-separated flag);
    `plan`: a resumed run refuses a change unless `--allow_plan_change` names it; `group`: the --help group
    this field opens."""
    metadata = dict(help=help, accepted=accepted, plan=plan, item=item, group=group)
    return dataclasses.field(default=default, metadata=metadata)


# The names of the library's registries (hvd_lars.data.DATASETS, hvd_lars.models.MODELS, ...), copied so
# that flags are checked before TensorFlow is imported (tests/test_config.py compares them).
# Each data set with the settings of this table it reads; another data set's setting is refused.
DATASET_SETTINGS = {
    "fashion_mnist": ("validation_examples",),
    "imagenet2012": ("image_size", "preprocessing", "skip_corrupt"),
    "image_folder": ("image_size", "preprocessing", "skip_corrupt"),
    "synthetic": ("image_size",),
}
MODELS = tuple("alexnet alexnet_bn resnet18 resnet20 resnet34 resnet50 small_cnn small_cnn_nobn".split())
PREPROCESSINGS = ("caffe", "caffe_scaled", "inception")
SCHEDULES = ("cosine", "mlperf_poly", "paper_poly", "step")
TRUST_RATIO_MODES = ("paper", "decayed_gradient", "update")
MOMENTUM_CORRECTIONS = ("none", "warmup", "always")
GRADIENT_REDUCTIONS = ("overlap", "grouped")
GRADIENT_COMPRESSIONS = ("none", "fp16")
OPTIMIZERS = ("lars", "momentum", "nesterov")
PRECISIONS = ("auto", "float32", "mixed_bfloat16")
DATASETS = tuple(sorted(DATASET_SETTINGS))
ANY_PLAN_CHANGE = "any"  # the --allow_plan_change value that accepts every change
# CPU flags (/proc/cpuinfo) of native bfloat16 arithmetic; without them bfloat16 is emulated and slower.
BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")

_COUNT = at_least(0, whole=True)  # a count where 0 means "derived" or "all"
_POSITIVE_COUNT = at_least(1, whole=True)
_RATE = at_least(0.0)


@dataclasses.dataclass
class TrainConfig:
    """Everything a training run needs: one field per flag of `python -m hvd_lars.main`, in --help's order."""

    dataset: str = setting(
        "fashion_mnist",
        "The data set (synthetic: random images, for timing).",
        DATASETS,
        plan=True,
        group="Data",
    )
    data_dir: str = setting("", "Data folder; empty: the dataset's default location.", plan=True)
    image_size: int = setting(0, "Crop side in pixels (0: the dataset's own).", _COUNT, plan=True)
    preprocessing: str = setting(
        "",
        "ImageNet-style views: inception (default: crops of 8-100% of the area), caffe (256x256, random 227 "
        "crop + mirror, means subtracted: AlexNet), caffe_scaled (the same x 1/256: AlexNet-BN).",
        PREPROCESSINGS,
        plan=True,
    )
    validation_examples: int = setting(
        0, "Hold out the last N training images, evaluated as val_* (0: none).", _COUNT, plan=True
    )
    max_train_examples: int = setting(0, "Train on the first N images only (0: all).", _COUNT, plan=True)
    model: str = setting("small_cnn", "The network.", MODELS, plan=True, group="Model")
    precision: str = setting("auto", "auto: mixed_bfloat16 on CPUs with native bf16.", PRECISIONS, plan=True)
    label_smoothing: float = setting(0.0, "Label smoothing (0: none).", fraction(), plan=True)
    seed: int = setting(0, "Random seed (weights, shuffling).", _COUNT, plan=True)
    optimizer: str = setting(
        "lars",
        "lars, momentum (SGD with coupled L2 decay) or nesterov (the same with Nesterov momentum).",
        OPTIMIZERS,
        plan=True,
        group="Optimizer and schedule",
    )
    base_learning_rate: float = setting(
        0.0, "Peak rate per 256 images (x global batch / 256).", _RATE, plan=True
    )
    peak_learning_rate: float = setting(0.0, "Peak learning rate (instead of base).", _RATE, plan=True)
    schedule: str = setting(
        "mlperf_poly",
        "mlperf_poly (warmup from 0, then poly decay), paper_poly (the paper's: poly decay counted from step "
        "0), cosine, step (Goyal et al.).",
        SCHEDULES,
        plan=True,
    )
    epochs: float = setting(10.0, "Training epochs.", above(0, whole=True), plan=True)
    warmup_epochs: float = setting(1.0, "Linear warmup length in epochs.", _RATE, plan=True)
    warmup_start_learning_rate: float = setting(0.0, "Rate at step 0.", _RATE, plan=True)
    end_learning_rate: float = setting(0.0, "Rate at the last step.", _RATE, plan=True)
    decay_power: float = setting(2.0, "Polynomial decay power after warmup.", above(0.0), plan=True)
    decay_boundaries_epochs: tuple = setting(
        (), "Step schedule's epochs (empty: 30, 60, 80 of 90).", _RATE, plan=True, item=float
    )
    decay_factor: float = setting(0.1, "Step schedule's multiplier at each boundary.", above(0.0), plan=True)
    momentum: float = setting(0.9, "Momentum.", fraction(), plan=True)
    weight_decay: float = setting(5e-4, "L2 weight decay (beta).", _RATE, plan=True)
    eta: float = setting(0.001, "LARS trust coefficient.", above(0.0), plan=True)
    trust_ratio_mode: str = setting(
        "paper",
        "LARS trust ratio: paper (||g|| + beta ||w||), decayed_gradient (||g + beta w||), update (of the "
        "momentum update).",
        TRUST_RATIO_MODES,
        plan=True,
    )
    momentum_correction: str = setting(
        "none",
        "LARS velocity x lr_t / lr_{t-1}: none (Intel Caffe's fused update, the paper's runs), warmup (its "
        "non-fused one: in warmup), always (Goyal et al. eq. 10).",
        MOMENTUM_CORRECTIONS,
        plan=True,
    )
    exclude_bn_and_bias: bool = setting(
        False, "Leave batch norm and biases out of LARS adaptation and weight decay (MLPerf).", plan=True
    )
    epsilon: float = setting(0.0, "LARS epsilon in the trust ratio's denominator.", _RATE, plan=True)
    global_batch_size: int = setting(
        0,
        "Images per update over all ranks and micro-batches (0: derived).",
        _COUNT,
        plan=True,
        group="Batch and scale",
    )
    per_rank_batch_size: int = setting(0, "Images per micro-batch on one rank (0: derived).", _COUNT)
    accumulation_steps: int = setting(
        1, "Micro-batches per update (batch norm normalises each on its own).", _POSITIVE_COUNT, plan=True
    )
    steps_per_epoch: int = setting(0, "Updates per epoch (0: data size // batch).", _COUNT, plan=True)
    elastic: bool = setting(False, "Workers may leave and join (launch/elastic.sh); the global batch stays.")
    workdir: str = setting(
        "results/runs", "Parent folder of the run directory.", group="Checkpoints and resume"
    )
    run_name: str = setting("", "Run directory name; empty: derived from the flags.")
    allow_plan_change: tuple = setting(
        (), "Settings of the plan a resumed run may change, by name (e.g. weight_decay,schedule), or any."
    )
    checkpoint_every_steps: int = setting(0, "Checkpoint every N updates (0: epoch ends only).", _COUNT)
    checkpoint_at_epoch_end: bool = setting(True, "Checkpoint at each epoch end (after evaluation).")
    keep_checkpoints: int = setting(3, "How many recent checkpoints to keep.", _POSITIVE_COUNT)
    async_checkpoints: bool = setting(True, "Rank 0 writes checkpoints in a background thread.")
    eval_every_epochs: int = setting(
        1, "Evaluate every N epochs (and after the last).", _POSITIVE_COUNT, group="Evaluation and logs"
    )
    max_eval_examples: int = setting(0, "Evaluate the first N images only (0: all).", _COUNT)
    verbose: int = setting(
        1, "Rank 0's lines: 0 none, 1 epochs and progress within them, 2 epochs only.", (0, 1, 2)
    )
    # 30 s: a stall shows within half a minute, and a batch log gets 2 lines a minute however long the epoch.
    progress_every_s: float = setting(30.0, "Seconds between progress lines (0: every micro-batch).", _RATE)
    gradient_reduction: str = setting(
        "overlap",
        "overlap: allreduce each gradient as backprop produces it; grouped: one allreduce after backprop.",
        GRADIENT_REDUCTIONS,
        group="Performance",
    )
    gradient_compression: str = setting(
        "none", "fp16: gradients travel as float16.", GRADIENT_COMPRESSIONS, plan=True
    )
    deterministic: bool = setting(True, "Fixed input order (exact resume); off: faster.", plan=True)
    input_threads: int = setting(0, "Input pipeline threads (0: this rank's cores).", _COUNT)
    intra_op_threads: int = setting(0, "TF intra-op threads (0: this rank's cores).", _COUNT)
    inter_op_threads: int = setting(0, "TF inter-op threads (0: this rank's cores).", _COUNT)
    skip_corrupt: bool = setting(False, "Skip and count unreadable training images.", group="Faults")
    hang_timeout_s: float = setting(
        900.0,
        "Seconds without an update, evaluation batch or checkpoint after which a rank exits with status 4 "
        "(0: never), so that a silent host or link cannot hang the job.",
        _RATE,
    )
    elastic_commit_every_steps: int = setting(
        10, "Elastic: updates between commits of the state in memory.", _POSITIVE_COUNT
    )

    def resolve_batch(self, world_size):
        """(global batch, per-rank micro-batch) at `world_size` ranks, the one given as 0 derived from the
        other: global batch = per-rank batch x world size x accumulation steps. Raises ValueError: a global
        batch that does not divide by ranks x accumulation, or contradicts the per-rank batch."""
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
        """Checks each setting by its declaration, then the rules between settings (`resolve_batch` checks
        the batch against the world size). Raises ValueError: one line naming the flag, its value and what
        would be accepted."""
        for field in dataclasses.fields(self):
            name, value, accepted = field.name, getattr(self, field.name), field.metadata["accepted"]
            if isinstance(accepted, tuple) and value not in accepted and not value == "" == field.default:
                empty = " (empty: the default)" if field.default == "" else ""
                raise ValueError(f"--{name}={value!r}; valid: {', '.join(map(str, accepted))}{empty}.")
            if isinstance(accepted, arguments.Range) and not isinstance(value, tuple):
                arguments.check(f"--{name}", value, accepted)
            elif isinstance(accepted, arguments.Range) and not all(map(accepted.accepts, value)):
                raise ValueError(f"--{name}={list(value)}: each must be {accepted.describe()}.")
        unknown = sorted(set(self.allow_plan_change) - set(plan_settings()) - {ANY_PLAN_CHANGE})
        if unknown:
            raise ValueError(
                f"--allow_plan_change names {', '.join(unknown)}, which are not settings of the plan; valid: "
                f"{', '.join(plan_settings())}, or {ANY_PLAN_CHANGE}."
            )
        if not self.global_batch_size and not self.per_rank_batch_size:
            raise ValueError("Give --global_batch_size or --per_rank_batch_size (both are 0).")
        lars = ("eta", "epsilon", "trust_ratio_mode")
        lars_only = [f"--{n}={getattr(self, n)}" for n in lars if getattr(self, n) != default_of(n)]
        if self.optimizer != "lars" and lars_only:
            raise ValueError(f"{', '.join(lars_only)} only apply to --optimizer=lars, not {self.optimizer}.")
        if (self.base_learning_rate > 0) == (self.peak_learning_rate > 0):
            raise ValueError(
                "Give exactly one positive learning rate: --base_learning_rate (per 256 images) or "
                f"--peak_learning_rate; got {self.base_learning_rate} and {self.peak_learning_rate}."
            )
        if self.warmup_epochs >= self.epochs:
            raise ValueError(
                f"--warmup_epochs={self.warmup_epochs} must be >= 0 and shorter than --epochs={self.epochs}."
            )
        if not self.checkpoint_at_epoch_end and not self.checkpoint_every_steps:
            raise ValueError(
                "--nocheckpoint_at_epoch_end with --checkpoint_every_steps=0 would save no checkpoint at all "
                "(a killed job could not resume): give --checkpoint_every_steps > 0 or keep epoch-end saves."
            )
        # A data set's settings set for another data set: refused rather than ignored.
        takes = DATASET_SETTINGS[self.dataset]
        others = sorted({n for names in DATASET_SETTINGS.values() for n in names} - set(takes))
        ignored = [f"--{n}={getattr(self, n)!r}" for n in others if getattr(self, n) != default_of(n)]
        if ignored:
            raise ValueError(
                f"Dataset {self.dataset!r} does not take {', '.join(ignored)}; of the data-set settings it "
                f"takes {', '.join(f'--{n}' for n in takes) or 'none'}."
            )


_FIELDS = {f.name: f for f in dataclasses.fields(TrainConfig)}


def default_of(name):
    """The declared default of setting `name`."""
    return _FIELDS[name].default


def plan_settings():
    """The settings of the plan a checkpoint belongs to (`setting(..., plan=True)`), in field order."""
    return [name for name, f in _FIELDS.items() if f.metadata["plan"]]


def resolve_precision(precision, cpuinfo_path="/proc/cpuinfo"):
    """The Keras dtype policy of `precision`: "auto" is "mixed_bfloat16" where `cpuinfo_path` lists a flag of
    `BF16_CPU_FLAGS`, else "float32"; other values are returned as they are."""
    if precision != "auto":
        return precision
    try:
        with open(cpuinfo_path) as f:
            flags = {word for line in f if line.startswith("flags") for word in line.split()}
    except OSError:
        return "float32"
    return "mixed_bfloat16" if flags & set(BF16_CPU_FLAGS) else "float32"
