"""benchmarks/large_batch_study.py: the sweep's decisions, each run's flags, and the whole study on a tiny
grid (through the real main program) killed in a run, resumed, and started again with nothing to do."""

import json
import os
import subprocess
import sys

import pytest

from benchmarks import large_batch_study as study
from benchmarks.common import HAND_WRITTEN
from tests.support import REPO


@pytest.mark.unit
@pytest.mark.parametrize(
    "scores, max_extensions, expected",
    [
        ({}, 2, -1),  # the first sweep, in order: k = -1, 0, 1
        ({-1: 0.8}, 2, 0),
        ({-1: 0.8, 0: 0.9}, 2, 1),
        ({-1: 0.8, 0: 0.9, 1: 0.85}, 2, None),  # best inside: done
        ({-1: 0.9, 0: 0.85, 1: 0.8}, 2, -2),  # best at the low edge: one lower
        ({-2: 0.88, -1: 0.9, 0: 0.85, 1: 0.8}, 2, None),
        ({-1: 0.7, 0: 0.8, 1: 0.9}, 2, 2),  # best at the high edge: one higher
        ({-1: 0.7, 0: 0.8, 1: 0.9, 2: 0.91}, 2, 3),
        ({-1: 0.7, 0: 0.8, 1: 0.9, 2: 0.91, 3: 0.92}, 2, None),  # extensions spent
        ({-1: 0.9, 0: 0.8, 1: 0.7}, 0, None),
        ({-1: 0.9, 0: 0.9, 1: 0.7}, 2, -2),  # a tie goes to the smaller rate
    ],
)
def test_sweep_decisions(scores, max_extensions, expected):
    assert study.next_sweep_index(scores, 3, max_extensions) == expected


@pytest.mark.unit
def test_chosen_rate_and_ties():
    assert study.chosen_index({-1: 0.8, 0: 0.9, 1: 0.85}) == 0
    assert study.chosen_index({-1: 0.9, 0: 0.9}) == -1


@pytest.mark.unit
def test_run_flags_follow_the_rules():
    args = study.parse_args(["--output_dir=/tmp/x"])
    assert args.batches == [8192, 2048, 512] and args.epochs == 12 and args.seeds == 2
    momentum = study.main_flags(args, study.Cell("momentum", 2048, 1, 0))
    # Linear scaling: 0.2 per 256 images is a peak of 1.6 at 2,048 (the main program scales it).
    assert "--base_learning_rate=0.2" in momentum and "--optimizer=momentum" in momentum
    assert study.ARMS["momentum"].peak(0.2, 2048) == pytest.approx(1.6)
    lars = study.main_flags(args, study.Cell("lars", 8192, -1, 1))
    assert "--peak_learning_rate=20" in lars and "--eta=0.001" in lars and "--seed=1" in lars
    for flags in (momentum, lars):
        assert {"--precision=float32", "--deterministic", "--validation_examples=5000"} <= set(flags)
        assert {"--weight_decay=0.0005", "--epochs=12", "--warmup_epochs=1", "--schedule=mlperf_poly"} <= set(
            flags
        )
    # Steps per epoch rounded: 55,000 / 8,192 = 6.7 -> 7 updates (57,344 images), not 6 (49,152).
    assert "--steps_per_epoch=7" in lars and "--steps_per_epoch=27" in momentum
    assert "--run_name=hvd_lars_study_lars_b8192_lr20_s1" in lars


@pytest.mark.unit
def test_complete_means_every_epoch_with_both_evaluations():
    epochs = [{"epoch": 1, "val_top1": 0.5, "test_top1": 0.5}, {"epoch": 2, "val_top1": 0.6}]
    assert not study.is_complete({"epochs": epochs}, 2)  # no test score in the last epoch
    epochs[1]["test_top1"] = 0.6
    assert study.is_complete({"epochs": epochs}, 2)
    assert not study.is_complete({"epochs": epochs[:1]}, 2) and not study.is_complete(None, 2)


