"""K6_STEP_CACHE=magcache on the tiny base checkpoint (Euler + CFG), judged against the unskipped run.

One pipeline serves every run: the step-cache switches act in `generate` (the DiT and its backend do not read them),
so the tests swap `pipe.options` between requests instead of loading the checkpoint again.
"""

from __future__ import annotations

import json

import pytest
import torch
from pipeline_testing import CountingDiT

from k6fast.checkpoint import open_checkpoint
from k6fast.pipeline import Pipeline, Request, RequestError
from k6fast.request import resolve_request
from k6fast.step_cache import MagCache, plan_run
from k6fast.switches import Options, SwitchError, load_options

STEPS = 10
REQUEST = Request(prompt="Rain on a tin roof, thunder far away", width=32, height=32, frames=5, steps=STEPS, seed=3)


@pytest.fixture(scope="module")
def runs(tiny_checkpoints, tmp_path_factory):
    """The reference, the calibration run and magcache at three settings, each with its DiT call count."""
    calibrations = tmp_path_factory.mktemp("calibrations")
    pipe = Pipeline(tiny_checkpoints["base"], Options(), device="cpu")
    pipe.dit = CountingDiT(pipe.dit)
    cache = Options().replace(step_cache="magcache", step_cache_dir=calibrations)
    settings = {
        "reference": Options(),
        "calibrate": Options().replace(step_cache="calibrate", step_cache_dir=calibrations),
        "threshold-0": cache.replace(step_cache_threshold=0.0),
        "default": cache,  # threshold 0.12, max skip 2, retention 0.2 (MagCache's and Kandinsky 5's)
        "permissive": cache.replace(step_cache_threshold=1.0, step_cache_max_skip=10, step_cache_retention=0.2),
    }
    out = {}
    for name, options in settings.items():  # in order: the calibration is written before magcache reads it
        pipe.options = options
        before = pipe.dit.calls
        result = pipe.generate(REQUEST)
        out[name] = (result, pipe.dit.calls - before)
    out["calibrations"] = calibrations
    return out


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def test_calibration_run_skips_nothing_and_records_every_series(runs) -> None:
    (ref, ref_calls), (cal, cal_calls) = runs["reference"], runs["calibrate"]
    assert ref_calls == cal_calls == 2 * STEPS
    for stream in ("video", "audio"):
        assert torch.equal(cal.latents[stream], ref.latents[stream])
    [path] = runs["calibrations"].iterdir()
    data = json.loads(path.read_text())
    assert data["steps"] == STEPS and data["guidance"] == 5.0 and data["geometry"] == [32, 32, 5]
    assert sorted(data["ratios"]) == ["audio.cond", "audio.uncond", "video.cond", "video.uncond"]
    for name, ratios in data["ratios"].items():
        assert len(ratios) == STEPS and ratios[0] == 1.0
        assert all(0.5 < r < 2.0 and r != 1.0 for r in ratios[1:]), (name, ratios)
        assert all(0.0 <= c < 0.5 for c in data["cosine_distance"][name])
    record = cal.telemetry.step_cache
    assert record["mode"] == "calibrate" and record["calibration"] == str(path) and len(record["digest"]) == 16


def test_threshold_zero_skips_nothing_and_is_bit_identical(runs) -> None:
    (ref, ref_calls), (run, calls) = runs["reference"], runs["threshold-0"]
    assert calls == ref_calls == 2 * STEPS
    assert run.telemetry.cached_steps == 0
    for stream in ("video", "audio"):
        assert torch.equal(run.latents[stream], ref.latents[stream])


