"""DistributedOptimizer in one process (world size 1): exactly the optimizer it holds, its arguments, its
errors, serialization and the loss-scaler nestings. The 2-rank behaviour is in tests/test_distributed.py."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from hvd_lars import (
    LARS,
    DistributedLossScaleOptimizer,
    DistributedOptimizer,
    LearningRateWarmupCallback,
)
from hvd_lars.parallel import collectives

LSO = keras.optimizers.LossScaleOptimizer


def _train(optimizer, steps=4, seed=0):
    """Weights after `steps` applies of fixed gradients (one tf.function, as model.fit runs)."""
    rng = np.random.default_rng(seed)
    variables = [keras.Variable(rng.normal(size=s).astype(np.float32)) for s in [(3, 2), (2,)]]
    grads = [[rng.normal(size=v.shape).astype(np.float32) for v in variables] for _ in range(steps)]
    optimizer.build(variables)
    step = tf.function(lambda g: optimizer.apply(g, variables))
    for g in grads:
        step([tf.constant(x) for x in g])
    return [v.numpy() for v in variables], optimizer


@pytest.mark.horovod
@pytest.mark.parametrize(
    "make",
    [
        lambda: keras.optimizers.SGD(0.1, momentum=0.9, clipnorm=0.5),
        lambda: keras.optimizers.Adam(
            keras.optimizers.schedules.ExponentialDecay(0.01, 1, 0.9), use_ema=True
        ),
        lambda: keras.optimizers.SGD(0.1, momentum=0.9, gradient_accumulation_steps=2),
        lambda: LARS(0.5, weight_decay=1e-3, eta=0.01, gradient_accumulation_steps=2),
        lambda: LSO(keras.optimizers.Lamb(0.01), initial_scale=8.0),
    ],
    ids=["sgd_clipnorm", "adam_schedule_ema", "sgd_accumulation", "lars_accumulation", "loss_scaled_lamb"],
)
def test_world_size_1_is_exactly_the_held_optimizer(make):
    want, plain = _train(make())
    got, wrapper = _train(DistributedOptimizer(make()))
    for a, b in zip(want, got):
        np.testing.assert_array_equal(a, b)
    assert int(wrapper.iterations) == int(plain.iterations)


@pytest.mark.unit
def test_keras_accumulation_is_taken_over():
    sgd = keras.optimizers.SGD(0.1, gradient_accumulation_steps=4)
    wrapper = DistributedOptimizer(sgd)
    assert wrapper.backward_passes_per_step == 4 and sgd.gradient_accumulation_steps is None
    assert DistributedOptimizer.from_config(wrapper.get_config()).backward_passes_per_step == 4
    # Through a loss scaler too.
    inner = keras.optimizers.Adam(gradient_accumulation_steps=3)
    assert DistributedOptimizer(LSO(inner)).backward_passes_per_step == 3


@pytest.mark.unit
@pytest.mark.parametrize(
    "kwargs, message",
    [
        (
            {"compression": "bf16"},
            "compression must be one of ('none', 'fp16'), hvd.Compression.none or .fp16, got 'bf16'",
        ),
        (
            {"gradient_reduction": "ring"},
            "gradient_reduction must be one of ('overlap', 'grouped'), got 'ring'",
        ),
        ({"backward_passes_per_step": 0}, "backward_passes_per_step must be an int >= 1, got 0"),
        ({"backward_passes_per_step": 2.0}, "got 2.0"),
        ({"backward_passes_per_step": True}, "got True"),
    ],
)
def test_bad_arguments_are_refused_with_the_value(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        DistributedOptimizer(keras.optimizers.SGD(), **kwargs)


@pytest.mark.unit
def test_misuse_is_refused():
    with pytest.raises(ValueError, match="contradicts the optimizer's gradient_accumulation_steps=2"):
        DistributedOptimizer(keras.optimizers.SGD(gradient_accumulation_steps=2), backward_passes_per_step=3)
    built = keras.optimizers.SGD(gradient_accumulation_steps=2)
    built.build([keras.Variable(np.zeros(2, np.float32))])
    with pytest.raises(ValueError, match="wrap it before it is built"):
        DistributedOptimizer(built)
    with pytest.raises(ValueError, match="optimizer must be a Keras 3 optimizer"):
        DistributedOptimizer("sgd")
    with pytest.raises(ValueError, match="wrap the optimizer only once"):
        DistributedOptimizer(DistributedOptimizer(keras.optimizers.SGD()))


@pytest.mark.unit
def test_a_loss_scaler_inside_makes_the_wrapper_a_loss_scaler():
    wrapper = DistributedOptimizer(LSO(keras.optimizers.SGD(1.0), initial_scale=4.0))
    assert isinstance(wrapper, DistributedLossScaleOptimizer) and isinstance(wrapper, LSO)
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)], name="wrapped")
        model.compile(optimizer=wrapper, loss="mse", jit_compile=False)
    finally:
        keras.mixed_precision.set_global_policy("float32")
    assert model.optimizer is wrapper  # Keras did not wrap it in a second loss scaler
    assert float(wrapper.scale_loss(tf.constant(1.0))) == 4.0
    assert wrapper.initial_scale == 4.0
    clone = keras.optimizers.deserialize(keras.optimizers.serialize(wrapper))
    assert type(clone) is DistributedLossScaleOptimizer and clone.get_config() == wrapper.get_config()


@pytest.mark.unit
def test_made_under_mixed_float16_the_wrapper_scales_the_loss_and_compile_keeps_it():
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        wrapper = DistributedOptimizer(keras.optimizers.SGD(1.0), name="d")
        model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)], name="wrapped")
        model.compile(optimizer=wrapper, loss="mse", jit_compile=False)
    finally:
        keras.mixed_precision.set_global_policy("float32")
    assert model.optimizer is wrapper and type(wrapper) is DistributedLossScaleOptimizer
    assert (
        type(wrapper.inner_optimizer) is LSO
        and type(wrapper.inner_optimizer.inner_optimizer).__name__ == "SGD"
    )
    assert wrapper.name == "d" and wrapper.initial_scale == 2.0**15  # Keras's default scale
    # Under float32 the same call gives the plain wrapper.
    assert type(DistributedOptimizer(keras.optimizers.SGD(1.0))) is DistributedOptimizer


@pytest.mark.unit
def test_a_loss_scaler_around_the_wrapper_is_refused_where_it_is_made():
    # By hand, and by model.compile for a wrapper made before mixed_float16 was set: one line saying what
    # to write instead, before any step could leave a rank waiting.
    with pytest.raises(
        ValueError,
        match=r"would check each rank's gradients alone .*DistributedOptimizer\(LossScaleOptimizer",
    ):
        LSO(DistributedOptimizer(keras.optimizers.SGD(1.0)))
    wrapper = DistributedOptimizer(keras.optimizers.SGD(1.0))
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)], name="wrapped")
        with pytest.raises(ValueError, match="set_global_policy"):
            model.compile(optimizer=wrapper, loss="mse", jit_compile=False)
    finally:
        keras.mixed_precision.set_global_policy("float32")


@pytest.mark.unit
def test_rate_and_settings_are_the_held_optimizers():
    rate = keras.Variable(0.5)
    lars = LARS(rate)
    wrapper = DistributedOptimizer(lars, compression="fp16", gradient_reduction="grouped")
    wrapper.learning_rate = 0.25
    assert float(rate.numpy()) == 0.25 and float(wrapper.learning_rate.numpy()) == 0.25
    wrapper.build([keras.Variable(np.ones(2, np.float32))])
    # No second learning-rate variable: the wrapper's own state is its micro-batch counter.
    assert [v.name for v in wrapper.variables].count(rate.name) == 1
    assert len(wrapper.variables) == 1 + len(lars.variables)
    config = wrapper.get_config()
    assert config["compression"] == "fp16" and config["gradient_reduction"] == "grouped"
    assert config["optimizer"]["class_name"] == "LARS"
    # Static loss scaling of the held optimizer: the loss is scaled through the wrapper.
    assert float(DistributedOptimizer(keras.optimizers.SGD(loss_scale_factor=8.0)).scale_loss(1.0)) == 8.0


@pytest.mark.unit
def test_allreduce_arguments_are_checked_where_the_optimizer_is_made():
    with pytest.raises(ValueError, match=r"reduction must be one of \('overlap', 'grouped'\), got 'tree'"):
        DistributedOptimizer(keras.optimizers.SGD(), gradient_reduction="tree")
    assert collectives.allreduce_gradients([None, tf.ones(2)], compression="fp16")[0] is None


@pytest.mark.unit
def test_warmup_callback_arguments():
    # Horovod's default momentum_correction=True is accepted (tests/test_horovod_keras.py tests it).
    assert LearningRateWarmupCallback(initial_lr=0.1).momentum_correction is True
    with pytest.raises(ValueError, match="initial_lr must be a finite number > 0, got 0"):
        LearningRateWarmupCallback(initial_lr=0)
    with pytest.raises(ValueError, match="warmup_epochs must be a finite number > 0, got 'five'"):
        LearningRateWarmupCallback(initial_lr=0.1, warmup_epochs="five")
