"""The suite's size, counted (issue 60): tests/timings.json records the README's test command on the 2-core machine
(per file: tests, seconds, process launches; the 40 slowest tests). Times are never asserted; what is checked is that
the record covers the suite as it is (a new test file without a refreshed record fails here, so the growth shows
up in review) and that the slower tier it names exists. Refresh: ``TRACEPP_TIMINGS=tests/timings.json python -m
pytest tests -q -m "not slow"``."""
import glob
import json
import os

HERE = os.path.dirname(os.path.abspath(__file__))


def _record() -> dict:
    with open(os.path.join(HERE, "timings.json")) as handle:
        return json.load(handle)


def test_the_timings_cover_every_test_file_and_report_the_launches(capsys):
    record = _record()
    files = {os.path.relpath(path, os.path.dirname(HERE)) for path in glob.glob(os.path.join(HERE, "test_*.py"))}
    slow = {name.split("::")[0] for name in _slow_tier()}  # a file whose every test is in the slower tier
    missing = sorted(f for f in files - set(record["files"]) - slow if not _skipped_whole(f))
    assert not missing, f"tests/timings.json predates {missing}: refresh it (this module's docstring says how)"
    assert record["launches"] == sum(entry["launches"] for entry in record["files"].values())
    with capsys.disabled():
        print(f"\nthe README's test command, as last recorded ({record['written']}): {record['tests']} tests, "
              f"{record['launches']} process launches, {record['seconds'] / 60:.1f} min")


def _skipped_whole(path: str) -> bool:
    """A file that skips itself where an optional package is missing (torchao for tests/test_fp8.py) runs no test
    in the recorded environment."""
    with open(os.path.join(os.path.dirname(HERE), path)) as handle:
        return any(line.startswith(("pytest.importorskip(", "pytestmark = pytest.mark.skipif")) or
                   ("= pytest.importorskip(" in line and not line.startswith(" ")) for line in handle)


def _slow_tier() -> list:
    with open(os.path.join(HERE, "slow_tier.txt")) as handle:
        return [line.split("#")[0].strip() for line in handle if line.split("#")[0].strip()]


def test_the_slower_tier_names_tests_that_exist():
    names = _slow_tier()
    assert names
    for name in names:
        path, _, test = name.partition("::")
        assert os.path.exists(os.path.join(os.path.dirname(HERE), path)), name
        with open(os.path.join(os.path.dirname(HERE), path)) as handle:
            assert f"def {test.split('[')[0]}(" in handle.read(), name