def test_permissive_threshold_skips_steps_within_the_bound(runs) -> None:
    (ref, _), (default, default_calls), (permissive, permissive_calls) = (
        runs["reference"],
        runs["default"],
        runs["permissive"],
    )
    for result, calls in ((default, default_calls), (permissive, permissive_calls)):
        skipped = result.telemetry.step_cache["skipped_steps"]
        assert skipped and result.telemetry.cached_steps == len(skipped)
        # CFG's two passes skip together: every called step is two DiT calls, a skipped one none.
        assert calls == result.telemetry.dit_calls == 2 * (STEPS - len(skipped))
    assert len(permissive.telemetry.step_cache["skipped_steps"]) > len(default.telemetry.step_cache["skipped_steps"])
    # The bound: at MagCache's threshold (0.12) the final latents stay within 0.15 relative L2 of the reference's,
    # video and audio alike (a different seed's latents are ~1.1 away). The tiny model's random weights do not follow
    # the magnitude law, so this holds the plumbing (the last called prediction reused, both streams, both
    # branches), and skipping more costs more: the permissive run is further from the reference.
    for stream in ("video", "audio"):
        err_default = _relative(default.latents[stream], ref.latents[stream])
        err_permissive = _relative(permissive.latents[stream], ref.latents[stream])
        assert 0.0 < err_default < 0.15, (stream, err_default)
        assert err_permissive > err_default, (stream, err_permissive, err_default)


def test_first_and_last_steps_always_run(runs) -> None:
    retained = int(STEPS * 0.2)
    for name in ("default", "permissive"):
        record = runs[name][0].telemetry.step_cache
        skipped = record["skipped_steps"]
        assert min(skipped) >= retained and max(skipped) <= STEPS - 2, (name, skipped)
        decisions = record["decisions"]
        assert [d["step"] for d in decisions] == list(range(STEPS))
        assert [d["why"] for d in decisions[:retained]] == ["first"] * retained and decisions[-1]["why"] == "last"
        # Every called step after a skipped run measured how far this request's ratios were from the calibration.
        assert all("drift" in d for d in decisions[1:] if d["called"])
    # The permissive run is held by the first and last steps only (max skip 10): it skips everything between.
    assert runs["permissive"][0].telemetry.step_cache["skipped_steps"] == list(range(retained, STEPS - 1))


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("K6_STEP_CACHE", "teacache"),
        ("K6_STEP_CACHE", "on"),
        ("K6_STEP_CACHE_THRESHOLD", "-0.1"),
        ("K6_STEP_CACHE_THRESHOLD", "1.5"),
        ("K6_STEP_CACHE_THRESHOLD", "nan"),
        ("K6_STEP_CACHE_MAX_SKIP", "0"),
        ("K6_STEP_CACHE_MAX_SKIP", "2.5"),
        ("K6_STEP_CACHE_RETENTION", "1.2"),
        ("K6_STEP_CACHE_RETENTION", "-1"),
    ],
)
def test_invalid_switch_values_are_refused_naming_the_variable(name, value) -> None:
    with pytest.raises(SwitchError, match=rf"Unable to use {name}={value!r}: expected "):
        load_options(environ={name: value})


def test_refused_without_a_calibration_naming_how_to_make_one(tiny_checkpoints, tmp_path) -> None:
    ckpt = open_checkpoint(tiny_checkpoints["base"])
    options = Options().replace(step_cache="magcache", step_cache_dir=tmp_path)
    with pytest.raises(RequestError, match=r"no calibration for this checkpoint at 10 steps.*K6_STEP_CACHE=calibrate"):
        resolve_request(ckpt, options, REQUEST)
    # A schedule too short to skip anything (step 0 and the last step always run) needs none: the server's
    # two-step warm-up runs.
    assert resolve_request(ckpt, options, Request(prompt="warm-up", width=32, height=32, frames=5, steps=2))
    # Threshold 0 cannot skip either.
    assert resolve_request(ckpt, options.replace(step_cache_threshold=0.0), REQUEST) == (STEPS, 5.0)


