"""Helpers shared by the tests (importable as ``helpers.*``: tests/conftest.py puts tests/ on
``sys.path``). They drive runtime pieces directly and are not part of the keyserve package."""
