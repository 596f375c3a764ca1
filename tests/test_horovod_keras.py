"""`hvd_lars.parallel.horovod_keras` as `horovod.tensorflow.keras` in Keras 3, and Open MPI's allreduce rules.
The 2-rank cases are functions of tests/support/hvd_worker.py, run as one job."""

import types

import keras
import numpy as np
import pytest

import hvd_lars
from hvd_lars.parallel import collectives, horovod_keras, ompi_allreduce_rules
from hvd_lars.parallel.horovod_keras.callbacks import LearningRateScheduleCallback, LearningRateWarmupCallback
from tests.support import hvd_worker


def _apply_twice(optimizer, first=1.0):
    """Gradients `first` (then 1.0, 1.0) on micro-batches of updates of 2; w after the last (from 0)."""
    w = keras.Variable(0.0)
    for g in (first, first) if first != 1.0 else ():
        optimizer.apply([keras.ops.convert_to_tensor(g)], [w])
    w.assign(0.0)
    for _ in range(2):
        optimizer.apply([keras.ops.ones(())], [w])
    return float(w.numpy())


@pytest.mark.unit
def test_horovods_distributed_optimizer_sums_micro_batches_and_takes_horovods_arguments():
    # SGD(1.0), gradient 1.0 twice in one update of 2 passes: Horovod sums; hvd_lars's optimizer averages,
    # as Keras's gradient_accumulation_steps does.
    sgd = lambda: keras.optimizers.SGD(1.0)
    assert _apply_twice(horovod_keras.DistributedOptimizer(sgd(), backward_passes_per_step=2)) == -2.0
    assert _apply_twice(hvd_lars.DistributedOptimizer(sgd(), backward_passes_per_step=2)) == -1.0
    assert not isinstance(horovod_keras.DistributedOptimizer, type)  # a function, as Horovod's
    wrapper = horovod_keras.DistributedOptimizer(sgd())
    got = [wrapper.average_aggregated_gradients, wrapper.op, wrapper.compression]
    assert got == [False, "average", "none"]
    assert type(wrapper).from_config(wrapper.get_config()).get_config() == wrapper.get_config()
    # Horovod's test_grad_aggregation_with_inf_grad: after infinite gradients the next update starts from 0.
    assert _apply_twice(horovod_keras.DistributedOptimizer(sgd(), backward_passes_per_step=2), np.inf) == -2.0
    for make in (hvd_lars.DistributedOptimizer, horovod_keras.DistributedOptimizer):
        assert make(sgd(), compression=horovod_keras.Compression.fp16).compression == "fp16"
        assert make(sgd(), compression=horovod_keras.Compression.none).compression == "none"
        assert make(sgd(), op=horovod_keras.Sum).op == "sum"
    with pytest.raises(ValueError, match=r"op must be one of \('average', 'sum'\), hvd.Average or hvd.Sum"):
        horovod_keras.DistributedOptimizer(keras.optimizers.SGD(), op=collectives.horovod_tensorflow().Adasum)


def _fit_epochs(optimizer, callbacks, epochs=2):
    """w after each epoch of one update from w = 1 with gradient 2 w (x = 1, y = 0, squared error), the
    callbacks called as `fit` calls them; and their History."""
    w, trace, history = keras.Variable(1.0), [], keras.callbacks.History()
    optimizer.build([w])
    model = types.SimpleNamespace(optimizer=optimizer)
    callbacks = keras.callbacks.CallbackList([*callbacks, history], model=model, epochs=epochs, steps=1)
    callbacks.on_train_begin()
    for epoch in range(epochs):
        callbacks.on_epoch_begin(epoch)
        callbacks.on_train_batch_begin(0)
        optimizer.apply([2 * w.value], [w])
        callbacks.on_train_batch_end(0)
        callbacks.on_epoch_end(epoch, {"loss": 4 * float(w.numpy()) ** 2})
        trace.append(float(w.numpy()))
    return trace, history


