"""A Kandinsky 6 checkpoint in the Diffusers layout: where it is, what it is, and whether it is whole.

`open_checkpoint` resolves a Hub id or a local directory, reads `model_index.json` and the configs, works out the
variant from the checkpoint's own files (scheduler class → distilled PiFlow or base flow-matching; transformer
width → Pro or Lite), and validates the transformer's tensors against its config and every safetensors file
against its own header, so a broken download fails at load with the file named, not minutes later. A checkpoint
written by `k6fast quantize` records its format in `transformer/config.json` and is validated against it (the
quantized tensors' names, shapes and dtypes).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .df11_header import COMPRESSION_FORMATS, COMPRESSION_KEY, COMPRESSION_VERSION
from .dit.config import QUANT_CONFIG_KEY, QUANT_FORMATS, QUANT_VERSION, DiTConfig, expected_shapes, quantized_layout
from .safetensors_index import CheckpointError, DF11Location, TensorLocation, file_tensors, read_header

COMPONENTS = (
    "transformer",
    "vae",
    "text_encoder",
    "tokenizer",
    "text_encoder_2",
    "tokenizer_2",
    "scheduler",
    "audio_vae",
    "vocoder",
)
# Components whose folder must hold a config.json (tokenizers and the scheduler have their own files).
_MODEL_COMPONENTS = ("transformer", "vae", "text_encoder", "text_encoder_2", "audio_vae", "vocoder")
DISTILLED_SCHEDULER = "PiflowScheduler"
BASE_SCHEDULER = "FlowMatchEulerDiscreteScheduler"


@dataclass(frozen=True)
class Checkpoint:
    root: Path
    model_index: dict[str, Any]
    dit: DiTConfig
    scheduler_class: str
    scheduler_config: dict[str, Any]
    transformer_files: tuple[Path, ...]
    # "fp8" / "nvfp4" for a checkpoint written by `k6fast quantize` (its fused-block linears are stored quantized and
    # run that format's GEMM whatever K6_GEMM says; lossy by construction), None for the released bf16 checkpoints.
    quantization: str | None = None
    # "df11" for a checkpoint written by `k6fast quantize --format df11`: its large BF16 transformer tensors are
    # stored as DF11 blobs (U8), lossless (k6fast/df11_checkpoint.py); None otherwise.
    compression: str | None = None

    @property
    def distilled(self) -> bool:
        return self.scheduler_class == DISTILLED_SCHEDULER

    @property
    def variant(self) -> str:
        """e.g. `pro-distill`, `lite`, `custom-distill` (custom = not a released width, e.g. the tiny model)."""
        return self.dit.size_class + ("-distill" if self.distilled else "")

    @property
    def default_steps(self) -> int:
        return 10 if self.distilled else 50

    @property
    def default_guidance(self) -> float:
        return 1.0 if self.distilled else 5.0

    def component(self, name: str) -> Path:
        return self.root / name


def resolve_model(model: str) -> Path:
    """A local Diffusers-layout directory, or a Hugging Face Hub id fetched with huggingface_hub (from the local
    cache when offline)."""
    path = Path(model).expanduser()
    if path.is_dir():
        return path.resolve()
    if path.exists():
        raise CheckpointError(f"--model {model!r} is a file; expected a checkpoint directory or a Hub id")
    if model.count("/") != 1 or model.startswith((".", "/", "~")):
        raise CheckpointError(f"--model {model!r}: no such directory, and not a Hub id of the form 'organisation/name'")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return Path(snapshot_download(model))
    except LocalEntryNotFoundError as exc:
        raise CheckpointError(
            f"--model {model!r}: not in the local Hugging Face cache and the Hub cannot be reached ({exc}); "
            "download it on a connected machine or pass a local directory"
        ) from exc
    except Exception as exc:  # network errors come in many types; the cache is the fallback for all of them
        try:
            return Path(snapshot_download(model, local_files_only=True))
        except LocalEntryNotFoundError:
            raise CheckpointError(f"--model {model!r}: download failed ({exc}) and it is not cached") from exc


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise CheckpointError(f"missing file {path}")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path} is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a JSON object, found {type(data).__name__}")
    return data


def weight_files(folder: Path, stem: str) -> tuple[Path, ...]:
    """The safetensors files of one component: `<stem>.safetensors` or the shards its index lists."""
    single = folder / f"{stem}.safetensors"
    index = folder / f"{stem}.safetensors.index.json"
    if index.is_file():
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index}: expected a non-empty 'weight_map'")
        files = tuple(folder / name for name in sorted(set(weight_map.values())))
        for file in files:
            if not file.is_file():
                raise CheckpointError(f"missing shard {file} (listed in {index.name})")
        return files
    if single.is_file():
        return (single,)
    raise CheckpointError(f"{folder}: expected {single.name} or {index.name}")


# Dtypes a tensor that is not a quantized weight or scale may have (converted to the compute dtype at load).
_FLOAT_DTYPES = ("BF16", "F16", "F32")


def quantization_of(config: dict[str, Any], path: Path) -> str | None:
    """The `k6fast_quantization` entry of a transformer config.json: its format, or None when absent."""
    entry = config.get(QUANT_CONFIG_KEY)
    if entry is None:
        return None
    if not isinstance(entry, dict) or entry.get("format") not in QUANT_FORMATS or entry.get("version") != QUANT_VERSION:
        raise CheckpointError(
            f"{path}: {QUANT_CONFIG_KEY} must be {{'format': one of {list(QUANT_FORMATS)}, 'version': "
            f"{QUANT_VERSION}}}, found {entry!r}"
        )
    return entry["format"]


def compression_of(config: dict[str, Any], path: Path) -> str | None:
    """The `k6fast_compression` entry of a transformer config.json: its format, or None when absent."""
    entry = config.get(COMPRESSION_KEY)
    if entry is None:
        return None
    if (not isinstance(entry, dict) or entry.get("format") not in COMPRESSION_FORMATS
            or entry.get("version") != COMPRESSION_VERSION):  # fmt: skip
        raise CheckpointError(
            f"{path}: {COMPRESSION_KEY} must be {{'format': one of {list(COMPRESSION_FORMATS)}, 'version': "
            f"{COMPRESSION_VERSION}}}, found {entry!r}"
        )
    return entry["format"]


def _stored_as(loc: TensorLocation, compression: str | None) -> tuple[tuple[int, ...], str]:
    """(shape, dtype) a tensor decodes to: a DF11 blob's from its header (read and checked by the index)."""
    if compression is not None and isinstance(loc, DF11Location):
        return loc.layout.shape, "BF16"
    return loc.shape, loc.dtype


