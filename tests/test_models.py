"""The models: parameter counts (and ResNet-50's and AlexNet's multiply-adds) against hand and published ones,
layers against their formulas, `fuse_batch_norm` against Keras."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import hvd_lars
from hvd_lars.models import MODELS, get_model
from hvd_lars.models.alexnet import LocalResponseNormalization
from hvd_lars.models.batch_norm import FusedBatchNormalization
from hvd_lars.models.cifar_resnet import ZeroPadShortcut, cifar_resnet
from hvd_lars.models.flops import forward_multiply_adds
from hvd_lars.models.resnet import resnet


def trainable_count(model):
    return sum(int(np.prod(v.shape)) for v in model.trainable_variables)


def moving_statistics_count(model):
    return sum(int(np.prod(v.shape)) for v in model.non_trainable_variables if "moving" in v.path)


def assert_float32_logits(model, classes):
    """Under mixed_bfloat16 (conftest sets float32 again after each test): bfloat16 convolutions."""
    assert model.get_layer("conv1").compute_dtype == "bfloat16"
    logits = model(tf.random.stateless_uniform((2, *model.input_shape[1:]), seed=(1, 2)), training=True)
    assert logits.dtype == tf.float32 and logits.shape == (2, classes)
    assert np.all(np.isfinite(logits.numpy()))


@pytest.mark.unit
def test_unknown_names_invalid_shapes_and_depths_are_refused():
    with pytest.raises(ValueError) as info:
        get_model("vgg16")
    assert "'vgg16'" in str(info.value) and all(name in str(info.value) for name in MODELS)
    with pytest.raises(ValueError, match=r"67x67.*\(64, 64, 3\)"):
        get_model("alexnet", input_shape=(64, 64, 3))
    with pytest.raises(ValueError, match="6n \\+ 2.*21"):
        cifar_resnet(21)
    with pytest.raises(ValueError, match="101"):
        resnet(101)


@pytest.mark.unit
def test_small_cnn_parameter_counts_with_and_without_batch_norm():
    with_bn = get_model("small_cnn", num_classes=10, input_shape=(28, 28, 1))
    without = get_model("small_cnn_nobn", num_classes=10, input_shape=(28, 28, 1))
    # convs (no bias): 3*3*(1*16 + 16*16 + 16*32 + 32*32) = 16,272; BN gamma+beta: 2*(16+16+32+32) = 192;
    # fc1: 7*7*32*128 + 128 = 200,832; fc1_bn: 256; logits: 128*10 + 10 = 1,290.
    assert trainable_count(with_bn) == 16272 + 192 + 200832 + 256 + 1290
    # Without BN, its gamma, beta, moving mean and variance go (4 * 224 = 896 numbers); each convolution
    # gains a bias in beta's place (16 + 16 + 32 + 32 = 96).
    assert with_bn.count_params() == 16272 + 896 + 200832 + 1290
    assert without.count_params() == with_bn.count_params() - 896 + 96
    bn_layers = [layer for layer in with_bn.layers if isinstance(layer, keras.layers.BatchNormalization)]
    assert [layer.name for layer in bn_layers] == ["conv1_bn", "conv2_bn", "conv3_bn", "conv4_bn", "fc1_bn"]
    assert [(layer.name, type(layer)) for layer in without.layers] == [
        (layer.name, type(layer)) for layer in with_bn.layers if layer not in bn_layers
    ]
    for layer in without.layers:
        if isinstance(layer, keras.layers.Conv2D):
            assert layer.use_bias and layer.kernel_initializer.__class__.__name__ == "HeNormal"


@pytest.mark.unit
def test_resnet50_v15_parameter_count_layout_and_multiply_adds():
    model = get_model("resnet50")
    # Stem 9,408 + 128; stage 1: 75,008 + 2 * 70,400; stage 2: 379,392 + 3 * 280,064; stage 3: 1,512,448 +
    # 5 * 1,117,184; stage 4: 6,039,552 + 2 * 4,462,592; fc 2,049,000: 25,557,032, torchvision's resnet50
    # and the MLPerf reference's (Keras Applications' convolutions carry biases: 25,583,592).
    assert trainable_count(model) == 25_557_032
    # Moving mean + variance: one pair per BN channel, i.e. half the BN gamma+beta count: 53,120.
    assert moving_statistics_count(model) == 53_120
    assert model.get_layer("stage4_block3_out").output.shape[1:] == (7, 7, 2048)
    # v1.5: the down-sampling block strides its 3x3 convolution, not its first 1x1.
    for stage in (2, 3, 4):
        assert model.get_layer(f"stage{stage}_block1_conv1").strides == (1, 1)
        assert model.get_layer(f"stage{stage}_block1_conv2").strides == (2, 2)
        assert model.get_layer(f"stage{stage}_block1_proj").strides == (2, 2)
    convs = [layer for layer in model.layers if isinstance(layer, keras.layers.Conv2D)]
    assert len(convs) == 53  # 1 stem + 16 blocks * 3 + 4 projections
    assert not any(layer.use_bias for layer in convs)
    # torchvision's ResNet-50 (v1.5): "GFLOPS 4.09" (multiply-adds) at 224x224 in its model table.
    assert sum(forward_multiply_adds(model).values()) == pytest.approx(4.09e9, rel=0.005)


@pytest.mark.unit
@pytest.mark.parametrize("name, options, count, gamma", [("resnet18", {}, 11_689_512, 0.0),
    ("resnet34", {"zero_init_residual": False}, 21_797_672, 1.0)])  # fmt: skip
def test_basic_block_resnet_counts_zero_init_residual_and_float32_logits(name, options, count, gamma):
    # torchvision's resnet18 / resnet34 counts (same layout, no convolution biases; any input size).
    keras.mixed_precision.set_global_policy("mixed_bfloat16")
    model = get_model(name, input_shape=(64, 64, 3), **options)
    assert trainable_count(model) == count
    assert_float32_logits(model, 1000)
    last = [layer for layer in model.layers if layer.name.endswith("_bn2")]
    assert len(last) == {"resnet18": 8, "resnet34": 16}[name]
    for layer in last:  # the last batch-norm gamma of every block; zero_init_residual by default
        np.testing.assert_array_equal(layer.gamma.numpy(), gamma)
    np.testing.assert_array_equal(model.get_layer("stage1_block1_bn1").gamma.numpy(), 1.0)


@pytest.mark.unit
def test_alexnet_parameter_and_multiply_add_counts_and_float32_logits():
    # One tower (no grouped convolutions), with biases: conv1 11*11*3*96 + 96 = 34,944; conv2 5*5*96*256 +
    # 256 = 614,656; conv3 3*3*256*384 + 384 = 885,120; conv4 3*3*384*384 + 384 = 1,327,488;
    # conv5 3*3*384*256 + 256 = 884,992; fc6 (6*6*256)*4096 + 4096 = 37,752,832; fc7 4096*4096 + 4096 =
    # 16,781,312; fc8 4096*1000 + 1000 = 4,097,000. Total 62,378,344 (the usual "62.3M" AlexNet figure).
    expected = 34_944 + 614_656 + 885_120 + 1_327_488 + 884_992 + 37_752_832 + 16_781_312 + 4_097_000
    keras.mixed_precision.set_global_policy("mixed_bfloat16")
    # The plain one at its smallest input, 67x67: fc6 sees 1x1x256 inputs instead of 6x6x256.
    plain = get_model("alexnet", input_shape=(67, 67, 3))
    assert trainable_count(plain) == expected - 35 * 256 * 4096
    assert moving_statistics_count(plain) == 0
    assert len([layer for layer in plain.layers if isinstance(layer, LocalResponseNormalization)]) == 2
    assert plain.get_layer("flatten").output.shape[1:] == (256,)
    assert_float32_logits(plain, 1000)
    # AlexNet-BN: BN without scale/shift adds no trainable parameter, only moving mean + variance on the
    # outputs of pool1, pool2, conv3, conv4: 2 * (96 + 256 + 384 + 384) = 2,240.
    bn = get_model("alexnet_bn")
    assert trainable_count(bn) == expected
    assert_float32_logits(bn, 1000)
    assert moving_statistics_count(bn) == 2_240
    assert not any(isinstance(layer, LocalResponseNormalization) for layer in bn.layers)
    # Fillers: bvlc_alexnet's; the released AlexNet-BN's train_val2.prototxt; fc6 weights N(0, 0.005^2).
    np.testing.assert_array_equal(plain.get_layer("conv2").bias.numpy(), np.float32(0.1))
    np.testing.assert_array_equal(plain.get_layer("conv3").bias.numpy(), 0.0)
    np.testing.assert_array_equal(plain.get_layer("logits").bias.numpy(), 0.0)
    for layer, value in [("conv1", 0.01), ("conv2", 0.01), ("conv3", 0.01), ("fc6", 0.1), ("logits", 0.01)]:
        np.testing.assert_array_equal(bn.get_layer(layer).bias.numpy(), np.float32(value))
    bn_layers = [layer for layer in bn.layers if isinstance(layer, keras.layers.BatchNormalization)]
    assert {layer.epsilon for layer in bn_layers} == {1e-4}
    assert abs(np.std(bn.get_layer("fc6").kernel[:256].numpy()) - 0.005) < 5e-5  # 1M weights: error 3.5e-6
    # Caffe's two-tower bvlc_alexnet (conv2, conv4, conv5 grouped in 2). Sze et al., "Efficient Processing of
    # Deep Neural Networks", Proc. IEEE 2017, table III: 666M multiply-adds in the convolutions, 58.6M in fc.
    inputs = keras.Input((227, 227, 3))
    x, zeros = inputs, dict(kernel_initializer="zeros")  # only shapes count: no random weights drawn
    for filters, kernel, strides, groups, pool in [
        (96, 11, 4, 1, True), (256, 5, 1, 2, True), (384, 3, 1, 1, False), (384, 3, 1, 2, False),
        (256, 3, 1, 2, True),
    ]:  # fmt: skip
        padding = "valid" if kernel == 11 else "same"
        x = keras.layers.Conv2D(filters, kernel, strides=strides, padding=padding, groups=groups, **zeros)(x)
        x = keras.layers.MaxPooling2D(3, 2)(x) if pool else x
    x = keras.layers.Flatten()(x)
    for units in (4096, 4096, 1000):
        x = keras.layers.Dense(units, **zeros)(x)
    counts = list(forward_multiply_adds(keras.Model(inputs, x)).values())
    assert sum(counts[:5]) == pytest.approx(666e6, rel=0.005)
    assert sum(counts[5:]) == pytest.approx(58.6e6, rel=0.005)
    # hvd_lars's AlexNet-BN is one tower: conv2, conv4 and conv5 see all input channels, twice the work.
    grouped = dict(zip(["conv1", "conv2", "conv3", "conv4", "conv5", "fc6", "fc7", "logits"], counts))
    want = {k: v * (2 if k in ("conv2", "conv4", "conv5") else 1) for k, v in grouped.items()}
    assert forward_multiply_adds(bn) == want


@pytest.mark.unit
def test_resnet20_parameter_count_zero_padded_shortcut_and_float32_logits():
    # Stem 3*3*3*16 + BN 32 = 464. Stage 1: 3 blocks of 2 * 3*3*16*16 + 2 BN (64) = 4,672 -> 14,016.
    # Stage 2: first block 3*3*16*32 + 3*3*32*32 + 128 = 13,952, two more of 2 * 9,216 + 128 = 18,560
    # -> 51,072. Stage 3: 3*3*32*64 + 3*3*64*64 + 256 = 55,552, two of 2 * 36,864 + 256 = 73,984
    # -> 203,520. Option-A shortcuts add nothing; fc 64*10 + 10 = 650. Total 269,722 (0.27M, table 6).
    keras.mixed_precision.set_global_policy("mixed_bfloat16")
    model = get_model("resnet20", num_classes=10)
    assert trainable_count(model) == 464 + 14_016 + 51_072 + 203_520 + 650 == 269_722
    assert_float32_logits(model, 10)
    assert model.get_layer("stage3_block3_out").output.shape[1:] == (8, 8, 64)
    # Option A: the shortcut subsamples and appends zero channels.
    x = np.arange(2 * 4 * 4 * 3, dtype=np.float32).reshape(2, 4, 4, 3)
    y = ZeroPadShortcut(8, 2)(x).numpy()
    assert y.shape == (2, 2, 2, 8) and not y[..., 3:].any()
    np.testing.assert_array_equal(y[..., :3], x[:, ::2, ::2, :])


@pytest.mark.unit
def test_local_response_normalization_matches_caffe_formula():
    x = np.random.default_rng(0).normal(size=(2, 3, 3, 7)).astype(np.float32) * 20
    y = LocalResponseNormalization()(x).numpy()
    # Caffe: x_c / (1 + 1e-4 / 5 * sum of x^2 over channels c-2..c+2, clipped at the edges) ** 0.75.
    sq = np.pad(x**2, [(0, 0), (0, 0), (0, 0), (2, 2)])
    window = sum(sq[..., i : i + 7] for i in range(5))
    np.testing.assert_allclose(y, x / (1 + 1e-4 / 5 * window) ** 0.75, rtol=1e-5)


@pytest.mark.unit
def test_fused_batch_norm_matches_reference_keras_gradients_and_variances():
    rng = np.random.default_rng(1)
    x = tf.constant(rng.normal(2.0, 3.0, size=(4, 3, 5, 6)).astype(np.float32))
    fused = FusedBatchNormalization(momentum=0.9, epsilon=1e-5)
    plain = keras.layers.BatchNormalization(momentum=0.9, epsilon=1e-5)
    gamma, beta = np.linspace(0.5, 2.0, 6).astype(np.float32), np.full(6, 0.3, np.float32)
    for layer in (fused, plain):
        layer.build(x.shape)
        layer.gamma.assign(gamma)
        layer.beta.assign(beta)
    weights = tf.constant(rng.normal(size=(4, 3, 5, 6)).astype(np.float32))
    with tf.GradientTape(persistent=True) as tape:
        tape.watch(x)
        y_fused = fused(x, training=True)
        y_plain = plain(x, training=True)
        loss_fused, loss_plain = tf.reduce_sum(y_fused * weights), tf.reduce_sum(y_plain * weights)
    xn = x.numpy()
    mean, var = xn.mean(axis=(0, 1, 2)), xn.var(axis=(0, 1, 2))
    np.testing.assert_allclose(y_fused, gamma * (xn - mean) / np.sqrt(var + 1e-5) + beta, atol=1e-5)
    np.testing.assert_allclose(tape.gradient(loss_fused, x), tape.gradient(loss_plain, x), atol=1e-5)
    np.testing.assert_allclose(
        tape.gradient(loss_fused, fused.gamma), tape.gradient(loss_plain, plain.gamma), rtol=1e-4
    )
    # Moving averages from 0 / 1: 0.1 * batch mean; 0.9 + 0.1 * unbiased variance (n = 60 values).
    np.testing.assert_allclose(fused.moving_mean.numpy(), 0.1 * mean, rtol=1e-5)
    np.testing.assert_allclose(fused.moving_variance.numpy(), 0.9 + 0.1 * var * 60 / 59, rtol=1e-5)
    expected = gamma * (xn - fused.moving_mean.numpy()) / np.sqrt(fused.moving_variance.numpy() + 1e-5) + beta
    np.testing.assert_allclose(fused(x, training=False), expected, atol=1e-5)
    # A Keras layer fused by fuse_batch_norm keeps Keras's biased moving variance.
    layer = keras.layers.BatchNormalization(momentum=0.9)
    layer.build(x.shape)
    hvd_lars.fuse_batch_norm(layer)(x, training=True)
    np.testing.assert_allclose(layer.moving_mean.numpy(), 0.1 * mean, rtol=1e-5)
    np.testing.assert_allclose(layer.moving_variance.numpy(), 0.9 + 0.1 * var, rtol=1e-5)


def _user_model(seed):
    """A user's own model: Keras batch norms after convolutions (one nested), and one on a (B, C) tensor."""
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((8, 8, 3))
    x = keras.layers.BatchNormalization(momentum=0.8, epsilon=1e-3)(
        keras.layers.Conv2D(4, 3, padding="same")(inputs)
    )
    block = keras.Sequential(
        [keras.layers.Conv2D(5, 3), keras.layers.BatchNormalization(center=False, scale=False)], name="block"
    )
    x = keras.layers.GlobalAveragePooling2D()(block(keras.layers.ReLU()(x)))
    x = keras.layers.BatchNormalization(momentum=0.5)(keras.layers.Dense(6)(x))
    return keras.Model(inputs, keras.layers.Dense(3)(x))


