"""How `make test` spreads the suite over pytest-xdist workers (tests/conftest.py): every file a group of its
own (its module-scoped fixtures built once) and every system test in one, first (two emulated clusters at
once would share host names); a test needs exactly one tier."""

import pytest

from tests import conftest

pytestmark = pytest.mark.unit


class _Item:
    """What the hooks read of a collected test: its id and its markers."""

    def __init__(self, nodeid, *tiers):
        self.nodeid, self.markers = nodeid, [getattr(pytest.mark, tier).mark for tier in tiers]

    def add_marker(self, mark):
        self.markers.append(mark.mark)

    def iter_markers(self):
        return iter(self.markers)

    def get_closest_marker(self, name):
        return next((m for m in self.markers if m.name == name), None)


def test_each_file_is_a_group_and_every_system_test_in_one_collected_first():
    ids = [
        "test_flops.py::test_a",
        "test_flops.py::test_b",
        "test_cluster.py::test_c",
        "test_slurm.py::test_d",
    ]
    items = [_Item(f"tests/{i}", tier) for i, tier in zip(ids, ["unit", "horovod", "system", "system"])]
    for item in items:
        conftest.pytest_itemcollected(item)
    groups = [item.get_closest_marker("xdist_group").args[0] for item in items]
    assert groups == ["tests/test_flops.py", "tests/test_flops.py", "system", "system"]
    conftest.pytest_collection_modifyitems(items)
    assert [item.nodeid.split("::")[1] for item in items] == ["test_c", "test_d", "test_a", "test_b"]
    with pytest.raises(pytest.UsageError, match=r"test_y has tier markers \['horovod', 'unit'\]"):
        conftest.pytest_collection_modifyitems([_Item("tests/test_x.py::test_y", "unit", "horovod")])