def _check_transformer(
    dit: DiTConfig, files: tuple[Path, ...], quantization: str | None = None, compression: str | None = None
) -> None:
    expected = expected_shapes(dit)
    expected_dtypes: dict[str, str] = {}
    if quantization is not None:
        expected, expected_dtypes = quantized_layout(expected, quantization)
    found: dict[str, tuple[tuple[int, ...], Path]] = {}
    dtypes: dict[str, str] = {}
    for file in files:
        for loc in file_tensors(file):
            shape, dtypes[loc.name] = _stored_as(loc, compression)
            found[loc.name] = (shape, file)
    missing = sorted(set(expected) - set(found))
    if missing:
        raise CheckpointError(
            f"transformer weights do not match transformer/config.json: {len(missing)} tensors missing "
            f"(e.g. {missing[:3]}); check num_visual_blocks/num_text_blocks and the shard files"
        )
    for name, shape in expected.items():
        actual, file = found[name]
        if actual != shape:
            raise CheckpointError(
                f"{file}: tensor {name} has shape {list(actual)}, transformer/config.json implies {list(shape)}"
            )
    extra = sorted(set(found) - set(expected))
    if extra:
        hint = ""
        if quantization is None and any(name.endswith(".weight_scale") for name in extra):
            hint = f"; quantized weights need a {QUANT_CONFIG_KEY!r} entry in transformer/config.json"
        raise CheckpointError(
            f"transformer weights hold {len(extra)} tensors transformer/config.json does not describe "
            f"(e.g. {extra[:3]} in {found[extra[0]][1]}){hint}"
        )
    for name in expected:
        want = expected_dtypes.get(name)
        if (want is None and dtypes[name] not in _FLOAT_DTYPES) or (want is not None and dtypes[name] != want):
            what = f"{want} (a k6fast {quantization} checkpoint)" if want else f"one of {', '.join(_FLOAT_DTYPES)}"
            raise CheckpointError(f"{found[name][1]}: tensor {name} has dtype {dtypes[name]}, expected {what}")


