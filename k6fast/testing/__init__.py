"""Checkpoint factories for tests, first runs and measurements: `tiny.make_tiny` (the release's layout and flags at
tiny widths) and `synthetic.make_synthetic` (the release's tensor shapes, random values), with the release's
constants in one table (`model_constants.py`). `k6fast make-tiny` and `k6fast make-synthetic` call them; the runtime
never imports this package."""
