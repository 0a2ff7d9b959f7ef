"""The bad-input fuzz's cases, by family (tests/fuzz_cases.py builds them; tests/test_fuzz.py runs them)."""
