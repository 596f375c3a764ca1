"""benchmarks/large_batch_study.py: the sweep's decisions, each run's flags, which part a selection trains,
what a study started again skips (fake run records), the report of a half-done study, and the whole study on
a tiny grid (through the real main program) killed in a run, resumed, and started again with nothing to do."""

import json
import os
import shutil
import subprocess
import sys

import pytest

from benchmarks import large_batch_report
from benchmarks import large_batch_study as study
from benchmarks.common import HAND_WRITTEN, NOT_RECORDED
from tests.support import REPO


@pytest.mark.unit
@pytest.mark.parametrize(
    "scores, max_extensions, start, expected",
    [
        ({}, 2, 0, -1),  # the first sweep, in order: k = -1, 0, 1
        ({-1: 0.8}, 2, 0, 0),
        ({-1: 0.8, 0: 0.9}, 2, 0, 1),
        ({-1: 0.8, 0: 0.9, 1: 0.85}, 2, 0, None),  # best inside: done
        ({-1: 0.9, 0: 0.85, 1: 0.8}, 2, 0, -2),  # best at the low edge: one lower
        ({-2: 0.88, -1: 0.9, 0: 0.85, 1: 0.8}, 2, 0, None),
        ({-1: 0.7, 0: 0.8, 1: 0.9}, 2, 0, 2),  # best at the high edge: one higher
        ({-1: 0.7, 0: 0.8, 1: 0.9, 2: 0.91}, 2, 0, 3),
        ({-1: 0.7, 0: 0.8, 1: 0.9, 2: 0.91, 3: 0.92}, 2, 0, None),  # extensions spent
        ({-1: 0.9, 0: 0.8, 1: 0.7}, 0, 0, None),
        ({-1: 0.9, 0: 0.9, 1: 0.7}, 2, 0, -2),  # a tie goes to the smaller rate
        # A sweep started elsewhere on the grid follows the same rule.
        ({}, 2, -2, -3),
        ({-3: 0.8, -2: 0.9}, 2, -2, -1),
        ({-3: 0.8, -2: 0.9, -1: 0.85}, 2, -2, None),
        ({-3: 0.9, -2: 0.85, -1: 0.8}, 2, -2, -4),
    ],
)
def test_sweep_decisions(scores, max_extensions, start, expected):
    assert study.next_sweep_index(scores, 3, max_extensions, start) == expected


@pytest.mark.unit
def test_a_sweep_where_no_rate_learned_goes_on_below_its_lowest():
    # The no-batch-norm network's momentum sweep at 8,192: every rate at chance (0.1; 0.1044 at k = 0).
    at_chance = {-1: 0.1, 0: 0.1044, 1: 0.1, 2: 0.1, 3: 0.1}
    assert study.next_sweep_index(at_chance, 3, 2) is None  # the old rule: 0 is "inside", done
    assert study.next_sweep_index(at_chance, 3, 2, 0, 0.2, 3) == -2
    assert study.next_sweep_index({**at_chance, -2: 0.1}, 3, 2, 0, 0.2, 3) == -3
    # Once one learns, the edge rule goes on with the budget the untrained rates added (2 + 3).
    assert study.next_sweep_index({**at_chance, -2: 0.85}, 3, 2, 0, 0.2, 3) == -3
    assert study.next_sweep_index({**at_chance, -2: 0.85, -3: 0.8}, 3, 2, 0, 0.2, 3) is None
    # Spent: 3 + 2 + 3 rates, none learned.
    spent = {**at_chance, -2: 0.1, -3: 0.1, -4: 0.1}
    assert study.next_sweep_index(spent, 3, 2, 0, 0.2, 3) is None
    # A sweep that learned is unchanged by the rule.
    assert study.next_sweep_index({-1: 0.8, 0: 0.9, 1: 0.85}, 3, 2, 0, 0.2, 3) is None
    assert study.next_sweep_index({-1: 0.9, 0: 0.85, 1: 0.1}, 3, 2, 0, 0.2, 3) == -2


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
def test_the_second_network_and_the_nesterov_arm_have_their_own_runs():
    args = study.parse_args(["--output_dir=/tmp/x"])
    nobn = study.main_flags(args, study.Cell("lars", 512, 0, 0, "small_cnn_nobn"))
    assert "--model=small_cnn_nobn" in nobn and "--run_name=hvd_lars_study_nobn_lars_b512_lr10_s0" in nobn
    assert "--model=small_cnn" in study.main_flags(args, study.Cell("lars", 512, 0, 0))
    nesterov = study.main_flags(args, study.Cell("nesterov", 8192, -2, 1))
    assert {"--optimizer=nesterov", "--base_learning_rate=0.025", "--steps_per_epoch=7"} <= set(nesterov)
    assert "--run_name=hvd_lars_study_nesterov_b8192_lr0.025_s1" in nesterov
    assert study.ARMS["nesterov"].peak(0.025, 8192) == pytest.approx(0.8)


