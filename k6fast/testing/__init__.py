"""Checkpoint factories for tests, first runs and measurements: `tiny.make_tiny` (the release's layout and flags at
tiny widths) and `synthetic.make_synthetic` (the release's tensor shapes, random values), with the release's
constants in one table (`model_constants.py`). `k6fast make-tiny` and `k6fast make-synthetic` call them. And how a
low-precision result is judged against an exact one (`bounds.py`: flash-attention's rule, for the tests). The runtime
never imports this package."""
