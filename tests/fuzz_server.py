"""Imported by the bad-input fuzz's forkserver (tests/test_fuzz.py): builds the cases and warms up
torch once, before any child is forked."""

from tests import fuzz_cases

fuzz_cases.warm_up()
