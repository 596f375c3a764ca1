"""benchmarks/large_batch_study.py: the sweep's decisions, each run's flags, what a study started again skips
(fake run records), the report of a half-done study, and one run of the real main program killed, resumed,
and started again with nothing to do."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import large_batch_report
from benchmarks import large_batch_study as study
from benchmarks.common import HAND_WRITTEN, NOT_RECORDED
from tests.support import REPO, main_server

CHANCE = {-1: 0.1, 0: 0.1044, 1: 0.1, 2: 0.1, 3: 0.1}  # every rate of a sweep learned nothing
RULE = (0.2, 3)  # learned_above, untrained_extensions


@pytest.mark.unit
@pytest.mark.parametrize(
    "scores, max_extensions, start, rule, expected",
    [
        ({}, 2, 0, (), -1),  # the first sweep, in order: k = -1, 0, 1
        ({-1: 0.8, 0: 0.9}, 2, 0, (), 1),
        ({-1: 0.8, 0: 0.9, 1: 0.85}, 2, 0, (), None),  # best inside: done
        ({-1: 0.9, 0: 0.85, 1: 0.8}, 2, 0, (), -2),  # best at the low edge: one lower
        ({-1: 0.7, 0: 0.8, 1: 0.9, 2: 0.91}, 2, 0, (), 3),  # best at the high edge: one higher
        ({-1: 0.7, 0: 0.8, 1: 0.9, 2: 0.91, 3: 0.92}, 2, 0, (), None),  # extensions spent
        ({-1: 0.9, 0: 0.9, 1: 0.7}, 2, 0, (), -2),  # a tie goes to the smaller rate
        ({-3: 0.9, -2: 0.85, -1: 0.8}, 2, -2, (), -4),  # a sweep started elsewhere on the grid
        (CHANCE, 2, 0, (), None),  # without the rule, 0.1044 at k = 0 is "inside": done
        (CHANCE, 2, 0, RULE, -2),  # with it, nothing learned: below the lowest
        ({**CHANCE, -2: 0.85}, 2, 0, RULE, -3),  # learned at the edge: budget 2 + 3 untrained
        ({**CHANCE, -2: 0.1, -3: 0.1, -4: 0.1}, 2, 0, RULE, None),  # 3 + 2 + 3 rates spent
        ({-1: 0.9, 0: 0.85, 1: 0.1}, 2, 0, RULE, -2),  # a sweep that learned: the edge rule
    ],
)
def test_sweep_decisions(scores, max_extensions, start, rule, expected):
    assert study.next_sweep_index(scores, 3, max_extensions, start, *rule) == expected


@pytest.mark.unit
def test_run_flags_and_selections(capsys):
    args = study.parse_args(["--output_dir=/tmp/x"])
    flags = lambda *cell: set(study.main_flags(args, study.Cell(*cell)))  # noqa: E731
    momentum, lars, nesterov = flags("momentum", 2048, 1, 0), flags("lars", 8192, -1, 1), flags(
        "nesterov", 8192, -2, 1)  # fmt: skip
    # Linear scaling: 0.2 per 256 images is a peak of 1.6 at 2,048. Steps per epoch rounded: 55,000 / 8,192
    # = 6.7 -> 7 updates (57,344 images), not 6 (49,152).
    assert study.ARMS["momentum"].peak(0.2, 2048) == pytest.approx(1.6)
    assert {"--base_learning_rate=0.2", "--optimizer=momentum", "--steps_per_epoch=27"} <= momentum
    assert {"--peak_learning_rate=20", "--eta=0.001", "--seed=1", "--steps_per_epoch=7", "--model=small_cnn",
            "--run_name=hvd_lars_study_lars_b8192_lr20_s1"} <= lars  # fmt: skip
    assert {"--optimizer=nesterov", "--base_learning_rate=0.025",
            "--run_name=hvd_lars_study_nesterov_b8192_lr0.025_s1"} <= nesterov  # fmt: skip
    assert {"--model=small_cnn_nobn", "--run_name=hvd_lars_study_nobn_lars_b512_lr10_s0"} <= flags(
        "lars", 512, 0, 0, "small_cnn_nobn")  # fmt: skip
    assert all({"--precision=float32", "--deterministic", "--validation_examples=5000", "--epochs=12",
                "--weight_decay=0.0005", "--warmup_epochs=1", "--schedule=mlperf_poly"} <= f
               for f in (momentum, lars, nesterov))  # fmt: skip
    only = study.parse_args(["--arms=nesterov"])  # the Nesterov arm at --nesterov_batches only
    assert [(g.network, g.batch) for g in study.groups(only, only.networks, only.arms)] == [
        ("small_cnn", 8192), ("small_cnn_nobn", 8192)]  # fmt: skip
    refusals = [
        (["--arms=lars,adam"], "--arms=lars,adam: unknown ['adam']; valid: momentum, lars, nesterov."),
        (["--networks=small_cnn,resnet50"], "--networks=small_cnn,resnet50: unknown ['resnet50']; valid:"),
        (["--nobn_batches=0"], "--nobn_batches=[0]"),
    ]
    for args, message in refusals:
        with pytest.raises(SystemExit):
            study.parse_args(args)
        assert message in capsys.readouterr().err, args


REAL_WRITE = large_batch_report.write
# Fake scores: validation top-1 peaks at grid index BEST[(network, arm)] (default 0); test = val - 0.01.
BEST = {("small_cnn", "momentum"): 1, ("small_cnn_nobn", "momentum"): -3}
TEST_CPU = {"model": "a test CPU", "vendor": "GenuineIntel", "family": "6", "model_number": "207",
            "stepping": "2", "flags": ["amx_bf16"], "name": "Intel Xeon with AMX", "key": "k"}  # fmt: skip
TEST_MATMUL = {"float32": 100.0, "bfloat16": 200.0, "size": 4096}


def _fake_summary(args, cell):
    """A finished run's summary.json as the main program writes it (the fields the study reads)."""
    steps = study.steps_per_epoch(args, cell.batch)
    val = round(0.9 - 0.01 * abs(cell.k - BEST.get((cell.network, cell.arm), 0)) + 0.002 * cell.seed, 6)
    plan = {"peak_learning_rate": study.ARMS[cell.arm].peak(study.rate_of(args, cell), cell.batch),
            "steps_per_epoch": steps, "total_steps": steps * args.epochs, "warmup_steps": 1}  # fmt: skip
    epoch = {"val_top1": val, "test_top1": val - 0.01, "val_loss": 0.3, "loss": 0.2, "top1": 0.95}
    return {"config": study.settings_of(args, cell), "plan": plan,
            "epochs": [{"epoch": e, **epoch} for e in range(1, args.epochs + 1)],
            "final_val_top1": val, "final_test_top1": val - 0.01, "final_test_top5": 0.99,
            "images_per_second": 1000.0, "git_sha": "abc123", "date": "2026-12-01T00:00:00+00:00",
            "machine": "a test CPU"}  # fmt: skip


