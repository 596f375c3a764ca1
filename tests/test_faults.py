"""Faults end a job cleanly: a launcher and Horovod that disagree about the world size, ranks that disagree
about their variables, divergence, preemption, a rank that dies, a failed write, a hang. Fault injection
lives in tests/ (kill_at_step.py, mismatch_worker.py)."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import types

import keras
import numpy as np
import pytest
import tensorflow as tf

from hvd_lars import main
from hvd_lars.training import checkpoints, faults
from tests.support import REPO
from tests.support.main_server import run_main, served
from tests.support.small_runs import KILLER, TWO_RANKS, final_tensors
from tests.test_main import _exit_of

LAUNCHER_VARIABLES = ("OMPI_COMM_WORLD_SIZE", "HOROVOD_SIZE", "PMI_SIZE", "PMIX_SIZE", "SLURM_STEP_NUM_TASKS")
# The training program's init outside a launcher starts no Horovod (no MPI start-up); the library's does.
INIT = (
    "from hvd_lars.parallel import collectives as c; import horovod.tensorflow as h; print("
    "c.init(launched_only=True), h.is_initialized(), c.init(), h.is_initialized())"
)


def _clean_env(**extra):
    env = {
        k: v for k, v in os.environ.items() if k not in LAUNCHER_VARIABLES and not k.startswith("OMPI_COMM")
    }
    return dict(env, PYTHONPATH=REPO, **extra)


@pytest.mark.unit
def test_launcher_world_size_reads_the_job_step_not_the_job():
    from hvd_lars.parallel.collectives import launcher_world_size

    assert launcher_world_size({"PMI_SIZE": "2", "PMI_RANK": "1"}) == ("PMI_SIZE", 2)
    assert launcher_world_size({"OMPI_COMM_WORLD_SIZE": "4", "PMI_SIZE": "2"}) == ("OMPI_COMM_WORLD_SIZE", 4)
    step = {"SLURM_STEP_NUM_TASKS": "8", "SLURM_NTASKS": "8"}
    assert launcher_world_size(step) == ("SLURM_STEP_NUM_TASKS", 8)
    # Job-level Slurm variables, which a one-process batch step also has, say nothing about this process.
    assert launcher_world_size({"SLURM_NTASKS": "2", "SLURM_NPROCS": "2"}) == (None, None)
    assert launcher_world_size({"PMI_SIZE": ""}) == (None, None)


@pytest.mark.horovod
def test_pmi_job_of_two_that_horovod_sees_as_one_is_refused_and_job_level_slurm_variables_are_not(tmp_path):
    # As a new user would: PMI_SIZE=2 PMI_RANK=1 set and no launcher Horovod's MPI can join. The main
    # program says so in one line, exit status 2, before it writes anything.
    main = [sys.executable, "-m", "hvd_lars.main", "--flagfile=flags/fashion_mnist_lars.flags"]
    env = _clean_env(PMI_SIZE="2", PMI_RANK="1")
    result = run_main(main + [f"--workdir={tmp_path}"], cwd=REPO, env=env, timeout=120)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert "the launcher started 2 processes (PMI_SIZE=2)" in result.stderr
    assert "initialised a world of 1 rank(s)" in result.stderr and os.listdir(tmp_path) == []
    env = _clean_env(SLURM_NTASKS="2", SLURM_NPROCS="2", SLURM_JOB_NUM_NODES="1")
    result = subprocess.run(
        [sys.executable, "-c", INIT], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0 and result.stdout == "(0, 1) False (0, 1) True\n", result.stderr[-2000:]


@pytest.fixture(scope="module")
def mismatch(tmp_path_factory):
    """Both ranks' results of tests/support/mismatch_worker.py (its two cases, one process group)."""
    out = tmp_path_factory.mktemp("mismatch")
    env = dict(os.environ, PYTHONPATH=REPO)
    worker = os.path.join(REPO, "tests", "support", "mismatch_worker.py")
    command = served(TWO_RANKS + [sys.executable, worker, str(out)], env=env)
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=150, env=env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return [np.load(out / f"rank{r}.npz") for r in range(2)]


@pytest.mark.horovod
def test_ranks_with_different_automatic_names_train_together(mismatch):
    # Rank 1 built an extra model first: its layers are sequential_1/dense_2 ... where rank 0 has
    # sequential/dense. Collectives named by position pair them; before, this hung with stall warnings.
    r0, r1 = mismatch
    assert list(r0["names"]) != list(r1["names"])  # the automatic names did differ
    weights = [k for k in r0.files if k.startswith("arr_")]
    assert len(weights) == 4
    for k in weights:
        np.testing.assert_array_equal(r0[k], r1[k])


