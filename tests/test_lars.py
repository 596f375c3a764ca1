"""LARS against the NumPy reference (tests/support/lars_reference.py) and Keras optimizer conventions."""

import copy
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

from hvd_lars import LARS, PaperPolynomialDecay, WarmupPolynomialDecay, mlperf_exclusions
from tests.support import lars_reference as numpy_lars

MODES = ["paper", "decayed_gradient", "update"]


def _run(optimizer, weights, grads_per_step, paths=None, lrs=None, fused=True):
    """Final weights after applying each step's gradients in a tf.function (rate `lrs[t]` if given)."""
    variables = numpy_lars.keras_variables(weights, paths)
    optimizer._fused = fused
    optimizer.build(variables)
    step = tf.function(lambda grads: optimizer.apply(grads, variables))
    for t, grads in enumerate(grads_per_step):
        if lrs is not None:
            optimizer.learning_rate = lrs[t]
        step([tf.constant(g, tf.float32) for g in grads])
    return [v.numpy() for v in variables]


CASES = [(m, n, c) for m in MODES for n in (False, True) for c in (False, True) if not (c and m == "update")]


@pytest.mark.horovod
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "portable"])
@pytest.mark.parametrize(
    "mode, nesterov, correction", CASES, ids=[f"{m}-{'nesterov' * n}-{'correction' * c}" for m, n, c in CASES]
)
def test_matches_numpy_reference(mode, nesterov, correction, fused):
    # Rates jump: with momentum correction the velocity is rescaled by lr_t / lr_{t-1} before each update.
    weights, grads = numpy_lars.problem()
    lrs = [0.5, 1.5, 0.25, 0.25, 1.0, 0.5]
    kw = dict(momentum=0.9, weight_decay=5e-3, eta=0.01, epsilon=1e-5 if nesterov else 0.0, nesterov=nesterov)
    correct = "always" if correction else "none"
    opt = LARS(0.5, trust_ratio_mode=mode, momentum_correction=correct, **numpy_lars.EXCLUSIONS, **kw)
    got = _run(opt, weights, grads, paths=numpy_lars.PATHS, lrs=lrs, fused=fused)
    kw.update(mode=mode)
    want = numpy_lars.reference(weights, grads, lrs, exclusions=True, correction=correction, **kw)
    for path, g, w in zip(numpy_lars.PATHS, got, want):
        np.testing.assert_allclose(g, w, rtol=2e-5, atol=1e-6, err_msg=path)
    assert np.abs(got[numpy_lars.ZERO_INIT]).max() > 0.05  # it moves: trust ratio 1 while ||w|| = 0
    # The problem tells the cases apart: any other case, or no exclusions, would fail the comparison.
    for m, n, c in CASES:
        if (m, n, c) != (mode, nesterov, correction):
            other = numpy_lars.reference(weights, grads, lrs, True, c, **{**kw, "mode": m, "nesterov": n})
            assert np.abs(other[2] - want[2]).max() > 1e-3, (m, n, c)
    unexcluded = numpy_lars.reference(weights, grads, lrs, correction=correction, **kw)
    assert min(np.abs(unexcluded[i] - want[i]).max() for i in (4, 5, 6)) > 1e-3


