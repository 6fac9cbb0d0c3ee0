"""Rules of the test suite itself (CONTRIBUTING.md, "The parity test pattern")."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent


@pytest.mark.harness
def test_no_test_skips_on_a_flatshard_module_failing_to_import():
    """An importorskip of one of flatshard's own modules turns a broken module into a skip;
    a plain import makes it a failure."""
    pattern = re.compile(r"importorskip\(\s*['\"]flatshard")
    found = [
        f"{path.relative_to(TESTS)}:{n}"
        for path in TESTS.rglob("*.py")
        if path != Path(__file__).resolve()  # this file names the pattern
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if pattern.search(line)
    ]
    assert found == [], f"import flatshard's modules plainly in {found}"
