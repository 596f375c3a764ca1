"""Elastic training (hvd_lars.training.train, hvd_lars.parallel.elastic): 2 workers, then 1, then 2 again,
under horovodrun's elastic driver and a host discovery script that the test rewrites as training
progresses; the refusals of a worker count that does not divide the global batch and of another plan."""

import hashlib
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf
from horovod.common.exceptions import HorovodInternalError

from hvd_lars import LARS
from hvd_lars.parallel import elastic as hvd_elastic
from hvd_lars.training import train
from hvd_lars.training.config import TrainConfig
from tests.support.elastic_job import ElasticJob
from tests.support.main_server import run_main


@pytest.mark.unit
def test_check_launched_names_what_is_missing(monkeypatch):
    config = TrainConfig(global_batch_size=64)
    with monkeypatch.context() as patch:
        patch.setattr(train, "State", object)  # as imported without Horovod
        with pytest.raises(
            ImportError, match=r"^--elastic needs Horovod \(horovod.common.elastic\): run `make"
        ):
            train.check_launched(config, environ={"HOROVOD_ELASTIC": "1"})
    with pytest.raises(ValueError, match=r"launch/elastic.sh.*HOROVOD_ELASTIC is None, not '1'"):
        train.check_launched(config, environ={})
    train.check_launched(config, environ={"HOROVOD_ELASTIC": "1"})
    with pytest.raises(
        ValueError, match=r"--elastic needs --global_batch_size \(got 0 with --per_rank_batch_size=32\)"
    ):
        train.check_launched(TrainConfig(per_rank_batch_size=32), environ={"HOROVOD_ELASTIC": "1"})


@pytest.mark.unit
def test_resolve_batch_names_the_worker_counts_that_fit():
    config = TrainConfig(global_batch_size=96, accumulation_steps=2)
    assert train.resolve_batch(config, 3) == (96, 16)
    assert train.resolve_batch(config, 48) == (96, 1)
    with pytest.raises(ValueError) as e:  # the main program's one-line error, exit status 2
        train.resolve_batch(config, 5)
    message = str(e.value)
    assert "now has 5 workers" in message and "global batch of 96 images" in message
    # 96 / (n x 2) whole: n in the divisors of 48.
    assert "worker counts that divide it: 1, 2, 3, 4, 6, 8, 12, 16, 24, 48." in message


@pytest.mark.unit
def test_commit_interval_is_checked():
    for bad in (0, -1, 2.5):
        with pytest.raises(ValueError, match=rf"every_steps must be a whole number >= 1, got {bad!r}"):
            hvd_elastic.CommitState(object(), bad)
    with pytest.raises(ValueError, match=r"--elastic_commit_every_steps must be a whole number >= 1, got 0"):
        TrainConfig(global_batch_size=64, elastic_commit_every_steps=0).validate()


@pytest.mark.unit
def test_every_failed_collective_is_retried_and_every_other_error_raised():
    # Horovod 0.28.1's TensorFlow wrapper returned None for the first two: a grouped allreduce's failure
    # (every gradient reduction here) and the background loop's shut-down ended the job without an error.
    failures = [
        "Graph execution error: Detected at node hvd_lars.gradients/HorovodGroupedAllreduce ... Gloo "
        "Connection closed by peer [198.18.0.13]:36744",
        "Horovod has been shut down. This was caused by an exception on one of the ranks",
        "HorovodAllreduce_hvd_lars_skipped_0 failed",
        # A dead peer, as a surviving rank of tests/test_elastic_hosts.py saw it: no Horovod op named.
        "[/tmp/tmp.rgtwRD9TUJ/horovod-0.28.1/third_party/compatible17_gloo/gloo/transport/tcp/pair.cc:589] "
        "Read error [198.18.0.13]:41612: Connection reset by peer\n\t [[{{node hvd_lars.gradient.17}}]] "
        "[Op:__inference_multi_step_on_iterator_2629]",
        "Connection reset by peer [[{{node hvd_lars.gradient.17}}]]",
    ]

    def retried(error):
        def step(state):
            raise error

        return hvd_elastic.retry_collective_failures(step)

    for message in failures:
        with pytest.raises(HorovodInternalError):
            retried(tf.errors.UnknownError(None, None, message))(object())
    for error in (tf.errors.UnknownError(None, None, "a kernel failed"), ValueError("bad flag")):
        with pytest.raises(type(error)) as raised:
            retried(error)(object())
        assert raised.value is error
    assert hvd_elastic.retry_collective_failures(lambda state, k: state + k)(2, k=3) == 5