@pytest.mark.horovod
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "portable"])
@pytest.mark.parametrize(
    "correction, scales",
    [
        ("none", [1, 1, 1, 1, 1, 1]),  # Intel Caffe's fused SGD update (the paper's runs)
        # Intel Caffe 1.0.7's non-fused ComputeUpdateValue: rate / GetWarmUpLR(t - 1) while t < warmup_iter,
        # GetWarmUpLR(t) = (t * base_lr + (warmup_iter - t) * warmup_start_lr) / warmup_iter (sgd_solver.cpp).
        ("warmup", [1, 5 / 3, 7 / 5, 1, 1, 1]),
        ("always", [1, 5 / 3, 7 / 5, 9 / 28, 4 / 9, 1 / 4]),  # lr_t / lr_{t-1}, Goyal et al. eq. 10
    ],
)
def test_momentum_correction_modes(correction, scales, fused):
    # The paper's schedule, small: rates 1, 5/3, 7/3 | 0.75, 1/3, 1/12; trust ratio 1: v = 0.9 s_t v + lr_t g.
    schedule = PaperPolynomialDecay(3.0, total_steps=6, warmup_steps=3, warmup_start_learning_rate=1.0)
    rates = [1, 5 / 3, 7 / 3, 0.75, 1 / 3, 1 / 12]
    np.testing.assert_allclose([float(schedule(t)) for t in range(6)], rates, rtol=1e-6)
    grads = np.random.default_rng(3).normal(size=(6, 4))
    w, v = np.ones(4), np.zeros(4)
    for t in range(6):
        v = 0.9 * scales[t] * v + rates[t] * grads[t]
        w = w - v
    opt = LARS(schedule, momentum=0.9, exclude_from_layer_adaptation=[""], momentum_correction=correction)
    (got,) = _run(opt, [np.ones(4, np.float32)], [[g.astype(np.float32)] for g in grads], fused=fused)
    np.testing.assert_allclose(got, w, rtol=1e-5, atol=1e-6)


@pytest.mark.horovod
def test_one_step_by_hand():
    # w = [3, 4] (norm 5), g = [0.6, 0.8] (norm 1), eta 0.001, beta 0.01, lr 2, v0 = 0:
    # trust = 0.001 * 5 / (1 + 0.01 * 5) = 0.005 / 1.05; lr * trust * (g + beta w) = [0.006, 0.008].
    w0, g = np.array([3.0, 4.0], np.float32), np.array([0.6, 0.8], np.float32)
    (w,) = _run(LARS(2.0, momentum=0.9, weight_decay=0.01, eta=0.001), [w0], [[g]])
    np.testing.assert_allclose(w, [2.994, 3.992], rtol=1e-6)


@pytest.mark.horovod
@pytest.mark.parametrize(
    "mode, start, trust",
    [("paper", 2.0, 1.0), ("decayed_gradient", 2.0, 0.1), ("update", 2.0, 0.1), ("paper", 0.0, 1.0)],
)
def test_zero_gradient_tensor_still_decays(mode, start, trust):
    # w = 2, g = 0, lr 0.1, beta 0.01, eta 0.001: "paper" measures ||g|| = 0 (trust 1); the others
    # ||g + beta w|| = beta ||w|| (trust eta / beta = 0.1): w *= 1 - lr * trust * beta; w = 0 stays 0, no NaN.
    opt = LARS(0.1, momentum=0.0, weight_decay=0.01, eta=0.001, trust_ratio_mode=mode)
    (w,) = _run(opt, [np.full((4,), start, np.float32)], [[np.zeros(4, np.float32)]] * 2)
    np.testing.assert_allclose(w, np.full(4, start * (1 - 0.1 * trust * 0.01) ** 2), rtol=1e-6)


@pytest.mark.unit
def test_exclusions_match_keras_variable_paths_and_unmatched_patterns_warn_once():
    # Named: an unnamed model's path prefix depends on earlier tests (sequential_3).
    layers = [
        keras.Input((4,)),
        keras.layers.Dense(3, name="fc"),
        keras.layers.BatchNormalization(name="fc_bn"),
    ]
    variables = keras.Sequential(layers, name="sequential").trainable_variables
    want = [f"sequential/{p}" for p in ("fc/kernel", "fc/bias", "fc_bn/gamma", "fc_bn/beta")]
    assert [v.path for v in variables] == want
    patterns = mlperf_exclusions()
    mlperf = dict(exclude_from_weight_decay=patterns, exclude_from_layer_adaptation=patterns)
    unmatched = dict(exclude_from_weight_decay=["no_layer", "kernel$"], exclude_from_layer_adaptation=["x"])
    warned = []
    for exclusions in (unmatched, mlperf):
        opt = LARS(0.3, **exclusions)
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            for _ in range(3):
                opt.apply([tf.ones(v.shape) for v in variables], variables)
            opt.build(variables)
        warned.append([str(w.message) for w in record if "LARS exclusion" in str(w.message)])
    (message,), none = warned
    assert "exclude_from_weight_decay='no_layer'" in message and "'kernel$'" not in message
    assert "exclude_from_layer_adaptation='x'" in message and none == []
    assert opt._decay_mask == opt._adapt_mask == [True, False, False, False]  # MLPerf's: only the kernel


