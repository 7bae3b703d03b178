"""LPIPS (AlexNet, v0.1) per video frame, with the backbone weights loaded from a file and never downloaded.

The `lpips` package ships its calibrated linear layers (`lpips/weights/v0.1/alex.pth`) but takes the AlexNet
backbone from torchvision, which would download `alexnet-owt-7be5be79.pth` on first use. The gate must not reach
the network in the middle of a run (GPU machines often cannot), so it builds LPIPS with a randomly initialised
trunk and loads the ImageNet backbone itself from the torch hub cache, where torchvision keeps that file, or from
an explicit path. When neither is there it stops and says how to provide the file.

`--lpips-backbone random` builds a seeded random backbone for tests on machines without the weights; every score
it produces is labelled RANDOM_LABEL and means nothing about quality.

Check: `pytest tests/test_gate_metrics.py`.
"""

from __future__ import annotations

import hashlib
import warnings
from pathlib import Path

import numpy as np
import torch

from . import GateError
from .config import MIN_SIZE

ALEXNET_FILE = "alexnet-owt-7be5be79.pth"
ALEXNET_URL = f"https://download.pytorch.org/models/{ALEXNET_FILE}"
# torchvision names its checkpoints by the first 8 hex digits of the file's SHA-256.
ALEXNET_SHA256_PREFIX = "7be5be79"
RANDOM = "random"
RANDOM_LABEL = "LPIPS backbone: RANDOM — not a quality measurement"
RANDOM_SEED = 0
# torchvision's alexnet().features index → the lpips slice holding that layer (lpips keeps the index as its name).
_FEATURE_SLICES = {0: 1, 3: 2, 6: 3, 8: 4, 10: 5}
# Conv 11/4, max-pool 3/2, conv 5, max-pool 3/2: below 32 pixels the second pool has nothing left to pool.
_BATCH = 8


def default_backbone_path() -> Path:
    """Where torchvision would keep the AlexNet weights: `<torch hub dir>/checkpoints/alexnet-owt-7be5be79.pth`.

    torch.hub.get_dir() follows TORCH_HOME / XDG_CACHE_HOME, as torchvision does, so a file downloaded by
    torchvision on this machine is found where torchvision put it.
    """
    return Path(torch.hub.get_dir()) / "checkpoints" / ALEXNET_FILE


def missing_backbone_message(path: Path) -> str:
    return (
        f"LPIPS needs torchvision's ImageNet AlexNet weights ({ALEXNET_FILE}, 233 MB), expected at {path}; found "
        "nothing there. Provide them in one of these ways: (1) on a machine with network access run "
        "`python -c \"import torchvision; torchvision.models.alexnet(weights='IMAGENET1K_V1')\"`, which downloads "
        f"the file into the torch hub cache, and copy it to {path}; (2) download {ALEXNET_URL} anywhere and pass "
        "--lpips-backbone PATH. (--lpips-backbone random exists for tests only: its scores measure nothing.)"
    )


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


