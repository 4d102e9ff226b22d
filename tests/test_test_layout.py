"""The test tree has no __init__.py files, so pytest imports each test file as a top-level module named after the
file (its default "prepend" import mode): two files with one name in different folders stop the whole collection.
Caught here with the names, before pytest's own error hides which run it came from."""
from collections import defaultdict
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def test_every_test_file_has_a_name_of_its_own():
    by_name = defaultdict(list)
    for path in TESTS.rglob("test_*.py"):
        by_name[path.name].append(str(path.relative_to(TESTS)))
    repeated = {name: paths for name, paths in by_name.items() if len(paths) > 1}
    assert not repeated, f"test files share a base name (rename one): {repeated}"
