"""`k6fast` command line: generate, make-tiny, switches."""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib
import math
import os
import sys
from collections.abc import Iterator
from pathlib import Path

from . import __version__
from .atomic import sidecar_path
from .checkpoint import Checkpoint, CheckpointError, open_checkpoint
from .cli_args import DTYPES, device_problem, seed_problem, size_arg, torch_dtype_of
from .entry import configure_allocator_environment, prepare_pipeline_process, quiet_warnings
from .request import Request, RequestError, dit_tokens, request_from_args, resolve_request, validate_geometry
from .step_cache import fixed_cache_note
from .switches import Options, SwitchError, load_options


class CliError(Exception):
    """A user error: printed as `error: ...` with exit status 2, no traceback."""


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="Hub id or local Diffusers-layout checkpoint directory")
    p.add_argument("--arm", help="named arm (switches/arms/NAME.env) or path to an .env file; env vars override it")
    p.add_argument("--device", help="cuda, cuda:N or cpu (default: cuda when available)")
    p.add_argument("--dtype", choices=DTYPES, help="compute dtype (default: bf16 GPU, fp32 CPU)")


def _check_out(out: Path, overwrite: bool = False) -> None:
    """`--out` must be a new file ending in .mp4 in a directory this user can write; with `overwrite`, an existing
    clip and its sidecar may be replaced. Nothing a user made is replaced without their word."""
    if out.suffix.lower() != ".mp4":
        raise CliError(f"--out {out}: expected a path ending in .mp4")
    if out.is_dir():
        raise CliError(f"--out {out}: is a directory; expected a file path ending in .mp4")
    if not out.parent.is_dir():
        raise CliError(f"--out {out}: the directory {out.parent} does not exist")
    # The clip is written beside `out` and renamed over it, so the directory must be writable, not only the file.
    if not os.access(out.parent, os.W_OK | os.X_OK):
        raise CliError(f"--out {out}: the directory {out.parent} is not writable by this user")
    existing = [p for p in (out, sidecar_path(out)) if p.exists()]
    if existing and not overwrite:
        raise CliError(f"--out {out}: {' and '.join(str(p) for p in existing)} already exist(s); expected a new path, "
                       "or --overwrite to replace the clip and its sidecar")  # fmt: skip


def _check_generate_args(args: argparse.Namespace) -> None:
    """The arguments on their own: the output path, the geometry and the numbers."""
    _check_out(Path(args.out), args.overwrite)
    width, height = args.size
    validate_geometry(width, height, args.frames)
    problem = seed_problem(args.seed)
    if problem:
        raise CliError(f"--seed: {problem}")
    if args.steps is not None and args.steps < 1:
        raise CliError(f"--steps: expected an integer >= 1, found {args.steps}")
    if args.stop_after_steps is not None and args.stop_after_steps < 1:
        raise CliError(f"--stop-after-steps: expected an integer >= 1, found {args.stop_after_steps}")
    if args.guidance is not None and not (math.isfinite(args.guidance) and args.guidance >= 1.0):
        raise CliError(f"--guidance: expected a finite number >= 1.0 (1.0 = no CFG), found {args.guidance}")
    if not args.prompt.strip():
        raise CliError("--prompt is empty; expected a description of the video and its sound")
    if args.save_latents and (
        not args.save_latents.endswith(".safetensors") or not Path(args.save_latents).parent.is_dir()
    ):
        raise CliError(f"--save-latents {args.save_latents}: expected a .safetensors path in an existing directory")


def _open_image(path: str):
    import PIL.Image

    try:
        image = PIL.Image.open(path)
        image.load()
    except (OSError, SyntaxError, ValueError, PIL.Image.DecompressionBombError) as exc:
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else "not an image Pillow can read"
        raise CliError(f"--image {path}: {why}; expected an image file such as PNG, JPEG or WebP") from None
    return image