def _halving(**kwargs):
    return LearningRateScheduleCallback(initial_lr=0.1, multiplier=lambda epoch: [1.0, 0.5][epoch], **kwargs)


@pytest.mark.unit
def test_momentum_correction_rescales_the_velocity_where_the_rate_changes_and_is_refused_where_wrong():
    # SGD(0.1, momentum=0.9), m = 0.9 m - lr g, w += m, g = 2 w. Epoch 0 at 0.1: m = -0.2, w = 0.8.
    # Epoch 1 at 0.05: corrected, m = 0.9 * (0.5 * -0.2) - 0.05 * 1.6 = -0.17, w = 0.63 (Horovod's
    # momentum 0.45 for that batch: 0.45 * -0.2 - 0.08, the same); uncorrected m = -0.26, w = 0.54.
    sgd = hvd_lars.DistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.9))
    trace, history = _fit_epochs(sgd, [_halving()])
    assert trace == pytest.approx([0.8, 0.63], abs=1e-6)
    assert history.history["lr"] == pytest.approx([0.1, 0.05])  # Horovod's callbacks log the rate
    trace, _ = _fit_epochs(keras.optimizers.SGD(0.1, momentum=0.9), [_halving(momentum_correction=False)])
    assert trace == pytest.approx([0.8, 0.54], abs=1e-6)
    # RMSprop's momentum buffer carries the rate too: m = 0.9 m + lr g / rms (rms of g = 2 w).
    trace, _ = _fit_epochs(keras.optimizers.RMSprop(0.1, rho=0.0, momentum=0.9, epsilon=0.0), [_halving()])
    assert trace == pytest.approx([0.9, 0.9 - (0.9 * 0.5 * 0.1 + 0.05)], abs=1e-5)
    # Without momentum (Adam, Horovod's hasattr check): nothing to correct, the same as without.
    with_correction, _ = _fit_epochs(keras.optimizers.Adam(0.1), [_halving()])
    without, _ = _fit_epochs(keras.optimizers.Adam(0.1), [_halving(momentum_correction=False)])
    assert with_correction == without
    # Where Horovod's rule is wrong: refused with either callback, accepted without the correction.
    for make, why in (
        (lambda: hvd_lars.LARS(0.1, momentum=0.9), "LARS rescales its own velocity"),
        (lambda: keras.optimizers.SGD(0.1, momentum=0.9, nesterov=True), "Nesterov's look-ahead"),
    ):
        for callback in (_halving(), LearningRateWarmupCallback(initial_lr=0.1, steps_per_epoch=1)):
            with pytest.raises(
                ValueError, match=f"^momentum_correction=True with .*{why}.*; pass momentum_correction=False"
            ):
                _fit_epochs(hvd_lars.DistributedOptimizer(make()), [callback])
        assert len(_fit_epochs(make(), [_halving(momentum_correction=False)])[0]) == 2


