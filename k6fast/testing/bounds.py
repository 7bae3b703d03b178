"""How a low-precision result is judged: flash-attention's rule, in one place for the tests.

A kernel that computes in bf16 (or fp8, or with fp16 accumulation) cannot match an fp32 reference exactly, and a fixed
tolerance is a guess that is either loose for one op or flaky for another. flash-attention's tests scale it to the op
instead: compute the exact result in fp32, and allow the kernel at most twice the error that a plain bf16 PyTorch
implementation of the same op makes against it, plus a floor for the rounding of the output itself:

    err(kernel, exact) <= 2 * err(torch_bf16, exact) + atol

`err` is a named metric (`METRICS`), or any function of (result, exact) -> float for a metric of the caller's own
(pixels, say); the call names it so a reader sees which error is bounded.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

Metric = Callable[[torch.Tensor, torch.Tensor], float]

# The allowance over the baseline's error: flash-attention's factor.
BASELINE_FACTOR = 2.0


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative L2 error of a against b (any shapes that broadcast, any dtypes), in float64."""
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


def max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest absolute difference of a and b, in float64."""
    return (a.double() - b.double()).abs().max().item()


METRICS: dict[str, Metric] = {"rel_l2": rel_l2, "max_abs": max_abs}


def assert_within_baseline_error(
    result: torch.Tensor,
    baseline: torch.Tensor,
    exact: torch.Tensor,
    *,
    metric: str | Metric,
    atol: float,
    what: str = "result",
) -> tuple[float, float]:
    """Assert `metric(result, exact) <= 2 * metric(baseline, exact) + atol`; return both errors.

    result: what the kernel (or the fast path) computed; baseline: the plain bf16 PyTorch computation of the same op
    (cuBLAS bf16, SDPA, diffusers in bf16); exact: the fp32 (or float64) reference both approximate. `atol` is the
    rounding floor, stated by the caller: it is what keeps a baseline that happens to be exact from demanding
    exactness of the kernel.
    """
    measure = METRICS[metric] if isinstance(metric, str) else metric
    name = metric if isinstance(metric, str) else getattr(metric, "__name__", "error")
    err, baseline_err = measure(result, exact), measure(baseline, exact)
    limit = BASELINE_FACTOR * baseline_err + atol
    if not err <= limit:  # written so that a NaN error fails too
        raise AssertionError(
            f"{what}: {name} {err:.3e} against the exact result exceeds {BASELINE_FACTOR:g} x the baseline's "
            f"{baseline_err:.3e} + {atol:g} = {limit:.3e}"
        )
    return err, baseline_err