@pytest.mark.unit
@pytest.mark.parametrize(
    "learning_rate, expected",
    [
        (0.25, [-0.25, -0.5]),
        (2, [-2.0, -4.0]),  # an int is accepted as a float
        (lambda: 0.5, [-0.5, -1.0]),  # callable of no arguments
        (keras.optimizers.schedules.PiecewiseConstantDecay([0], [1.0, 0.1]), [-1.0, -1.1]),
        ("variable", [-0.5, -0.625]),  # the caller's variable, set to 0.125 between the steps
    ],
    ids=["float", "int", "callable", "schedule", "variable"],
)
def test_learning_rate_forms(learning_rate, expected):
    # LARS without adaptation, momentum or decay: w -= lr * g (g = 1).
    rate = keras.Variable(0.5, dtype="float32", name="shared_rate")
    learning_rate = rate if learning_rate == "variable" else learning_rate
    opt = LARS(learning_rate, momentum=0.0, exclude_from_layer_adaptation=[""])
    (w,) = numpy_lars.keras_variables([np.zeros(2, np.float32)])
    history = []
    for _ in range(2):
        opt.apply([tf.ones(2)], [w])
        history.append(float(w.numpy()[0]))
        rate.assign(0.125)
    np.testing.assert_allclose(history, expected, rtol=1e-6)
    if learning_rate is rate:
        assert opt.get_config()["learning_rate"] == 0.125


@pytest.mark.unit
def test_gradient_accumulation_counts_applied_updates():
    # 3 micro-batches per update: 2 updates at schedule(0) = 1 and schedule(1) = 1.75 (Keras's own SGD would
    # take the rate at the micro-batch count, 2 and 5).
    schedule = WarmupPolynomialDecay(4.0, total_steps=20, warmup_steps=4, warmup_start_learning_rate=1.0)
    opt = LARS(schedule, momentum=0.5, eta=1.0, weight_decay=0.01, gradient_accumulation_steps=3)
    rng = np.random.default_rng(3)
    w0 = rng.normal(size=(3, 2)).astype(np.float32)
    micro = [rng.normal(size=(3, 2)).astype(np.float32) for _ in range(6)]
    (w,) = numpy_lars.keras_variables([w0])
    step = tf.function(lambda g: opt.apply([g], [w]))
    counts = []
    for g in micro:
        step(tf.constant(g))
        counts.append(int(opt.iterations.numpy()))
    assert counts == [0, 0, 1, 1, 1, 2]
    averaged = [[np.mean(micro[0:3], axis=0)], [np.mean(micro[3:6], axis=0)]]
    (want,) = numpy_lars.reference([w0], averaged, [1.0, 1.75], momentum=0.5, eta=1.0, weight_decay=0.01)
    np.testing.assert_allclose(w.numpy(), want, rtol=2e-5, atol=1e-6)
    assert float(opt.learning_rate) == pytest.approx(float(schedule(2)))


@pytest.mark.unit
@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"eta": -0.1}, "eta"), ({"eta": 0.0}, "eta"), ({"momentum": 1.0}, "momentum"),
        ({"momentum": -0.5}, "momentum"), ({"momentum": "0.9"}, "momentum"),
        ({"weight_decay": -1e-4}, "weight_decay"), ({"epsilon": -1.0}, "epsilon"),
        ({"learning_rate": -0.1}, "learning_rate"), ({"trust_ratio_mode": "layerwise"}, "trust_ratio_mode"),
        ({"exclude_from_weight_decay": ["("]}, "regular expression"),
        ({"momentum_correction": True}, r"must be one of \('none', 'warmup', 'always'\), got True"),
        ({"momentum_correction": "warmup", "learning_rate": 0.5}, "int `warmup_steps`.*got 0.5"),
        # In "update" mode the velocity is in gradient units: there is no rate in it to correct.
        ({"momentum_correction": "always", "trust_ratio_mode": "update"}, "does not apply"),
    ],
)  # fmt: skip
def test_invalid_arguments_quote_the_value(kwargs, message):
    with pytest.raises(ValueError, match=message) as info:
        LARS(**{"learning_rate": 0.1, **kwargs})
    for value in kwargs.values():
        assert repr(value).strip("[]") in str(info.value)


