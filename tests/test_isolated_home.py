"""The tests' moespec home is set before module-scoped fixtures run (they write stores and runs).

A module-scoped fixture that profiled a model on the disk tier wrote its store file into the real
home while the home was a per-test fixture: module fixtures run first.
"""

from __future__ import annotations

import os

import pytest


@pytest.fixture(scope="module")
def home_seen_by_a_module_fixture():
    return os.environ.get("MOESPEC_HOME")


def test_a_module_fixture_sees_the_same_home_as_the_test(home_seen_by_a_module_fixture, tmp_path_factory):
    assert home_seen_by_a_module_fixture == os.environ.get("MOESPEC_HOME")
    if os.environ.get("CI"):
        assert home_seen_by_a_module_fixture == str(tmp_path_factory.getbasetemp() / "moespec_home")
