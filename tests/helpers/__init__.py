"""Test utilities imported by the tests (``from helpers.toyfed import make_toy``); ``tests/`` is on
pytest's ``pythonpath`` (pyproject.toml), and ``conftest.py`` keeps the fixtures only."""
