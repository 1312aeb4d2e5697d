"""Helpers shared by the tests (on sys.path through pyproject's `pythonpath`): real checkpoints and media."""
