"""Settings (config.py) checked before any work; a resume compares plans (plan.py) by meaning."""

import dataclasses
import math
import os

import pytest

from hvd_lars.arguments import Range
from hvd_lars.optim.scaling import steps_in_epochs
from hvd_lars.training import config as settings_table
from hvd_lars.training.config import DATASET_SETTINGS, PLAN_SETTINGS, TrainConfig, resolve_precision
from hvd_lars.training.plan import input_options, input_request, make_plan, plan_changes

pytestmark = pytest.mark.unit

FIELDS = {f.name: f for f in dataclasses.fields(TrainConfig)}
NUMERIC = [
    n for n, f in FIELDS.items() if f.type in (int, float) and isinstance(f.metadata["accepted"], Range)
]
CHOICES = [n for n, f in FIELDS.items() if isinstance(f.metadata["accepted"], tuple)]


def _config(**kw):
    return TrainConfig(
        **{**dict(peak_learning_rate=2.0, global_batch_size=64, epochs=3, warmup_epochs=1), **kw}
    )


def test_plan_for_the_demo_and_the_batch_and_rate_it_derives():
    config = _config(peak_learning_rate=20.0, global_batch_size=4096, epochs=12)
    plan = make_plan(config, world_size=2, num_train_examples=60000)
    steps = (plan.per_rank_batch_size, plan.steps_per_epoch, plan.total_steps, plan.warmup_steps)
    assert steps == (2048, 14, 168, 14)
    assert "global batch 4096 = 2 ranks x per-rank batch 2048" in plan.describe()
    one = "global batch 64 = 1 rank x per-rank batch 64 x accumulation 1; 1 step per epoch x 1 epoch = 1 step"
    assert make_plan(_config(epochs=1), 1, 64).describe().startswith(one + "; warmup 1 step;")  # no plurals
    per_256 = dataclasses.replace(config, peak_learning_rate=0.0, base_learning_rate=1.25)
    assert make_plan(per_256, 2, 60000).peak_learning_rate == pytest.approx(20.0)  # 1.25 x 4096 / 256
    per_rank = TrainConfig(per_rank_batch_size=64, accumulation_steps=4, peak_learning_rate=1.0)
    assert per_rank.resolve_batch(8) == (2048, 64)  # 8 ranks x 64 x 4 micro-batches
    with pytest.raises(ValueError, match="4096"):  # a global batch larger than the data
        make_plan(config, 1, 1000)
    # Accepted: a momentum run excluding BN and bias from decay; step checkpoints alone.
    _config(optimizer="momentum", exclude_bn_and_bias=True).validate()
    _config(checkpoint_at_epoch_end=False, checkpoint_every_steps=5).validate()


@pytest.mark.parametrize("name", NUMERIC)
@pytest.mark.parametrize("bad", [math.inf, math.nan, -1])
def test_every_numeric_setting_refuses_non_finite_and_negative_values_naming_itself(name, bad):
    if bad == -1 and FIELDS[name].metadata["accepted"].low < -1:
        pytest.skip(f"{name} accepts -1")
    with pytest.raises(ValueError) as info:
        _config(**{name: bad}).validate()
    message = str(info.value)
    assert f"--{name}" in message and repr(bad) in message and "\n" not in message


