"""k6fast: a fast runtime for Kandinsky 6 joint video+audio generation on one GPU."""

__version__ = "0.1.0"