def _write_summary(args, cell, summary):
    os.makedirs(study.run_dir(args, cell), exist_ok=True)
    Path(study.run_dir(args, cell), "summary.json").write_text(json.dumps(summary))


def _fake_args(tmp_path, *extra):
    return study.parse_args(
        [f"--output_dir={tmp_path / 'out'}", f"--report={tmp_path / 'r.md'}", "--batches=128",
         "--nobn_batches=128", "--nesterov_batches=128", "--epochs=2", "--warmup_epochs=0.5", *extra]
    )  # fmt: skip


@pytest.mark.unit
def test_a_study_in_parts_its_report_and_a_run_of_other_settings(tmp_path, monkeypatch):
    # study.run_cell replaced by one that writes a finished fake summary and notes the cell trained.
    trained, reports = [], []

    def run_cell(args, cell, journal):
        trained.append(cell)
        _write_summary(args, cell, _fake_summary(args, cell))
        return _fake_summary(args, cell)

    monkeypatch.setattr(study, "run_cell", run_cell)
    monkeypatch.setattr(large_batch_report, "write", lambda *a: reports.append(a))
    monkeypatch.setattr(study.common, "cpu", lambda: dict(TEST_CPU))
    monkeypatch.setattr(study.common, "matmul_rate", lambda: dict(TEST_MATMUL))
    args = _fake_args(tmp_path)
    half = study.Cell("momentum", 128, -1, 0, "small_cnn_nobn")  # found done: one rate of a sweep
    _write_summary(args, half, _fake_summary(args, half))
    cut = study.Cell("lars", 128, -1, 0, "small_cnn_nobn")  # cut short (epoch 1 of 2): not done
    _write_summary(args, cut, {**_fake_summary(args, cut), "epochs": _fake_summary(args, cut)["epochs"][:1]})
    with pytest.raises(SystemExit, match="nesterov on small_cnn_nobn at batch 128 waits for the momentum"):
        study.study(_fake_args(tmp_path, "--networks=small_cnn_nobn", "--arms=nesterov"))
    assert trained == []
    outcomes = study.study(_fake_args(tmp_path, "--networks=small_cnn", "--arms=momentum,nesterov"))
    # Sweep -1, 0, 1; best at the high edge (1) -> 2; best 1 inside -> done; then seed 1 of k = 1. Nesterov's
    # sweep is centred on momentum's choice (k = 1); its own best is at 0: one extension down.
    runs = {arm: [(c.k, c.seed) for c in trained if c.arm == arm] for arm in ("momentum", "nesterov")}
    assert runs == {"momentum": [(-1, 0), (0, 0), (1, 0), (2, 0), (1, 1)],
                    "nesterov": [(0, 0), (1, 0), (2, 0), (-1, 0), (0, 1)]}  # fmt: skip
    group = study.Group("small_cnn", "nesterov", 128)
    assert outcomes[group].chosen == 0 and [r["k"] for r in outcomes[group].records if r["chosen"]] == [0, 0]
    assert outcomes[study.Group("small_cnn", "lars", 128)].records == []  # not selected: not run yet
    assert len(reports) == len(trained) + 1  # the report after every run, and once at the end
    attempts = [{"seconds": 7200.0, "command": "python -m benchmarks.large_batch_study"}]
    REAL_WRITE(args, outcomes, attempts, study.NETWORKS, study.ARMS)
    text = (tmp_path / "r.md").read_text()
    # Chosen: momentum k = 1, Nesterov k = 0, each test top-1 0.89 and 0.892 (seeds 0, 1): mean 0.891.
    assert "| 128 | **0.8910** (0.8900-0.8920), n=2 | not run yet | **0.8910** (0.8900-0.8920), n=2 |" in text
    assert "| 128 | not run yet (sweep: 1 rate(s) done) | not run yet | not run yet (waits for the" in text
    assert "## Findings: small_cnn (batch norm)" in text and "## Findings: small_cnn_nobn (no batch" in text
    assert "Not enough finished runs yet: the smallest batch (128) is the reference, not run yet." in text
    assert "Wall time: 2.00 h over 1 run attempts" in text and "`abc123`" in text
    # The 10 runs the study trained carry the machine it measured; the one it found done does not.
    measured = ("a test CPU; CPU: GenuineIntel family 6 model 207 stepping 2; CPU flags: amx_bf16; tf.matmul "
                "4096^2: 100 GFLOP/s float32, 200 bfloat16")  # fmt: skip
    found = f"a test CPU; CPU vendor, family and model {NOT_RECORDED}; tf.matmul rate {NOT_RECORDED}"
    assert f"- Machines of the runs: {found} (1 runs); or {measured} (10 runs)\n" in text
    assert f"| `abc123` | {found} | 2026-12-01 to 2026-12-01 | run directory | 1 (small_cnn_nobn/mom" in text

    # Started again with everything selected: the done runs are skipped, the rest (and the cut one) trained.
    before = len(trained)
    study.study(args)
    new = trained[before:]
    assert all(c.arm == "lars" or c.network == "small_cnn_nobn" for c in new) and cut in new
    assert len({(c.network, c.arm, c.k, c.seed) for c in trained}) == len(trained)  # nothing twice
    nobn = [(c.arm, c.k) for c in new if c.network == "small_cnn_nobn" and c.seed == 0]
    assert [k for a, k in nobn if a == "momentum"] == [0, 1, -2, -3]  # best at -3: 2 extensions spent
    assert [k for a, k in nobn if a == "nesterov"][:3] == [-4, -3, -2]  # centred on momentum's -3

    # A third start trains nothing, even with the run directories gone: the records file holds them.
    records = json.loads((tmp_path / "r.json").read_text())["records"]
    assert len(records) == len(trained) + 1 and {r["source"] for r in records} == {"run directory"}
    shutil.rmtree(tmp_path / "out" / "runs")
    outcomes = study.study(args)
    assert len(trained) == before + len(new) and all(o.chosen is not None for o in outcomes.values())

    # A record, or a run directory, of other settings is refused.
    cell = study.Cell("lars", 128, -1, 0)
    record = study._record(args, cell, _fake_summary(args, cell))
    record["settings"]["epochs"] = 12.0
    study.save_records(args, {record["run_name"]: record})
    with pytest.raises(SystemExit, match=r"r\.json holds hvd_lars_study_lars_b128.*'epochs': \(12.0, 2.0\)"):
        study.study(args)
    summary = _fake_summary(args, cell)
    _write_summary(args, cell, {**summary, "config": {**summary["config"], "model": "small_cnn_nobn"}})
    with pytest.raises(SystemExit, match="lars_b128_lr.* trained with other settings.*'model'"):
        study.study(args)