@pytest.mark.parametrize("name", CHOICES)
def test_every_setting_of_choices_refuses_another_value_listing_them(name):
    with pytest.raises(ValueError) as info:
        _config(**{name: "bogus"}).validate()
    accepted = ", ".join(map(str, FIELDS[name].metadata["accepted"]))
    assert str(info.value).startswith(f"--{name}='bogus'; valid: {accepted}")


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        (dict(epochs=2.5), "--epochs must be a whole number > 0, got 2.5."),
        (dict(intra_op_threads=-1), "--intra_op_threads must be a whole number >= 0, got -1."),
        (dict(eta=0.0), "--eta must be a finite number > 0, got 0.0."),
        (dict(momentum=1.0), "--momentum must be a finite number >= 0 and < 1, got 1.0."),
        (dict(decay_boundaries_epochs=(1.0, math.inf)), "--decay_boundaries_epochs=[1.0, inf]: each must be"),
        (dict(allow_plan_change=("workdir",)), "--allow_plan_change names workdir, which are not settings"),
        (dict(global_batch_size=4095), "4095 does not divide by the world size 2"),
        (dict(global_batch_size=0), "Give --global_batch_size or --per_rank_batch_size (both are 0)."),
        (dict(warmup_epochs=3), "--warmup_epochs=3 must be < --epochs=3."),
        (dict(base_learning_rate=1.0), "(got --base_learning_rate=1.0, --peak_learning_rate=2.0)."),
        (dict(peak_learning_rate=0.0), "Give exactly one positive --base_learning_rate or --peak_learning_"),
        (dict(optimizer="momentum", eta=0.01, trust_ratio_mode="update"),
         "--eta=0.01, --trust_ratio_mode='update' only apply to --optimizer=lars"),
        (dict(checkpoint_at_epoch_end=False), "--nocheckpoint_at_epoch_end needs --checkpoint_every_steps >"),
        # A data set's settings (`DATASET_SETTINGS`): another's, set, is refused.
        (dict(image_size=227, preprocessing="caffe"),
         "Dataset 'fashion_mnist' does not take --image_size=227, --preprocessing='caffe'; of the "
         "data-set settings it takes --validation_examples."),
        (dict(dataset="synthetic", validation_examples=100, skip_corrupt=True),
         "'synthetic' does not take --skip_corrupt=True, --validation_examples=100; of the data-set "
         "settings it takes --image_size."),
        (dict(dataset="image_folder", validation_examples=5), "--image_size, --preprocessing, --skip_corr"),
        (dict(dataset="image_folder"), "--dataset=image_folder needs --data_dir=<folder holding train/"),
        (dict(decay_boundaries_epochs=("1", "a")), "--decay_boundaries_epochs=1,a: each must be a finite"),
        *[(dict(run_name=name), f"--run_name={name!r}: a folder name inside --workdir (no '/', not '.' or")
          for name in ("..", ".", "a/b", "/tmp/run", "../results")],
    ],
)  # fmt: skip
def test_bad_values_are_one_line_naming_flag_and_value(kwargs, fragment):
    with pytest.raises(ValueError) as info:
        config = _config(**kwargs)
        config.validate()
        config.resolve_batch(2)
    assert fragment in str(info.value) and "\n" not in str(info.value)


