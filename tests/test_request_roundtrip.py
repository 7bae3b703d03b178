"""One request type from every entry point to the pipeline: a `Request` with every field set to a value unlike its
default goes through each conversion (JSON, the job store, a Ray message, `k6fast generate`'s arguments, the
server's create body, a bench visit spec) and comes back the same. A field added to `Request` fails here until it
has a value in NON_DEFAULT and each conversion carries it (or the source is declared not to set it)."""

from __future__ import annotations

import base64
import dataclasses
import io
import json
import pickle
from pathlib import Path
from typing import Any

import numpy as np
import PIL.Image
import pytest

from k6fast.request import FPS, Request, request_from_args

PIXELS = np.arange(16 * 32 * 3, dtype=np.uint8).reshape(16, 32, 3)
NON_DEFAULT: dict[str, Any] = {
    "prompt": "a heron lands on a pond; water splashes, frogs go quiet",
    "width": 96,
    "height": 48,
    "frames": 13,
    "steps": 3,
    "guidance": 4.5,
    "seed": 2**40 + 3,
    "negative_prompt": "blurry, distorted",
    "image": PIL.Image.fromarray(PIXELS),
    "audio": False,
    "fps": 30.0,
}
# Fields a source has no way to set: they arrive at their default. `k6fast generate` and the server's API run clips
# at the model's frame rate.
NOT_FROM_ARGS = {"fps"}
NOT_FROM_CREATE = {"fps"}


