"""The MP4 mux, sequential (`output.write_result`) against streamed (`output.Mp4Sink`, `output.generate_to_mp4`): how
much of the encode the request still waits for after the last frame, and whether both write the same bytes.

- mux: synthetic frames (moving gradients over a fixed fine texture, in [0, 1] on --device) and a tone. Sequential:
  write_result's steps (numpy uint8 conversion, write_mp4). Streamed: an Mp4Sink handed the frames all at once, in
  chunks of 10 (what a whole-clip decode does during its last op), and paced over --decode-s seconds in 12 chunks
  (a slab decode at that pace). Each --repeats times; the files are compared byte for byte.
- reproducibility: the sha256 of write_mp4 on the same input, --repeats times (x264 must give the same bytes).
- with --model: the checkpoint's generate + write_result against generate_to_mp4, with the whole-clip decode and
  with a slab decode (3 latent frames a slab), the streamed file against write_result of the streamed Result.

Run: `python measurements/bench_streamed_mux.py --device cuda --size 864x480x121 --model /tmp/k6-tiny --out r.json`
(`k6fast make-tiny /tmp/k6-tiny` first). Prints one JSON object and writes it to --out.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from k6fast.media import prepare_audio, write_mp4
from k6fast.output import Mp4Sink, frames_to_uint8, generate_to_mp4, mp4_metadata, write_result
from k6fast.switches import Options

SR = 44100


def synthetic(f: int, h: int, w: int, device: str) -> torch.Tensor:
    """fp32 [F, H, W, 3] in [0, 1]: gradients moving a few pixels a frame over a fixed 4 % texture."""
    y = torch.arange(h, device=device).view(h, 1).float()
    x = torch.arange(w, device=device).view(1, w).float()
    texture = torch.rand(h, w, generator=torch.Generator(device=device).manual_seed(0), device=device) * 0.04
    frames = torch.empty(f, h, w, 3, device=device)
    for i in range(f):
        frames[i, ..., 0] = (x + 3 * i) / (w + 400) + texture
        frames[i, ..., 1] = y / h
        frames[i, ..., 2] = 0.5 + 0.3 * torch.sin((x + y + 5 * i) / 40) + texture
    return frames.clamp_(0, 1)


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16]


def bench_mux(frames: torch.Tensor, decode_s: float, repeats: int, tmp: Path) -> dict:
    f, h, w, _ = frames.shape
    options = Options()
    audio = (0.3 * np.sin(np.arange(round(f / 24 * SR)) / 10)).astype(np.float32)
    host = frames.cpu().numpy()
    rows: dict[str, list[dict]] = {"sequential": [], "streamed_all_at_end": [], "streamed_paced": []}
    same = True
    bounds = [0, 1, *range(11, f, 10), f]
    for _ in range(repeats):
        t0 = time.perf_counter()
        rgb = frames_to_uint8(host)
        t1 = time.perf_counter()
        write_mp4(tmp / "sequential.mp4", rgb, 24.0, prepare_audio(audio), SR, mp4_metadata(options))
        t2 = time.perf_counter()
        rows["sequential"].append({"uint8_s": t1 - t0, "write_mp4_s": t2 - t1, "mux_s": t2 - t0})
        chunks = list(zip(bounds[:-1], bounds[1:], strict=True))
        for name, gap in (("streamed_all_at_end", 0.0), ("streamed_paced", decode_s / len(chunks))):
            with Mp4Sink(tmp / f"{name}.mp4", options) as sink:
                sink.begin(f, h, w, 24.0, audio, SR)
                for a, b in chunks:
                    time.sleep(gap)
                    sink.frames(a, b, frames[a:b])
                sink.finish()
            rows[name].append({"encode_s": sink.encode_s, "exposed_s": sink.exposed_s})
            same &= (tmp / f"{name}.mp4").read_bytes() == (tmp / "sequential.mp4").read_bytes()
    median = {
        name: {k: round(float(np.median([r[k] for r in runs])), 3) for k in runs[0]} for name, runs in rows.items()
    }
    return {"median": median, "runs": len(rows["sequential"]), "streamed_bytes_equal_sequential": same}


def reproducibility(frames: torch.Tensor, repeats: int, tmp: Path) -> list[str]:
    rgb = frames_to_uint8(frames.cpu().numpy())
    hashes = []
    for _ in range(repeats):
        write_mp4(tmp / "again.mp4", rgb, 24.0)
        hashes.append(sha(tmp / "again.mp4"))
    return hashes


def bench_pipeline(model: str, device: str, size: tuple[int, int, int], tmp: Path) -> dict:
    from k6fast.pipeline import Pipeline, Request
    from k6fast.video_decode import plan_video_decode

    w, h, f = size
    pipe = Pipeline(model, Options(), device=device, plan_geometry=size)
    request = Request(prompt="a fox runs through snow", width=w, height=h, frames=f, steps=2, seed=1)
    pipe.generate(request)  # warm-up
    out = {}
    for decode in ("whole-clip", "slabs"):
        if decode == "slabs":
            pipe.options = pipe.options.replace(video_decode="streamed")
            pipe.plan_decode = lambda shape: plan_video_decode(
                pipe.vae, shape, budget_bytes=8 << 30, chunk_latent_frames=3
            )
        rows = {}
        for way in ("sequential", "streamed"):
            start = time.perf_counter()
            if way == "sequential":
                result = pipe.generate(request)
                write_result(result, tmp / "p_sequential.mp4", pipe.options, request, model, pipe.ckpt.variant)
            else:
                result = generate_to_mp4(pipe, request, tmp / "p_streamed.mp4", model)
            t = result.telemetry
            rows[way] = {
                "wall_s": round(time.perf_counter() - start, 3),
                "phases_s": {k: round(v, 3) for k, v in t.phases.items()},
                "mux_encode_s": round(t.mux_encode_s, 3),
                "mux_exposed_s": round(t.mux_exposed_s, 3),
            }
        write_result(result, tmp / "p_again.mp4", pipe.options, request, model, pipe.ckpt.variant)
        same = (tmp / "p_streamed.mp4").read_bytes() == (tmp / "p_again.mp4").read_bytes()
        out[decode] = {"plan": result.telemetry.video_decode, "streamed_bytes_equal_sequential": same, **rows}
    pipe.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--size", default="864x480x121", help="WxHxF")
    parser.add_argument("--decode-s", type=float, default=7.2, help="the paced hand-over's length (a slab decode)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--model", help="a checkpoint for the whole-request rows (the tiny one will do)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    w, h, f = (int(v) for v in args.size.split("x"))
    record = {"device": args.device, "size": args.size, "cpus": torch.get_num_threads()}
    if args.device.startswith("cuda"):
        record["gpu"] = torch.cuda.get_device_name()
    with tempfile.TemporaryDirectory() as folder:
        tmp = Path(folder)
        frames = synthetic(f, h, w, args.device)
        record["mux"] = bench_mux(frames, args.decode_s, args.repeats, tmp)
        record["write_mp4_sha256_per_run"] = reproducibility(frames, args.repeats, tmp)
        if args.model:
            record["pipeline"] = bench_pipeline(args.model, args.device, (w, h, f), tmp)
    text = json.dumps(record, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