def open_checkpoint(model: str | Path) -> Checkpoint:
    root = resolve_model(str(model))
    model_index = _read_json(root / "model_index.json")
    missing = [c for c in COMPONENTS if c not in model_index and c not in ("audio_vae", "vocoder")]
    if missing:
        raise CheckpointError(f"{root / 'model_index.json'}: no entry for {missing}")
    for name in COMPONENTS:
        if not (root / name).is_dir():
            raise CheckpointError(f"missing component folder {root / name}")
    for name in _MODEL_COMPONENTS:
        _read_json(root / name / "config.json")
        stem = "model" if name.startswith("text_encoder") else "diffusion_pytorch_model"
        for file in weight_files(root / name, stem):
            read_header(file)

    transformer_config = _read_json(root / "transformer" / "config.json")
    dit = DiTConfig.from_dict(transformer_config)
    quantization = quantization_of(transformer_config, root / "transformer" / "config.json")
    compression = compression_of(transformer_config, root / "transformer" / "config.json")
    if quantization is not None and compression is not None:
        raise CheckpointError(f"{root / 'transformer' / 'config.json'}: both {QUANT_CONFIG_KEY} and {COMPRESSION_KEY}")
    transformer_files = weight_files(root / "transformer", "diffusion_pytorch_model")
    _check_transformer(dit, transformer_files, quantization, compression)

    scheduler_config = _read_json(root / "scheduler" / "scheduler_config.json")
    scheduler_class = scheduler_config.get("_class_name", "")
    if scheduler_class not in (DISTILLED_SCHEDULER, BASE_SCHEDULER):
        raise CheckpointError(
            f"{root / 'scheduler' / 'scheduler_config.json'}: scheduler {scheduler_class!r} is not supported; "
            f"expected {DISTILLED_SCHEDULER} (distilled) or {BASE_SCHEDULER} (base)"
        )
    if scheduler_class == DISTILLED_SCHEDULER:
        n_grid = int(scheduler_config.get("n_grid", 10))
        if dit.out_visual_dim != n_grid * dit.in_visual_dim or dit.out_audio_dim != n_grid * dit.in_audio_dim:
            raise CheckpointError(
                f"{root / 'transformer' / 'config.json'}: a PiFlow checkpoint (n_grid {n_grid}) needs out dims "
                f"{n_grid} x in dims, found video {dit.out_visual_dim}/{dit.in_visual_dim}, "
                f"audio {dit.out_audio_dim}/{dit.in_audio_dim}"
            )
    elif dit.out_visual_dim != dit.in_visual_dim or dit.out_audio_dim != dit.in_audio_dim:
        raise CheckpointError(
            f"{root / 'transformer' / 'config.json'}: a flow-matching checkpoint needs out dims equal to in dims, "
            f"found video {dit.out_visual_dim}/{dit.in_visual_dim}, audio {dit.out_audio_dim}/{dit.in_audio_dim}"
        )
    return Checkpoint(
        root, model_index, dit, scheduler_class, scheduler_config, transformer_files, quantization, compression
    )
