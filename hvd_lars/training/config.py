"""The run's configuration: one `TrainConfig` field per flag of `hvd_lars.main`, declared by `setting`."""

import dataclasses
import os
import pathlib

from hvd_lars import arguments
from hvd_lars.arguments import above, at_least, counted, fraction


def setting(default, help, accepted=None, *, plan=False, group=None):
    """A `TrainConfig` field: `accepted` values or `arguments.Range`, a `plan` setting, the --help `group`."""
    metadata = dict(help=help, accepted=accepted, plan=plan, group=group)
    return dataclasses.field(default=default, metadata=metadata)


# Copies of the library's registries' names (checked before TensorFlow is imported); each data set's settings.
DATASET_SETTINGS = {
    "fashion_mnist": ("validation_examples",),
    "imagenet2012": ("image_size", "preprocessing", "skip_corrupt"),
    "image_folder": ("image_size", "preprocessing", "skip_corrupt"),
    "synthetic": ("image_size",),
}
DATASETS = tuple(sorted(DATASET_SETTINGS))
MODELS = tuple("alexnet alexnet_bn resnet18 resnet20 resnet34 resnet50 small_cnn small_cnn_nobn".split())
PREPROCESSINGS = ("caffe", "caffe_scaled", "inception")
SCHEDULES = ("cosine", "mlperf_poly", "paper_poly", "step")
TRUST_RATIO_MODES = ("paper", "decayed_gradient", "update")
MOMENTUM_CORRECTIONS = ("none", "warmup", "always")
GRADIENT_REDUCTIONS = ("overlap", "grouped")
GRADIENT_COMPRESSIONS = ("none", "fp16")
OPTIMIZERS = ("lars", "momentum", "nesterov")
PRECISIONS = ("auto", "float32", "mixed_bfloat16")
ANY_PLAN_CHANGE = "any"  # the --allow_plan_change value that accepts every change

_COUNT = at_least(0, whole=True)  # a count where 0 means "derived" or "all"
_POSITIVE_COUNT = at_least(1, whole=True)
_RATE = at_least(0.0)


