"""Each setting declared once (config.py): every value is checked by its declaration, a resume compares the
plan it makes (plan.py) by meaning, and epochs never turn into 0 steps silently."""

import dataclasses
import math
import os

import pytest

from hvd_lars.arguments import Range
from hvd_lars.optim.scaling import steps_in_epochs
from hvd_lars.training.config import PLAN_SETTINGS, TrainConfig
from hvd_lars.training.plan import make_plan, plan_changes

pytestmark = pytest.mark.unit

FIELDS = {f.name: f for f in dataclasses.fields(TrainConfig)}
NUMERIC = [
    f.name for f in FIELDS.values() if f.type in (int, float) and isinstance(f.metadata["accepted"], Range)
]


def _config(**kw):
    base = dict(peak_learning_rate=2.0, global_batch_size=64, epochs=3, warmup_epochs=1)
    base.update(kw)
    return TrainConfig(**base)


@pytest.mark.parametrize("name", NUMERIC)
@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan, -1])
def test_every_numeric_setting_refuses_non_finite_and_negative_values_naming_itself(name, bad):
    if bad == -1 and FIELDS[name].metadata["accepted"].low < -1:
        pytest.skip(f"{name} accepts -1")
    with pytest.raises(ValueError) as info:
        _config(**{name: bad}).validate()
    message = str(info.value)
    assert f"--{name}" in message and repr(bad) in message and "\n" not in message


@pytest.mark.parametrize(
    "name, value, fragment",
    [
        ("epochs", math.inf, "--epochs must be a whole number > 0, got inf."),
        ("intra_op_threads", -1, "--intra_op_threads must be a whole number >= 0, got -1."),
        ("input_threads", -2, "--input_threads must be a whole number >= 0, got -2."),
        ("seed", -1, "--seed must be a whole number >= 0, got -1."),
        ("max_eval_examples", -1, "--max_eval_examples must be a whole number >= 0, got -1."),
        ("eta", math.inf, "--eta must be a finite number > 0, got inf."),
        ("epochs", 2.5, "--epochs must be a whole number > 0, got 2.5."),
        ("optimizer", "adam", "--optimizer='adam'; valid: lars, momentum, nesterov."),
        ("decay_boundaries_epochs", (1.0, math.inf), "--decay_boundaries_epochs=[1.0, inf]: each must be"),
        ("allow_plan_change", ("workdir",), "--allow_plan_change names workdir, which are not settings"),
    ],
)
def test_bad_values_are_one_line_naming_flag_and_value(name, value, fragment):
    with pytest.raises(ValueError) as info:
        _config(**{name: value}).validate()
    assert fragment in str(info.value)


# A value other than the default for each setting of the plan (precision: compared as resolved).
CHANGED = {
    "dataset": "synthetic", "data_dir": "/elsewhere", "image_size": 32, "preprocessing": "caffe",
    "deterministic": False, "model": "resnet20", "optimizer": "momentum", "global_batch_size": 128,
    "accumulation_steps": 2, "gradient_compression": "fp16", "label_smoothing": 0.1, "epochs": 4,
    "warmup_epochs": 2, "base_learning_rate": 0.1, "peak_learning_rate": 3.0, "warmup_start_learning_rate":
    0.1,
    "end_learning_rate": 0.01, "schedule": "cosine", "decay_power": 1.0, "decay_boundaries_epochs": (1.0,),
    "decay_factor": 0.5, "momentum": 0.8, "weight_decay": 0.0, "eta": 0.002, "trust_ratio_mode": "update",
    "momentum_correction": "warmup", "exclude_bn_and_bias": True, "epsilon": 1e-5, "seed": 1,
    "max_train_examples": 1000, "validation_examples": 100, "steps_per_epoch": 5,
}  # fmt: skip


def _plan(config, world_size=1):
    # The plan of `config` over a data set of 6,400 images of 28 x 28 x 1 (or --image_size), as the input
    # pipeline would give them: --validation_examples held out, then --max_train_examples kept.
    examples = min(6400 - config.validation_examples, config.max_train_examples or 6400)
    side = config.image_size or 28
    return make_plan(config, world_size, examples, input_shape=(side, side, 1))


# The entry of the resolved settings through which a change of a setting shows.
ENTRY = {
    "image_size": "input_shape", "max_train_examples": "train_examples", "warmup_epochs": "warmup_steps",
    "decay_boundaries_epochs": "decay_boundaries_steps", "base_learning_rate": "peak_learning_rate",
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(set(PLAN_SETTINGS) - {"precision"}))
def test_a_resume_refuses_each_change_of_the_plan_unless_named(name):
    old = _config()
    recorded = _plan(old).settings
    new = dataclasses.replace(old, **{name: CHANGED[name]})
    if name == "base_learning_rate":
        new = dataclasses.replace(new, peak_learning_rate=0.0)
    plan = _plan(new)
    changes = plan_changes(recorded, plan)
    entry = ENTRY.get(name, name)
    assert any(c.startswith(f"{entry} ") for c in changes), changes
    assert plan_changes(recorded, plan, allowed=(name,)) == []
    assert plan_changes(recorded, plan, allowed=("any",)) == []


