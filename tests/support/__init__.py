"""Helpers shared by the tests (on sys.path through pyproject's `pythonpath`): real checkpoints, media and
server processes."""
