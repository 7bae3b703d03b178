"""Helpers shared by the server tests: the real tiny pipeline behind a gate, deadlines, and the checks every error
response must pass (OpenAI's error shape, nothing of the server's insides)."""

from __future__ import annotations

import gc
import os
import re
import threading
import time
from collections.abc import Callable

from k6fast.cancel import Cancelled
from k6fast.pipeline import Pipeline
from k6fast.server.config import ServerConfig

DEADLINE_S = 60.0


class GatedPipeline:
    """The real pipeline, entered only when `gate` is open; while it waits it honours should_stop as the sampler
    does at a step boundary. A prompt in `fail_with` raises that exception instead of generating."""

    def __init__(self, real: Pipeline):
        self.real = real
        self.ckpt, self.device, self.options = real.ckpt, real.device, real.options
        self.gate = threading.Event()
        self.gate.set()
        self.waiting = threading.Event()
        self.fail_with: dict[str, BaseException] = {}

    def resolve(self, request):
        return self.real.resolve(request)

    def generate(self, request, on_step=None, should_stop=None, **kwargs):
        self.waiting.set()
        deadline = time.monotonic() + DEADLINE_S
        while not self.gate.wait(0.01):
            if should_stop is not None and should_stop():
                raise Cancelled("denoise", "held at the gate")
            assert time.monotonic() < deadline, "the test never opened the gate"
        self.waiting.clear()
        if request.prompt in self.fail_with:
            raise self.fail_with[request.prompt]
        return self.real.generate(request, on_step=on_step, should_stop=should_stop, **kwargs)


def tiny_server_config(data_dir, **changes) -> ServerConfig:
    """A server over the tiny checkpoint with limits small enough for tests to reach; `changes` override them."""
    values = dict(
        model="tiny",
        served_model_name="k6-tiny",
        data_dir=data_dir,
        max_queue=2,
        max_size=(128, 96),
        max_frames=33,
        max_steps=8,
        default_size=(64, 64),
        default_seconds="0.167",
    )
    return ServerConfig(**(values | changes))


def until(check: Callable[[], object], what: str, timeout: float = DEADLINE_S) -> object:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


# What must never reach a client: Python's insides (tracebacks, exception or warning type names, object reprs with
# heap addresses), the server's paths (absolute paths under the usual roots, source files, installed packages).
INTERNALS = (
    re.compile(r"Traceback|File \""),
    re.compile(r"[A-Za-z]+(Error|Exception|Warning)\b"),
    re.compile(r"(?<![0-9A-Za-z])0x[0-9a-fA-F]{4,}"),
    re.compile(r"<[\w.]+ object"),
    re.compile(r"(?<![\w.])/(home|usr|tmp|work|etc|root|opt|var|proc|dev|lib|srv|mnt)(/|\b)"),
    re.compile(r"\.py\b|site-packages|dist-packages|k6fast/"),
)


def internals_in(text: str) -> list[str]:
    """The pieces of `text` that name something internal (empty when it is clean)."""
    return [match.group(0) for pattern in INTERNALS for match in pattern.finditer(text)]


def check_error_body(body: object) -> dict:
    """`body` is OpenAI's error shape; returns its `error` object."""
    assert isinstance(body, dict) and set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"], error
    assert error["type"] in ("invalid_request_error", "authentication_error", "rate_limit_error"), error
    assert error["param"] is None or isinstance(error["param"], str), error
    assert error["code"] is None or isinstance(error["code"], str), error
    return error


def rss_bytes() -> int:
    """This process's resident memory now."""
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakRss:
    """The process's peak resident memory while the block runs, sampled every millisecond (garbage collected at
    both ends, so what is left over is what the block kept)."""

    def __enter__(self) -> PeakRss:
        gc.collect()
        self.start = self.peak = rss_bytes()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._done.wait(0.001):
            self.peak = max(self.peak, rss_bytes())

    def __exit__(self, *exc) -> None:
        self._done.set()
        self._thread.join()
        gc.collect()
        self.end = rss_bytes()

    @property
    def growth(self) -> int:
        return self.peak - self.start


def budget_fitting(root, width: int, height: int, frames: int) -> float:
    """A VRAM budget (GiB) for the tiny checkpoint at `root` on the CPU that holds requests up to this geometry (the
    DiT's fixed weights, two streamed blocks, this geometry's activations or the text phase, the reserve) and
    refuses much larger ones."""
    from k6fast.checkpoint import open_checkpoint
    from k6fast.memory import GiB
    from k6fast.request import dit_tokens
    from k6fast.safetensors_index import index_safetensors
    from k6fast.stream.plan import RESERVE_BYTES, activation_estimate, index_footprint
    from k6fast.text_plan import text_footprint, text_weights

    ckpt = open_checkpoint(root)
    cfg = ckpt.dit
    fixed, block = index_footprint(index_safetensors(ckpt.transformer_files), cfg.num_visual_blocks, 4)
    act = activation_estimate(*dit_tokens(width, height, frames), cfg.model_dim, cfg.model_dim_a, ff_dim=cfg.ff_dim)
    text = text_footprint(text_weights(root), "F32").device_bytes  # fp32: the CPU's compute dtype
    return (fixed + max(act, text) + RESERVE_BYTES + 2 * block) / GiB + 1e-6
