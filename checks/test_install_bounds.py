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

pytestmark = pytest.mark.unit


def _bounds(lines):
    return {r.name.lower(): r.specifier for r in (Requirement(line) for line in lines if line.strip())}


def _setup_cfg():
    config = configparser.ConfigParser()
    config.read(os.path.join(REPO, "setup.cfg"))
    extras = "\n".join(config["options.extras_require"].values())
    return _bounds([*config["options"]["install_requires"].splitlines(), *extras.splitlines()])


def test_setup_cfg_and_requirements_txt_give_the_same_bounds():
    package = _setup_cfg()
    with open(os.path.join(REPO, "requirements.txt")) as f:
        requirements = _bounds(line.split("#")[0].strip() for line in f)
    assert {"tensorflow", "keras", "absl-py", "numpy", "matplotlib", "tensorflow-datasets"} <= set(package)
    assert {name: requirements.get(name) for name in package} == package


def test_keras_range_is_what_the_unit_tier_passed_on():
    specifier = _setup_cfg()["keras"]
    with open(os.path.join(REPO, "results", "keras_versions.md")) as f:
        rows = re.findall(r"^\| (\d+\.\d+\.\d+) \| (pass|fail) \|", f.read(), re.M)
    releases = {Version(v): verdict == "pass" for v, verdict in rows}
    inside = [v for v in releases if v in specifier]
    assert inside and all(releases[v] for v in inside), f"keras{specifier}: {releases}"
    # Every minor the range admits was run (and passed, above).
    lower = min(Version(s.version) for s in specifier if s.operator == ">=")
    upper = min(Version(s.version) for s in specifier if s.operator == "<")
    assert sorted({(v.major, v.minor) for v in inside}) == [(3, m) for m in range(lower.minor, upper.minor)]
    # The lower bound is TensorFlow's own: a lower one could not be installed beside it.
    needs = [
        Requirement(r).specifier for r in importlib.metadata.requires("tensorflow") if r.startswith("keras")
    ]
    assert [min(Version(s.version) for s in t if s.operator == ">=") for t in needs] == [lower]