@dataclasses.dataclass
class TrainConfig:
    """Everything a training run needs: one field per flag of `python -m hvd_lars.main`, in --help's order."""

    dataset: str = setting(
        "fashion_mnist", "Data set (synthetic: random images, for timing).", DATASETS, plan=True, group="Data"
    )
    data_dir: str = setting("", "Data folder; empty: the dataset's default location.", plan=True)
    image_size: int = setting(0, "Crop side in pixels (0: the dataset's own).", _COUNT, plan=True)
    preprocessing: str = setting(
        "", "ImageNet views (empty: inception; caffe, caffe_scaled: AlexNet, -BN).", PREPROCESSINGS, plan=True
    )
    validation_examples: int = setting(0, "Hold out the last N images as val_* (0: none).", _COUNT, plan=True)
    max_train_examples: int = setting(0, "Train on the first N images only (0: all).", _COUNT, plan=True)
    model: str = setting("small_cnn", "The network.", MODELS, plan=True, group="Model")
    precision: str = setting("auto", "auto: mixed_bfloat16 on CPUs with native bf16.", PRECISIONS, plan=True)
    label_smoothing: float = setting(0.0, "Label smoothing (0: none).", fraction(), plan=True)
    seed: int = setting(0, "Random seed (weights, shuffling).", _COUNT, plan=True)
    optimizer: str = setting(
        "lars", "LARS, or SGD with coupled L2 decay.", OPTIMIZERS, plan=True, group="Optimizer and schedule"
    )
    base_learning_rate: float = setting(0.0, "Peak rate per 256 images.", _RATE, plan=True)
    peak_learning_rate: float = setting(0.0, "Peak learning rate (instead of base).", _RATE, plan=True)
    schedule: str = setting(
        "mlperf_poly", "mlperf_poly: warmup, then poly; paper_poly: poly from step 0.", SCHEDULES, plan=True
    )
    epochs: int = setting(10, "Training epochs.", above(0, whole=True), plan=True)
    warmup_epochs: float = setting(1.0, "Linear warmup length in epochs.", _RATE, plan=True)
    warmup_start_learning_rate: float = setting(0.0, "Rate at step 0.", _RATE, plan=True)
    end_learning_rate: float = setting(0.0, "Rate at the last step.", _RATE, plan=True)
    decay_power: float = setting(2.0, "Polynomial decay power after warmup.", above(0.0), plan=True)
    decay_boundaries_epochs: tuple = setting((), "Step epochs (empty: 30, 60, 80 of 90).", _RATE, plan=True)
    decay_factor: float = setting(0.1, "Step schedule's multiplier at each boundary.", above(0.0), plan=True)
    momentum: float = setting(0.9, "Momentum.", fraction(), plan=True)
    weight_decay: float = setting(5e-4, "L2 weight decay (beta).", _RATE, plan=True)
    eta: float = setting(0.001, "LARS trust coefficient.", above(0.0), plan=True)
    trust_ratio_mode: str = setting("paper", "Trust ratio (docs/fidelity.md).", TRUST_RATIO_MODES, plan=True)
    momentum_correction: str = setting(
        "none", "LARS velocity x lr_t / lr_{t-1} (docs/training.md).", MOMENTUM_CORRECTIONS, plan=True
    )
    exclude_bn_and_bias: bool = setting(False, "No LARS adaptation or decay of BN and biases.", plan=True)
    epsilon: float = setting(0.0, "LARS epsilon in the trust ratio's denominator.", _RATE, plan=True)
    global_batch_size: int = setting(
        0, "Images per update over all ranks (0: derived).", _COUNT, plan=True, group="Batch and scale"
    )
    per_rank_batch_size: int = setting(0, "Images per micro-batch on one rank (0: derived).", _COUNT)
    accumulation_steps: int = setting(1, "Micro-batches per update.", _POSITIVE_COUNT, plan=True)
    steps_per_epoch: int = setting(0, "Updates per epoch (0: data size // batch).", _COUNT, plan=True)
    elastic: bool = setting(False, "Workers may leave and join (launch/elastic.sh); the global batch stays.")
    workdir: str = setting(
        "results/runs", "Parent folder of the run directory.", group="Checkpoints and resume"
    )
    run_name: str = setting("", "Run directory name in --workdir (no '/'); empty: derived from the flags.")
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
    verbose: int = setting(1, "Rank 0 prints 0: nothing, 1: epochs and progress, 2: epochs.", (0, 1, 2))
    # 30 s: a stall shows within half a minute, and a batch log gets 2 lines a minute however long the epoch.
    progress_every_s: float = setting(30.0, "Seconds between progress lines (0: every micro-batch).", _RATE)
    gradient_reduction: str = setting(
        "overlap", "overlap: allreduce in backprop; grouped: after.", GRADIENT_REDUCTIONS, group="Performance"
    )
    gradient_compression: str = setting("none", "fp16: send float16.", GRADIENT_COMPRESSIONS, plan=True)
    deterministic: bool = setting(True, "Fixed input order (exact resume); off: faster.", plan=True)
    input_threads: int = setting(0, "Input pipeline threads (0: this rank's cores).", _COUNT)
    intra_op_threads: int = setting(0, "TF intra-op threads (0: this rank's cores).", _COUNT)
    inter_op_threads: int = setting(0, "TF inter-op threads (0: this rank's cores).", _COUNT)
    skip_corrupt: bool = setting(False, "Skip and count unreadable training images.", group="Faults")
    hang_timeout_s: float = setting(900.0, "Seconds without progress until exit 4 (0: never).", _RATE)
    elastic_commit_every_steps: int = setting(10, "Elastic: updates between commits.", _POSITIVE_COUNT)

    def __post_init__(self):  # a list (a list flag's strings, JSON's) as a tuple, of floats for numbers
        for f in dataclasses.fields(self):
            if f.type is tuple:
                value = getattr(self, f.name)
                item = float if isinstance(f.metadata["accepted"], arguments.Range) else str
                try:
                    setattr(self, f.name, tuple(map(item, value)))
                except ValueError:  # a float's: str takes anything
                    given, each = ",".join(map(str, value)), f.metadata["accepted"].describe()
                    raise ValueError(f"--{f.name}={given}: each must be {each}.") from None

    def resolve_batch(self, world_size):
        """(global batch, per-rank micro-batch) at `world_size` ranks; ValueError: they do not fit."""
        divisor = world_size * self.accumulation_steps
        if not self.global_batch_size:
            return self.per_rank_batch_size * divisor, self.per_rank_batch_size
        per_rank, over = divmod(self.global_batch_size, divisor)
        ranks = f"{counted(world_size, 'rank')} x {counted(self.accumulation_steps, 'accumulation step')}"
        if over:
            raise ValueError(
                f"--global_batch_size={self.global_batch_size} does not divide by the world size {ranks} = "
                f"{divisor}; use a multiple of {divisor} (e.g. {per_rank * divisor or divisor})."
            )
        if self.per_rank_batch_size not in (0, per_rank):
            raise ValueError(
                f"--per_rank_batch_size={self.per_rank_batch_size} contradicts --global_batch_size="
                f"{self.global_batch_size} over {ranks} (which gives {per_rank}); give only one of them."
            )
        return self.global_batch_size, per_rank

    def validate(self):
        """Checks each setting and the rules between them. Raises ValueError naming the flag and its value."""
        for f in dataclasses.fields(self):
            name, value, accepted = f.name, getattr(self, f.name), f.metadata["accepted"]
            if isinstance(accepted, tuple) and value not in accepted and not value == "" == f.default:
                empty = " (empty: the default)" if f.default == "" else ""
                raise ValueError(f"--{name}={value!r}; valid: {', '.join(map(str, accepted))}{empty}.")
            if isinstance(accepted, arguments.Range) and not isinstance(value, tuple):
                arguments.check(f"--{name}", value, accepted)
            elif isinstance(accepted, arguments.Range) and not all(map(accepted.accepts, value)):
                raise ValueError(f"--{name}={list(value)}: each must be {accepted.describe()}.")
        if unknown := sorted(set(self.allow_plan_change) - set(PLAN_SETTINGS) - {ANY_PLAN_CHANGE}):
            raise ValueError(
                f"--allow_plan_change names {', '.join(unknown)}, which are not settings of the plan; valid: "
                f"{', '.join(PLAN_SETTINGS)}, or {ANY_PLAN_CHANGE}."
            )
        if not self.global_batch_size and not self.per_rank_batch_size:
            raise ValueError("Give --global_batch_size or --per_rank_batch_size (both are 0).")
        if self.optimizer != "lars" and (lars_only := self._given(("eta", "epsilon", "trust_ratio_mode"))):
            raise ValueError(f"{', '.join(lars_only)} only apply to --optimizer=lars, not {self.optimizer}.")
        if (self.base_learning_rate > 0) == (self.peak_learning_rate > 0):
            given = ", ".join(
                f"--{n}={getattr(self, n)}" for n in ("base_learning_rate", "peak_learning_rate")
            )
            raise ValueError(
                f"Give exactly one positive --base_learning_rate or --peak_learning_rate (got {given})."
            )
        if self.warmup_epochs >= self.epochs:
            raise ValueError(f"--warmup_epochs={self.warmup_epochs} must be < --epochs={self.epochs}.")
        if self.run_name in (".", "..") or "/" in self.run_name:
            raise ValueError(
                f"--run_name={self.run_name!r}: a folder name inside --workdir (no '/', not '.' or '..'); "
                "--workdir says where."
            )
        if not self.checkpoint_at_epoch_end and not self.checkpoint_every_steps:
            raise ValueError("--nocheckpoint_at_epoch_end needs --checkpoint_every_steps > 0.")
        takes = DATASET_SETTINGS[self.dataset]
        ignored = self._given(sorted({n for names in DATASET_SETTINGS.values() for n in names} - set(takes)))
        if ignored:  # refused rather than ignored
            raise ValueError(
                f"Dataset {self.dataset!r} does not take {', '.join(ignored)}; of the data-set settings it "
                f"takes {', '.join(f'--{n}' for n in takes) or 'none'}."
            )
        if self.dataset == "image_folder" and not self.data_dir:
            raise ValueError(arguments.IMAGE_FOLDER_NEEDS_DATA_DIR)

    def _given(self, names):  # ["--name=value", ...] of the settings of `names` off their defaults
        return [f"--{n}={getattr(self, n)!r}" for n in names if getattr(self, n) != getattr(TrainConfig(), n)]


PLAN_SETTINGS = tuple(f.name for f in dataclasses.fields(TrainConfig) if f.metadata["plan"])


def resolve_precision(precision, cpuinfo_path="/proc/cpuinfo"):
    """The Keras dtype policy of `precision`; "auto": "mixed_bfloat16" on native bf16 CPUs, else "float32"."""
    if precision != "auto":
        return precision
    words = set(pathlib.Path(cpuinfo_path).read_text().split()) if os.path.exists(cpuinfo_path) else set()
    return "mixed_bfloat16" if words & {"avx512_bf16", "amx_bf16"} else "float32"
