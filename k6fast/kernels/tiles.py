"""Tile scheduling shared by k6fast's Triton GEMMs, and their launch."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Under the interpreter (CPU tensors) autotuning would time every config on the CPU: one small tile instead.
INTERPRETER_TILE = {"BLOCK_M": 32, "BLOCK_N": 32, "GROUP_M": 4}


def launch_gemm(
    kernel, tuned, m: int, n: int, device: torch.device, args: tuple, flags: dict, interpreter_tile: dict | None = None
) -> None:
    """Launch a grouped-tile GEMM (one program per BLOCK_M x BLOCK_N tile of the [m, n] output): `tuned`, the
    autotuned `kernel`, on CUDA; `kernel` itself with `interpreter_tile` (default INTERPRETER_TILE) elsewhere."""
    if device.type == "cuda":
        grid = lambda meta: (triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(n, meta["BLOCK_N"]),)
        tuned[grid](*args, **flags)
    else:
        tile = INTERPRETER_TILE if interpreter_tile is None else interpreter_tile
        kernel[(triton.cdiv(m, tile["BLOCK_M"]) * triton.cdiv(n, tile["BLOCK_N"]),)](*args, **flags, **tile)


@triton.jit
def grouped_tile(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(pid_m, pid_n) of program `pid` in grouped order: GROUP_M row tiles share each weight column tile while it is
    in L2, instead of every row tile sweeping all of N."""
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_pid_in_group = GROUP_M * num_pid_n
    first_pid_m = (pid // num_pid_in_group) * GROUP_M
    group_size_m = min(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + ((pid % num_pid_in_group) % group_size_m)
    pid_n = (pid % num_pid_in_group) // group_size_m
    return pid_m, pid_n


@triton.jit
def wrapped_tile(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(offs_m, offs_n, rm, rn) of program `pid`'s output tile in grouped order: the tile's row and column indices, and
    the same wrapped into [0, M) and [0, N) so that edge tiles read valid rows and columns and the K loop needs no
    M/N masks (`store_tile` masks the store instead)."""
    pid_m, pid_n = grouped_tile(pid, M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    return offs_m, offs_n, offs_m % M, offs_n % N


@triton.jit
def store_tile(y_ptr, acc, bias_ptr, offs_m, offs_n, M, N, stride_ym, HAS_BIAS: tl.constexpr):
    """acc (+ bias[n] when HAS_BIAS) in y's dtype, stored where the tile lies inside [M, N] (unit column stride)."""
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n % N).to(tl.float32)[None, :]
    y_ptrs = y_ptr + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))