@pytest.mark.horovod
def test_ranks_with_different_models_get_an_error_naming_the_first_difference(mismatch):
    # The same error on both ranks (raised before any broadcast), instead of a hang.
    for r in mismatch:
        error = str(r["error"])
        assert "ranks disagree about the variables they exchange: rank 0 has" in error
        # Rank 0's output layer (kernel 3x2) stands where rank 1 has its extra hidden layer (3x3).
        assert "first difference at position 2: rank 0 sequential/dense/kernel [3, 2] float32" in error
        assert "rank 1 sequential/dense/kernel [3, 3] float32" in error


# ------------------------------------------------------------------------------------ training runs
# 8 updates per epoch, 16 in all; warmup over the first 8.
SMALL = [
    "--flagfile=flags/fashion_mnist_lars.flags", "--max_train_examples=512", "--max_eval_examples=500",
    "--global_batch_size=64", "--epochs=2", "--warmup_epochs=1", "--run_name=r", "--verbose=0",
]  # fmt: skip


def _train(workdir, *flags, launcher=(), fault=(), timeout=300):
    program = [KILLER, *fault] if fault else ["-m", "hvd_lars.main"]
    cmd = list(launcher) + [sys.executable] + program + SMALL + [f"--workdir={workdir}", *flags]
    return run_main(cmd, cwd=REPO, timeout=timeout)


def _checkpoint_steps(run_dir):
    folder = os.path.join(run_dir, "checkpoints")
    return sorted(int(f.split("-")[1].split(".")[0]) for f in os.listdir(folder) if f.endswith(".index"))


def _check_diverged(tmp_path, out):
    """`out`: the run's output. Returns the step it diverged at, after checking its record."""
    match = re.search(r"training diverged at step (\d+) \(learning rate ([0-9.e+-]+)\)", out)
    assert match, out[-3000:]
    step, rate = int(match.group(1)), float(match.group(2))
    # The rate of update `step` on the linear warmup over 8 updates: 1,000 x (step - 1) / 8.
    assert 1 < step <= 16 and rate == pytest.approx(1000 * (step - 1) / 8)
    run_dir = tmp_path / "r"
    strict = dict(parse_constant=lambda token: pytest.fail(f"bare {token} in summary.json: not strict JSON"))
    stopped = json.loads((run_dir / "summary.json").read_text(), **strict)["stopped"]
    assert stopped["reason"] == "TrainingDiverged" and stopped["step"] == step
    # One checkpoint per update up to the last finite one; none of non-finite weights rotated them out.
    kept = _checkpoint_steps(run_dir)
    assert kept == list(range(max(1, step - 3), step)), kept
    for s in kept:
        tensors = final_tensors(run_dir, s)  # the model's and the optimizer's
        assert len(tensors) > 20 and all(np.isfinite(v).all() for v in tensors.values()), s
    return step


# Momentum SGD warmed up towards a peak rate of 1,000: the weights overflow during the warmup.
DIVERGING = [
    "--optimizer=momentum",
    "--peak_learning_rate=1000",
    "--checkpoint_every_steps=1",
    "--keep_checkpoints=3",
]


@pytest.mark.unit
def test_divergence_stops_one_process_with_status_3_keeping_finite_checkpoints(tmp_path, monkeypatch, caplog):
    status, [line] = _exit_of([*SMALL[1:], *DIVERGING, f"--workdir={tmp_path}"], monkeypatch, caplog)
    assert status == 3
    _check_diverged(tmp_path, line)


@pytest.mark.horovod
def test_divergence_stops_both_ranks_at_the_same_update(tmp_path):
    result = _train(tmp_path, *DIVERGING, launcher=TWO_RANKS)
    assert result.returncode != 0
    step = _check_diverged(tmp_path, result.stderr)
    # Both ranks stopped after the same update; rank 0's line says so, counting the ranks.
    assert f"[1,0]<stderr>:hvd_lars: error: training diverged at step {step} " in result.stderr
    assert result.stderr.count("hvd_lars: error:") == 1, result.stderr[-3000:]
    assert "non-finite loss or variables on 2 of 2 rank(s)" in result.stderr


