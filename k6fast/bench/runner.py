"""What a bench visit runs: its spec (`VisitSpec`, written by the session, read by the visit process), the `Runner`
protocol every arm implements (k6fast's runners in visit.py, the peers' in peers.py) and the timing primitives they
share."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from typing import TYPE_CHECKING, Any, Protocol

from ..cli_args import DTYPES, torch_dtype_of
from ..request import Request
from .records import DEFAULT_PROMPT
from .workload import Geometry

if TYPE_CHECKING:  # PyTorch loads in the visit process only: the session that plans visits never needs it
    import torch

COMPONENTS = ("pipeline", "dit", "block")


@dataclass(frozen=True)
class VisitSpec:
    """Everything one visit needs; written by the session as JSON, read back by the visit process."""

    session: str
    visit: int  # 0-based index in the session's order
    position: int  # position within one mirrored pattern (A B B A: 0..3)
    repeat: int  # which repetition of the pattern
    arm: str  # arm name, arm file path, or a peer arm name
    model: str
    component: str
    width: int
    height: int
    frames: int
    steps: int
    guidance: float
    seed: int = 42
    prompt: str = DEFAULT_PROMPT
    requests: int = 1
    warmup: int = 1
    device: str | None = None
    dtype: str | None = None
    mux: bool = True
    command: str = ""
    switches: dict[str, str] = field(default_factory=dict)  # session-wide switches over the arm's (see SessionPlan)
    stop_after_steps: int | None = None  # denoise only the schedule's first steps (a per-step measurement)

    @property
    def geometry(self) -> Geometry:
        return Geometry(self.width, self.height, self.frames)

    @property
    def request(self) -> Request:
        """The request a `pipeline` visit runs: the fields this spec shares with `Request` by name; the others (no
        image, no negative prompt, the model's frame rate) keep their defaults."""
        shared = {f.name for f in fields(Request)} & {f.name for f in fields(self)}
        return Request.from_dict({name: getattr(self, name) for name in shared})

    def resolved_device(self) -> torch.device:
        import torch

        from ..allocator import resolve_device

        return resolve_device(self.device or ("cuda" if torch.cuda.is_available() else "cpu"))

    def resolved_dtype(self) -> torch.dtype:
        import torch

        if self.dtype is not None:
            return torch_dtype_of(self.dtype)
        return torch.bfloat16 if self.resolved_device().type == "cuda" else torch.float32

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> VisitSpec:
        spec = cls(**raw)
        if spec.component not in COMPONENTS:
            raise ValueError(f"component {spec.component!r}: expected one of {', '.join(COMPONENTS)}")
        if spec.dtype is not None and spec.dtype not in DTYPES:
            raise ValueError(f"dtype {spec.dtype!r}: expected one of {', '.join(DTYPES)}")
        if spec.requests < 1 or spec.warmup < 0:
            raise ValueError(f"expected requests >= 1 and warmup >= 0, found {spec.requests} and {spec.warmup}")
        return spec

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class Runner(Protocol):
    """One arm at one component: `load` once, then `run` per request."""

    def load(self) -> None: ...

    def run(self) -> dict[str, Any]:
        """One request: {"seconds": float, "telemetry": Telemetry.as_dict()-shaped dict}."""
        ...

    def describe(self) -> dict[str, Any]:
        """Provenance of what ran (k6fast: version, commit, arm, hash, switches; peers: their settings too)."""
        ...


def sync(device: torch.device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def reset_peak(device: torch.device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_vram(device: torch.device) -> dict[str, int]:
    import torch

    if device.type != "cuda":
        return {"allocated": 0, "reserved": 0}
    return {"allocated": torch.cuda.max_memory_allocated(device), "reserved": torch.cuda.max_memory_reserved(device)}


def time_call(
    device: torch.device, phase: str, call: Callable[[], object], on_done: Callable[[Any], None] | None = None
) -> dict[str, Any]:
    """Time one synchronised call as a one-step Telemetry (a DiT forward is one step at guidance 1); `on_done`
    receives the Telemetry after the call, to add what the runtime measured inside it."""
    import torch

    from ..telemetry import Telemetry

    telemetry = Telemetry(device=str(device))
    reset_peak(device)
    with torch.no_grad(), telemetry.phase(phase):
        call()
    seconds = telemetry.phases[phase]
    telemetry.step_seconds.append(seconds)
    telemetry.dit_calls = 1 if phase == "dit_forward" else 0
    if on_done is not None:
        on_done(telemetry)
    return {"seconds": seconds, "telemetry": telemetry.as_dict()}