@pytest.mark.unit
@pytest.mark.parametrize("policy, tolerance", [("float32", 1e-4), ("mixed_bfloat16", 3e-2)])
def test_fused_user_model_trains_infers_and_saves_as_keras(policy, tolerance, tmp_path):
    keras.mixed_precision.set_global_policy(policy)
    rng = np.random.default_rng(0)
    x = rng.normal(1.0, 2.0, size=(16, 8, 8, 3)).astype(np.float32)
    y = rng.integers(0, 3, size=16)
    plain, fused = _user_model(7), _user_model(7)
    fused.set_weights(plain.get_weights())
    assert hvd_lars.fuse_batch_norm(fused) is fused
    kinds = [type(layer).__name__ for layer in fused._flatten_layers() if "batch_norm" in layer.name]
    assert kinds == ["FusedBatchNormalization"] * 3  # the nested one too; the (B, C) one stays Keras's
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    for model in (plain, fused):  # eagerly: the same ops as in fit's traced step (test_keras_conformance)
        model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9), loss=loss, run_eagerly=True)
        for _ in range(3):
            model.train_on_batch(x, y)
    for a, b in zip(plain.weights, fused.weights, strict=True):
        np.testing.assert_allclose(b, a, rtol=tolerance, atol=tolerance, err_msg=a.path)
    predicted = fused(x, training=False)
    np.testing.assert_allclose(predicted, plain(x, training=False), atol=tolerance)
    fused.save(tmp_path / "fused.keras")
    loaded = keras.models.load_model(tmp_path / "fused.keras")
    layers = [layer for layer in loaded._flatten_layers() if isinstance(layer, FusedBatchNormalization)]
    assert len(layers) == 3 and not any(layer.bessel_correction for layer in layers)
    np.testing.assert_allclose(loaded(x, training=False), predicted, atol=1e-6)