@pytest.mark.unit
def test_the_selection_picks_the_part_to_train_and_the_study_covers_the_rest():
    args = study.parse_args(["--output_dir=/tmp/x"])
    assert args.nobn_batches == [8192, 512] and args.nesterov_batches == [8192]
    everything = [(g.network, g.arm, g.batch) for g in study.groups(args)]
    assert everything == [
        ("small_cnn", "momentum", 8192), ("small_cnn", "lars", 8192), ("small_cnn", "nesterov", 8192),
        ("small_cnn", "momentum", 2048), ("small_cnn", "lars", 2048),
        ("small_cnn", "momentum", 512), ("small_cnn", "lars", 512),
        ("small_cnn_nobn", "momentum", 8192), ("small_cnn_nobn", "lars", 8192),
        ("small_cnn_nobn", "nesterov", 8192),
        ("small_cnn_nobn", "momentum", 512), ("small_cnn_nobn", "lars", 512),
    ]  # fmt: skip
    assert args.networks == ["small_cnn", "small_cnn_nobn"] and args.arms == ["momentum", "lars", "nesterov"]
    part = study.parse_args(
        ["--networks=small_cnn_nobn", "--arms=lars,momentum", "--nobn_batches=8192,2048,512"]
    )
    assert [(g.network, g.arm, g.batch) for g in study.groups(part, part.networks, part.arms)] == [
        ("small_cnn_nobn", a, b) for b in (8192, 2048, 512) for a in ("momentum", "lars")
    ]
    nesterov = study.parse_args(["--arms=nesterov"])
    assert [(g.network, g.batch) for g in study.groups(nesterov, nesterov.networks, nesterov.arms)] == [
        ("small_cnn", 8192),
        ("small_cnn_nobn", 8192),
    ]


@pytest.mark.unit
@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["--networks=small_cnn,resnet50"], "--networks=small_cnn,resnet50: unknown ['resnet50']; valid:"),
        (["--arms=adam"], "--arms=adam: unknown ['adam']; valid: momentum, lars, nesterov."),
        (["--nobn_batches=0"], "--nobn_batches=[0]"),
    ],
)
def test_a_bad_selection_is_refused_naming_it(argv, fragment, capsys):
    with pytest.raises(SystemExit):
        study.parse_args(argv)
    assert fragment in capsys.readouterr().err


REAL_WRITE = large_batch_report.write
# Fake scores: validation top-1 peaks at grid index BEST[(network, arm, batch)]; test = validation - 0.01.
BEST = {
    ("small_cnn", "momentum", 128): 1,
    ("small_cnn", "lars", 128): 0,
    ("small_cnn_nobn", "momentum", 128): -3,
}


def _val(cell):
    best = BEST.get((cell.network, cell.arm, cell.batch), 0)
    return round(0.9 - 0.01 * abs(cell.k - best) + 0.002 * cell.seed, 6)


def _fake_summary(args, cell):
    """A finished run's summary.json as the main program writes it (the fields the study reads)."""
    rate = study.rate_of(args, cell)
    steps = study.steps_per_epoch(args, cell.batch)
    val = _val(cell)
    epochs = [
        {"epoch": e, "val_top1": val, "test_top1": val - 0.01, "val_loss": 0.3, "loss": 0.2, "top1": 0.95}
        for e in range(1, args.epochs + 1)
    ]
    return {
        "config": study.settings_of(args, cell),
        "plan": {
            "peak_learning_rate": study.ARMS[cell.arm].peak(rate, cell.batch),
            "steps_per_epoch": steps,
            "total_steps": steps * args.epochs,
            "warmup_steps": 1,
        },
        "epochs": epochs,
        "final_val_top1": val,
        "final_test_top1": val - 0.01,
        "final_test_top5": 0.99,
        "images_per_second": 1000.0,
        "git_sha": "abc123",
        "date": "2026-12-01T00:00:00+00:00",
        "machine": "a test CPU",
    }


def _write_summary(args, cell, summary):
    os.makedirs(study.run_dir(args, cell), exist_ok=True)
    with open(os.path.join(study.run_dir(args, cell), "summary.json"), "w") as f:
        json.dump(summary, f)