def _prepare_generate(args: argparse.Namespace) -> tuple[Options, Checkpoint, Request]:
    """Everything `generate` can check before PyTorch, diffusers and transformers are imported (seconds, and minutes
    of loading after them): the arguments, the switches and arm, the image, the checkpoint's files and configs (JSON
    and safetensors headers only) and the request against them, then the device (on a machine with GPUs, PyTorch
    counts them)."""
    _check_generate_args(args)
    options = load_options(arm=args.arm)
    image = _open_image(args.image) if args.image else None
    clock = startup_clock(args)
    clock.lap("checks")
    ckpt = open_checkpoint(args.model)
    clock.lap("checkpoint")
    request = request_from_args(args, image)
    steps, _ = resolve_request(ckpt, options, request)
    if args.stop_after_steps is not None and args.stop_after_steps > steps:
        raise CliError(f"--stop-after-steps {args.stop_after_steps}: expected at most the request's {steps} steps")
    problem = device_problem(args.device)
    if problem:
        raise CliError(f"--device {args.device}: {problem}")
    return options, ckpt, request


def prompt_cache_dir(args: argparse.Namespace, options: Options) -> Path | None:
    """Where encoded prompts are kept between runs: a repeated prompt then skips the text encoders' ≈ 13 GB of
    streamed weights. Beside the compile caches when K6_INDUCTOR_CACHE_DIR names a folder (emptying it empties
    both)."""
    if args.prompt_cache is not None:
        return None if args.prompt_cache.lower() == "none" else Path(args.prompt_cache).expanduser()
    if options.inductor_cache_dir:
        return Path(options.inductor_cache_dir) / "prompts"
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "k6fast" / "prompts"


# diffusers' and transformers' shared modules, which each of their model classes k6fast builds imports, and with them
# Dynamo, Triton and sympy (diffusers.utils), scipy, torchvision and torchao (transformers' loss and quantizer modules),
# every diffusers autoencoder and, through them, its UNet and transformer modules and loaders (a VAE class's import):
# `generate` imports them in a lap of their own in its start-up profile, before k6fast's modules, which import nothing
# more from these libraries but a few model classes.
LIBRARY_MODULES = ("diffusers.utils.torch_utils", "transformers.modeling_utils", "diffusers.models.autoencoders")


@contextlib.contextmanager
def collector_paused(freeze: bool = False) -> Iterator[None]:
    """Python's cyclic garbage collector paused inside, then one full collection. For the imports: they create
    hundreds of thousands of objects that live as long as the process, which the collector would scan again and
    again as they pile up, finding almost nothing to free (measurements/sessions/2026-12-02_imports-cpu). A caller's
    process gets its collector back as it found it. freeze: for a process that ends with the command (`k6fast
    generate` itself), the objects are frozen instead (`gc.freeze`): never scanned again, no collection paid for (what
    that saves: measurements/sessions/2026-12-02_gc-freeze-cpu), the little import-time garbage it would have freed
    kept until the process ends."""
    collecting = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if freeze:
            gc.freeze()
        else:
            gc.collect()
        if collecting:
            gc.enable()


def startup_clock(args: argparse.Namespace):
    """The `StartupClock` `main` started for this command; a fresh one where a caller runs the command itself."""
    if getattr(args, "startup", None) is None:
        from .telemetry import StartupClock

        args.startup = StartupClock(from_process_start=False)
    return args.startup


