"""Every flagfile parses into a valid configuration; smoke.flags runs end to end."""

import glob
import json
import os
import re
import sys

import pytest
from absl import flags

from hvd_lars import main
from hvd_lars.data import DATASETS
from hvd_lars.models import MODELS
from hvd_lars.training.plan import make_plan
from tests.support import REPO
from tests.support.main_server import run_main

FLAGFILES = sorted(glob.glob(os.path.join(REPO, "flags", "*.flags")))
# Training-set sizes the plans are checked against (ImageNet-1k: 1,281,167 images).
TRAIN_EXAMPLES = {"imagenet2012": 1281167, "fashion_mnist": 60000, "synthetic": 1281167}


def _parse(path):
    flags.FLAGS.unparse_flags()
    flags.FLAGS(["hvd_lars", f"--flagfile={path}"])
    return main.config_from_flags()


@pytest.mark.unit
@pytest.mark.parametrize("path", FLAGFILES, ids=os.path.basename)
def test_flagfile_parses_and_plans(path):
    text = open(path).read()
    header = [line for line in text.splitlines() if line.startswith("#")]
    # The header states the command, the hardware and the expected outcome.
    for word in ("Command:", "Hardware:", "Expected:"):
        assert any(word in line for line in header), f"{path} header lacks {word!r}"
    config = _parse(path)
    assert config.model in MODELS and config.dataset in DATASETS
    config.validate()
    plan = make_plan(config, 1, TRAIN_EXAMPLES[config.dataset])
    assert 0 <= plan.warmup_steps < plan.total_steps
    if config.dataset == "imagenet2012":
        # The paper's global batches, and 90 or 100 epochs.
        assert plan.global_batch_size in (512, 8192, 32768) and plan.epochs in (90, 100)
        assert plan.steps_per_epoch == (config.steps_per_epoch or 1281167 // plan.global_batch_size)


def _header_and_flags(path):
    lines = open(path).read().splitlines()
    return [line for line in lines if line.startswith("#")], [line for line in lines if line.startswith("--")]


@pytest.mark.unit
@pytest.mark.parametrize("path", FLAGFILES, ids=os.path.basename)
def test_every_flag_has_a_source_in_the_header(path):
    header, flag_lines = _header_and_flags(path)
    starts = [i for i, line in enumerate(header) if line.startswith("# Sources")]
    assert starts, f"{path} has no '# Sources' section"
    sources = "\n".join(header[starts[0] :])
    missing = [f for f in flag_lines if not re.search(re.escape(f.split("=")[0]) + r"(?![\w-])", sources)]
    assert not missing, f"{path}: no source given for {missing}"


@pytest.mark.unit
@pytest.mark.parametrize("path", FLAGFILES, ids=os.path.basename)
def test_the_papers_processors_run_float32(path):
    header, _ = _header_and_flags(path)
    text = "\n".join(header)
    if "Xeon Platinum 8160" in text or "Xeon Phi 7250" in text:
        # Neither has bfloat16 units: the paper's arithmetic is float32; a line says what bfloat16 changes.
        assert _parse(path).precision == "float32"
        assert any(line.startswith("# Precision:") and "bfloat16" in line for line in header), path


@pytest.mark.unit
def test_alexnet_flagfiles_run_as_the_papers_caffe():
    for name, preprocessing in [
        ("alexnet_bn_bs32k", "caffe_scaled"), ("alexnet_bn_bs512", "caffe_scaled"), ("alexnet_bs8k", "caffe"),
    ]:  # fmt: skip
        config = _parse(os.path.join(REPO, "flags", f"{name}.flags"))
        assert (config.preprocessing, config.image_size) == (preprocessing, 227), name
        assert config.momentum_correction == "none", name  # Intel Caffe's fused SGD update
        assert config.schedule == "paper_poly" and config.trust_ratio_mode == "paper", name


@pytest.mark.unit
def test_paper_32k_numbers():
    config = _parse(os.path.join(REPO, "flags", "alexnet_bn_bs32k.flags"))
    plan = make_plan(config, 2048, 1281167)
    # The released solver's iterations: max_iter 4000, warmup_iter 400.
    assert (plan.per_rank_batch_size, plan.steps_per_epoch, plan.total_steps) == (16, 40, 4000)
    assert plan.warmup_steps == 400
    assert plan.peak_learning_rate == 32 and config.schedule == "paper_poly"
    config = _parse(os.path.join(REPO, "flags", "resnet50_bs8k_momentum.flags"))
    assert make_plan(config, 256, 1281167).peak_learning_rate == pytest.approx(3.2)  # 0.1 x 8192 / 256


@pytest.mark.horovod
def test_smoke_flags_run_end_to_end(tmp_path):
    cmd = [sys.executable, "-m", "hvd_lars.main", "--flagfile=flags/smoke.flags", f"--workdir={tmp_path}"]
    result = run_main(cmd, cwd=REPO, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert re.search(
        r"global batch 32 = 1 ranks x per-rank batch 32 x accumulation 1; 3 steps per epoch", result.stdout
    )
    summary = json.loads((tmp_path / "smoke" / "summary.json").read_text())
    assert summary["plan"]["total_steps"] == 6 and len(summary["epochs"]) == 2
    assert summary["threads"]["intra_op"] == os.cpu_count()  # one process: every core, read back from TF
    checkpoints = sorted(f for f in os.listdir(tmp_path / "smoke" / "checkpoints") if f.endswith(".index"))
    assert checkpoints == ["ckpt-2.index", "ckpt-3.index", "ckpt-4.index", "ckpt-6.index"][-3:]


def _predicted_line(header):
    """The `# Predicted:` header line with its indented continuation lines, as one line ('' if none)."""
    for i, line in enumerate(header):
        if line.startswith("# Predicted:"):
            parts = [line[2:]]
            for more in header[i + 1 :]:
                if not more.startswith("#           "):
                    break
                parts.append(more[1:].strip())
            return " ".join(parts)
    return ""


@pytest.mark.unit
def test_paper_flagfiles_state_the_time_to_train_models_prediction():
    from benchmarks import time_to_train

    pattern = re.compile(
        r"Predicted: (\d+) ranks x per-rank batch (\d+) x accumulation (\d+) = (\d+); on \d+ (.+?) sockets .*"
        r"a step of [\d.]+ m?s and [\d.]+ minutes to train"
    )
    for name, (_, ranks, per_rank, socket) in time_to_train.FLAGFILES.items():
        path = os.path.join(REPO, "flags", f"{name}.flags")
        header, _ = _header_and_flags(path)
        found = pattern.search(_predicted_line(header))
        rebuild = "python -m benchmarks.time_to_train --update_flagfiles"
        assert found, f"{name}: no '# Predicted:' line ({rebuild})"
        r, b, a, g = (int(x) for x in found.groups()[:4])
        plan = make_plan(_parse(path), r, TRAIN_EXAMPLES["imagenet2012"])
        assert (r, b, a) == (ranks, per_rank, 1) and r * b * a == g == plan.global_batch_size, name
        assert (plan.per_rank_batch_size, plan.accumulation_steps) == (b, a), name
        # The hardware of the prediction is the hardware the header names.
        chip = time_to_train.SOCKETS[socket].name
        assert found.group(5) == chip and chip.split()[-1] in " ".join(header).split("Predicted:")[0], name
