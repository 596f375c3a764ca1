import keras
import numpy as np
import pytest
import tensorflow as tf

import hvd_lars
from hvd_lars.models.batch_norm import FusedBatchNormalization


def user_model(seed):
    """A user's own model: Keras batch norms after convolutions (one nested), and one on a (B, C) tensor."""
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((8, 8, 3))
    x = keras.layers.Conv2D(4, 3, padding="same")(inputs)
    x = keras.layers.BatchNormalization(momentum=0.8, epsilon=1e-3)(x)
    x = keras.layers.ReLU()(x)
    block = keras.Sequential(
        [keras.layers.Conv2D(5, 3), keras.layers.BatchNormalization(center=False, scale=False)], name="block"
    )
    x = keras.layers.GlobalAveragePooling2D()(block(x))
    x = keras.layers.BatchNormalization(momentum=0.5)(keras.layers.Dense(6)(x))
    return keras.Model(inputs, keras.layers.Dense(3)(x))


def trained(model, x, y):
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9), loss=loss)
    for _ in range(3):
        model.train_on_batch(x, y)
    return model


@pytest.mark.unit
@pytest.mark.parametrize("policy, tolerance", [("float32", 1e-4), ("mixed_bfloat16", 3e-2)])
def test_fused_user_model_trains_and_infers_as_keras(policy, tolerance):
    keras.mixed_precision.set_global_policy(policy)
    try:
        rng = np.random.default_rng(0)
        x = rng.normal(1.0, 2.0, size=(16, 8, 8, 3)).astype(np.float32)
        y = rng.integers(0, 3, size=16)
        plain, fused = user_model(7), user_model(7)
        fused.set_weights(plain.get_weights())
        assert hvd_lars.fuse_batch_norm(fused) is fused
        kinds = [type(layer).__name__ for layer in fused._flatten_layers() if "batch_norm" in layer.name]
        assert (
            kinds == ["FusedBatchNormalization"] * 3
        )  # the nested one too; the (B, C) one computes as Keras's
        trained(plain, x, y), trained(fused, x, y)
        for a, b in zip(plain.weights, fused.weights, strict=True):
            np.testing.assert_allclose(
                np.asarray(b), np.asarray(a), rtol=tolerance, atol=tolerance, err_msg=a.path
            )
        np.testing.assert_allclose(fused.predict(x, verbose=0), plain.predict(x, verbose=0), atol=tolerance)
    finally:
        keras.mixed_precision.set_global_policy("float32")


@pytest.mark.unit
def test_fused_moving_variance_is_keras_biased_variance():
    x = np.random.default_rng(1).normal(2.0, 3.0, size=(4, 3, 5, 6)).astype(np.float32)
    layer = keras.layers.BatchNormalization(momentum=0.9)
    layer.build(x.shape)
    hvd_lars.fuse_batch_norm(layer)
    layer(x, training=True)
    np.testing.assert_allclose(layer.moving_mean.numpy(), 0.1 * x.mean(axis=(0, 1, 2)), rtol=1e-5)
    np.testing.assert_allclose(layer.moving_variance.numpy(), 0.9 + 0.1 * x.var(axis=(0, 1, 2)), rtol=1e-5)


@pytest.mark.unit
def test_fused_model_saves_and_loads(tmp_path):
    model = hvd_lars.fuse_batch_norm(user_model(3))
    x = np.random.default_rng(2).normal(size=(4, 8, 8, 3)).astype(np.float32)
    trained(model, x, np.array([0, 1, 2, 0]))
    model.save(tmp_path / "fused.keras")
    loaded = keras.models.load_model(tmp_path / "fused.keras")
    layers = [layer for layer in loaded._flatten_layers() if isinstance(layer, FusedBatchNormalization)]
    assert len(layers) == 3 and not any(layer.bessel_correction for layer in layers)
    np.testing.assert_allclose(loaded.predict(x, verbose=0), model.predict(x, verbose=0), atol=1e-6)
    assert tf.is_tensor(loaded(x))
