"""How `make test` spreads the suite over pytest-xdist workers (tests/conftest.py): every file a group of its
own (its module-scoped fixtures built once) and every system test in one, first (two emulated clusters at
once would share host names), then the files that start processes, the unit-only ones last (short tests
fill the end); a test needs exactly one tier."""

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


def test_each_file_is_a_group_every_system_test_in_one_first_then_files_that_start_processes():
    ids = "lars.py::test_u flops.py::test_a flops.py::test_b cluster.py::test_c slurm.py::test_d".split()
    tiers = "unit unit horovod system system".split()
    items = [_Item(f"tests/test_{i}", tier) for i, tier in zip(ids, tiers)]
    for item in items:
        conftest.pytest_itemcollected(item)
    groups = [item.get_closest_marker("xdist_group").args[0] for item in items]
    assert groups == ["tests/test_lars.py", "tests/test_flops.py", "tests/test_flops.py", "system", "system"]
    conftest.pytest_collection_modifyitems(items)
    order = [item.nodeid.split("::")[1] for item in items]
    assert order == ["test_c", "test_d", "test_a", "test_b", "test_u"]  # a file's tests stay together
    with pytest.raises(pytest.UsageError, match=r"test_y has tier markers \['horovod', 'unit'\]"):
        conftest.pytest_collection_modifyitems([_Item("tests/test_x.py::test_y", "unit", "horovod")])