def _fake_args(tmp_path, *extra):
    return study.parse_args(
        [f"--output_dir={tmp_path / 'out'}", f"--report={tmp_path / 'r.md'}", "--batches=128",
         "--nobn_batches=128", "--nesterov_batches=128", "--epochs=2", "--warmup_epochs=0.5", *extra]
    )  # fmt: skip


@pytest.fixture
def fake_training(monkeypatch):
    """study.run_cell replaced by one that writes a finished fake summary; returns the cells trained."""
    trained, reports = [], []

    def run_cell(args, cell, journal):
        trained.append(cell)
        _write_summary(args, cell, _fake_summary(args, cell))
        return _fake_summary(args, cell)

    monkeypatch.setattr(study, "run_cell", run_cell)
    monkeypatch.setattr(large_batch_report, "write", lambda *a: reports.append(a))
    # The machine the study measures once when it trains (no subprocess in the unit tier).
    monkeypatch.setattr(study.common, "cpu", lambda: dict(TEST_CPU))
    monkeypatch.setattr(study.common, "matmul_rate", lambda: dict(TEST_MATMUL))
    return trained, reports


TEST_CPU = {"model": "a test CPU", "vendor": "GenuineIntel", "family": "6", "model_number": "207",
            "stepping": "2", "flags": ["amx_bf16"], "name": "Intel Xeon with AMX", "key": "k"}  # fmt: skip
TEST_MATMUL = {"float32": 100.0, "bfloat16": 200.0, "size": 4096}


@pytest.mark.unit
def test_a_study_in_parts_trains_each_run_once_and_nesterov_starts_at_momentums_choice(
    tmp_path, fake_training
):
    trained, reports = fake_training
    # Nesterov on small_cnn_nobn first: its momentum sweep is not done, so it cannot start.
    with pytest.raises(SystemExit, match="nesterov on small_cnn_nobn at batch 128 waits for the momentum"):
        study.study(_fake_args(tmp_path, "--networks=small_cnn_nobn", "--arms=nesterov"))
    assert trained == []

    outcomes = study.study(_fake_args(tmp_path, "--networks=small_cnn", "--arms=momentum,nesterov"))
    momentum = [(c.k, c.seed) for c in trained if c.arm == "momentum"]
    # Sweep -1, 0, 1; best at the high edge (1) -> 2; best 1 inside -> done; then seed 1 of k = 1.
    assert momentum == [(-1, 0), (0, 0), (1, 0), (2, 0), (1, 1)]
    # Nesterov's sweep is centred on momentum's choice (k = 1: 0.2 per 256); its own best is at 0, so
    # it extends down once.
    assert [(c.k, c.seed) for c in trained if c.arm == "nesterov"] == [
        (0, 0),
        (1, 0),
        (2, 0),
        (-1, 0),
        (0, 1),
    ]
    group = study.Group("small_cnn", "nesterov", 128)
    assert outcomes[group].chosen == 0 and [r["k"] for r in outcomes[group].records if r["chosen"]] == [0, 0]
    assert outcomes[study.Group("small_cnn", "lars", 128)].records == []  # not selected: not run yet
    assert len(reports) == len(trained) + 1  # the report after every run, and once at the end

    # Started again with everything selected: the done runs are skipped, the rest are trained.
    before = len(trained)
    study.study(_fake_args(tmp_path))
    new = trained[before:]
    assert all(c.arm == "lars" or c.network == "small_cnn_nobn" for c in new)
    assert len({(c.network, c.arm, c.k, c.seed) for c in trained}) == len(trained)  # nothing twice
    nobn_nesterov = [
        c.k for c in new if c.network == "small_cnn_nobn" and c.arm == "nesterov" and c.seed == 0
    ]
    nobn_momentum = study.chosen_index(
        {c.k: _val(c) for c in new if c.network == "small_cnn_nobn" and c.arm == "momentum" and c.seed == 0}
    )
    assert nobn_momentum == -3 and nobn_nesterov[:3] == [-4, -3, -2]

    # A third start trains nothing, even with the run directories gone: the records file holds them.
    records = json.loads((tmp_path / "r.json").read_text())["records"]
    assert len(records) == len(trained) and {r["source"] for r in records} == {"run directory"}
    shutil.rmtree(tmp_path / "out" / "runs")
    count = len(trained)
    outcomes = study.study(_fake_args(tmp_path))
    assert len(trained) == count and all(o.chosen is not None for o in outcomes.values())