def test_a_calibration_that_does_not_fit_the_request_is_refused(runs, tiny_checkpoints) -> None:
    ckpt = open_checkpoint(tiny_checkpoints["base"])
    options = Options().replace(step_cache="magcache", step_cache_dir=runs["calibrations"])
    assert resolve_request(ckpt, options, REQUEST) == (STEPS, 5.0)
    with pytest.raises(RequestError, match="no calibration for this checkpoint at 12 steps"):
        resolve_request(ckpt, options, Request(prompt="x", width=32, height=32, frames=5, steps=12))
    [path] = runs["calibrations"].iterdir()
    data = json.loads(path.read_text())
    del data["ratios"]["audio.uncond"]
    data["cosine_distance"].pop("audio.uncond")
    broken = ckpt.root.parent / "broken-calibration"
    broken.mkdir(exist_ok=True)
    (broken / path.name).write_text(json.dumps(data))
    with pytest.raises(RequestError, match="calibrated without audio.uncond"):
        resolve_request(ckpt, options.replace(step_cache_dir=broken), REQUEST)
    # Without audio the calibration still holds every series the request produces.
    silent = Request(prompt="x", width=32, height=32, frames=5, steps=STEPS, audio=False)
    assert resolve_request(ckpt, options.replace(step_cache_dir=broken), silent) == (STEPS, 5.0)
    data["checkpoint"] = "0" * 16
    (broken / path.name).write_text(json.dumps(data))
    with pytest.raises(RequestError, match=r"calibrates checkpoint 0{16} at 10 steps, expected"):
        resolve_request(ckpt, options.replace(step_cache_dir=broken), silent)


def test_refused_on_a_distilled_checkpoint(tiny_checkpoints, tmp_path) -> None:
    distilled = open_checkpoint(tiny_checkpoints["distill"])
    request = Request(prompt="x", width=32, height=32, frames=5)
    for mode in ("magcache", "calibrate"):
        with pytest.raises(RequestError, match=rf"K6_STEP_CACHE={mode} is for base checkpoints.*distilled"):
            resolve_request(distilled, Options().replace(step_cache=mode, step_cache_dir=tmp_path), request)
    # Beside K6_PIFLOW_CACHE_STEPS on a base checkpoint it runs alone: that cache is the distilled schedule's.
    base = open_checkpoint(tiny_checkpoints["base"])
    both = Options().replace(step_cache="calibrate", piflow_cache_steps=(3,), step_cache_dir=tmp_path)
    steps, guidance = resolve_request(base, both, REQUEST)
    assert steps == STEPS
    # Alone (K6_STEP_CACHE off), it is not applied on a base checkpoint, at a step count it would not even fit; on a
    # distilled one it is.
    final = load_options(environ={}, arm="final")
    short = Request(prompt="x", width=32, height=32, frames=5, steps=4)
    assert resolve_request(base, final, short) == (4, 5.0)
    assert plan_run(base, final, 4, 5.0, True).fixed == ()
    assert plan_run(distilled, final, 10, 1.0, True).fixed == final.piflow_cache_steps == (8,)
    with pytest.raises(RequestError, match="outside the schedule"):
        resolve_request(distilled, final, short)


def test_fast_base_arm_refuses_distilled_checkpoints(tiny_checkpoints) -> None:
    options = load_options(environ={}, arm="fast-base")
    assert options.step_cache == "magcache" and options.piflow_cache_steps == ()
    with pytest.raises(RequestError, match="K6_STEP_CACHE=magcache is for base checkpoints"):
        resolve_request(open_checkpoint(tiny_checkpoints["distill"]), options, Request(prompt="x", width=32, height=32))
    # On a base checkpoint it asks for the calibration (none is beside the shared tiny checkpoint).
    with pytest.raises(RequestError, match="K6_STEP_CACHE=calibrate"):
        resolve_request(open_checkpoint(tiny_checkpoints["base"]), options, Request(prompt="x", width=32, height=32))