def test_a_resume_compares_precision_as_resolved_and_names_every_change():
    old = _config(precision="float32")
    new = _config(precision="mixed_bfloat16", schedule="cosine", weight_decay=0.0)
    assert plan_changes(_plan(old).settings, _plan(new)) == [
        "precision 'float32' -> 'mixed_bfloat16'",
        "schedule 'mlperf_poly' -> 'cosine'",
        "weight_decay 0.0005 -> 0.0",
    ]
    assert plan_changes(_plan(old).settings, _plan(old)) == []
    nesterov = _config(optimizer="nesterov")
    assert plan_changes(_plan(nesterov).settings, _plan(_config(optimizer="momentum"))) == [
        "optimizer 'nesterov' -> 'momentum'"
    ]
    # An entry the checkpoint does not record is a change too.
    recorded = {k: v for k, v in _plan(old).settings.items() if k != "input_shape"}
    assert plan_changes(recorded, _plan(old)) == [
        "input_shape None -> [28, 28, 1] (set by image_size, dataset, model)"
    ]


def test_plans_are_compared_by_meaning_not_by_spelling(tmp_path):
    # The same plan spelled otherwise is the same plan.
    old = _config(global_batch_size=32, data_dir=str(tmp_path), warmup_epochs=1, peak_learning_rate=0.125)
    recorded = _plan(old).settings
    (tmp_path / "link").symlink_to(tmp_path)
    same = [
        dict(global_batch_size=0, per_rank_batch_size=32),  # on 1 rank: a global batch of 32
        dict(data_dir=f"{tmp_path}/link/"),  # the same folder
        dict(peak_learning_rate=0.0, base_learning_rate=1.0),  # 1.0 per 256 images at 32: 0.125
        dict(max_train_examples=6400),  # all of them
        dict(image_size=28),  # the data set's own
        dict(warmup_epochs=200 / 200),
        # Logging, checkpoint and thread settings are not part of the plan.
        dict(
            verbose=0, checkpoint_every_steps=7, keep_checkpoints=9, intra_op_threads=1, max_eval_examples=5
        ),
        dict(workdir="/elsewhere", run_name="r", eval_every_epochs=2, async_checkpoints=False),
    ]
    for change in same:
        assert plan_changes(recorded, _plan(dataclasses.replace(old, **change))) == [], change
    # On 2 ranks the same per-rank batch is a global batch of 64: another plan.
    two_ranks = _plan(dataclasses.replace(old, global_batch_size=0, per_rank_batch_size=32), world_size=2)
    assert plan_changes(recorded, two_ranks)[0] == "global_batch_size 32 -> 64"


def test_a_default_that_stands_for_a_value_is_the_plan_of_that_value_spelled_out(tmp_path, monkeypatch):
    # After `make train` (no --data_dir), `--data_dir=/usr/share/datasets/fashion-mnist` is the same plan.
    folder = "/usr/share/datasets/fashion-mnist"
    default, spelled = _plan(_config()), _plan(_config(data_dir=folder))
    assert default.settings == spelled.settings and default.settings["data_dir"] == os.path.realpath(folder)
    assert plan_changes(default.settings, spelled) == plan_changes(spelled.settings, default) == []
    assert plan_changes(default.settings, _plan(_config(data_dir=str(tmp_path)))) == [
        f"data_dir {os.path.realpath(folder)!r} -> {str(tmp_path)!r}"
    ]
    # ImageNet's default folder is tensorflow-datasets' ($TFDS_DATA_DIR).
    monkeypatch.setenv("TFDS_DATA_DIR", str(tmp_path))
    imagenet = _config(dataset="imagenet2012")
    assert _plan(imagenet).settings == _plan(dataclasses.replace(imagenet, data_dir=str(tmp_path))).settings
    # Data sets without a default folder record none.
    assert _plan(_config(dataset="synthetic")).settings["data_dir"] == ""
    assert _plan(_config(dataset="image_folder")).settings["data_dir"] == ""
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


def test_naming_a_setting_accepts_what_it_explains_and_nothing_else():
    old = _config(global_batch_size=32)
    recorded = _plan(old).settings
    bigger = _plan(dataclasses.replace(old, global_batch_size=64))
    assert plan_changes(recorded, bigger) == [
        "global_batch_size 32 -> 64",
        "steps_per_epoch 200 -> 100",
        "warmup_steps 200 -> 100 (set by warmup_epochs, steps_per_epoch, global_batch_size, dataset, "
        "data_dir, max_train_examples, validation_examples)",
    ]
    assert plan_changes(recorded, bigger, allowed=("global_batch_size",)) == []
    # A smaller data set as well: the global batch explains neither it nor the steps it changes.
    smaller = _plan(dataclasses.replace(old, global_batch_size=64, max_train_examples=3200))
    changes = plan_changes(recorded, smaller, allowed=("global_batch_size",))
    assert changes == ["train_examples 6400 -> 3200 (set by dataset, data_dir, max_train_examples, "
                       "validation_examples)"]  # fmt: skip


@pytest.mark.parametrize(
    "epochs, steps_per_epoch, steps",
    [(0.5, 1, 1), (0.01, 10, 1), (0, 5, 0), (0.5, 3, 2), (1.25, 4, 5), (2, 7, 14)],
)
def test_a_fraction_of_an_epoch_is_never_zero_steps(epochs, steps_per_epoch, steps):
    assert steps_in_epochs(epochs, steps_per_epoch) == steps


def test_warmup_of_half_an_epoch_of_one_step_is_one_step():
    plan = make_plan(_config(warmup_epochs=0.5, steps_per_epoch=1, epochs=5), 1, 6400)
    assert plan.warmup_steps == 1 and plan.total_steps == 5
