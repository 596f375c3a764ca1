"""setup.cfg and requirements.txt give each package they share the same bounds, and Keras's range is the one
results/keras_versions.md shows the unit tier passing on (install/check_keras_versions.sh)."""

import configparser
import importlib.metadata
import os
import re

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

from tests.support import REPO


def _setup_cfg_requirements():
    config = configparser.ConfigParser()
    config.read(os.path.join(REPO, "setup.cfg"))
    lines = config["options"]["install_requires"].splitlines()
    for extra in config["options.extras_require"].values():
        lines += extra.splitlines()
    return {r.name.lower(): r.specifier for r in (Requirement(line) for line in lines if line.strip())}


def _requirements_txt():
    with open(os.path.join(REPO, "requirements.txt")) as f:
        lines = [line.split("#")[0].strip() for line in f]
    return {r.name.lower(): r.specifier for r in (Requirement(line) for line in lines if line)}


@pytest.mark.unit
def test_setup_cfg_and_requirements_txt_give_the_same_bounds():
    package, requirements = _setup_cfg_requirements(), _requirements_txt()
    assert {"tensorflow", "keras", "absl-py", "numpy", "matplotlib", "tensorflow-datasets"} <= set(package)
    for name, specifier in package.items():
        assert specifier == requirements.get(name), (
            f"{name}: setup.cfg {specifier}, requirements.txt {requirements.get(name)}"
        )


@pytest.mark.unit
def test_keras_range_is_what_the_unit_tier_passed_on():
    specifier = _setup_cfg_requirements()["keras"]
    with open(os.path.join(REPO, "results", "keras_versions.md")) as f:
        rows = re.findall(r"^\| (\d+\.\d+\.\d+) \| (pass|fail) \|", f.read(), re.M)
    releases = {Version(v): verdict == "pass" for v, verdict in rows}
    inside = [v for v in releases if v in specifier]
    assert inside and all(releases[v] for v in inside), f"keras{specifier}: {releases}"
    # Every minor the range admits was run (and passed, above).
    minors = sorted({(v.major, v.minor) for v in inside})
    lower = min(Version(s.version) for s in specifier if s.operator == ">=")
    upper = min(Version(s.version) for s in specifier if s.operator == "<")
    assert minors == [(3, m) for m in range(lower.minor, upper.minor)], (minors, str(specifier))
    # The lower bound is TensorFlow's own: a lower one could not be installed beside it.
    tensorflow_needs = [
        Requirement(r).specifier for r in importlib.metadata.requires("tensorflow") if r.startswith("keras")
    ]
    assert [min(Version(s.version) for s in t if s.operator == ">=") for t in tensorflow_needs] == [lower]