@pytest.mark.unit
def test_a_run_with_other_settings_is_refused_from_its_directory_or_its_record(tmp_path, fake_training):
    args = _fake_args(tmp_path, "--arms=lars", "--networks=small_cnn")
    cell = study.Cell("lars", 128, -1, 0)
    summary = _fake_summary(args, cell)
    summary["config"]["model"] = "small_cnn_nobn"
    _write_summary(args, cell, summary)
    with pytest.raises(
        SystemExit, match="hvd_lars_study_lars_b128_lr.* trained with other settings.*'model'"
    ):
        study.study(args)
    os.remove(os.path.join(study.run_dir(args, cell), "summary.json"))
    record = study._record(args, cell, _fake_summary(args, cell))
    record["settings"]["epochs"] = 12.0
    study.save_records(args, {record["run_name"]: record})
    with pytest.raises(
        SystemExit, match=r"r\.json holds hvd_lars_study_lars_b128_lr.*'epochs': \(12.0, 2.0\)"
    ):
        study.study(args)


@pytest.mark.unit
def test_the_report_of_a_half_done_study(tmp_path, fake_training):
    trained, _ = fake_training
    args = _fake_args(tmp_path, "--networks=small_cnn", "--arms=momentum,lars", "--seeds=2")
    study.study(args)
    # A half-done sweep on the second network: one rate of momentum SGD.
    half = study.Cell("momentum", 128, -1, 0, "small_cnn_nobn")
    _write_summary(args, half, _fake_summary(args, half))
    # A run cut short (epoch 1 of 2) does not count.
    cut = study.Cell("lars", 128, -1, 0, "small_cnn_nobn")
    short = _fake_summary(args, cut)
    short["epochs"] = short["epochs"][:1]
    _write_summary(args, cut, short)
    (tmp_path / "r.md").write_text(f"old\n{HAND_WRITTEN}\n## Plainly\n\nBy hand.\n")
    outcomes = study.collect(args, study.load_records(args))
    attempts = [{"seconds": 7200.0, "command": "python -m benchmarks.large_batch_study"}]
    REAL_WRITE(args, outcomes, attempts, study.NETWORKS, study.ARMS)  # the fixture stubs the module's
    text = (tmp_path / "r.md").read_text()
    momentum = [_val(c) - 0.01 for c in trained if c.arm == "momentum" and c.k == 1]
    lars = [_val(c) - 0.01 for c in trained if c.arm == "lars" and c.k == 0]
    assert len(momentum) == len(lars) == 2
    row = (
        f"| 128 | **{sum(momentum) / 2:.4f}** ({min(momentum):.4f}-{max(momentum):.4f}), n=2 | "
        f"**{sum(lars) / 2:.4f}** ({min(lars):.4f}-{max(lars):.4f}), n=2 | not run yet |"
    )
    assert row in text
    assert (
        "| 128 | not run yet (sweep: 1 rate(s) done) | not run yet | not run yet (waits for the momentum"
        in text
    )
    assert (
        "## Findings: small_cnn (batch norm)" in text
        and "## Findings: small_cnn_nobn (no batch norm)" in text
    )
    assert "Reference: the better arm at the smallest batch (128) reaches 0.8910" in text
    assert "Wall time: 2.00 h over 1 run attempts" in text and "`abc123`" in text
    # The 9 runs the study trained carry the machine it measured; the one it found done does not.
    measured = (
        "a test CPU; CPU: GenuineIntel family 6 model 207 stepping 2; CPU flags: amx_bf16; tf.matmul "
        "4096^2: 100 GFLOP/s float32, 200 bfloat16"
    )
    found = f"a test CPU; CPU vendor, family and model {NOT_RECORDED}; tf.matmul rate {NOT_RECORDED}"
    assert f"- Machines of the runs: {found} (1 runs); or {measured} (9 runs)\n" in text
    provenance = f"| `abc123` | {measured} | 2026-12-01 to 2026-12-01 | run directory | 9 (small_cnn/lars, "
    assert provenance + "small_cnn/momentum) |" in text
    assert (
        f"| `abc123` | {found} | 2026-12-01 to 2026-12-01 | run directory | 1 (small_cnn_nobn/momentum) |"
        in text
    )
    assert text.endswith(f"{HAND_WRITTEN}\n## Plainly\n\nBy hand.\n") and "old\n" not in text
    assert (tmp_path / "r.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.unit
def test_findings_say_per_network_whether_lars_holds_what_the_momentum_arms_lose():
    def outcome(network, arm, batch, *tests):
        records = [{"chosen": True, "test_top1": t} for t in tests]
        return study.Group(network, arm, batch), study.Outcome(records, chosen=0)

    args = study.parse_args(["--output_dir=/tmp/x"])
    outcomes = dict(
        [
            outcome("small_cnn_nobn", "momentum", 512, 0.92, 0.92),
            outcome("small_cnn_nobn", "lars", 512, 0.921, 0.919),
            outcome("small_cnn_nobn", "momentum", 8192, 0.80, 0.82),
            outcome("small_cnn_nobn", "lars", 8192, 0.918, 0.916),
            outcome("small_cnn_nobn", "nesterov", 8192, 0.85, 0.85),
        ]
    )
    sentences = large_batch_report.findings(args, "small_cnn_nobn", outcomes, study.ARMS)
    assert sentences[1] == (
        "Batch 8192: momentum SGD 0.8100 (loses 11.0 points); LARS 0.9170 (holds); Nesterov momentum SGD "
        "0.8500 (loses 7.0 points); LARS is ahead of momentum SGD by 10.7 points; LARS is ahead of Nesterov "
        "momentum SGD by 6.7 points."
    )
    assert (
        sentences[2] == "In short: at 8192, LARS held what the momentum arms lost (the paper's claim holds)."
    )
    outcomes.update([outcome("small_cnn_nobn", "nesterov", 8192, 0.918, 0.917)])
    said = large_batch_report.findings(args, "small_cnn_nobn", outcomes, study.ARMS)
    assert said[2] == "In short: at 8192, LARS held and so did Nesterov momentum SGD (no case for LARS here)."


@pytest.mark.unit
def test_complete_means_every_epoch_with_both_evaluations():
    epochs = [{"epoch": 1, "val_top1": 0.5, "test_top1": 0.5}, {"epoch": 2, "val_top1": 0.6}]
    assert not study.is_complete({"epochs": epochs}, 2)  # no test score in the last epoch
    epochs[1]["test_top1"] = 0.6
    assert study.is_complete({"epochs": epochs}, 2)
    assert not study.is_complete({"epochs": epochs[:1]}, 2) and not study.is_complete(None, 2)


@pytest.mark.unit
def test_a_diverged_run_is_a_result_at_chance_level(tmp_path):
    # The main program stops a diverged run (exit status 3) and says so in summary.json; the sweep goes on.
    args = _fake_args(tmp_path)
    cell = study.Cell("momentum", 128, 0, 0, network="small_cnn_nobn")
    summary = _fake_summary(args, cell)
    summary["epochs"] = []
    assert not study.is_complete(summary, 2) and study.diverged(summary) is None
    summary["stopped"] = {"reason": "TrainingDiverged", "step": 8, "message": "training diverged at step 8"}
    assert study.is_complete(summary, 2) and study.diverged(summary) == 8
    record = study._record(args, cell, summary)
    assert record["diverged_at_step"] == 8
    assert (record["val_top1"], record["test_top1"], record["test_top5"]) == (0.1, 0.1, 0.5)
    assert large_batch_report._loss(record, "val_loss") == "diverged at step 8"
    summary["stopped"]["reason"] = "Preempted"  # stopped by a signal: not done, it resumes
    assert not study.is_complete(summary, 2)


def _study(tmp_path, *extra):
    command = [sys.executable, "-m", "benchmarks.large_batch_study", f"--output_dir={tmp_path / 'out'}"]
    command += [f"--report={tmp_path / 'r.md'}"]
    # 1 arm, 1 batch, a sweep of 2 rates, then the better one with a second seed: 3 runs of 2 epochs of
    # 4 updates (512 training images, batch 128).
    command += [
        "--networks=small_cnn",
        "--arms=lars",
        "--batches=128",
        "--sweep_points=2",
        "--max_extensions=0",
    ]
    command += ["--seeds=2"]
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
    # Mean test top-1 of the chosen rate's 2 seeds (momentum SGD, not selected, is not run yet).
    assert f"| 128 | not run yet | **{(seed0 + seed1) / 2:.4f}**" in report
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
    assert rewritten.endswith(" |\n" + hand) and rewritten.count(hand) == 1
    assert "| edited |" not in rewritten and rewritten.count("| lars | 128 |") == 2 + 2
    assert result.returncode == 0 and "training" not in result.stdout and "done: 3 runs" in result.stdout
    assert (tmp_path / "out" / "attempts.jsonl").read_text().splitlines() == attempts
    assert {name: os.path.getmtime(runs / name / "summary.json") for name in summaries} == mtimes
