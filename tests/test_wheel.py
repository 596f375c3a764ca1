"""The wheel a user installs, built from `git archive HEAD`, installed into a fresh virtual environment and
run from outside the checkout (the editable install would hide a file the wheel leaves out), up to a 2-rank
run of flags/smoke.flags through its console script. The environment borrows from the project's only what
the wheel's metadata asks for (and Horovod), through a `.pth` line naming a folder of links."""

import configparser
import importlib.metadata
import json
import os
import pathlib
import re
import subprocess
import sys
import sysconfig
import venv
import zipfile

import numpy as np
import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests.support import HOROVODRUN, REPO

OUTSIDE = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # no module from the checkout

# What the installed package must show, run by the fresh environment's Python from outside the checkout.
_CHECK = r"""
import importlib, importlib.metadata, importlib.resources, json, pkgutil, sys
import numpy as np
import hvd_lars
modules = sorted(m.name for m in pkgutil.walk_packages(hvd_lars.__path__, "hvd_lars."))
for name in modules:
    importlib.import_module(name)
import keras
from hvd_lars import LARS
# One LARS step (paper rule: momentum 0.9 from zero velocity, weight decay 0.01, eta 0.001), one
# bias-free Dense layer, mean squared error over 2 outputs.
w0 = np.array([[0.5, -1.0], [2.0, 0.25]], np.float32)
x, y = np.array([[1.0, 2.0]], np.float32), np.zeros((1, 2), np.float32)
model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(2, use_bias=False)])
model.layers[0].kernel.assign(w0)
model.compile(optimizer=LARS(0.1, momentum=0.9, weight_decay=0.01, eta=0.001), loss="mse")
model.train_on_batch(x, y)
g = x.T @ (x @ w0 - y)  # d/dw of mean((x w - y)^2) over 2 outputs
trust = 0.001 * np.linalg.norm(w0) / (np.linalg.norm(g) + 0.01 * np.linalg.norm(w0))
expected = w0 - 0.1 * trust * (g + 0.01 * w0)
pkg = importlib.resources.files("hvd_lars")
data = sorted(str(p.relative_to(pkg)) for p in pkg.rglob("*") if p.is_file() and "__pycache__" not in str(p))
print(json.dumps({
    "file": hvd_lars.__file__,
    "modules": modules,
    "weights": model.layers[0].kernel.numpy().tolist(),
    "expected": expected.tolist(),
    "files": data,
    "scripts": sorted(e.name for e in importlib.metadata.distribution("hvd_lars").entry_points
                      if e.group == "console_scripts"),
}))
"""


def _run(command, **kwargs):
    """`command`'s standard output; fails with its output unless it exits with status 0."""
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, **kwargs)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-4000:]
    return result.stdout


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """(environment folder, wheel path, JSON of `_CHECK`) for the wheel of the committed tree."""
    tmp = tmp_path_factory.mktemp("wheel")
    src, dist, env = tmp / "src", tmp / "dist", tmp / "env"
    src.mkdir()
    archive = subprocess.run(["git", "-C", REPO, "archive", "HEAD"], capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", str(src)], input=archive.stdout, check=True)
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    _run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(dist), str(src)])
    (wheel,) = dist.glob("hvd_lars-*.whl")
    venv.EnvBuilder(with_pip=False).create(env)
    python = env / "bin" / "python"
    site = _run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"]).strip()
    # Links to the project's installs of what the wheel requires with its `train` extra (the application's)
    # and no other, and of what those require.
    with zipfile.ZipFile(wheel) as z:
        (metadata,) = [n for n in z.namelist() if n.endswith(".dist-info/METADATA")]
        pending = [*re.findall(r"^Requires-Dist: (.*)$", z.read(metadata).decode(), re.M), "horovod"]
    purelib, seen, borrowed = sysconfig.get_path("purelib"), set(), tmp / "borrowed"
    borrowed.mkdir()
    while pending:
        requirement = Requirement(pending.pop())
        name = canonicalize_name(requirement.name)
        if name in seen or (requirement.marker and not requirement.marker.evaluate({"extra": "train"})):
            continue
        seen.add(name)
        distribution = importlib.metadata.distribution(name)
        pending += distribution.requires or []
        for top in {f.parts[0] for f in distribution.files or () if f.parts[0] != os.pardir}:
            if not (borrowed / top).exists() and os.path.exists(os.path.join(purelib, top)):
                (borrowed / top).symlink_to(os.path.join(purelib, top))
    pathlib.Path(site, "project_requirements.pth").write_text(f"{borrowed}\n")
    _run([*pip, "--python", str(python), "install", "--no-deps", str(wheel)])
    checked = _run([str(python), "-c", _CHECK], cwd=tmp, env=OUTSIDE)
    return env, wheel, json.loads(checked.strip().splitlines()[-1])


