"""LARS against the NumPy reference (tests/lars_reference.py) and Keras optimizer conventions."""

import copy
import os
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf
from lars_reference import lars_step

from hvd_lars import LARS, WarmupPolynomialDecay, mlperf_exclusions

SHAPES = [(), (7,), (3, 3, 2, 4)]


def _run(optimizer, weights, grads_per_step):
    """Applies the gradient lists step by step in a tf.function; returns the final weights (NumPy)."""
    variables = [keras.Variable(w, dtype="float32", name=f"w{i}") for i, w in enumerate(weights)]
    optimizer.build(variables)

    @tf.function
    def step(grads):
        optimizer.apply(grads, variables)

    for grads in grads_per_step:
        step([tf.constant(g, tf.float32) for g in grads])
    return [v.numpy() for v in variables]


def _reference(weights, grads_per_step, lrs, adapt=None, betas=None, **kw):
    ws = [np.asarray(w, np.float64) for w in weights]
    vs = [np.zeros_like(w) for w in ws]
    for t, grads in enumerate(grads_per_step):
        for i, g in enumerate(grads):
            ws[i], vs[i] = lars_step(
                ws[i],
                vs[i],
                g,
                lrs[t],
                adapt=True if adapt is None else adapt[i],
                beta=kw.get("weight_decay", 0.0) if betas is None else betas[i],
                **{k: v for k, v in kw.items() if k != "weight_decay"},
            )
    return ws


def _problem(seed=0, steps=6, zero_weight=False, zero_grad=False):
    rng = np.random.default_rng(seed)
    weights = [rng.normal(size=s).astype(np.float32) for s in SHAPES]
    if zero_weight:
        weights[1][:] = 0.0
    grads = [[rng.normal(scale=0.1, size=s).astype(np.float32) for s in SHAPES] for _ in range(steps)]
    if zero_grad:
        for g in grads:
            g[2][:] = 0.0
    return weights, grads


@pytest.mark.parametrize("mode", ["paper", "decayed_gradient", "update"])
@pytest.mark.parametrize("nesterov", [False, True])
def test_matches_numpy_reference(mode, nesterov):
    weights, grads = _problem()
    kw = dict(momentum=0.9, weight_decay=5e-4, eta=0.01, epsilon=1e-5, nesterov=nesterov)
    got = _run(LARS(0.5, trust_ratio_mode=mode, **kw), weights, grads)
    want = _reference(weights, grads, [0.5] * len(grads), mode=mode, **kw)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=2e-5, atol=1e-6)


def test_zero_weights_and_zero_gradients_move_without_nan():
    weights, grads = _problem(zero_weight=True, zero_grad=True)
    got = _run(LARS(1.0, weight_decay=1e-3), weights, grads)
    want = _reference(weights, grads, [1.0] * len(grads), weight_decay=1e-3)
    assert all(np.all(np.isfinite(g)) for g in got)
    # Zero-initialised tensor: trust ratio 1, so it moves by the plain momentum update.
    assert np.abs(got[1]).max() > 0.1
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=2e-5, atol=1e-6)


def test_zero_gradient_tensor_still_decays():
    w0 = np.full((4,), 2.0, np.float32)
    (w,) = _run(LARS(0.1, momentum=0.0, weight_decay=0.01), [w0], [[np.zeros(4, np.float32)]])
    # Trust ratio 1 (zero gradient): w - lr * beta * w = 2 - 0.1 * 0.01 * 2.
    np.testing.assert_allclose(w, np.full(4, 2.0 - 0.002), rtol=1e-6)


def test_one_step_by_hand():
    # w = [3, 4] (norm 5), g = [0.6, 0.8] (norm 1), eta 0.001, beta 0.01, lr 2, v0 = 0:
    # trust = 0.001 * 5 / (1 + 0.01 * 5) = 0.005 / 1.05; update = lr * trust * (g + beta * w).
    w0, g = np.array([3.0, 4.0], np.float32), np.array([0.6, 0.8], np.float32)
    (w,) = _run(LARS(2.0, momentum=0.9, weight_decay=0.01, eta=0.001), [w0], [[g]])
    trust = 0.005 / 1.05
    expected = w0 - 2.0 * trust * (g + 0.01 * w0)
    np.testing.assert_allclose(w, expected, rtol=1e-6)


def test_exclusions_match_variable_path():
    model = keras.Sequential(
        [keras.Input((4,)), keras.layers.Dense(3, name="fc"), keras.layers.BatchNormalization(name="fc_bn")]
    )
    rng = np.random.default_rng(1)
    grads = [
        [rng.normal(size=v.shape).astype(np.float32) for v in model.trainable_variables] for _ in range(5)
    ]
    weights = [v.numpy() for v in model.trainable_variables]
    paths = [v.path for v in model.trainable_variables]
    assert paths == [f"sequential/{p}" for p in ("fc/kernel", "fc/bias", "fc_bn/gamma", "fc_bn/beta")]
    opt = LARS(
        0.3,
        weight_decay=0.01,
        eta=0.02,
        exclude_from_weight_decay=mlperf_exclusions(),
        exclude_from_layer_adaptation=mlperf_exclusions(),
    )
    opt.build(model.trainable_variables)

    @tf.function
    def step(gs):
        opt.apply(gs, model.trainable_variables)

    for gs in grads:
        step([tf.constant(g) for g in gs])
    want = _reference(
        weights, grads, [0.3] * 5, adapt=[True, False, False, False], betas=[0.01, 0.0, 0.0, 0.0], eta=0.02
    )
    for v, w in zip(model.trainable_variables, want):
        np.testing.assert_allclose(v.numpy(), w, rtol=2e-5, atol=1e-6)


