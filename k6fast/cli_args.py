"""Argument types shared by every `k6fast` subcommand (generate, serve, gate). Imports nothing heavy: the gate's
and server's `register` functions must stay cheap to import."""

from __future__ import annotations

import argparse


def size_arg(text: str) -> tuple[int, int]:
    """`864x480` → (864, 480); an argparse type, so a bad value is a usage error naming what was expected."""
    try:
        width, height = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected WIDTHxHEIGHT such as 864x480, found {text!r}") from None
    return width, height