@pytest.mark.unit
def test_learning_rate_schedule_and_best_model_checkpoint_callbacks_as_horovods():
    rates = []
    record = keras.callbacks.LambdaCallback(
        on_train_batch_begin=lambda batch, logs: rates.append(float(model.optimizer.learning_rate.numpy()))
    )
    model = keras.Sequential([keras.Input((1,)), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", jit_compile=False)
    # Not a staircase: initial_lr * multiplier(epoch + batch / steps) before each of 2 batches per epoch,
    # from epoch 1 on (start_epoch), until epoch 3 (end_epoch excluded).
    smooth = LearningRateScheduleCallback(1.0, lambda e: e / 10, start_epoch=1, end_epoch=3, staircase=False)
    model.fit(np.ones((4, 1)), np.ones((4, 1)), batch_size=2, epochs=4, verbose=0, callbacks=[smooth, record])
    assert rates == pytest.approx([0.1, 0.1, 0.1, 0.15, 0.2, 0.25, 0.25, 0.25])
    best = horovod_keras.callbacks.BestModelCheckpoint(monitor="loss", filepath="best.keras")
    assert best.save_best_only and best.monitor == "loss"  # saves the best only


@pytest.mark.unit
@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: LearningRateScheduleCallback(None, 0.5), "initial_lr must be a finite number > 0, got None"),
        (lambda: LearningRateWarmupCallback(initial_lr=0), "initial_lr must be a finite number > 0, got 0"),
        (lambda: LearningRateWarmupCallback(initial_lr=0.1, warmup_epochs="five"),
         "warmup_epochs must be a finite number > 0, got 'five'"),
        (lambda: horovod_keras.callbacks.BestModelCheckpoint(monitor="loss"),
         "BestModelCheckpoint needs filepath="),
        (lambda: horovod_keras.broadcast_global_variables(0),
         r"pass the model .*BroadcastGlobalVariablesCallback\(0\)"),
        (lambda: horovod_keras.load_model("model.keras", legacy_opts=True),
         r"load_model\(legacy_opts=True\): Keras 3 has no legacy optimizers"),
        (lambda: horovod_keras.DistributedOptimizer(keras.optimizers.SGD()).register_local_var(1.0),
         "var must be a keras.Variable or a tf.Variable, got 1.0"),  # tf.Variables: the 2-rank job's
    ],
)  # fmt: skip
def test_arguments_keras_3_cannot_take_are_refused_saying_why(make, message):
    with pytest.raises(ValueError, match=message):
        make()


@pytest.mark.unit
def test_ompi_allreduce_rules_unless_the_user_or_site_chose(tmp_path):
    site = tmp_path / "openmpi-mca-params.conf"
    site.write_text("btl = ^openib\n# coll_tuned_use_dynamic_rules = 1 (a comment)\n")
    environ = {"PATH": "/bin"}
    applied, line = ompi_allreduce_rules.apply(environ, open_mpi=True, gpu=False, files=[str(site)])
    cpu = ompi_allreduce_rules.CPU_DEFAULTS  # their values: tests/test_threads.py
    assert applied == {**cpu, **ompi_allreduce_rules.RULES_SETTINGS}
    assert environ == {"PATH": "/bin", **applied}
    assert "the ring" in line and "OMPI_MCA_coll_tuned_use_dynamic_rules=0" in line
    # Chosen by the user (any coll_tuned variable) or the site (a coll_tuned line of a parameter file).
    for environ, files, chosen in (
        ({"OMPI_MCA_coll_tuned_allreduce_algorithm": "4"}, [], "OMPI_MCA_coll_tuned_allreduce_algorithm=4"),
        ({"OMPI_MCA_coll_tuned_use_dynamic_rules": "0"}, [], "OMPI_MCA_coll_tuned_use_dynamic_rules=0"),
        ({}, [str(tmp_path / "user.conf")], "coll_tuned_allreduce_algorithm in "),
    ):
        (tmp_path / "user.conf").write_text("coll_tuned_allreduce_algorithm = 2\n")
        got, line = ompi_allreduce_rules.apply(environ, open_mpi=True, gpu=False, files=files)
        assert got == cpu and chosen in line and "not applied" in line
        assert "OMPI_MCA_coll_tuned_dynamic_rules_filename" not in environ
    # Open MPI's list of parameter files, when the user sets it.
    environ = {"OMPI_MCA_mca_base_param_files": f"{tmp_path / 'user.conf'}:{tmp_path / 'absent.conf'}"}
    assert ompi_allreduce_rules.parameter_files(environ) == [str(tmp_path / "user.conf")]
    assert ompi_allreduce_rules.apply(environ, open_mpi=True, gpu=False)[0] == cpu
    # GPU jobs and jobs not on Open MPI are left alone, silently.
    assert ompi_allreduce_rules.apply({}, open_mpi=True, gpu=True, files=[]) == ({}, None)
    assert ompi_allreduce_rules.apply({}, open_mpi=False, gpu=False, files=[]) == ({}, None)
    assert not ompi_allreduce_rules.open_mpi_job({"HOROVOD_CONTROLLER": "gloo", "OMPI_COMM_WORLD_SIZE": "4"})
    assert ompi_allreduce_rules.open_mpi_job({"OMPI_COMM_WORLD_SIZE": "4"})