def test_auto_precision_follows_native_bf16(tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    for flags_line, expected in [
        ("fpu avx2 avx512f avx512_bf16 fma", "mixed_bfloat16"), ("fpu amx_bf16 amx_tile", "mixed_bfloat16"),
        ("fpu avx2 avx512f fma", "float32"),
    ]:  # fmt: skip
        cpuinfo.write_text(f"processor\t: 0\nflags\t\t: {flags_line}\n")
        assert resolve_precision("auto", str(cpuinfo)) == expected, flags_line
        assert resolve_precision("float32", str(cpuinfo)) == "float32"
    assert resolve_precision("auto", str(tmp_path / "missing")) == "float32"


# A value other than the default for each setting of the plan (precision: compared as resolved).
CHANGED = {
    "dataset": "synthetic", "data_dir": "/elsewhere", "image_size": 32, "preprocessing": "caffe",
    "deterministic": False, "model": "resnet20", "optimizer": "momentum", "global_batch_size": 128,
    "accumulation_steps": 2, "gradient_compression": "fp16", "label_smoothing": 0.1, "epochs": 4,
    "warmup_epochs": 2, "base_learning_rate": 0.1, "peak_learning_rate": 3.0,
    "warmup_start_learning_rate": 0.1, "end_learning_rate": 0.01, "schedule": "cosine", "decay_power": 1.0,
    "decay_boundaries_epochs": (1.0,), "decay_factor": 0.5, "momentum": 0.8, "weight_decay": 0.0,
    "eta": 0.002, "trust_ratio_mode": "update", "momentum_correction": "warmup", "exclude_bn_and_bias": True,
    "epsilon": 1e-5, "seed": 1, "max_train_examples": 1000, "validation_examples": 100, "steps_per_epoch": 5,
}  # fmt: skip
# The entry of the resolved settings through which a change of a setting shows.
ENTRY = {
    "image_size": "input_shape", "max_train_examples": "train_examples", "warmup_epochs": "warmup_steps",
    "decay_boundaries_epochs": "decay_boundaries_steps", "base_learning_rate": "peak_learning_rate",
}  # fmt: skip


def _plan(config, world_size=1):
    # Over a data set of 6,400 images of 28 x 28 x 1 (or --image_size), less --validation_examples.
    examples = min(6400 - config.validation_examples, config.max_train_examples or 6400)
    side = config.image_size or 28
    return make_plan(config, world_size, examples, input_shape=(side, side, 1))


@pytest.mark.parametrize("name", sorted(set(PLAN_SETTINGS) - {"precision"}))
def test_a_resume_refuses_each_change_of_the_plan_unless_named(name):
    old = _config()
    recorded = _plan(old).settings
    new = dataclasses.replace(old, **{name: CHANGED[name]})
    if name == "base_learning_rate":
        new = dataclasses.replace(new, peak_learning_rate=0.0)
    plan = _plan(new)
    changes = plan_changes(recorded, plan)
    assert any(c.startswith(f"{ENTRY.get(name, name)} ") for c in changes), changes
    assert (
        plan_changes(recorded, plan, allowed=(name,)) == plan_changes(recorded, plan, allowed=("any",)) == []
    )


def test_plans_are_compared_by_meaning_and_a_default_is_the_value_it_stands_for(tmp_path, monkeypatch):
    old = _config(global_batch_size=32, data_dir=str(tmp_path), warmup_epochs=1, peak_learning_rate=0.125)
    recorded = _plan(old).settings
    (tmp_path / "link").symlink_to(tmp_path)
    same = [
        dict(global_batch_size=0, per_rank_batch_size=32),  # on 1 rank: a global batch of 32
        dict(data_dir=f"{tmp_path}/link/"),  # the same folder
        dict(peak_learning_rate=0.0, base_learning_rate=1.0),  # 1.0 per 256 images at 32: 0.125
        dict(max_train_examples=6400),  # all of them
        dict(image_size=28),  # the data set's own
        # Logging, checkpoint and thread settings are not part of the plan.
        dict(verbose=0, checkpoint_every_steps=7, keep_checkpoints=9),
        dict(intra_op_threads=1, max_eval_examples=5),
        dict(workdir="/elsewhere", run_name="r", eval_every_epochs=2, async_checkpoints=False),
    ]  # fmt: skip
    for change in same:
        assert plan_changes(recorded, _plan(dataclasses.replace(old, **change))) == [], change
    # On 2 ranks the same per-rank batch is a global batch of 64: another plan.
    two_ranks = _plan(dataclasses.replace(old, global_batch_size=0, per_rank_batch_size=32), world_size=2)
    assert plan_changes(recorded, two_ranks)[0] == "global_batch_size 32 -> 64"
    # After `make train` (no --data_dir), `--data_dir=/usr/share/datasets/fashion-mnist` is the same plan.
    folder = "/usr/share/datasets/fashion-mnist"
    default, spelled = _plan(_config()), _plan(_config(data_dir=folder))
    assert default.settings == spelled.settings and default.settings["data_dir"] == os.path.realpath(folder)
    assert plan_changes(default.settings, _plan(_config(data_dir=str(tmp_path)))) == [
        f"data_dir {os.path.realpath(folder)!r} -> {str(tmp_path)!r}"
    ]
    # ImageNet's default folder is tensorflow-datasets' ($TFDS_DATA_DIR); other data sets record none.
    monkeypatch.setenv("TFDS_DATA_DIR", str(tmp_path))
    imagenet = _config(dataset="imagenet2012")
    assert _plan(imagenet).settings == _plan(dataclasses.replace(imagenet, data_dir=str(tmp_path))).settings
    assert _plan(_config(dataset="synthetic")).settings["data_dir"] == ""
    # The step schedule without boundaries: Goyal et al.'s epochs 30, 60, 80 of 90 (100 steps per epoch).
    step = _config(schedule="step", epochs=90)
    goyal = _plan(dataclasses.replace(step, decay_boundaries_epochs=(30.0, 60.0, 80.0)))
    assert _plan(step).settings == goyal.settings
    assert goyal.settings["decay_boundaries_steps"] == [3000, 6000, 8000]
    assert plan_changes(_plan(step).settings, _plan(dataclasses.replace(step, schedule="cosine"))) == [
        "schedule 'step' -> 'cosine'",
        "decay_boundaries_steps [3000, 6000, 8000] -> [] (set by decay_boundaries_epochs, schedule, epochs, "
        "steps_per_epoch, global_batch_size, dataset, data_dir, max_train_examples, validation_examples)",
    ]


def test_a_resume_names_every_change_and_a_named_setting_accepts_what_it_explains_and_nothing_else():
    # Precision compared as resolved.
    old = _config(precision="float32")
    new = _config(precision="mixed_bfloat16", schedule="cosine", weight_decay=0.0)
    assert plan_changes(_plan(old).settings, _plan(new)) == [
        "precision 'float32' -> 'mixed_bfloat16'",
        "schedule 'mlperf_poly' -> 'cosine'",
        "weight_decay 0.0005 -> 0.0",
    ]
    # An entry the checkpoint does not record is a change too.
    recorded = {k: v for k, v in _plan(old).settings.items() if k != "input_shape"}
    assert plan_changes(recorded, _plan(old)) == [
        "input_shape None -> [28, 28, 1] (set by image_size, dataset, model)"
    ]
    # A change of the global batch changes the steps it sets.
    old = _config(global_batch_size=32)
    recorded = _plan(old).settings
    bigger = _plan(dataclasses.replace(old, global_batch_size=64))
    assert plan_changes(recorded, bigger) == [
        "global_batch_size 32 -> 64",
        "steps_per_epoch 200 -> 100",
        "warmup_steps 200 -> 100 (set by warmup_epochs, steps_per_epoch, global_batch_size, dataset, "
        "data_dir, max_train_examples, validation_examples)",
    ]
    # Named, the global batch accepts those; a smaller data set it explains neither, nor the steps it changes.
    smaller = _plan(dataclasses.replace(old, global_batch_size=64, max_train_examples=3200))
    assert plan_changes(recorded, smaller, allowed=("global_batch_size",)) == [
        "train_examples 6400 -> 3200 (set by dataset, data_dir, max_train_examples, validation_examples)"
    ]


def test_a_fraction_of_an_epoch_is_never_zero_steps():
    cases = [(0.5, 1, 1), (0.01, 10, 1), (0, 5, 0), (0.5, 3, 2), (1.25, 4, 5), (2, 7, 14)]
    assert [steps_in_epochs(epochs, per_epoch) for epochs, per_epoch, _ in cases] == [s for *_, s in cases]
    plan = make_plan(_config(warmup_epochs=0.5, steps_per_epoch=1, epochs=5), 1, 6400)
    assert plan.warmup_steps == 1 and plan.total_steps == 5


def test_each_dataset_reads_the_settings_its_entry_declares_and_no_other():
    from hvd_lars.data import DATASETS, InputRequest, get_input
    from hvd_lars.training import faults, threads

    for name, entry in DATASETS.items():
        # The settings a data set reads are options it takes, and settings of the run.
        assert set(DATASET_SETTINGS[name]) <= set(FIELDS) & set(entry.option_names()), name
        # Left at their defaults, the settings other data sets read pass, and are not given.
        config = _config(dataset=name, data_dir="/data" if name == "image_folder" else "")
        config.validate()
        assert input_options(config) == {s: getattr(config, s) for s in DATASET_SETTINGS[name]}
    config = _config(image_size=0, preprocessing="", skip_corrupt=False, max_train_examples=64, seed=3)
    assert input_options(config) == {"validation_examples": 0}
    request = input_request(config, 8, 1, 2, "/runs/r")
    assert request == InputRequest(
        per_rank_batch=8, rank=1, world_size=2, seed=3, data_dir="", max_train_examples=64,
        input_threads=threads.threads_per_rank(), run_dir="/runs/r", on_unreadable=faults.note_unreadable,
    )  # fmt: skip
    data = get_input(config.dataset, request, **input_options(config))
    assert (data.input_shape, data.num_train_examples) == ((28, 28, 1), 64)
    assert input_options(_config(dataset="synthetic", image_size=16)) == {"image_size": 16}


def test_the_names_the_flags_accept_are_the_librarys():
    # config.py copies them so that a typo is refused before TensorFlow is imported.
    from hvd_lars.data import DATASETS
    from hvd_lars.data.preprocessing import PREPROCESSINGS
    from hvd_lars.models import MODELS
    from hvd_lars.optim import lars, schedules
    from hvd_lars.parallel import collectives

    assert sorted(settings_table.DATASET_SETTINGS) == sorted(DATASETS)
    assert sorted(settings_table.MODELS) == sorted(MODELS)
    assert sorted(settings_table.PREPROCESSINGS) == sorted(PREPROCESSINGS)
    assert sorted(settings_table.SCHEDULES) == sorted(schedules.SCHEDULES)
    assert settings_table.TRUST_RATIO_MODES == lars.TRUST_RATIO_MODES
    assert settings_table.MOMENTUM_CORRECTIONS == lars.MOMENTUM_CORRECTIONS
    assert settings_table.GRADIENT_REDUCTIONS == collectives.GRADIENT_REDUCTIONS
    assert settings_table.GRADIENT_COMPRESSIONS == collectives.GRADIENT_COMPRESSIONS
