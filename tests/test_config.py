"""Bad configurations are refused before any work, quoting the values; the step plan's arithmetic."""

import pytest

from hvd_lars.training import config as settings_table
from hvd_lars.training.config import DATASET_SETTINGS, TrainConfig, resolve_precision
from hvd_lars.training.plan import input_options, input_request, make_plan

pytestmark = pytest.mark.unit


def _config(**kw):
    base = dict(peak_learning_rate=20.0, global_batch_size=4096, epochs=12, warmup_epochs=1)
    base.update(kw)
    return TrainConfig(**base)


def test_plan_for_the_demo():
    plan = make_plan(_config(), world_size=2, num_train_examples=60000)
    steps = (plan.per_rank_batch_size, plan.steps_per_epoch, plan.total_steps, plan.warmup_steps)
    assert steps == (2048, 14, 168, 14)
    assert "global batch 4096 = 2 ranks x per-rank batch 2048" in plan.describe()


def test_base_learning_rate_is_per_256_images():
    plan = make_plan(_config(peak_learning_rate=0.0, base_learning_rate=1.25), 2, 60000)
    assert plan.peak_learning_rate == pytest.approx(20.0)


@pytest.mark.parametrize(
    "kwargs, world, fragments",
    [
        (dict(global_batch_size=4095), 2, ["4095", "2 ranks"]),
        (dict(warmup_epochs=12), 1, ["--warmup_epochs=12 must be < --epochs=12."]),
        (dict(base_learning_rate=1.0), 1, ["exactly one"]),
        (dict(peak_learning_rate=0.0), 1, ["exactly one"]),
        (dict(momentum=1.0), 1, ["--momentum", "1.0"]),
        (dict(eta=0.0), 1, ["--eta", "0.0"]),
        (dict(gradient_reduction="ring"), 1, ["--gradient_reduction='ring'", "overlap, grouped"]),
        (dict(gradient_compression="bf16"), 1, ["--gradient_compression='bf16'", "none, fp16"]),
        (dict(preprocessing="vgg"), 1, ["--preprocessing='vgg'", "caffe, caffe_scaled, inception"]),
        (dict(momentum_correction="goyal"), 1, ["--momentum_correction='goyal'", "none, warmup, always"]),
        # A data set's settings (`DATASET_SETTINGS`): another's, set, is refused (bad values of one setting:
        # tests/test_settings.py).
        (
            dict(image_size=227, preprocessing="caffe"),
            1,
            [
                "Dataset 'fashion_mnist' does not take --image_size=227, --preprocessing='caffe'; of the "
                "data-set settings it takes --validation_examples."
            ],
        ),
        (
            dict(dataset="synthetic", validation_examples=100, skip_corrupt=True),
            1,
            [
                "'synthetic' does not take --skip_corrupt=True, --validation_examples=100;",
                "takes --image_size.",
            ],
        ),
        (
            dict(dataset="image_folder", validation_examples=5),
            1,
            ["--image_size, --preprocessing, --skip_corrupt"],
        ),
    ],
)
def test_invalid_configs(kwargs, world, fragments):
    with pytest.raises(ValueError) as info:
        config = _config(**kwargs)
        config.validate()
        config.resolve_batch(world)
    for fragment in fragments:
        assert fragment in str(info.value)


def test_global_batch_larger_than_data():
    with pytest.raises(ValueError, match="4096"):
        make_plan(_config(), 1, 1000)


@pytest.mark.parametrize(
    "flags_line, expected",
    [
        ("flags\t\t: fpu avx2 avx512f avx512_bf16 fma", "mixed_bfloat16"),
        ("flags\t\t: fpu amx_bf16 amx_tile", "mixed_bfloat16"),
        ("flags\t\t: fpu avx2 avx512f fma", "float32"),
    ],
)
def test_auto_precision_follows_native_bf16(flags_line, expected, tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(f"processor\t: 0\n{flags_line}\n")
    assert resolve_precision("auto", str(cpuinfo)) == expected
    assert resolve_precision("float32", str(cpuinfo)) == "float32"
    assert resolve_precision("auto", str(tmp_path / "missing")) == "float32"


def test_per_rank_batch_alone_derives_the_global_batch():
    config = TrainConfig(per_rank_batch_size=64, accumulation_steps=4, peak_learning_rate=1.0)
    assert config.resolve_batch(8) == (2048, 64)
    with pytest.raises(ValueError, match="Give --global_batch_size or --per_rank_batch_size"):
        TrainConfig(peak_learning_rate=1.0).validate()


def test_lars_only_flags_refused_for_momentum():
    with pytest.raises(
        ValueError, match="--eta=0.01, --trust_ratio_mode='update' only apply to --optimizer=lars"
    ):
        _config(optimizer="momentum", eta=0.01, trust_ratio_mode="update").validate()
    _config(optimizer="momentum", exclude_bn_and_bias=True).validate()


def test_no_checkpoint_at_all_is_refused():
    with pytest.raises(ValueError, match="--nocheckpoint_at_epoch_end needs --checkpoint_every_steps > 0"):
        _config(checkpoint_at_epoch_end=False).validate()
    _config(checkpoint_at_epoch_end=False, checkpoint_every_steps=5).validate()


def test_each_dataset_reads_the_settings_its_entry_declares_and_no_other():
    import dataclasses

    from hvd_lars.data import DATASETS, InputRequest, get_input
    from hvd_lars.training import faults, threads

    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    for name, entry in DATASETS.items():
        # The settings a data set reads are options it takes, and settings of the run.
        assert set(DATASET_SETTINGS[name]) <= fields & set(entry.option_names()), name
        # Left at their defaults, the settings other data sets read pass, and are not given.
        config = _config(dataset=name)
        config.validate()
        assert input_options(config) == {s: getattr(config, s) for s in DATASET_SETTINGS[name]}
    config = _config(image_size=0, preprocessing="", skip_corrupt=False, max_train_examples=64, seed=3)
    assert input_options(config) == {"validation_examples": 0}
    request = input_request(config, 8, 1, 2, "/runs/r")
    assert request == InputRequest(
        per_rank_batch=8, rank=1, world_size=2, seed=3, data_dir="", max_train_examples=64,
        input_threads=threads.threads_per_rank(), run_dir="/runs/r",
        on_unreadable=faults.note_unreadable,
    )  # fmt: skip
    data = get_input(config.dataset, request, **input_options(config))
    assert (data.input_shape, data.num_train_examples) == ((28, 28, 1), 64)
    synthetic = input_options(_config(dataset="synthetic", image_size=16))
    assert synthetic == {"image_size": 16}


def test_the_names_the_flags_accept_are_the_librarys():
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
