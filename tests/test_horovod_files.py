"""Horovod 0.28.1's own Keras tests on 2 ranks: those that apply under Keras 3 pass, the rest skip."""

import os
import subprocess
import sys
import xml.etree.ElementTree as ElementTree

import pytest

from tests.support import REPO, TWO_RANKS
from tests.support.horovod_files import (
    HOROVOD_FILES,
    NOT_UNDER_KERAS_3,
    RENAMES,
    not_under_keras_3,
    renamed_source,
)
from tests.support.main_server import served

pytestmark = pytest.mark.skipif(
    not os.path.isdir(HOROVOD_FILES),
    reason=f"Horovod 0.28.1's own files are not at {HOROVOD_FILES} (or set HVD_LARS_HOROVOD_FILES)",
)


@pytest.mark.horovod
def test_horovods_keras_tests_that_apply_under_keras_3_pass_on_both_ranks(tmp_path):
    path = os.path.join(HOROVOD_FILES, "test", "parallel", "test_tensorflow2_keras.py")
    env = dict(os.environ, PYTHONPATH=REPO)
    runner = os.path.join(REPO, "tests", "support", "horovod_files.py")
    cmd = served([*TWO_RANKS, sys.executable, runner, "pytest", str(tmp_path), path], tmp_path, env)
    result = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-8000:]
    applying = {
        "test_train_model_lr_schedule",  # warmup, 3 LearningRateScheduleCallbacks, MetricAverageCallback
        "test_sparse_as_dense",
        "test_from_config",
        "test_elastic_state",
        "test_broadcast_global_variables_callback_with_local_vars",
    }
    for rank in range(2):
        cases = ElementTree.parse(tmp_path / f"rank{rank}.xml").iter("testcase")
        results = {c.get("name"): [child.tag for child in c] for c in cases}
        assert {name for name, children in results.items() if not children} == applying
        skipped = {name for name, children in results.items() if children == ["skipped"]}
        # tf.test.TestCase's own test_session is "Not a test"; the others: NOT_UNDER_KERAS_3.
        assert skipped - {"test_session"} == {n for n in results if not_under_keras_3(n)}
        assert len(skipped) == 9
    for base, reason in NOT_UNDER_KERAS_3.items():  # each reason names a test there, and is printed
        assert any(not_under_keras_3(name) == reason for name in results), base
        assert f"not under Keras 3: {reason}" in output


@pytest.mark.unit
def test_every_rename_is_needed_by_a_horovod_file_and_keeps_its_lines():
    used = set()
    for name in (
        "examples/tensorflow2/tensorflow2_keras_mnist.py",
        "examples/tensorflow2/tensorflow2_keras_synthetic_benchmark.py",
        "examples/elastic/tensorflow2/tensorflow2_keras_mnist_elastic.py",
        "test/parallel/test_tensorflow2_keras.py",
    ):
        path = os.path.join(HOROVOD_FILES, name)
        text, counts = renamed_source(path)
        used.update(counts)
        with open(path) as f:
            assert len(text.splitlines()) == len(f.read().splitlines()), name  # tracebacks stay true
        compile(text, path, "exec")
    assert used == {rename for _, _, rename, _ in RENAMES}
