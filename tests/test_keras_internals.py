"""Private Keras names are used in `hvd_lars.keras_internals` only, and each name it lists exists."""

import ast
import pathlib

import keras
import numpy as np
import pytest

from hvd_lars import keras_internals

REPO = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = REPO / "hvd_lars"
SHIM = PACKAGE / "keras_internals.py"


def violations(source, private, path="<source>"):
    """(path, line, name) of each private Keras name (listed hooks' overrides aside) or keras.src import."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr in private:
            hook = node.attr in keras_internals.OVERRIDDEN_HOOKS
            through_super = isinstance(node.value, ast.Call) and getattr(node.value.func, "id", "") == "super"
            if not (hook and through_super):
                found.append((path, node.lineno, node.attr))
        elif isinstance(node, ast.FunctionDef) and node.name in private:
            if node.name not in keras_internals.OVERRIDDEN_HOOKS:
                found.append((path, node.lineno, node.name))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            modules = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            if any(m == "keras.src" or m.startswith("keras.src.") for m in modules):
                found.append((path, node.lineno, "keras.src"))
    return sorted(found, key=lambda f: f[1])


@pytest.fixture(scope="module")
def private():
    """Single-underscore attribute names of Keras objects, built as the package uses them."""
    variable = keras.Variable(np.ones((2, 1), np.float32))
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9), loss="mse", jit_compile=False)
    model.fit(np.ones((2, 2), np.float32), np.ones((2, 1), np.float32), verbose=0)
    scaler = keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam())
    scaler.build([variable])
    objects = [variable, model, model.layers[0], model.optimizer, scaler, keras.callbacks.Callback()]
    names = {n for obj in objects for n in [*dir(obj), *vars(obj)]}
    return {n for n in names if n.startswith("_") and not n.startswith("__")}


@pytest.mark.unit
def test_private_keras_names_are_in_the_shim_only_and_it_lists_each_it_uses(private):
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path != SHIM:
            found += violations(path.read_text(), private, str(path.relative_to(REPO)))
    assert found == [], "private Keras names outside hvd_lars/keras_internals.py: " + repr(found)
    used = {node.attr for node in ast.walk(ast.parse(SHIM.read_text())) if isinstance(node, ast.Attribute)}
    used &= private | set(keras_internals.PRIVATE_NAMES)
    assert used == set(keras_internals.PRIVATE_NAMES), "the shim's uses are not the names it lists"


@pytest.mark.unit
def test_the_scan_finds_each_kind_of_use(private):
    # Each kind of use is found; the listed hooks' overrides and super() calls are not.
    source = """import keras.src.backend
from keras.src import ops
def f(model, optimizer):
    model._flatten_layers()
    return optimizer._iterations
class O:
    def _var_key(self, v):
        return v
    def _backend_update_step(self, g, v, r):
        super()._backend_update_step(g, v, r)
        self._backend_update_step(g, v, r)
"""
    found = [(line, name) for _, line, name in violations(source, private)]
    assert found == [(1, "keras.src"), (2, "keras.src"), (4, "_flatten_layers"), (5, "_iterations"),
                     (7, "_var_key"), (11, "_backend_update_step")]  # fmt: skip


@pytest.mark.unit
def test_every_listed_name_exists_in_the_installed_keras():
    # An instance attribute (made in __init__ or build) is looked up on a built instance.
    built = {
        "keras.optimizers.Optimizer": keras.optimizers.SGD(0.1),
        "keras.Model": keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)]),
        "keras.Variable": keras.Variable(0.0),
    }
    built["keras.optimizers.Optimizer"].build([keras.Variable(np.ones(2, np.float32))])
    listed = {**keras_internals.PRIVATE_NAMES, **keras_internals.OVERRIDDEN_HOOKS}
    found = lambda name, owner: hasattr(eval(owner, {"keras": keras}), name) or hasattr(built[owner], name)
    assert [(name, owner) for name, owner in listed.items() if not found(name, owner)] == []