def test_unmatched_exclusion_pattern_warns():
    opt = LARS(0.1, exclude_from_weight_decay=["no_such_layer"])
    with pytest.warns(UserWarning, match="no_such_layer"):
        opt.build([keras.Variable(np.ones(3), name="w")])


def test_weight_decay_is_not_handed_to_the_keras_base_class():
    # The reference tests above (weight_decay > 0) would fail if the base class decayed a second time.
    opt = LARS(0.1, weight_decay=0.1)
    assert opt.weight_decay is None
    assert opt.get_config()["weight_decay"] == 0.1


def test_schedule_follows_applied_updates():
    schedule = WarmupPolynomialDecay(peak_learning_rate=4.0, total_steps=10, warmup_steps=4)
    opt = LARS(schedule, momentum=0.0, eta=1.0)
    weights, grads = [np.ones(2, np.float32)], [[np.full(2, 0.5, np.float32)] for _ in range(3)]
    got = _run(opt, weights, grads)
    want = _reference(weights, grads, [float(schedule(t)) for t in range(3)], momentum=0.0, eta=1.0)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-6)
    assert int(opt.iterations.numpy()) == 3


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"eta": -0.1}, "eta"),
        ({"eta": 0.0}, "eta"),
        ({"momentum": 1.0}, "momentum"),
        ({"momentum": -0.5}, "momentum"),
        ({"weight_decay": -1e-4}, "weight_decay"),
        ({"epsilon": -1.0}, "epsilon"),
        ({"trust_ratio_mode": "layerwise"}, "trust_ratio_mode"),
        ({"exclude_from_weight_decay": ["("]}, "regular expression"),
    ],
)
def test_invalid_arguments_quote_the_value(kwargs, message):
    with pytest.raises(ValueError, match=message) as info:
        LARS(0.1, **kwargs)
    assert repr(list(kwargs.values())[0]).strip("[]") in str(info.value)


def test_config_round_trip():
    schedule = WarmupPolynomialDecay(peak_learning_rate=3.0, total_steps=100, warmup_steps=10)
    opt = LARS(
        schedule,
        momentum=0.8,
        weight_decay=1e-4,
        eta=0.002,
        epsilon=1e-5,
        nesterov=True,
        exclude_from_weight_decay=["bias"],
        exclude_from_layer_adaptation=["bn"],
        trust_ratio_mode="decayed_gradient",
        momentum_correction=True,
    )
    config = opt.get_config()
    clone = LARS.from_config(copy.deepcopy(config))
    assert clone.get_config() == config
    assert config["weight_decay"] == 1e-4 and config["eta"] == 0.002
    assert isinstance(clone._learning_rate, WarmupPolynomialDecay)


def test_model_save_and_load_keeps_optimizer(tmp_path):
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    model.compile(optimizer=LARS(0.5, weight_decay=1e-3), loss="mse")
    x, y = np.ones((8, 3), np.float32), np.zeros((8, 2), np.float32)
    model.fit(x, y, epochs=2, verbose=0)
    path = os.path.join(tmp_path, "m.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    assert isinstance(loaded.optimizer, LARS)
    assert loaded.optimizer.lars_weight_decay == 1e-3
    for a, b in zip(model.optimizer.variables, loaded.optimizer.variables):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_momentum_correction_rescales_velocity():
    # Rates 1 then 3: with correction the stored velocity is multiplied by 3 / 1 before the second step.
    opt = LARS(1.0, momentum=0.5, eta=1.0, momentum_correction=True)
    w = keras.Variable(np.array([1.0, 0.0], np.float32))
    opt.build([w])
    g = tf.constant([0.0, 1.0])
    want_w, want_v = np.array([1.0, 0.0]), np.zeros(2)
    for rate, scale in ((1.0, 1.0), (3.0, 3.0)):
        opt.learning_rate = rate
        opt.apply([g], [w])
        want_w, want_v = lars_step(
            want_w, want_v, g.numpy(), rate, momentum=0.5, eta=1.0, velocity_scale=scale
        )
    np.testing.assert_allclose(w.numpy(), want_w, rtol=1e-6)
    # Without correction the second step differs (the check above can fail).
    plain_w, plain_v = lars_step([1.0, 0.0], np.zeros(2), g.numpy(), 1.0, momentum=0.5, eta=1.0)
    plain_w, _ = lars_step(plain_w, plain_v, g.numpy(), 3.0, momentum=0.5, eta=1.0)
    assert not np.allclose(plain_w, want_w)


def test_mixed_bfloat16_keeps_float32_weights_and_slots():
    keras.mixed_precision.set_global_policy("mixed_bfloat16")
    try:
        model = keras.Sequential(
            [keras.Input((4,)), keras.layers.Dense(3), keras.layers.Dense(2, dtype="float32")]
        )
        model.compile(optimizer=LARS(0.1, weight_decay=1e-4), loss="mse")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model.fit(np.ones((16, 4), np.float32), np.zeros((16, 2), np.float32), epochs=2, verbose=0)
        assert all(v.dtype == "float32" for v in model.optimizer.velocities)
        assert all(v.dtype == "float32" for v in model.trainable_variables)
        assert all(np.all(np.isfinite(v.numpy())) for v in model.trainable_variables)
    finally:
        keras.mixed_precision.set_global_policy("float32")