@pytest.mark.unit
def test_findings_say_per_network_whether_lars_holds_what_the_momentum_arms_lose():
    def outcome(arm, batch, *tests):
        records = [{"chosen": True, "test_top1": t} for t in tests]
        return study.Group("small_cnn_nobn", arm, batch), study.Outcome(records, chosen=0)

    args = study.parse_args(["--output_dir=/tmp/x"])
    outcomes = dict([outcome("momentum", 512, 0.92, 0.92), outcome("lars", 512, 0.921, 0.919),
                     outcome("momentum", 8192, 0.80, 0.82), outcome("lars", 8192, 0.918, 0.916),
                     outcome("nesterov", 8192, 0.85, 0.85)])  # fmt: skip
    sentences = large_batch_report.findings(args, "small_cnn_nobn", outcomes, study.ARMS)
    assert sentences[0].startswith(
        "Reference: the better arm at the smallest batch (512) reaches 0.9200 mean test"
    )
    assert sentences[1:] == [
        "Batch 8192: momentum SGD 0.8100 (loses 11.0 points); LARS 0.9170 (holds); Nesterov momentum SGD "
        "0.8500 (loses 7.0 points); LARS is ahead of momentum SGD by 10.7 points; LARS is ahead of Nesterov "
        "momentum SGD by 6.7 points.",
        "In short: at 8192, LARS held what the momentum arms lost (the paper's claim holds).",
    ]
    outcomes.update([outcome("nesterov", 8192, 0.918, 0.917)])
    said = large_batch_report.findings(args, "small_cnn_nobn", outcomes, study.ARMS)
    assert said[2] == "In short: at 8192, LARS held and so did Nesterov momentum SGD (no case for LARS here)."


