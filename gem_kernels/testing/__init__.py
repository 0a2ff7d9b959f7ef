"""Test and measurement helpers that ship with the package (importing torch only)."""