@pytest.mark.unit
def test_state_commits_and_restores_model_and_optimizer_exactly():
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2), keras.layers.BatchNormalization()])
    model.compile(optimizer=LARS(0.1), loss="mse")
    x, y = np.arange(24, dtype="float32").reshape(8, 3) / 24, np.ones((8, 2), "float32")
    model.fit(x, y, batch_size=4, epochs=1, verbose=0)
    state = hvd_elastic.KerasState(model, step=2)
    every = lambda: [v.numpy().copy() for v in model.variables + model.optimizer.variables]
    committed = every()
    model.fit(x, y, batch_size=4, epochs=1, verbose=0)
    state.step = 4
    assert int(model.optimizer.iterations) == 4
    assert any(not np.array_equal(a, b) for a, b in zip(committed, every()))
    state.restore()
    assert state.step == 2 and int(model.optimizer.iterations) == 2
    np.testing.assert_equal(every(), committed)
    model.fit(x, y, batch_size=4, epochs=1, verbose=0)
    state.step = 4
    state.commit()  # saves, then checks for membership changes (none: no driver)
    after = every()
    state.restore()
    assert state.step == 4
    np.testing.assert_equal(every(), after)


@pytest.mark.unit
def test_a_commit_due_at_an_epochs_last_update_waits_for_that_epochs_logs_and_checkpoint():
    # 3 updates per epoch, a commit every 3: due at each epoch's last update, where a membership change
    # taken up at once would skip the epoch's evaluation, logs and checkpoint (callbacks placed before).
    events = []

    class Recorder:
        def commit(self):
            events.append(("commit", self.step))

    logger = keras.callbacks.LambdaCallback(on_epoch_end=lambda epoch, logs: events.append(("logs", epoch)))
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    x, y = np.ones((6, 2), "float32"), np.ones((6, 1), "float32")
    model.fit(
        x, y, batch_size=2, epochs=2, verbose=0, callbacks=[logger, hvd_elastic.CommitState(Recorder(), 3)]
    )
    assert events == [("logs", 0), ("commit", 3), ("logs", 1), ("commit", 6)]


@pytest.mark.horovod
def test_a_worker_count_that_does_not_divide_the_global_batch_is_refused_at_the_change(tmp_path):
    job = ElasticJob(tmp_path, "localhost:1", 1, 2, "--global_batch_size=63")
    job.wait_for("elastic attempt 1: 1 worker(s) from update 0, 63 images per rank")  # killed if it fails
    job.set_hosts("localhost:2")
    returncode, out = job.finish(timeout=240), job.output()
    assert returncode != 0
    assert (
        "hvd_lars: error: the elastic job now has 2 workers: the global batch of 63 images does not fit them "
        "(x 1 accumulation steps)" in out
    ), out[-6000:]
    assert "worker counts that divide it: 1, 3, 7, 9, 21, 63." in out
    assert "elastic attempt 2" not in out


# smoke.flags as a resumable run with a checkpoint after every update (synchronous).
RESUMABLE = ["--run_name=r", "--checkpoint_every_steps=1", "--noasync_checkpoints",
             "--precision=float32", "--verbose=0"]  # fmt: skip


@pytest.mark.horovod
def test_an_elastic_restart_under_another_plan_is_refused_on_every_rank_and_resumes_under_its_own(tmp_path):
    # The plan check meets the elastic job's first sync (no collective may come before it).
    killer = [sys.executable, "tests/support/kill_at_step.py", "--flagfile=flags/smoke.flags", *RESUMABLE]
    killed = run_main([*killer, "--kill_at_step=4", f"--workdir={tmp_path}"])
    assert killed.returncode == -9, killed.stderr[-3000:]
    folder = tmp_path / "r" / "checkpoints"

    def digests():
        return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}

    before = digests()
    job = ElasticJob(tmp_path, "localhost:2", 2, 2, "--peak_learning_rate=2", flagfile="flags/smoke.flags",
                     base_flags=RESUMABLE)  # fmt: skip
    returncode, out = job.finish(), job.output()
    # No traceback from a worker (horovodrun has its own).
    assert returncode != 0 and ">:Traceback" not in out, out[-6000:]
    refusal = "holds a run with another plan (peak_learning_rate 1.0 -> 2.0), the plan of its checkpoint "
    refusals = [line for line in out.splitlines() if "hvd_lars: error:" in line and refusal in line]
    assert [line.split("]")[0] for line in refusals] == ["[0"], out[-6000:]  # rank 0, once
    assert digests() == before
    # Its own flags: rank 0 resumes the checkpoint of update 4 and both workers finish the run.
    job = ElasticJob(tmp_path, "localhost:2", 2, 2, flagfile="flags/smoke.flags", base_flags=RESUMABLE)
    returncode, out = job.finish(), job.output()
    assert returncode == 0, out[-6000:]
    assert f"resumed from {folder}/ckpt-4 (step 4)" in out
    assert "elastic attempt 1: 2 worker(s) from update 4, 16 images per rank" in out