@pytest.mark.unit
def test_complete_means_every_epoch_with_both_evaluations_or_a_divergence(tmp_path):
    epochs = [{"epoch": 1, "val_top1": 0.5, "test_top1": 0.5}, {"epoch": 2, "val_top1": 0.6}]
    assert not study.is_complete({"epochs": epochs}, 2)  # no test score in the last epoch
    assert not study.is_complete({"epochs": epochs[:1]}, 2) and not study.is_complete(None, 2)
    assert study.is_complete({"epochs": [epochs[0], {**epochs[1], "test_top1": 0.6}]}, 2)
    # The main program stops a diverged run (exit status 3) and says so in summary.json; the sweep goes on.
    args, cell = _fake_args(tmp_path), study.Cell("momentum", 128, 0, 0, network="small_cnn_nobn")
    summary = {**_fake_summary(args, cell), "epochs": []}
    assert not study.is_complete(summary, 2) and study.diverged(summary) is None
    summary["stopped"] = {"reason": "TrainingDiverged", "step": 8, "message": "training diverged at step 8"}
    assert study.is_complete(summary, 2) and study.diverged(summary) == 8
    r = study._record(args, cell, summary)
    assert (r["diverged_at_step"], r["val_top1"], r["test_top1"], r["test_top5"]) == (8, 0.1, 0.1, 0.5)
    assert large_batch_report._loss(r, "val_loss") == "diverged at step 8"
    summary["stopped"]["reason"] = "Preempted"  # stopped by a signal: not done, it resumes
    assert not study.is_complete(summary, 2)