def test_the_error_model_by_hand() -> None:
    """MagCache's rule on a made-up curve: each skip multiplies the ratios since the last called step and adds
    |1 - product| to the run's error; the series furthest from 1 decides for all of them."""
    steady = [1.0] * 10
    falling = [1.0] + [0.9] * 9
    cache = MagCache({"video.cond": steady, "audio.uncond": falling}, 10, threshold=0.5, max_skip=5, retention=0.2)
    called = [cache.call(step) for step in range(10)]
    # Steps 0-1 retained; 2: 0.1, 3: 0.1 + 0.19 = 0.29 skip; 4: 0.29 + 0.271 = 0.561 >= 0.5 runs, and so on; 9 last.
    assert [s for s, c in enumerate(called) if not c] == [2, 3, 5, 6, 8] == cache.skipped_steps
    assert cache.record[4] == {"step": 4, "called": True, "why": "error", "error": 0.561}
    capped = MagCache({"video.cond": steady}, 10, threshold=0.5, max_skip=2, retention=0.0)
    assert [s for s in range(10) if not capped.call(s)] == [1, 2, 4, 5, 7, 8]  # step 0 always runs
    strict = MagCache({"video.cond": steady}, 10, threshold=0.0, max_skip=5, retention=0.0)
    assert all(strict.call(s) for s in range(10))  # an error of exactly 0 is not under a threshold of 0


def test_the_pro_and_lite_presets_are_base_checkpoints() -> None:
    """`k6fast make-synthetic --preset pro` (or `lite`) writes what fast-base runs on: velocity heads and the
    flow-matching Euler scheduler (writing one here would be gigabytes, so the config it is built from is checked)."""
    from k6fast.testing.model_constants import SCHEDULERS
    from k6fast.testing.synthetic import PRESETS, transformer_config

    for preset in ("pro", "lite"):
        config = transformer_config(preset, None)
        assert not PRESETS[preset][1]
        assert config["out_visual_dim"] == config["in_visual_dim"] and config["out_audio_dim"] == config["in_audio_dim"]
    assert transformer_config("pro", None)["num_visual_blocks"] == 60
    assert SCHEDULERS["base"] == "FlowMatchEulerDiscreteScheduler"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_magcache_on_the_tiny_base_checkpoint(tiny_checkpoints, tmp_path) -> None:
    """The same flow on the GPU in bf16: calibrate (bit-identical to the plain run), then skip with both CFG passes."""
    pipe = Pipeline(tiny_checkpoints["base"], Options(), device="cuda")
    try:
        ref = pipe.generate(REQUEST)
        pipe.options = Options().replace(step_cache="calibrate", step_cache_dir=tmp_path)
        cal = pipe.generate(REQUEST)
        assert torch.equal(cal.latents["video"], ref.latents["video"])
        pipe.options = Options().replace(step_cache="magcache", step_cache_dir=tmp_path, step_cache_threshold=1.0)
        run = pipe.generate(REQUEST)
        skipped = run.telemetry.step_cache["skipped_steps"]
        assert skipped and run.telemetry.dit_calls == 2 * (STEPS - len(skipped))
        # At most 2 skips in a row (the default) keeps it near the reference, a different seed being ~1.1 away.
        assert _relative(run.latents["video"], ref.latents["video"]) < 0.3
    finally:
        pipe.close()


def test_a_calibration_that_cannot_be_written_is_refused_before_any_work(
    tiny_checkpoints, tmp_path, monkeypatch
) -> None:
    (tmp_path / "a-file").write_text("")
    pipe = Pipeline(tiny_checkpoints["base"], Options(), device="cpu")
    pipe.options = Options().replace(step_cache="calibrate", step_cache_dir=tmp_path / "a-file" / "calibrations")
    monkeypatch.setattr(pipe.text, "encode", lambda *a, **k: pytest.fail("text encoded"))
    with pytest.raises(RequestError, match="K6_STEP_CACHE=calibrate cannot write to .*a-file.*K6_STEP_CACHE_DIR"):
        pipe.generate(REQUEST)
