"""DistributedOptimizer at world size 1: the held optimizer exactly, its arguments and errors."""

import horovod.tensorflow as hvd
import keras
import numpy as np
import pytest
import tensorflow as tf

from hvd_lars import LARS, DistributedLossScaleOptimizer, DistributedOptimizer
from hvd_lars.parallel import collectives

LSO, SGD = keras.optimizers.LossScaleOptimizer, keras.optimizers.SGD
DECAY = keras.optimizers.schedules.ExponentialDecay(0.01, 1, 0.9)


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
        lambda: keras.optimizers.Adam(DECAY, use_ema=True),
        lambda: LARS(0.5, weight_decay=1e-3, eta=0.01, gradient_accumulation_steps=2),
        lambda: LSO(keras.optimizers.Lamb(0.01), initial_scale=8.0),
    ],
    ids=["adam_schedule_ema", "lars_accumulation", "loss_scaled_lamb"],
)
def test_world_size_1_is_exactly_the_held_optimizer(make):
    # SGD with each base-class feature: test_keras_conformance.
    want, plain = _train(make())
    got, wrapper = _train(DistributedOptimizer(make()))
    np.testing.assert_equal(got, want)
    assert int(wrapper.iterations) == int(plain.iterations)


@pytest.mark.unit
@pytest.mark.parametrize("nesterov", [False, True], ids=["momentum", "nesterov"])
def test_a_held_momentum_sgd_runs_the_fused_kernel_to_the_same_bits(nesterov):
    make = lambda: SGD(keras.optimizers.schedules.ExponentialDecay(0.1, 1, 0.9), 0.9, nesterov=nesterov)
    want, _ = _train(make(), steps=6)
    got, wrapper = _train(DistributedOptimizer(make()), steps=6)
    np.testing.assert_equal(got, want)
    variables = [keras.Variable(np.zeros(s, np.float32)) for s in [(3, 2), (2,)]]
    signature = [tf.TensorSpec(v.shape, tf.float32) for v in variables]

    def kernels(optimizer):
        graph = tf.function(lambda g: optimizer.apply(g, variables)).get_concrete_function(signature).graph
        return {op.type for op in graph.get_operations()}

    assert "ResourceApplyKerasMomentum" in kernels(DistributedOptimizer(make()))
    assert "ResourceApplyKerasMomentum" not in kernels(DistributedOptimizer(SGD(0.1)))