@pytest.mark.horovod
def test_a_rank_killed_mid_epoch_ends_the_job_within_a_minute(tmp_path):
    # Rank 1 SIGKILLed after update 12 of 16 (mid-epoch 2), between the checkpoints of steps 10 and 15.
    record = tmp_path / "killed_at"
    fault = ["--kill_at_step=12", "--kill_signal=KILL", "--kill_rank=1", f"--kill_record={record}"]
    result = _train(tmp_path, "--checkpoint_every_steps=5", launcher=TWO_RANKS, fault=fault)
    ended = time.time()
    assert result.returncode != 0
    assert ended - float(record.read_text()) < 60
    run_dir = tmp_path / "r"
    assert _checkpoint_steps(run_dir) == [5, 8, 10]
    # The index names the last complete checkpoint, which loads whole.
    latest = final_tensors(run_dir)
    assert len(latest) > 20 and all(np.isfinite(v).all() for v in latest.values())
    assert int(latest["optimizer/_iterations/.ATTRIBUTES/VARIABLE_VALUE"]) == 10


@pytest.mark.unit
def test_run_dir_problems_and_a_failed_checkpoint_are_one_clear_error(tmp_path, monkeypatch, caplog):
    (tmp_path / "file").write_text("")
    status, [line] = _exit_of([*SMALL[1:], f"--workdir={tmp_path / 'file'}"], monkeypatch, caplog)
    assert status == 2
    assert line.startswith(f"cannot write the run directory {tmp_path / 'file' / 'r'}: [Errno 20] Not a dir")
    assert faults.run_dir_problem(str(tmp_path / "new"), 1) is None and (tmp_path / "new").is_dir()
    monkeypatch.setattr(shutil, "disk_usage", lambda path: types.SimpleNamespace(free=100 * 2**20))
    assert faults.run_dir_problem(str(tmp_path / "new"), 2**30) == (
        f"the run directory {tmp_path / 'new'} has 100.0 MiB free, but training needs 1024.0 MiB there for "
        "its checkpoints. Free space, lower --keep_checkpoints, or choose another --workdir."
    )
    # float32 3x4 + 4 and a bfloat16 2x2: 64 + 8 bytes.
    variables = [keras.Variable(np.zeros((3, 4), "float32")), keras.Variable(np.zeros(4, "float32"))]
    variables.append(keras.Variable(np.zeros((2, 2)), dtype="bfloat16"))
    assert faults.checkpoint_bytes(variables) == 72
    # The checkpoint folder becomes a file after a start: the epoch-end checkpoint of update 2 fails, written
    # in the foreground or in the background (found at the end). (That the loop lets its callbacks' errors
    # through: the divergence test above.)
    model = keras.Sequential([keras.Input((1,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    model.optimizer.iterations.assign(2)
    for asynchronous in (False, True):
        folder = tmp_path / f"checkpoints_{asynchronous}"
        manager = tf.train.CheckpointManager(tf.train.Checkpoint(model=model), str(folder), max_to_keep=3)
        checkpointer = checkpoints.PeriodicCheckpoint(manager, every_steps=0, asynchronous=asynchronous)
        checkpointer.set_model(model)
        folder.write_text("not a folder")
        ends = (checkpointer.on_epoch_end, checkpointer.on_train_end)
        monkeypatch.setattr(main, "run_training", lambda config, ends=ends: [end(0) for end in ends])
        monkeypatch.setattr(faults, "_noted", None)  # the other case's failure, noted in this process
        caplog.clear()
        status, [line] = _exit_of([*SMALL[1:], f"--workdir={tmp_path / 'w'}"], monkeypatch, caplog)
        assert status == 2 and line.startswith(f"could not write the checkpoint of step 2 to {folder}: "), (
            line
        )
        assert line.endswith("it resumes from the last complete checkpoint.")
    assert sorted(os.listdir(tmp_path)) == ["checkpoints_False", "checkpoints_True", "file", "new"]


class _Clock:
    """A monotonic clock the test moves by hand (hvd_lars.training.faults reads `time.monotonic`)."""

    def __init__(self, now):
        self.now, self.reads = now, 0

    def monotonic(self):
        self.reads += 1
        return self.now

    def __getattr__(self, name):
        return getattr(time, name)


def _until(condition, what, limit_s=60):
    # Waits for an event of the watchdog's thread; the limit only keeps a broken build from hanging.
    started = time.monotonic()
    while not condition():
        assert time.monotonic() - started < limit_s, f"the watchdog's thread never {what}"
        time.sleep(0.01)


@pytest.mark.unit
def test_watchdog_ends_a_process_without_progress_and_spares_one_with_it_or_stopped(monkeypatch, caplog):
    clock = _Clock(1000.0)
    monkeypatch.setattr(faults, "time", clock)
    ended = []

    def checked():  # the watchdog's thread reads the clock once per check
        reads = clock.reads
        _until(lambda: clock.reads > reads, "checked the clock")

    with faults.ProgressWatchdog(0.4, exit=ended.append) as watchdog:  # checks every 0.1 s
        watchdog.set_model(types.SimpleNamespace(optimizer=types.SimpleNamespace(iterations=7)))
        assert faults._last_progress == 1000.0
        for _ in range(5):  # 0.5 s with progress every 0.1 s: never 0.4 s without
            clock.now += 0.1
            faults.heartbeat()
            checked()
        # Stopped for 100 s: the thread wakes 100 s after its last check, far past 2 checks + 1 s.
        last, clock.now = faults._last_progress, clock.now + 100
        _until(lambda: faults._last_progress != last, "saw the stop")
        assert faults._last_progress == pytest.approx(clock.now - 0.1) and ended == []
        # Then 0.35 s without progress while running: not yet; 0.6 s (under 2 checks + 1 s): hung.
        clock.now += 0.25
        checked()
        checked()  # the first check's verdict is in
        assert ended == [] and not watchdog.fired
        clock.now += 0.25
        _until(lambda: ended, "fired")
    assert ended == [faults.EXIT_HUNG] == [4] and watchdog.fired
    [line] = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert line.startswith("rank 0 of 1: no progress for 1 s (--hang_timeout_s=0.4) after update 7: ")
    assert line.endswith(
        f"(exit status {faults.EXIT_HUNG}) so that the launcher ends the job; the last "
        "complete checkpoint is kept."
    )
    with faults.ProgressWatchdog(0, exit=ended.append) as watchdog:
        assert watchdog._thread is None  # off: no thread to end anything
    with pytest.raises(ValueError, match=r"hang timeout must be >= 0 seconds \(0: off\), got -1"):
        faults.ProgressWatchdog(-1)


@pytest.mark.horovod
def test_a_rank_stopped_and_continued_is_not_ended_as_hung(tmp_path):
    # A process under a 5 s watchdog reports progress, writes a marker and waits for a line on its stdin;
    # SIGSTOPped for 7 s, past the timeout, then continued and sent the line, it must finish (status 0).
    code = """import sys
from hvd_lars.training import faults
with faults.ProgressWatchdog(5.0):
    faults.heartbeat()
    open(sys.argv[1], 'w').close()
    sys.stdin.readline()
    faults.heartbeat()
print('finished')
"""
    marker = tmp_path / "waiting"
    env = dict(os.environ, PYTHONPATH=REPO, TF_CPP_MIN_LOG_LEVEL="2")
    command = [sys.executable, "-c", code, str(marker)]
    pipes = dict(stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc = subprocess.Popen(command, cwd=REPO, env=env, text=True, **pipes)
    try:
        _until(marker.exists, "started", limit_s=300)
        proc.send_signal(signal.SIGSTOP)
        time.sleep(7.0)  # the stop itself is what is tested: longer than 5 s
        proc.send_signal(signal.SIGCONT)
        out, err = proc.communicate("go\n", timeout=300)
    finally:
        proc.kill()
    assert proc.returncode == 0 and "finished" in out, (proc.returncode, err[-2000:])


@pytest.mark.unit
def test_the_finite_check_is_traced_once_per_model_and_still_sees_every_value():
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2), keras.layers.BatchNormalization()])
    model.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9), loss="mse")
    model.optimizer.build(model.trainable_variables)  # as the loop's start does, before any fit
    checks = []
    for attempt in range(3):  # each attempt's guard (its start only: no collective here), fits between
        if attempt:
            model.fit(np.ones((4, 3)), np.ones((4, 2)), batch_size=2, verbose=0)
        guard = faults.FaultGuard(faults.StopSignals(), None)
        guard.set_model(model)
        guard.on_train_begin()
        checks.append(guard._finite)
    assert checks[1] is checks[0] and checks[2] is checks[0]  # one trace for the model's variables
    assert bool(checks[0]())
    slot = model.optimizer.variables[-1]  # a momentum slot: not a weight, checked all the same
    slot.assign(np.full(slot.shape, np.inf, "float32"))
    assert not bool(checks[0]())
    other = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    other.compile(optimizer="sgd", loss="mse")
    other.optimizer.build(other.trainable_variables)
    guard = faults.FaultGuard(faults.StopSignals(), None)
    guard.set_model(other)
    guard.on_train_begin()
    assert guard._finite is not checks[0] and bool(guard._finite())
