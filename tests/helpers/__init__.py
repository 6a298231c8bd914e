"""Helpers shared by the tests, importable as ``helpers.*`` (pyproject's pytest ``pythonpath``
puts tests/ on ``sys.path``). They drive runtime pieces directly and are not part of the
keyserve package."""