@pytest.mark.horovod  # subprocesses: pip, the environment's Python, its console scripts
def test_the_wheel_holds_and_imports_every_file_of_the_package_and_steps_by_the_lars_rule(installed):
    env, wheel, found = installed
    listed = subprocess.check_output(["git", "-C", REPO, "ls-files", "hvd_lars"], text=True)
    committed = sorted(os.path.relpath(p, "hvd_lars") for p in listed.split())
    with zipfile.ZipFile(wheel) as z:
        in_wheel = sorted(os.path.relpath(n, "hvd_lars") for n in z.namelist() if n.startswith("hvd_lars/"))
    assert in_wheel == found["files"] == committed  # every package folder, module and data file
    assert found["file"].startswith(str(env)), found["file"]  # from the wheel, not the checkout
    modules = [p[: -len(".py")].replace("/", ".") for p in committed if p.endswith(".py")]
    assert found["modules"] == sorted(
        "hvd_lars." + m.removesuffix(".__init__") for m in modules if m != "__init__"
    )
    np.testing.assert_allclose(found["weights"], found["expected"], rtol=1e-5)
    assert np.abs(np.subtract(found["weights"], [[0.5, -1.0], [2.0, 0.25]])).max() > 1e-5  # it moved


@pytest.mark.horovod
def test_console_scripts_answer_help_and_train_two_ranks_to_the_end(installed):
    env, _, found = installed
    config = configparser.ConfigParser()
    config.read(os.path.join(REPO, "setup.cfg"))
    lines = config["options.entry_points"]["console_scripts"].strip().splitlines()
    declared = sorted(line.split("=")[0].strip() for line in lines)
    assert found["scripts"] == declared and len(declared) >= 2
    for script in declared:
        help_ = [str(env / "bin" / script), "--help"]
        result = subprocess.run(help_, cwd=env, capture_output=True, text=True, timeout=300, env=OUTSIDE)
        # absl's --help exits with status 1 after printing (argparse's with 0).
        assert result.returncode in (0, 1), (script, result.stdout[-2000:], result.stderr[-3000:])
        options = set(re.findall(r"--([a-z][a-z0-9_]+)", result.stdout)) - {"help", "helpfull", "helpshort"}
        assert options, (script, result.stdout[-3000:])  # the program's own options, listed
        if script == "hvd-lars-train":
            assert {"global_batch_size", "peak_learning_rate"} <= options
    # A user's first run: hvd-lars-train on 2 ranks, outside the checkout, with only what the wheel brings.
    work = env.parent / "run"
    work.mkdir()
    train = [str(env / "bin" / "hvd-lars-train"), f"--flagfile={REPO}/flags/smoke.flags", "--workdir=runs"]
    out = _run([HOROVODRUN, "-np", "2", "-H", "localhost:2", *train], cwd=work, env=OUTSIDE)
    assert "[hvd_lars] finished smoke: 2 of 2 epochs (6 steps)" in out, out[-3000:]
    run_dir = work / "runs" / "smoke"
    assert json.loads((run_dir / "summary.json").read_text())["final_test_top1"] is not None
    assert (run_dir / "run.png").exists() and any((run_dir / "tensorboard").iterdir())