def _study(tmp_path, *program):
    # One run (1 arm, batch, rate, seed) of 2 epochs of 4 updates (512 images, batch 128): `python program`,
    # forked from the main program's server.
    program = " ".join(main_server.shared().rank_command(program or ["-m", "hvd_lars.main"])[1:])
    command = [sys.executable, "-m", "benchmarks.large_batch_study", f"--output_dir={tmp_path / 'out'}",
               f"--report={tmp_path / 'r.md'}", "--networks=small_cnn", "--arms=lars", "--batches=128",
               "--sweep_points=1", "--max_extensions=0", "--seeds=1", "--epochs=2", "--warmup_epochs=0.5",
               "--max_train_examples=512", "--max_eval_examples=200",
               f"--train_program={program}"]  # fmt: skip
    env = dict(os.environ, PYTHONPATH=REPO)
    return subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=400)


@pytest.mark.horovod
def test_study_killed_resumes_then_redoes_nothing(tmp_path):
    runs, name = tmp_path / "out" / "runs", "hvd_lars_study_lars_b128_lr5_s0"
    # The run dies after update 6 of 8; its last checkpoint is the end of epoch 1 (step 4).
    result = _study(tmp_path, f"{REPO}/tests/support/kill_at_step.py", "--kill_at_step=6")
    assert result.returncode != 0 and f"{name} failed (exit status -9)" in result.stderr
    assert [e["epoch"] for e in json.loads((runs / name / "summary.json").read_text())["epochs"]] == [1]

    result = _study(tmp_path)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    log = (tmp_path / "out" / "logs" / f"{name}.log").read_text()
    assert "resumed from" in log and "(step 4)" in log and "--run_name=hvd_lars_study_" in log
    summary = json.loads((runs / name / "summary.json").read_text())
    assert os.listdir(runs) == [name] and [e["epoch"] for e in summary["epochs"]] == [1, 2]
    assert 0 < summary["final_val_top1"] <= 1 and 0 < summary["final_test_top1"] <= 1
    report = (tmp_path / "r.md").read_text()
    # The chosen rate's test top-1 (momentum SGD, not selected, is not run yet); its sweep row and seed row.
    assert f"| 128 | not run yet | **{summary['final_test_top1']:.4f}**" in report
    assert report.count("| lars | 128 |") == 2 and (tmp_path / "r.png").read_bytes()[:4] == b"\x89PNG"
    attempts = (tmp_path / "out" / "attempts.jsonl").read_text().splitlines()
    assert len(attempts) == 2  # the killed attempt and the resumed one

    # A third start: nothing trains, the report is rewritten, a section written by hand at its end stays.
    hand = f"\n{HAND_WRITTEN}\n## Plainly (written by hand from the tables above, today)\n\nLARS held here.\n"
    (tmp_path / "r.md").write_text(report.replace("| lars | 128 |", "| edited |") + hand)
    mtime = os.path.getmtime(runs / name / "summary.json")
    result = _study(tmp_path)
    rewritten = (tmp_path / "r.md").read_text()
    assert rewritten.endswith(" |\n" + hand) and rewritten.count(hand) == 1
    assert "| edited |" not in rewritten and rewritten.count("| lars | 128 |") == 2
    assert result.returncode == 0 and "training" not in result.stdout and "done: 1 runs" in result.stdout
    assert (tmp_path / "out" / "attempts.jsonl").read_text().splitlines() == attempts
    assert os.path.getmtime(runs / name / "summary.json") == mtime