def cmd_generate(args: argparse.Namespace) -> int:
    options, ckpt, request = _prepare_generate(args)
    clock = startup_clock(args)
    clock.lap("checks")  # the request against the checkpoint, the device
    out = Path(args.out)
    # Everything is checked: now the imports that take seconds, each lapped (PyTorch; the libraries' shared modules;
    # k6fast's own and the model classes they import), and between the first two the CUDA context, which needs only
    # PyTorch: on a GPU machine torchao, which transformers imports where it is installed, asks for the GPU's
    # capability on import, which would start CUDA inside the libraries' lap. The DiT needs only PyTorch and k6fast's
    # own modules: its build starts on a thread of its own before the libraries' imports, which are Python holding the
    # GIL for seconds, while its reads and copies to the device release it (`dit_load`). K6_DIT_AHEAD=off leaves it to
    # the pipeline's load, after the imports, to measure what the overlap saves.
    width, height = args.size
    dtype, ahead = torch_dtype_of(args.dtype), None
    try:
        with collector_paused(freeze=getattr(args, "ends_process", False)):
            import torch

            clock.lap("imports_torch")
            clock.facts["cuda_initialized_before_context"] = torch.cuda.is_initialized()
            prepare_pipeline_process(options, args.device)  # this process's allocator cap and compile caches
            clock.lap("cuda_context")  # the CUDA context and the allocator's cap at the budget
            if options.dit_ahead == "on":
                from .dit_load import DiTAhead

                ahead = DiTAhead(ckpt, options, args.device, dtype, plan_geometry=(width, height, args.frames))
            # The DiT build's modules imported, its arguments worked out, its thread started (off: nothing, so the
            # profile keeps the same parts either way).
            clock.lap("dit_start")
            for name in LIBRARY_MODULES:
                importlib.import_module(name)
            clock.lap("imports_libraries")
            from tqdm import tqdm

            from .output import generate_to_mp4
            from .pipeline import Pipeline
            from .telemetry import bytecode_compiled

            clock.lap("imports_k6fast")
        clock.lap("imports_collect")  # the one garbage collection after them, or their freeze
        clock.facts["gc_frozen"] = gc.get_freeze_count()
        cache_dir = prompt_cache_dir(args, options)
        # The prompt is encoded beside the rest of the load (its "text_encode" phase is then the wait for it).
        pipe = Pipeline(ckpt, options, device=args.device, dtype=dtype, plan_geometry=(width, height, args.frames),
                        prompt_cache_dir=cache_dir, first_request=request, dit_ahead=ahead)  # fmt: skip
    except BaseException:
        if ahead is not None:  # its thread ends before the process does (a failed pipeline has closed it already)
            ahead.close()
        raise
    try:
        # The DiT's parts keep their own seconds; those it ran beside the imports are said apart (`load_overlapped_s`).
        clock.lap_split(pipe.load_parts, "load_other", overlapped=pipe.load_overlapped_s)
        if pipe.device.type == "cuda":  # the residency plan is a GPU memory budget; the CPU has none
            print(pipe.runtime.plan.describe(), file=sys.stderr)
        steps, _ = pipe.resolve(request)
        print(
            f"k6fast {__version__}: {pipe.ckpt.variant} on {pipe.device} ({str(pipe.dtype).removeprefix('torch.')}), "
            f"{width}x{height}x{args.frames}, {steps} steps, arm {options.arm_name} [{options.arm_hash()}], "
            f"loaded in {pipe.load_seconds:.1f} s",
            file=sys.stderr,
        )
        if note := fixed_cache_note(pipe.ckpt, options):
            print(note, file=sys.stderr)
        # The residency this request runs under (its own geometry's plan: `Pipeline.generate` fits the DiT to it).
        tokens = dit_tokens(width, height, args.frames, pipe.audio_rate)
        plan = pipe.runtime.plan_for(tokens) if pipe.runtime else pipe.runtime_plan
        extra = {"load_s": pipe.load_seconds, "residency": plan.as_dict() if plan else None}
        if pipe.device.type == "cuda":
            extra["gpu_name"] = torch.cuda.get_device_name(pipe.device)
        clock.facts["bytecode"] = bytecode_compiled(clock.started)  # every module the start-up imported
        clock.lap("before_request")
        extra["process"] = clock.as_dict()  # the start-up profile; `main` adds the request and the teardown at the end
        try:
            with tqdm(total=args.stop_after_steps or steps, desc="denoise", unit="step", file=sys.stderr) as bar:
                # The MP4 is encoded on its own thread while the video decodes (`generate_to_mp4`).
                result = generate_to_mp4(pipe, request, out, args.model, on_step=lambda event: bar.update(1),
                                         extra=extra, stop_after_steps=args.stop_after_steps)  # fmt: skip
        except OSError as exc:  # the disk filled up or the directory changed while the clip was generated
            raise CliError(f"--out {out}: could not write the clip ({exc.strerror or 'write failed'})") from None
        clock.lap("request")  # the request, its MP4 and the sidecar's first write
        if args.save_latents:
            from safetensors.torch import save_file

            from .atomic import fsync_path

            save_file({k: v.contiguous() for k, v in result.latents.items()}, args.save_latents)
            fsync_path(Path(args.save_latents))  # on disk before the process ends without the interpreter's teardown
            clock.lap("latents")
        print(result.telemetry.summary(), file=sys.stderr)
        print(f"wrote {out} and {sidecar_path(out)}", file=sys.stderr)
        args.sidecar = sidecar_path(out)
        return 0
    finally:  # an error before the request took the prompt's encode: its thread ends before the process does
        pipe.settle_text()


