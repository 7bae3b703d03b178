"""Helpers shared by the pipeline tests that count DiT calls (the step caches')."""

from __future__ import annotations


class CountingDiT:
    """Wraps a pipeline's DiT and counts its forward calls; what the pipeline tells the DiT per step and per request
    (`begin_step`, `should_stop`) reaches the wrapped one."""

    def __init__(self, dit):
        self.dit = dit
        self.calls = 0

    def __call__(self, **kwargs):
        self.calls += 1
        return self.dit(**kwargs)

    def begin_step(self, *args) -> None:
        self.dit.begin_step(*args)

    def __setattr__(self, name, value):
        if name == "should_stop":  # the pipeline sets it per request on the DiT it holds
            setattr(self.dit, name, value)
        super().__setattr__(name, value)
