import pytest

from hvd_lars.models import MODELS, get_model


def test_unknown_model_lists_valid_names():
    with pytest.raises(ValueError) as info:
        get_model("vgg16")
    assert "'vgg16'" in str(info.value)
    for name in MODELS:
        assert name in str(info.value)


def test_small_cnn_parameter_count():
    model = get_model("small_cnn", num_classes=10, input_shape=(28, 28, 1))
    # convs (no bias): 3*3*(1*16 + 16*16 + 16*32 + 32*32) = 16,272; BN gamma+beta: 2*(16+16+32+32) = 192;
    # fc1: 7*7*32*128 + 128 = 200,832; fc1_bn: 256; logits: 128*10 + 10 = 1,290.
    assert model.count_params() - sum(v.numpy().size for v in model.non_trainable_variables) == (
        16272 + 192 + 200832 + 256 + 1290
    )
    assert model.output.dtype == "float32"
