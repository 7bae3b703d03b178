"""The text phase at real size: Qwen2.5-VL-7B and CLIP-L streamed through the device per new prompt (`TextPhase`),
beside a DiT whose resident blocks must stay where they are.

What it measures, each after a correctness check (the streamed result equals itself across passes, bit for bit; a
cache hit equals the encode it came from):
  first     a new prompt in a fresh process's TextPhase (cold CUDA kernels included)
  new       further new prompts (the steady cost: ≈ 13 GB of decoder layers read and copied)
  repeated  a prompt seen before: the prompt cache (in memory), no weights read
  cfg       a new prompt with a negative prompt (both share each layer's upload)
Each row has wall seconds, bytes streamed, the effective GB/s, and the device memory the phase reserved at its peak
against the plan's `device_bytes`. A DiT stand-in (a tensor of `--dit-resident-gb`) is allocated first and its data
pointer checked afterwards: the text phase ran beside it, nothing was evicted or re-uploaded.

Run:  python measurements/bench_text_phase.py --model CKPT --out text_phase.json [--prompts N] [--dit-resident-gb 17]
      (CKPT with real-size text encoders: `k6fast make-synthetic DIR --text-encoders full --text-encoder-dir D`)
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import itertools
import json
import platform
import sys
import time
from pathlib import Path

import torch

PROMPTS = (
    "A fox runs through snow at dusk, wind howling over the ridge",
    "A cat and a dog bake a cake together; pans clatter, the dog barks",
    "Rain on a tin roof, a kettle starts to whistle in the kitchen",
    "A street drummer plays under a bridge while trains pass overhead",
    "Waves break on black sand; gulls cry; a child laughs far away",
)
NEGATIVE = "Static, 2D cartoon, worst quality, low quality"


def _same(a, b) -> bool:
    return torch.equal(a.embeds, b.embeds) and torch.equal(a.pooled, b.pooled)


class LayerMarks:
    """Wall time at each Qwen decoder layer's start and end (the device synchronised there), for finding where a
    first encode's extra seconds go: in the layers' weight reads, their first kernels, or before the first layer."""

    def __init__(self, phase, device: torch.device):
        self.device, self.marks, self.hooks = device, [], []
        self.start = time.perf_counter()
        for i, layer in enumerate(phase._layers):
            self.hooks.append(layer.register_forward_pre_hook(lambda m, a, i=i: self._mark(i, "start")))
            self.hooks.append(layer.register_forward_hook(lambda m, a, o, i=i: self._mark(i, "end")))

    def _mark(self, layer: int, what: str) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.marks.append((layer, what, time.perf_counter()))

    def take(self) -> dict:
        """Seconds from the previous take (or construction) to the first layer's start, each layer's start-to-end
        (its first call only: CFG calls a layer twice), and the gaps between layers (waiting for the weights)."""
        marks, self.marks = self.marks, []
        if not marks:
            return {}
        starts = {layer: t for layer, what, t in reversed(marks) if what == "start"}
        ends = {layer: t for layer, what, t in marks if what == "end"}
        order = sorted(starts)
        out = {
            "before_first_layer_s": round(starts[order[0]] - self.start, 4),
            "layer_s": [round(ends[i] - starts[i], 4) for i in order],
            "wait_s": [round(starts[b] - ends[a], 4) for a, b in itertools.pairwise(order)],
        }
        self.start = time.perf_counter()
        return out

    def remove(self) -> None:
        for hook in self.hooks:
            hook.remove()


def main(argv: list[str] | None = None) -> int:
    from k6fast.prompt_cache import PromptCache
    from k6fast.text_phase import TextPhase

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, type=Path)
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--prompts", type=int, default=3, help="new prompts after the first (at most 4)")
    p.add_argument("--dit-resident-gb", type=float, default=0.0, help="a DiT stand-in held on the device meanwhile")
    p.add_argument("--breakdown", action="store_true",
                   help="per-layer wall times of the first and new encodes (synchronising after each layer, so the "
                        "rows' seconds include that cost)")  # fmt: skip
    args = p.parse_args(argv)

    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    cuda = device.type == "cuda"
    dit = torch.empty(int(args.dit_resident_gb * 2**30), dtype=torch.uint8, device=device)
    dit_ptr = dit.data_ptr()
    started = time.perf_counter()
    phase = TextPhase(args.model, device, dtype, cache=PromptCache())
    init_s = time.perf_counter() - started
    rows = []

    def run(kind: str, prompt: str, negative: str | None = None):
        if cuda:
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            base = torch.cuda.memory_reserved(device)
        t0 = time.perf_counter()
        out = phase.encode(prompt, negative)
        if cuda:
            torch.cuda.synchronize(device)
        seconds = time.perf_counter() - t0
        stats = phase.last
        row = {"kind": kind, "prompt_chars": len(prompt), "negative": negative is not None,
               "seconds": round(seconds, 4), "source": stats.source, "bytes_streamed": stats.bytes_streamed,
               "gb_s": round(stats.bytes_streamed / seconds / 1e9, 2) if stats.bytes_streamed else None,
               "tokens": int(out[0].embeds.shape[1])}  # fmt: skip
        if cuda:
            row["peak_reserved_above_start_bytes"] = torch.cuda.max_memory_reserved(device) - base
        rows.append(row)
        print(json.dumps(row), flush=True)
        return out

    layer_marks = LayerMarks(phase, device) if args.breakdown else None
    first = run("first", PROMPTS[0])
    if layer_marks is not None:
        rows[-1]["layers"] = layer_marks.take()
    for prompt in PROMPTS[1 : 1 + min(args.prompts, len(PROMPTS) - 1)]:
        run("new", prompt)
        if layer_marks is not None:
            rows[-1]["layers"] = layer_marks.take()
    if layer_marks is not None:
        layer_marks.remove()
    hit = run("repeated", PROMPTS[0])
    assert _same(hit[0], first[0]), "a cache hit differs from the encode it came from"
    phase.cache.clear()
    again = run("new (same prompt, cache cleared)", PROMPTS[0])
    assert _same(again[0], first[0]), "two streamed encodes of one prompt differ"
    run("cfg", PROMPTS[-1] + " at night", NEGATIVE)
    assert dit.data_ptr() == dit_ptr and dit.numel() == int(args.dit_resident_gb * 2**30)
    footprint = phase.footprint()
    record = {
        "what": "text phase at real size: TextPhase streaming Qwen2.5-VL's decoder layers and CLIP per new prompt",
        "command": " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]),
        "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "gpu": torch.cuda.get_device_name(device) if cuda else platform.processor() or "cpu",
        "versions": {name: importlib.metadata.version(name) for name in ("torch", "transformers", "diffusers")},
        "python": platform.python_version(),
        "model": str(args.model),
        "synthetic": json.loads((args.model / "synthetic.json").read_text())
        if (args.model / "synthetic.json").exists()
        else None,
        "dtype": str(dtype),
        "init_s": round(init_s, 3),
        "dit_stand_in_bytes": dit.numel(),
        "dit_stand_in_kept": True,
        "plan": footprint.as_dict(),
        "rows": rows,
    }
    phase.close()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {args.out}: init {init_s:.2f} s; plan {footprint.describe()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