@pytest.mark.unit
def test_config_round_trip_and_automatic_names():
    kwargs = dict(momentum=0.8, weight_decay=1e-4, eta=0.002, epsilon=1e-5, nesterov=True,
                  exclude_from_weight_decay=["bias"], exclude_from_layer_adaptation=["bn"],
                  trust_ratio_mode="decayed_gradient", momentum_correction="warmup",
                  gradient_accumulation_steps=2, clipnorm=2.0)  # fmt: skip
    opt = LARS(WarmupPolynomialDecay(peak_learning_rate=3.0, total_steps=100, warmup_steps=10), **kwargs)
    config = opt.get_config()
    assert {k: config[k] for k in kwargs} == kwargs
    assert opt.weight_decay is None  # LARS decays; the Keras base class must not decay a second time
    clone = LARS.from_config(copy.deepcopy(config))
    assert clone.get_config() == config and isinstance(clone._learning_rate, WarmupPolynomialDecay)
    serialized = keras.optimizers.serialize(opt)
    for again in (keras.optimizers.deserialize(serialized), keras.optimizers.get(serialized)):
        assert type(again) is LARS and again.get_config() == config
    # Keras's automatic names ("lars", "lars_1"), so the paths exclusions and logs match on are unique.
    first, second = LARS(0.1), LARS(0.1)
    for optimizer in (first, second):
        optimizer.build([keras.Variable(np.zeros(3, np.float32), name="kernel")])
    paths = [v.path for o in (first, second) for v in o.variables]
    assert len(set(paths)) == 6 and first.name != second.name  # iteration, learning_rate, a velocity each
    assert {p.split("/")[0] for p in paths} == {first.name, second.name} and first.name.startswith("lars")
    assert LARS(0.1, name="mine").name == "mine"


@pytest.mark.unit
def test_fit_matches_reference_and_saved_state_continues_identically(tmp_path):
    # Listed twice, a rate variable would make a checkpoint refuse to save and a .keras load drop the state;
    # momentum correction keeps the previous rate, which must be saved too.
    def build():
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2, name="fc")])
        opt = LARS(keras.Variable(0.5, name="shared_rate"), momentum=0.9, weight_decay=1e-3, eta=0.01,
                   exclude_from_layer_adaptation=["bias"], momentum_correction="always")  # fmt: skip
        model.compile(optimizer=opt, loss="mse")
        return model

    rng = np.random.default_rng(4)
    x, y = rng.normal(size=(16, 3)).astype(np.float32), rng.normal(size=(16, 2)).astype(np.float32)
    model = build()
    w, v = [a.numpy().astype(np.float64) for a in model.trainable_variables], [np.zeros((3, 2)), np.zeros(2)]
    want = []  # full batch, 4 updates at rate 0.5, 2 at 0.2 (the velocity first rescaled by 0.2 / 0.5)
    for t, rate in enumerate([0.5] * 4 + [0.2] * 2):
        residual = (x @ w[0] + w[1] - y) * 2.0 / y.size  # linear regression's MSE gradient
        for i, g in enumerate([x.T @ residual, residual.sum(0)]):
            scale = 0.4 if t == 4 else 1.0
            w[i], v[i] = numpy_lars.lars_step(
                w[i], v[i], g, rate, adapt=i == 0, beta=1e-3, momentum=0.9, eta=0.01, velocity_scale=scale
            )
        want.append(list(w))
    model.fit(x, y, batch_size=16, epochs=4, shuffle=False, verbose=0)
    for got, ref in zip(model.trainable_variables, want[3]):
        np.testing.assert_allclose(got.numpy(), ref, rtol=1e-4, atol=1e-6)
    assert np.abs(want[3][0] - want[0][0]).max() > 1e-3
    opt = model.optimizer
    opt.learning_rate = 0.2  # the previous rate (0.5) now differs from the rate
    assert float(opt._previous_learning_rate.numpy()) == pytest.approx(0.5)
    saved = [np.asarray(v) for v in opt.variables]  # iterations, rate, previous rate, 2 velocities
    assert len(saved) == 5 and int(opt.iterations) == 4 and np.abs(opt.velocities[0].numpy()).max() > 0
    tf.train.Checkpoint(optimizer=opt).write(str(tmp_path / "ckpt"))
    fresh = build()
    fresh.optimizer.build(fresh.trainable_variables)
    tf.train.Checkpoint(optimizer=fresh.optimizer).read(str(tmp_path / "ckpt")).assert_consumed()
    model.save(tmp_path / "m.keras")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loaded = keras.models.load_model(tmp_path / "m.keras")
    assert not [w for w in caught if "Skipping variable loading" in str(w.message)]
    assert isinstance(loaded.optimizer, LARS) and loaded.optimizer.get_config() == opt.get_config()
    for restored in (fresh.optimizer, loaded.optimizer):
        for a, b in zip(saved, restored.variables, strict=True):
            np.testing.assert_array_equal(a, np.asarray(b))
    # The velocity and the previous rate are restored: the next steps coincide, and with the reference.
    for m in (model, loaded):
        m.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    for a, b, ref in zip(model.trainable_variables, loaded.trainable_variables, want[5]):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-6)
        np.testing.assert_allclose(a.numpy(), ref, rtol=1e-4, atol=1e-6)


