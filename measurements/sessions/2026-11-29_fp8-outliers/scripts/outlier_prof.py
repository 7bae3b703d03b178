"""Run 15's profile of the channel choice (commit d75d9cf): torch's choice, vector_norm + topk (v2, also sampling every
256th row), vector_norm + sort (v4), and the CUDA kernels v2 launches."""

import torch
import torch.nn.functional as F
import triton
from torch.profiler import ProfilerActivity, profile

from k6fast.kernels.fp8_linear import outlier_columns


def v2(x, c, stride=64):
    a = torch.linalg.vector_norm(x[::stride], ord=float("inf"), dim=0)
    return F.pad(a.topk(c, sorted=False).indices.to(torch.int32), (0, 128 - c), value=-1)


def v4(x, c):
    a = torch.linalg.vector_norm(x[::64], ord=float("inf"), dim=0)
    return F.pad(a.sort(descending=True).indices[:c].to(torch.int32), (0, 128 - c), value=-1)


def b(fn):
    return triton.testing.do_bench(fn, warmup=50, rep=300, return_mode="median") * 1e3


def shape(k):
    x = torch.randn(50220, k, device="cuda").bfloat16()
    x[:, torch.randperm(k, device="cuda")[: k // 512]] *= 30
    ref = set(x[::64].abs().amax(0).topk(k // 512).indices.tolist())
    variants = {
        "cur": lambda: outlier_columns(x, 32),
        "v2": lambda: v2(x, 32),
        "v2_s256": lambda: v2(x, 32, 256),
        "v4": lambda: v4(x, 32),
    }
    for name, fn in variants.items():
        assert ref <= set(fn()[:32].tolist()), name
        print(f"K={k} {name}: {b(fn):.1f} us", flush=True)
    with profile(activities=[ProfilerActivity.CUDA]) as p:
        for _ in range(20):
            v2(x, 32)
        torch.cuda.synchronize()
    print(p.key_averages().table(sort_by="cuda_time_total", row_limit=8, max_name_column_width=60))


for k in (4096, 16384):
    shape(k)