@pytest.mark.unit
@pytest.mark.parametrize("size, printed", [(2, ""), (3, "ring line\n")])
def test_init_applies_the_rules_unless_off_and_says_so_on_three_ranks(monkeypatch, capsys, size, printed):
    monkeypatch.setattr(horovod_keras._horovod, "is_initialized", lambda: False)  # whatever ran before
    calls = []
    # The CPU defaults are applied either way (their cases: test_ompi_allreduce_rules_unless_...), the rules
    # unless turned off.
    apply = lambda rules: calls.append(("apply", rules)) or ({}, "ring line" if rules else None)
    monkeypatch.setattr(ompi_allreduce_rules, "apply", apply)
    init = lambda comm=None, process_sets=None: calls.append("init") or (0, size)
    monkeypatch.setattr(collectives, "init", init)
    assert horovod_keras.init(ompi_allreduce_rules=False) == (0, size) and calls == [("apply", False), "init"]
    assert capsys.readouterr().out == ""
    calls.clear()
    assert horovod_keras.init() == (0, size) and calls == [("apply", True), "init"]
    assert capsys.readouterr().out == printed


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    w = hvd_worker
    cases = [w.init_state, w.optimizer_arguments, w.value_collectives, w.aggregation_with_local_vars,
             w.warmup_momentum_correction, w.deferred_build, w.rank0_loads, w.local_variables]  # fmt: skip
    return hvd_worker.run(tmp_path_factory.mktemp("horovod_keras"), [(case,) for case in cases])


@pytest.mark.horovod
def test_init_gives_open_mpi_the_ring_silently_and_the_value_collectives_on_two_ranks(ranks):
    results, stdout = ranks
    assert "allreduce" not in stdout  # the rules act on 3 ranks and more: nothing to say on 2
    rules = ompi_allreduce_rules.RULES_FILE
    for r, got in enumerate(results(hvd_worker.init_state)):
        assert got == {"rank": r, "size": 2, "cross_rank": 0, "initialized": True, "rules": rules}
    for r, got in enumerate(results(hvd_worker.value_collectives)):
        assert got["allreduce"] == [1.5] and got["allreduce_sum"] == 3.0
        assert got["allreduce_variable"] == [1.0] and got["allreduce_graph"] == [3.0]
        assert got["allgather"] == [[0], [1]] and got["broadcast"] == 15
        # [1, 2, 3, 4] + [2, 4, 6, 8] = [3, 6, 9, 12], split between the ranks.
        assert got["reducescatter"] == [[3.0, 6.0], [9.0, 12.0]][r]
        assert got["max_over_ranks"] == 3


@pytest.mark.horovod
def test_op_predivide_compression_groups_and_load_model_on_two_ranks(ranks):
    # Gradients 0 and -4 at w = 1: mean -2 (w = 1.2), sum -4 (w = 1.4); a predivide factor, float16 on the
    # wire, explicit groups and a plain optimizer that hvd.load_model wraps give the same mean.
    for got in ranks[0](hvd_worker.optimizer_arguments):
        got = dict(got)
        assert got.pop("sum") == pytest.approx(1.4, abs=1e-6)
        assert got.pop("load_model_types") == ["DistributedOptimizer", "SGD"]
        assert got == pytest.approx(dict.fromkeys(got, 1.2), abs=1e-6)
        assert len(got) == 6