@pytest.mark.unit
def test_mixed_bfloat16_keeps_float32_weights_and_slots():
    keras.mixed_precision.set_global_policy("mixed_bfloat16")  # conftest sets float32 again after the test
    layers = [keras.Input((4,)), keras.layers.Dense(3), keras.layers.Dense(2, dtype="float32")]
    model = keras.Sequential(layers)
    model.compile(optimizer=LARS(0.1, weight_decay=1e-4), loss="mse")  # a traced step, as training's
    before = [v.numpy() for v in model.trainable_variables]
    model.fit(np.ones((16, 4), np.float32), np.zeros((16, 2), np.float32), epochs=2, verbose=0)
    assert model.layers[0].compute_dtype == "bfloat16"
    assert all(v.dtype == "float32" for v in model.optimizer.velocities + model.trainable_variables)
    for v, b in zip(model.trainable_variables, before):
        assert np.all(np.isfinite(v.numpy())) and np.abs(v.numpy() - b).max() > 0


@pytest.mark.unit
def test_bfloat16_variables_follow_the_reference_loosely():
    # bfloat16 variables (not the mixed policy): rate 5 moves every tensor 10x the tolerance or more.
    weights, grads = numpy_lars.problem(seed=6, steps=5)
    to_bf16 = lambda a: tf.cast(tf.constant(a), tf.bfloat16)
    rounded = lambda a: to_bf16(a).numpy().astype(np.float32)
    variables = [keras.Variable(to_bf16(w), dtype="bfloat16") for w in weights]
    opt = LARS(5.0, weight_decay=5e-3, eta=0.01)
    for gs in grads:
        opt.apply([to_bf16(g) for g in gs], variables)
    assert all(v.dtype == "bfloat16" for v in opt.velocities)
    bf16_grads = [[rounded(g) for g in gs] for gs in grads]
    want = numpy_lars.reference(
        [rounded(w) for w in weights], bf16_grads, [5.0] * 5, weight_decay=5e-3, eta=0.01
    )
    for w, start in zip(want, weights):
        assert np.abs(w - rounded(start)).max() > 0.2
    # One bfloat16 ulp at |w| ~ 1 is 2**-8 relative: five steps stay within a few.
    for path, v, w in zip(numpy_lars.PATHS, variables, want):
        np.testing.assert_allclose(v.numpy().astype(np.float32), w, rtol=2e-2, atol=2e-2, err_msg=path)