def _study(tmp_path, *extra):
    command = [sys.executable, "-m", "benchmarks.large_batch_study", f"--output_dir={tmp_path / 'out'}"]
    command += [f"--report={tmp_path / 'r.md'}"]
    # 1 arm, 1 batch, a sweep of 2 rates, then the better one with a second seed: 3 runs of 2 epochs of
    # 4 updates (512 training images, batch 128).
    command += ["--arms=lars", "--batches=128", "--sweep_points=2", "--max_extensions=0", "--seeds=2"]
    command += ["--epochs=2", "--warmup_epochs=0.5", "--max_train_examples=512", "--max_eval_examples=200"]
    command += list(extra)
    environment = dict(os.environ, PYTHONPATH=REPO)
    return subprocess.run(command, cwd=REPO, env=environment, capture_output=True, text=True, timeout=400)


@pytest.mark.horovod
def test_study_killed_resumes_then_redoes_nothing(tmp_path):
    runs = tmp_path / "out" / "runs"
    first = "hvd_lars_study_lars_b128_lr2.5_s0"
    # Every run dies (SIGKILL) after update 6 of 8; its last checkpoint is the end of epoch 1 (step 4).
    kill_at_6 = (
        f"--train_program={os.path.join(REPO, 'tests', 'support', 'kill_at_step.py')} --kill_at_step=6"
    )
    result = _study(tmp_path, kill_at_6)
    assert result.returncode != 0 and f"{first} failed (exit status -9)" in result.stderr
    assert os.listdir(runs) == [first]  # the study stopped at the failed run
    assert [e["epoch"] for e in json.loads((runs / first / "summary.json").read_text())["epochs"]] == [1]

    result = _study(tmp_path)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    log = (tmp_path / "out" / "logs" / f"{first}.log").read_text()
    assert "resumed from" in log and "(step 4)" in log
    summaries = {name: json.loads((runs / name / "summary.json").read_text()) for name in os.listdir(runs)}
    val = {
        k: summaries[f"hvd_lars_study_lars_b128_lr{rate}_s0"]["final_val_top1"]
        for k, rate in ((-1, 2.5), (0, 5))
    }
    chosen_rate = (2.5, 5)[study.chosen_index(val) + 1]
    assert sorted(summaries) == sorted(
        [first, "hvd_lars_study_lars_b128_lr5_s0", f"hvd_lars_study_lars_b128_lr{chosen_rate:g}_s1"]
    )
    for name, summary in summaries.items():
        assert [e["epoch"] for e in summary["epochs"]] == [1, 2]
        assert (
            summary["config"]["precision"] == "float32" and summary["config"]["validation_examples"] == 5000
        )
        assert 0 < summary["final_val_top1"] <= 1 and 0 < summary["final_test_top1"] <= 1
        assert "--run_name=hvd_lars_study_" in (tmp_path / "out" / "logs" / f"{name}.log").read_text()
    report = (tmp_path / "r.md").read_text()
    seed1 = summaries[f"hvd_lars_study_lars_b128_lr{chosen_rate:g}_s1"]["final_test_top1"]
    seed0 = summaries[f"hvd_lars_study_lars_b128_lr{chosen_rate:g}_s0"]["final_test_top1"]
    assert f"| 128 | **{(seed0 + seed1) / 2:.4f}**" in report  # mean test top-1 of the chosen rate's 2 seeds
    assert report.count("| lars | 128 |") == 2 + 2  # 2 sweep rows, 2 seed rows
    assert (tmp_path / "r.png").read_bytes()[:4] == b"\x89PNG"
    attempts = (tmp_path / "out" / "attempts.jsonl").read_text().splitlines()
    assert len(attempts) == 1 + 3  # the killed attempt, then the 3 runs

    # A third start: every run is done; nothing trains, the report is rewritten from the summaries, and a
    # section written by hand at its end stays.
    hand = f"\n{HAND_WRITTEN}\n## Plainly (written by hand from the tables above, today)\n\nLARS held here.\n"
    (tmp_path / "r.md").write_text(report.replace("| lars | 128 |", "| edited |") + hand)
    mtimes = {name: os.path.getmtime(runs / name / "summary.json") for name in summaries}
    result = _study(tmp_path)
    rewritten = (tmp_path / "r.md").read_text()
    assert rewritten.endswith("` |\n" + hand) and rewritten.count(hand) == 1
    assert "| edited |" not in rewritten and rewritten.count("| lars | 128 |") == 2 + 2
    assert result.returncode == 0 and "training" not in result.stdout and "done: 3 runs" in result.stdout
    assert (tmp_path / "out" / "attempts.jsonl").read_text().splitlines() == attempts
    assert {name: os.path.getmtime(runs / name / "summary.json") for name in summaries} == mtimes
