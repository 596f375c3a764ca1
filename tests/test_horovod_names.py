"""Horovod 0.28.1's public Keras-layer names: in `horovod_keras` with their arguments, and in the README."""

import ast
import importlib.util
import inspect
import os
import re
from pathlib import Path

import pytest

from hvd_lars.parallel import horovod_keras
from tests.support import REPO
from tests.support.horovod_files import RENAMES

pytestmark = pytest.mark.unit

HOROVOD = importlib.util.find_spec("horovod").submodule_search_locations[0]
KERAS = os.path.join(HOROVOD, "tensorflow", "keras")
SOURCES = {part: os.path.join(KERAS, f"{part or '__init__'}.py") for part in ("", "callbacks", "elastic")}


def horovod_names(path):
    """{name: ast node of its def or class, or None for an imported name} of Horovod's public names."""
    names = {}
    for node in ast.parse(Path(path).read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and not node.name.startswith("_"):
            names[node.name] = node
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("horovod.tensorflow"):
            for alias in node.names:
                bound = alias.asname or alias.name
                if not bound.startswith("_"):
                    names[bound] = None
        elif isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets):
            names = {k: names.get(k) for k in ast.literal_eval(node.value)}
    return names


ALL = sorted(
    (part, name, node) for part, path in SOURCES.items() for name, node in horovod_names(path).items()
)


@pytest.mark.parametrize("part, name, node", ALL, ids=[f"{p or 'hvd'}.{n}" for p, n, _ in ALL])
def test_every_horovod_name_is_here_with_its_arguments(part, name, node):
    ours = getattr(getattr(horovod_keras, part) if part else horovod_keras, name, None)
    assert ours is not None, f"horovod_keras{'.' + part if part else ''} lacks Horovod's {name}"
    if node is None:
        return
    if isinstance(node, ast.ClassDef):
        init = next((n for n in node.body if isinstance(n, ast.FunctionDef) and n.name == "__init__"), None)
        if init is None:
            return
        arguments, ours = init.args, ours.__init__
    else:
        arguments = node.args
    theirs = [a.arg for a in arguments.args if a.arg != "self"]
    defaults = dict(zip(reversed(theirs), reversed(arguments.defaults)))
    parameters = inspect.signature(ours).parameters.values()
    positional = [p.name for p in parameters if p.kind == p.POSITIONAL_OR_KEYWORD and p.name != "self"]
    assert positional[: len(theirs)] == theirs, f"{name}: Horovod's arguments {theirs}, ours {positional}"
    for arg, default in defaults.items():
        want = eval(compile(ast.Expression(default), "<horovod default>", "eval"), vars(horovod_keras))  # noqa: S307
        got = inspect.signature(ours).parameters[arg].default
        assert got is want or got == want, f"{name}({arg}=): Horovod's {ast.unparse(default)}, ours {got!r}"


def test_horovods_own_names_are_horovods():
    import horovod.tensorflow as hvd

    own = "shutdown is_initialized Average Sum Compression ProcessSet global_process_set add_process_set"
    for name in (own + " remove_process_set start_timeline mpi_threads_supported gloo_enabled").split():
        assert getattr(horovod_keras, name) is getattr(hvd, name), name


def test_the_readmes_horovod_table_names_every_horovod_name_and_rename():
    with open(os.path.join(REPO, "README.md")) as f:
        section = f.read().split("### With Horovod: the `horovod.tensorflow.keras` names for Keras 3", 1)[1]
    section = section.split("\n## ", 1)[0]
    cells = re.findall(r"`([^`]*)`", "\n".join(line for line in section.splitlines() if line.startswith("|")))
    assert {"Compression", "reducescatter", "BestModelCheckpoint", "run"} <= {n for _, n, _ in ALL}  # read
    for _part, name, _ in ALL:
        assert any(re.search(rf"\b{re.escape(name)}\b", cell) for cell in cells), f"README table lacks {name}"
    for _, _, rename, _ in RENAMES:
        assert rename in section, rename