@pytest.mark.horovod
def test_local_variables_keep_their_own_values_and_gradients_as_horovods_numbers(ranks):
    # Not broadcast (local_variables), not averaged, divided by the world size (Horovod's
    # scale_local_gradients): rank 0 at w = 1 has gradient 0; rank 1 at w = 0 has -6, so -3: w = 0.3.
    r0, r1 = ranks[0](hvd_worker.local_variables)
    assert r0 == pytest.approx({"register_local_var": 1.0, "partial": 1.0}, abs=1e-6)
    assert r1 == pytest.approx({"register_local_var": 0.3, "partial": 0.3}, abs=1e-6)
    # Horovod's compute_expected_value: after pass k (from 0), n = (k + 1) // 4 updates; d loss / dx = 1,
    # d loss / dy_0 = -(rank + 1); shared variables get the mean over ranks (y: -1.5), local ones their
    # rank's own divided by the world size; summed over the 4 passes when not averaging.
    for r, result in enumerate(ranks[0](hvd_worker.aggregation_with_local_vars)):
        for average in (True, False):
            for k, row in enumerate(result[average]):
                n = (k + 1) // 4 * (1 if average else 4)
                x = [n / 2] * 4 + [float(n)] * 4
                y = [1.0 - n * (r + 1) / 2] * 4 + [1.0 - 1.5 * n] * 4
                assert row == pytest.approx(x + y, abs=1e-6), (r, average, k)


@pytest.mark.horovod
def test_warmup_corrects_momentum_on_two_ranks(ranks):
    # Warmup to 0.2 over 1 epoch of 2 updates on 2 ranks: rates 0.15, 0.2, 0.2, 0.2; at the change
    # (update 1) the velocity is multiplied by 0.2 / 0.15. x = 1, y = 0: g = 2 w on both ranks.
    w, m, want = 1.0, 0.0, []
    for lr, ratio in ((0.15, 1.0), (0.2, 0.2 / 0.15), (0.2, 1.0), (0.2, 1.0)):
        m = 0.9 * m * ratio - lr * 2 * w
        w += m
        want.append(w)
    for got in ranks[0](hvd_worker.warmup_momentum_correction):
        assert got["w"] == pytest.approx(want, abs=1e-5)
        assert got["lr_logs"] == pytest.approx([0.2, 0.2])


@pytest.mark.horovod
def test_broadcast_reaches_models_built_in_their_first_step_and_models_loaded_on_rank_0(ranks):
    # Rank 0 starts from w = 1, rank 1 from w = 0: from rank 0's w the averaged gradient is
    # (2 (1 - 1) + 2 (1 - 3)) / 2 = -2, so SGD(0.1, momentum=0.9) sets m to 0.9 m + 0.2 and w to w + m
    # (from rank 1's w = 0 the mean gradient would be -3: w = 1.3).
    built = ranks[0](hvd_worker.deferred_build)
    assert built[0] == built[1]
    # DistributedOptimizer's micro-batch counter, SGD's counter, rate and momentum: 1, 1, 0.1, 0.2.
    for kind in ("sequential", "subclassed"):
        got = built[0][kind]
        assert (got["w"], got["iterations"]) == (pytest.approx(1.2, abs=1e-6), 1), kind
        assert got["optimizer"] == pytest.approx([1, 1, 0.1, 0.2], abs=1e-6), kind
    loaded = ranks[0](hvd_worker.rank0_loads)
    assert loaded[0]["paths"] != loaded[1]["paths"]  # e.g. dense_3/kernel against dense_2/kernel
    for got in loaded:
        # Rank 0's file: w = 1, momentum 0.5, 7 updates; one more: momentum 0.45 + 0.2, w 1.65, 8 updates.
        assert (got["w"], got["iterations"]) == (pytest.approx(1.65, abs=1e-6), 8)
        assert got["optimizer"] == pytest.approx([1, 8, 0.1, 0.65], abs=1e-6)