class LpipsScorer:
    """LPIPS distances between decoded frames. `backbone`: None (the torch hub cache), a path, or "random".

    Attributes: `label` (a line for reports naming the backbone), `random` (True for the test backbone),
    `sha256` (of the backbone file; None for random), `device`.
    """

    def __init__(self, backbone: str | Path | None = None, device: str | torch.device | None = None):
        import lpips  # imported here: it pulls in torchvision, which the rest of k6fast does not need

        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.random = isinstance(backbone, str) and backbone == RANDOM
        with warnings.catch_warnings(), torch.random.fork_rng(devices=[]):
            # lpips calls torchvision with the deprecated `pretrained=False`; the warning is about lpips, not us.
            warnings.simplefilter("ignore", UserWarning)
            # The random trunk draws from the global generator: seed it here (and restore it after) so that the
            # random backbone is the same in every run and the caller's random state is left untouched.
            torch.manual_seed(RANDOM_SEED)
            model = lpips.LPIPS(net="alex", version="0.1", pretrained=True, pnet_rand=True, verbose=False)
        self.sha256: str | None = None
        if self.random:
            self.label = RANDOM_LABEL
        else:
            path = Path(backbone) if backbone is not None else default_backbone_path()
            if not path.is_file():
                raise GateError(missing_backbone_message(path))
            _load_backbone(model.net, path)
            self.sha256 = _sha256(path)
            if self.sha256.startswith(ALEXNET_SHA256_PREFIX):
                self.label = (
                    f"LPIPS v0.1 AlexNet, torchvision IMAGENET1K_V1 backbone ({path}, sha256 {self.sha256[:16]})"
                )
            else:
                self.label = (
                    f"LPIPS v0.1 AlexNet, backbone from {path} (sha256 {self.sha256[:16]}: not torchvision's "
                    f"{ALEXNET_FILE}; scores are comparable only with runs that used this same file)"
                )
        self.model = model.to(self.device).eval()

    @torch.inference_mode()
    def frames(self, reference: np.ndarray, test: np.ndarray) -> np.ndarray:
        """LPIPS of each frame pair. reference, test: uint8 [F, H, W, 3] RGB → float64 [F].

        Byte-identical frames score exactly 0.0 without running the network, so a lossless arm reads 0 on any
        device (a GPU convolution is not guaranteed to round the same way in two calls).
        """
        _check_frames(reference, test)
        scores = np.zeros(reference.shape[0], np.float64)
        differ = np.flatnonzero((reference != test).reshape(reference.shape[0], -1).any(axis=1))
        for start in range(0, differ.size, _BATCH):
            index = differ[start : start + _BATCH]
            a, b = (self._tensor(frames[index]) for frames in (reference, test))
            scores[index] = self.model(a, b).flatten().double().cpu().numpy()
        return scores

    def _tensor(self, frames: np.ndarray) -> torch.Tensor:
        """uint8 [B, H, W, 3] → float32 [B, 3, H, W] in [-1, 1] (LPIPS' input range) on the scoring device."""
        x = torch.from_numpy(np.ascontiguousarray(frames)).to(self.device).permute(0, 3, 1, 2).float()
        return x / 127.5 - 1.0


def _check_frames(reference: np.ndarray, test: np.ndarray) -> None:
    for name, frames in (("reference", reference), ("test", test)):
        if not isinstance(frames, np.ndarray) or frames.dtype != np.uint8 or frames.ndim != 4 or frames.shape[3] != 3:
            found = f"{frames.dtype} {list(frames.shape)}" if isinstance(frames, np.ndarray) else type(frames).__name__
            raise GateError(f"LPIPS: expected {name} frames as uint8 [F, H, W, 3], found {found}")
    if reference.shape != test.shape:
        raise GateError(
            f"LPIPS: expected reference and test clips of the same shape, found {list(reference.shape)} and "
            f"{list(test.shape)} (were they generated at different geometries?)"
        )
    height, width = reference.shape[1:3]
    if min(height, width) < MIN_SIZE:
        raise GateError(f"LPIPS (AlexNet) needs frames of at least {MIN_SIZE}x{MIN_SIZE}, found {width}x{height}")


def _load_backbone(net: torch.nn.Module, path: Path) -> None:
    """Load torchvision AlexNet weights (`features.N.*`, classifier ignored; or a bare `N.*` features dict) into
    the lpips trunk `net` (`sliceK.N.*`). Every conv weight and bias must be present with the expected shape."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch.load raises many types for a file that is not a checkpoint
        raise GateError(
            f"LPIPS backbone {path}: expected a torch state dict of AlexNet weights, unreadable ({exc})"
        ) from exc
    if isinstance(state, dict) and "state_dict" in state and isinstance(state["state_dict"], dict):
        state = state["state_dict"]
    if not isinstance(state, dict):
        raise GateError(f"LPIPS backbone {path}: expected a state dict, found {type(state).__name__}")
    target = net.state_dict()
    mapped, problems = {}, []
    for index, slice_no in _FEATURE_SLICES.items():
        for kind in ("weight", "bias"):
            ours = f"slice{slice_no}.{index}.{kind}"
            found = state.get(f"features.{index}.{kind}", state.get(f"{index}.{kind}"))
            if found is None:
                problems.append(f"features.{index}.{kind} missing")
            elif tuple(found.shape) != tuple(target[ours].shape):
                problems.append(
                    f"features.{index}.{kind} has shape {list(found.shape)}, expected {list(target[ours].shape)}"
                )
            else:
                mapped[ours] = found.float()
    if problems:
        raise GateError(f"LPIPS backbone {path}: not torchvision AlexNet weights: {'; '.join(problems)}")
    net.load_state_dict(mapped, strict=True)