@pytest.mark.unit
@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: DistributedOptimizer(SGD(), compression="bf16"),
         "compression must be one of ('none', 'fp16'), hvd.Compression.none or .fp16, got 'bf16'"),
        (lambda: DistributedOptimizer(SGD(), compression=object), "compression must .*, got <class 'object"),
        (lambda: DistributedOptimizer(SGD(), gradient_reduction="ring"),
         "gradient_reduction must be one of ('overlap', 'grouped'), got 'ring'"),
        (lambda: DistributedOptimizer(SGD(), backward_passes_per_step=0),
         "backward_passes_per_step must be an int >= 1, got 0"),
        (lambda: DistributedOptimizer(SGD(), backward_passes_per_step=2.0), "got 2.0"),
        (lambda: DistributedOptimizer(SGD(), backward_passes_per_step=True), "got True"),
        (lambda: DistributedOptimizer(SGD(), groups=0),
         "groups must be None, an int >= 1 or a list of lists of variables, got 0"),
        (lambda: DistributedOptimizer(SGD(), gradient_predivide_factor=-1),
         "gradient_predivide_factor must be a finite number > 0, got -1"),
        (lambda: DistributedOptimizer(SGD(), groups=2, gradient_reduction="grouped"), "give one of them"),
        (lambda: DistributedOptimizer(SGD(gradient_accumulation_steps=2), backward_passes_per_step=3),
         "contradicts the optimizer's gradient_accumulation_steps=2"),
        (lambda: DistributedOptimizer(_train(SGD(gradient_accumulation_steps=2), steps=0)[1]),
         "wrap it before it is"),
        (lambda: DistributedOptimizer("sgd"), "optimizer must be a Keras 3 optimizer"),
        (lambda: DistributedOptimizer(DistributedOptimizer(SGD())), "wrap the optimizer only once"),
        (lambda: LSO(DistributedOptimizer(SGD(1.0))),
         "would check each rank's gradients alone .*DistributedOptimizer(LossScaleOptimizer"),
        (lambda: LSO(DistributedOptimizer(LSO(SGD(1.0)))), "would check each rank's gradients alone"),
        (lambda: DistributedOptimizer(SGD(), process_set=hvd.ProcessSet([0])),
         "process_set must be the global process set (launch a subset of ranks as a job)"),
        (lambda: DistributedOptimizer(SGD(), sparse_as_dense="yes"), "must be a bool, got 'yes'"),
    ],
)  # fmt: skip
def test_bad_arguments_and_misuse_are_refused_where_the_optimizer_is_made(make, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        make()


@pytest.mark.unit
def test_loss_scaling_under_mixed_float16():
    # A loss scaler inside, or the policy where the wrapper is made: the wrapper is the loss scaler, which
    # compile keeps; a wrapper made before the policy is refused (Keras's scaler around it: ranks alone).
    inside = DistributedOptimizer(LSO(SGD(1.0), initial_scale=4.0))
    made_before = DistributedOptimizer(SGD(1.0))
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        made_under = DistributedOptimizer(SGD(1.0), name="d")
        for wrapper in (inside, made_under, made_before):
            model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)], name="wrapped")
            if wrapper is made_before:
                with pytest.raises(ValueError, match="set_global_policy"):
                    model.compile(optimizer=wrapper, loss="mse", jit_compile=False)
            else:
                model.compile(optimizer=wrapper, loss="mse", jit_compile=False)
                assert model.optimizer is wrapper
    finally:
        keras.mixed_precision.set_global_policy("float32")
    assert type(inside) is type(made_under) is DistributedLossScaleOptimizer and isinstance(inside, LSO)
    assert float(inside.scale_loss(tf.constant(1.0))) == 4.0 and inside.initial_scale == 4.0
    clone = keras.optimizers.deserialize(keras.optimizers.serialize(inside))
    assert type(clone) is DistributedLossScaleOptimizer and clone.get_config() == inside.get_config()
    assert type(made_under.inner_optimizer) is LSO and made_under.initial_scale == 2.0**15  # Keras's default
    assert type(made_under.inner_optimizer.inner_optimizer).__name__ == "SGD" and made_under.name == "d"
    assert type(made_before) is DistributedOptimizer


@pytest.mark.unit
def test_rate_settings_and_config_are_the_held_optimizers():
    rate = keras.Variable(0.5)
    lars = LARS(rate)
    settings = dict(compression="fp16", gradient_reduction="grouped", sparse_as_dense=True)
    wrapper = DistributedOptimizer(lars, process_set=hvd.global_process_set, **settings)
    wrapper.learning_rate = 0.25
    assert float(rate.numpy()) == 0.25 and float(wrapper.learning_rate.numpy()) == 0.25
    wrapper.build([keras.Variable(np.ones(2, np.float32))])
    # No second learning-rate variable: the wrapper's own state is its micro-batch counter.
    assert [v.name for v in wrapper.variables].count(rate.name) == 1
    assert len(wrapper.variables) == 1 + len(lars.variables)
    config = wrapper.get_config()
    assert (config["compression"], config["gradient_reduction"], config["optimizer"]["class_name"]) == (
        "fp16", "grouped", "LARS")  # fmt: skip
    # Keras's accumulation is taken over, through a loss scaler too.
    inner = keras.optimizers.Adam(0.01, global_clipnorm=1.0, gradient_accumulation_steps=2)
    adam = DistributedOptimizer(inner)
    assert (adam.backward_passes_per_step, inner.gradient_accumulation_steps) == (2, None)
    through_scaler = DistributedOptimizer(LSO(keras.optimizers.Adam(gradient_accumulation_steps=3)))
    assert through_scaler.backward_passes_per_step == 3
    for optimizer in (wrapper, adam):
        serialized = keras.optimizers.serialize(optimizer)
        for again in (keras.optimizers.deserialize(serialized), keras.optimizers.get(serialized)):
            assert type(again) is DistributedOptimizer and again.get_config() == optimizer.get_config()
    assert again.backward_passes_per_step == 2
    # Static loss scaling of the held optimizer: the loss is scaled through the wrapper.
    assert float(DistributedOptimizer(SGD(loss_scale_factor=8.0)).scale_loss(1.0)) == 8.0


@pytest.mark.unit
def test_a_missing_gradient_stays_missing():
    assert collectives.allreduce_gradients([None, tf.ones(2)], compression="fp16")[0] is None
