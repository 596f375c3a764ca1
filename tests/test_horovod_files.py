"""Horovod 0.28.1's own tests of its TF2 Keras layer (`test/parallel/test_tensorflow2_keras.py`) on 2 real
ranks with `horovod.tensorflow.keras` as `hvd_lars.parallel.horovod_keras` and the Keras 3 renames of
tests/support/horovod_files.py: those that apply under Keras 3 pass, the others are skipped with their reason.
Every rename is needed by one of Horovod's files, keeps its lines, and is in the README's table.
"""

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

needs_files = pytest.mark.skipif(
    not os.path.isdir(HOROVOD_FILES),
    reason=f"Horovod 0.28.1's own files are not at {HOROVOD_FILES} (or set HVD_LARS_HOROVOD_FILES)",
)
RUNNER = os.path.join(REPO, "tests", "support", "horovod_files.py")


@pytest.fixture(scope="module")
def horovod_tests(tmp_path_factory):
    out = tmp_path_factory.mktemp("horovod_tests")
    path = os.path.join(HOROVOD_FILES, "test", "parallel", "test_tensorflow2_keras.py")
    env = dict(os.environ, PYTHONPATH=REPO)
    cmd = served(
        [*TWO_RANKS, sys.executable, RUNNER, "pytest", str(out), path],
        out,
        env,
    )
    result = subprocess.run(cmd, cwd=out, env=env, capture_output=True, text=True, timeout=600)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-8000:]
    results = []
    for r in range(2):
        cases = ElementTree.parse(out / f"rank{r}.xml").iter("testcase")
        results.append({c.get("name"): [child.tag for child in c] for c in cases})
    return results, output


@pytest.mark.horovod
@needs_files
def test_horovods_keras_tests_that_apply_under_keras_3_pass_on_both_ranks(horovod_tests):
    results, _ = horovod_tests
    applying = {
        "test_train_model_lr_schedule",  # warmup, 3 LearningRateScheduleCallbacks, MetricAverageCallback
        "test_sparse_as_dense",
        "test_from_config",
        "test_elastic_state",
        "test_broadcast_global_variables_callback_with_local_vars",
    }
    for r in results:
        passed = {name for name, children in r.items() if not children}
        assert passed == applying
        skipped = {name for name, children in r.items() if children == ["skipped"]}
        # tf.test.TestCase's own test_session is "Not a test"; the others: NOT_UNDER_KERAS_3.
        assert {n for n in skipped if n != "test_session"} == {n for n in r if not_under_keras_3(n)}
        assert len(skipped) == 9


@pytest.mark.horovod
@needs_files
def test_each_horovod_test_left_out_is_listed_with_its_reason(horovod_tests):
    results, output = horovod_tests
    for base, reason in NOT_UNDER_KERAS_3.items():
        assert any(not_under_keras_3(name) == reason for name in results[0]), base
        assert f"not under Keras 3: {reason}" in output


FILES = [
    "examples/tensorflow2/tensorflow2_keras_mnist.py",
    "examples/tensorflow2/tensorflow2_keras_synthetic_benchmark.py",
    "examples/elastic/tensorflow2/tensorflow2_keras_mnist_elastic.py",
    "test/parallel/test_tensorflow2_keras.py",
]


@pytest.mark.unit
@needs_files
def test_every_rename_is_needed_by_a_horovod_file_and_keeps_its_lines():
    used = set()
    for name in FILES:
        path = os.path.join(HOROVOD_FILES, name)
        text, counts = renamed_source(path)
        used.update(counts)
        with open(path) as f:
            assert len(text.splitlines()) == len(f.read().splitlines()), name  # tracebacks stay true
        compile(text, path, "exec")
    assert used == {rename for _, _, rename, _ in RENAMES}


@pytest.mark.unit
def test_every_rename_is_in_the_readmes_horovod_table():
    with open(os.path.join(REPO, "README.md")) as f:
        readme = f.read()
    section = readme.split("### With Horovod: the `horovod.tensorflow.keras` names for Keras 3", 1)[1]
    section = section.split("\n## ", 1)[0]
    for _, _, rename, _ in RENAMES:
        assert rename in section, rename
