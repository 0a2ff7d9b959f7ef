"""Imported by the bad-input fuzz's forkserver (tests/test_fuzz.py): builds the cases (the op cases
and the front door's, which import TorchRec, model.train and bench) and warms up torch once, before
any child is forked."""

from tests import fuzz_cases, fuzz_front  # noqa: F401

fuzz_cases.warm_up()