def _finish_generate(sidecar: Path, clock, end: bool) -> None:
    """Complete the sidecar's "process" entry: the request, the latents and, where this process ends here (`end`: the
    `k6fast` command itself, not a caller of `main`), the teardown from the MP4 and sidecar written to the end (the
    entry's own rewrite not counted). The process then ends without the interpreter's teardown (`entry.end_process`):
    every file it wrote is closed and fsynced by now, and what that teardown would free the kernel frees at exit."""
    import json

    from .atomic import write_json_atomic
    from .entry import end_process

    clock.lap("teardown")
    clock.ended = end
    record = json.loads(sidecar.read_text())
    record["process"] = clock.as_dict()
    write_json_atomic(sidecar, record)
    if end:
        end_process(0)


def cmd_make_tiny(args: argparse.Namespace) -> int:
    from .testing.tiny import make_tiny

    try:
        path = make_tiny(args.dir, variant=args.variant, seed=args.seed)
    except ValueError as exc:
        raise CliError(str(exc)) from exc
    print(f"wrote a tiny random-weight {args.variant} checkpoint to {path}")
    return 0


def cmd_make_synthetic(args: argparse.Namespace) -> int:
    from .testing.synthetic import make_synthetic

    try:
        path = make_synthetic(args.dir, preset=args.preset, blocks=args.blocks, seed=args.seed,
                              text_encoders=args.text_encoders, text_encoder_dir=args.text_encoder_dir)  # fmt: skip
    except (ValueError, FileExistsError) as exc:
        raise CliError(str(exc)) from exc
    print(f"wrote a synthetic random-weight {args.preset} checkpoint (real tensor shapes) to {path}")
    return 0


def cmd_switches(args: argparse.Namespace) -> int:
    from .switches import readme_table, render_table

    if args.markdown:
        print(readme_table())
        return 0
    options = load_options(arm=args.arm)
    print(render_table(options))
    print()
    print(_resolution_table(options))
    return 0


