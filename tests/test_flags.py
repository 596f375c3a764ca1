"""Every flagfile parses, plans and states its sources; the paper's flagfiles give the paper's numbers."""

import glob
import os
import re

import pytest
from absl import flags

from hvd_lars import main
from hvd_lars.training.plan import make_plan
from tests.support import REPO

pytestmark = pytest.mark.unit

FLAGFILES = sorted(glob.glob(os.path.join(REPO, "flags", "*.flags")))
IMAGENET = 1281167  # ImageNet-1k's training images
TRAIN_EXAMPLES = {"imagenet2012": IMAGENET, "fashion_mnist": 60000, "synthetic": IMAGENET}


def _parse(name):
    flags.FLAGS.unparse_flags()
    flags.FLAGS(["hvd_lars", f"--flagfile={os.path.join(REPO, 'flags', name + '.flags')}"])
    return main.config_from_flags()


@pytest.mark.parametrize("path", FLAGFILES, ids=os.path.basename)
def test_flagfile_parses_plans_and_states_its_sources(path):
    lines = open(path).read().splitlines()
    header, flag_lines = [x for x in lines if x.startswith("#")], [x for x in lines if x.startswith("--")]
    for word in ("Command:", "Hardware:", "Expected:"):
        assert any(word in line for line in header), f"{path} header lacks {word!r}"
    starts = [i for i, line in enumerate(header) if line.startswith("# Sources")]
    assert starts, f"{path} has no '# Sources' section"
    sources = "\n".join(header[starts[0] :])
    missing = [f for f in flag_lines if not re.search(re.escape(f.split("=")[0]) + r"(?![\w-])", sources)]
    assert not missing, f"{path}: no source given for {missing}"
    config = _parse(os.path.basename(path)[: -len(".flags")])
    config.validate()
    plan = make_plan(config, 1, TRAIN_EXAMPLES[config.dataset])
    assert 0 <= plan.warmup_steps < plan.total_steps
    if config.dataset == "imagenet2012":  # the paper's global batches, and 90 or 100 epochs
        assert plan.global_batch_size in (512, 8192, 32768) and plan.epochs in (90, 100)
        assert plan.steps_per_epoch == (config.steps_per_epoch or IMAGENET // plan.global_batch_size)
    if "Xeon Platinum 8160" in "\n".join(header) or "Xeon Phi 7250" in "\n".join(header):
        # Neither has bfloat16 units: the paper's arithmetic is float32; a line says what bfloat16 changes.
        assert config.precision == "float32"
        assert any(line.startswith("# Precision:") and "bfloat16" in line for line in header), path


def test_paper_numbers_and_the_alexnets_run_as_the_papers_caffe():
    for name, preprocessing in [("alexnet_bn_bs32k", "caffe_scaled"), ("alexnet_bn_bs512", "caffe_scaled"),
                                ("alexnet_bs8k", "caffe")]:  # fmt: skip
        config = _parse(name)
        assert (config.preprocessing, config.image_size) == (preprocessing, 227), name
        assert config.momentum_correction == "none", name  # Intel Caffe's fused SGD update
        assert config.schedule == "paper_poly" and config.trust_ratio_mode == "paper", name
    # The released 32K solver's iterations: max_iter 4000, warmup_iter 400, base_lr 32.
    plan = make_plan(_parse("alexnet_bn_bs32k"), 2048, IMAGENET)
    steps = (plan.per_rank_batch_size, plan.steps_per_epoch, plan.total_steps, plan.warmup_steps)
    assert steps == (16, 40, 4000, 400) and plan.peak_learning_rate == 32
    assert make_plan(_parse("resnet50_bs8k_momentum"), 256, IMAGENET).peak_learning_rate == pytest.approx(3.2)


def test_paper_flagfiles_state_the_time_to_train_models_prediction():
    from benchmarks import time_to_train

    pattern = re.compile(
        r"# Predicted: (\d+) ranks x per-rank batch (\d+) x accumulation (\d+) = (\d+); on \d+ (.+?) sockets "
        r".*a step of [\d.]+ m?s and [\d.]+ minutes to train"
    )
    for name, (_, ranks, per_rank, socket) in time_to_train.FLAGFILES.items():
        text = open(os.path.join(REPO, "flags", f"{name}.flags")).read()
        # The `# Predicted:` line with its indented continuation lines, as one line.
        found = pattern.search(re.sub(r"\n#           ", " ", text))
        assert found, f"{name} lacks '# Predicted:' (python -m benchmarks.time_to_train --update_flagfiles)"
        r, b, a, g = (int(x) for x in found.groups()[:4])
        plan = make_plan(_parse(name), r, IMAGENET)
        assert (r, b, a) == (ranks, per_rank, 1) and r * b * a == g == plan.global_batch_size, name
        assert (plan.per_rank_batch_size, plan.accumulation_steps) == (b, a), name
        # The hardware of the prediction is the hardware the header names.
        chip = time_to_train.SOCKETS[socket].name
        assert found.group(5) == chip and chip.split()[-1] in text.split("# Predicted:")[0], name