def _png(image: PIL.Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def _same(got: Request, want: Request, unset: set[str] = frozenset()) -> None:
    """Every field of `got` equals `want`'s (the image by its pixels), except `unset` ones, which are default."""
    defaults = Request(prompt="-")
    for f in dataclasses.fields(Request):
        expected = getattr(defaults if f.name in unset else want, f.name)
        value = getattr(got, f.name)
        if f.name == "image" and expected is not None:
            assert value is not None and np.array_equal(np.asarray(value.convert("RGB")), np.asarray(expected))
        else:
            assert value == expected, f"{f.name}: {value!r}, expected {expected!r}"


@pytest.fixture
def full() -> Request:
    return Request(**NON_DEFAULT)


def test_every_field_has_a_value_unlike_its_default() -> None:
    names = [f.name for f in dataclasses.fields(Request)]
    assert set(NON_DEFAULT) == set(names), "a field of Request is missing from NON_DEFAULT (or is no longer one)"
    for f in dataclasses.fields(Request):
        if f.default is not dataclasses.MISSING:
            assert NON_DEFAULT[f.name] != f.default, f"{f.name}: {NON_DEFAULT[f.name]!r} is its default"
    assert set(names) >= NOT_FROM_ARGS | NOT_FROM_CREATE


def test_json_round_trip_keeps_every_field(full: Request) -> None:
    raw = json.loads(json.dumps(full.to_dict()))
    assert set(raw) == {f.name for f in dataclasses.fields(Request)} and raw["image"] is True
    _same(Request.from_dict(raw, image=full.image), full)
    _same(Request.from_dict(Request(prompt="x").to_dict()), Request(prompt="x"))


def test_from_dict_refuses_what_it_cannot_carry(full: Request) -> None:
    raw = full.to_dict()
    with pytest.raises(ValueError, match="unknown request field.*duration"):
        Request.from_dict({**raw, "duration": 5}, image=full.image)
    with pytest.raises(ValueError, match="had an image and none was given"):
        Request.from_dict(raw)
    with pytest.raises(ValueError, match="had no image and one was given"):
        Request.from_dict({**raw, "image": False}, image=full.image)


def test_generate_arguments_carry_every_field_the_command_has(full: Request) -> None:
    from k6fast.cli import build_parser

    argv = ["generate", "--model", "m", "--out", "clip.mp4", "--prompt", full.prompt, "--image", "first.png",
            "--size", f"{full.width}x{full.height}", "--frames", str(full.frames), "--steps", str(full.steps),
            "--guidance", str(full.guidance), "--seed", str(full.seed), "--negative-prompt", full.negative_prompt,
            "--no-audio"]  # fmt: skip
    args = build_parser().parse_args(argv)
    assert args.image == "first.png"
    _same(request_from_args(args, full.image), full, unset=NOT_FROM_ARGS)


def _create_body(request: Request) -> dict[str, Any]:
    url = "data:image/png;base64," + base64.b64encode(_png(request.image)).decode()
    return {
        "prompt": request.prompt,
        "size": f"{request.width}x{request.height}",
        "num_frames": str(request.frames),
        "num_inference_steps": str(request.steps),
        "guidance_scale": str(request.guidance),
        "seed": str(request.seed),
        "negative_prompt": request.negative_prompt,
        "sample_audio": "true" if request.audio else "false",
        "input_reference": {"image_url": url},
    }


class Resolving:
    """Stands in for the pipeline's `resolve`: keeps what it was asked, returns the request's own steps and
    guidance (a checkpoint default fills in only what the client left out)."""

    def __init__(self) -> None:
        self.asked: list[Request] = []

    def resolve(self, request: Request) -> tuple[int, float]:
        self.asked.append(request)
        return request.steps, request.guidance


def test_the_server_carries_every_field_from_the_body_to_the_pipeline(full: Request, tmp_path: Path) -> None:
    """Create body → Draft → JobSpec → the job store → a Ray message → the request a dispatcher runs."""
    pytest.importorskip("fastapi")  # the server's extra
    from k6fast.server.config import ServerConfig
    from k6fast.server.jobs import JobStore, new_job_id
    from k6fast.server.ray_messages import JobPayload
    from k6fast.server.validation import parse_create, resolve_spec
    from k6fast.server.worker import request_from_spec

    config = ServerConfig(model="m", served_model_name="m", data_dir=tmp_path)
    draft = parse_create(_create_body(full), config, ("m",))
    assert draft.image is not None and draft.request.image is None, "the upload travels apart from the request"
    _same(draft.request, dataclasses.replace(full, image=None), unset=NOT_FROM_CREATE)
    model = Resolving()
    spec = resolve_spec(draft, model, config.max_steps)
    assert model.asked[0].image is not None, "the pipeline is asked whether the checkpoint takes an image"
    assert spec.image and spec.request.image is None and spec.seconds == "0.5"

    store = JobStore(tmp_path / "jobs.sqlite3")
    try:
        stored = store.create(new_job_id(), spec, "m", {}, max_queue=4).spec
        assert store.get(store.ids().pop()).spec == stored == spec
    finally:
        store.close()
    payload = pickle.loads(pickle.dumps(JobPayload("video_" + "0" * 32, stored, 1, ("serve", "in"), draft.image.data)))
    assert payload.spec == spec
    _same(request_from_spec(payload.spec, payload.image_png), full, unset=NOT_FROM_CREATE)


def test_a_stored_spec_round_trips_every_field_and_older_records_load(full: Request) -> None:
    from k6fast.server.jobs import JobSpec

    spec = JobSpec(dataclasses.replace(full, image=None), "0.5", image=True)
    again = JobSpec.from_json(spec.to_json())
    assert again == spec and again.image and again.request.fps == full.fps
    # A record as k6fast wrote it before the request had `fps` in the store: it loads at the model's frame rate.
    older = (
        '{"audio": false, "frames": 13, "guidance": 4.5, "height": 48, "image": true, "negative_prompt": "blurry", '
        '"prompt": "a heron", "seconds": "0.5", "seed": 7, "steps": 3, "width": 96}'
    )
    loaded = JobSpec.from_json(older)
    assert loaded.request == Request("a heron", 96, 48, 13, 3, 4.5, 7, "blurry", audio=False, fps=FPS)
    written, before = json.loads(loaded.to_json()), json.loads(older)
    assert {key: written[key] for key in before} == before, "what an older k6fast stored is stored the same way"
    defaults = Request(prompt="-").to_dict()
    assert {key: written[key] for key in set(written) - set(before)} == {
        key: defaults[key] for key in set(written) - set(before)
    }, "only request fields, at their defaults, are added"
    assert (loaded.seconds, loaded.image, loaded.size) == ("0.5", True, "96x48")
    with pytest.raises(ValueError, match="unknown request field.*loop_count"):
        JobSpec.from_json(older.replace('"audio"', '"loop_count": 2, "audio"'))


def test_a_bench_visit_spec_carries_the_fields_it_shares_with_the_request(full: Request) -> None:
    from k6fast.bench.runner import VisitSpec

    shared = {f.name for f in dataclasses.fields(VisitSpec)} & set(NON_DEFAULT)
    values = {name: NON_DEFAULT[name] for name in shared}
    spec = VisitSpec(session="s", visit=0, position=0, repeat=0, arm="reference", model="m", component="pipeline",
                     **values)  # fmt: skip
    again = VisitSpec.from_dict(json.loads(json.dumps(spec.as_dict())))
    assert again == spec
    _same(again.request, full, unset=set(NON_DEFAULT) - shared)
    assert {"prompt", "width", "height", "frames", "steps", "guidance", "seed"} <= shared


def test_request_from_args_reads_the_namespace_the_parser_makes() -> None:
    """`generate`'s defaults are the request's: a command with only a prompt asks for the default request."""
    from k6fast.cli import build_parser

    args = build_parser().parse_args(["generate", "--model", "m", "--out", "x.mp4", "--prompt", "a cat"])
    assert request_from_args(args) == Request(prompt="a cat")