def _resolution_table(options) -> str:
    """What K6_GEMM and K6_ATTN run as on this machine's GPU and on each architecture k6fast targets."""
    import torch

    from .dit.arch import TARGETS, resolve_for, target_of

    if torch.cuda.is_available():
        here = target_of(torch.device("cuda"))
        targets = [(f"this GPU: {here.name}", here)]
    else:
        targets = [("this machine: no CUDA GPU", target_of(torch.device("cpu")))]
    targets += [(t.name, t) for t in TARGETS]
    rows = [(name, resolve_for(options, t)) for name, t in targets]
    width = max(len(name) for name, _ in rows)
    lines = [f"K6_GEMM={options.gemm} and K6_ATTN={options.attn} resolve to (k6fast/dit/arch.py):"]
    lines += [f"  {name:<{width}}  K6_GEMM={r.gemm:<12} K6_ATTN={r.attn}" for name, r in rows]
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="k6fast", description="Fast Kandinsky 6 video+audio generation")
    parser.add_argument("--version", action="version", version=f"k6fast {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("generate", help="generate one clip with sound")
    _add_model_args(p)
    p.add_argument("--prompt", required=True)
    p.add_argument("--image", help="reference image for the first frame (image-to-video)")
    p.add_argument("--size", type=size_arg, default=(864, 480), help="WIDTHxHEIGHT, multiples of 16 (default 864x480)")
    p.add_argument("--frames", type=int, default=121, help="frame count 4k+1 at 24 fps (default 121)")
    p.add_argument("--steps", type=int, help="denoising steps (default: 10 distilled, 50 base)")
    p.add_argument("--guidance", type=float, help="CFG scale (default: 1.0 distilled — required — 5.0 base)")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--negative-prompt", help="negative prompt for CFG (base checkpoints)")
    p.add_argument("--no-audio", action="store_true", help="denoise video only")
    p.add_argument("--out", required=True, help="output .mp4 path (a new file unless --overwrite)")
    p.add_argument("--overwrite", action="store_true", help="replace --out and its .json sidecar if they exist")
    p.add_argument("--save-latents", help="also write the denoised latents (video, audio) to this .safetensors file")
    p.add_argument("--stop-after-steps", type=int, help="a measurement: denoise only the schedule's first N steps, "
                   "then decode what they leave (a long schedule's per-step cost; not a finished clip)")  # fmt: skip
    p.add_argument("--prompt-cache", help="folder of encoded prompts reused by later runs (default: prompts/ in "
                   "K6_INDUCTOR_CACHE_DIR, else ~/.cache/k6fast/prompts; 'none' = do not keep them)")  # fmt: skip
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("make-tiny", help="write a tiny random-weight checkpoint (tests, first runs)")
    p.add_argument("dir")
    p.add_argument("--variant", choices=["distill", "base"], default="distill")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=cmd_make_tiny)

    p = sub.add_parser("make-synthetic", help="write a random-weight checkpoint with the real Pro/Lite shapes")
    p.add_argument("dir")
    p.add_argument("--preset", choices=["pro-distill", "pro", "lite-distill", "lite"], default="pro-distill")
    p.add_argument("--blocks", type=int, help="fused blocks to write (default: the full depth, 60 for Pro)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--text-encoders", choices=["one-layer", "full"], default="one-layer",
                   help="full: Qwen2.5-VL-7B and CLIP-L at their real shapes (about 16.8 GB)")  # fmt: skip
    p.add_argument("--text-encoder-dir", help="with --text-encoders full: write them to this missing or empty folder "
                   "(e.g. under /dev/shm) and link them into the checkpoint")  # fmt: skip
    p.set_defaults(func=cmd_make_synthetic)

    p = sub.add_parser("switches", help="list the K6_* switches and their current values")
    p.add_argument("--markdown", action="store_true", help="the table README.md carries (defaults)")
    p.add_argument("--arm", help="show values with this arm applied")
    p.set_defaults(func=cmd_switches)

    from .bench.acceptance_cli import register as register_acceptance
    from .bench.cli import register as register_bench
    from .doctor import register as register_doctor
    from .quality_gate.command import register as register_gate
    from .quantize_cli import register as register_quantize
    from .server.cli import register as register_serve
    from .tune.cli import register as register_tune

    register_serve(sub)
    register_gate(sub)
    register_bench(sub)
    register_acceptance(sub)
    register_doctor(sub)
    register_quantize(sub)
    register_tune(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    from .server.cli import ServeError
    from .stream.plan import ResidencyError
    from .telemetry import StartupClock

    clock = StartupClock(from_process_start=argv is None)  # with argv, a caller's process: timed from here
    quiet_warnings()
    args = build_parser().parse_args(argv)
    args.startup, args.ends_process = clock, argv is None  # the process ends with the command (`_finish_generate`)
    clock.lap("interpreter")  # Python's start, k6fast.cli's imports, the arguments parsed
    configure_allocator_environment()  # before anything touches CUDA (k6fast/allocator.py says why)
    try:
        code = args.func(args)
    except (CliError, CheckpointError, RequestError, SwitchError, ResidencyError, ServeError, FileExistsError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130
    if code == 0 and getattr(args, "sidecar", None) is not None:  # `generate` wrote a clip
        _finish_generate(args.sidecar, clock, end=argv is None)
    return code


if __name__ == "__main__":
    sys.exit(main())
