"""Helpers the test modules share, grouped by what they stand in for or drive.

Test modules import helpers from here (and from `nexa`, `tests.realparts` and `tests.conftest`),
never from one another (`tests/test_layout.py` checks). Fixtures shared by several modules live in
the nearest `conftest.py`.
"""
