"""The PiFlow step cache (K6_PIFLOW_CACHE_STEPS): skipped DiT calls, bit-identical latents up to the cached step."""

from __future__ import annotations

import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler, PiflowScheduler
from pipeline_testing import CountingDiT

from k6fast.checkpoint import open_checkpoint
from k6fast.pipeline import Pipeline, Request, RequestError
from k6fast.step_cache import fixed_cache_note, fixed_cache_steps
from k6fast.switches import Options

REQUEST = Request(prompt="Rain on a tin roof, thunder far away", width=32, height=32, frames=5, steps=10, seed=3)


def _run(path, options: Options, request: Request, monkeypatch, scheduler_cls=PiflowScheduler):
    """Generate and record the latents the scheduler sees before every step."""
    pipe = Pipeline(path, options, device="cpu")
    pipe.dit = CountingDiT(pipe.dit)
    seen: list[torch.Tensor] = []
    original = scheduler_cls.step

    def recording_step(self, model_output, timestep, sample, return_dict=True):
        if sample.ndim == 5:  # the video scheduler; the audio one gets [B, L, C]
            seen.append(sample.clone())
        return original(self, model_output, timestep, sample, return_dict=return_dict)

    monkeypatch.setattr(scheduler_cls, "step", recording_step)
    result = pipe.generate(request)
    monkeypatch.setattr(scheduler_cls, "step", original)
    return pipe.dit.calls, seen, result


def test_cached_step_skips_the_dit_and_keeps_earlier_latents(tiny_distill, monkeypatch) -> None:
    ref_calls, ref_latents, ref = _run(tiny_distill, Options(), REQUEST, monkeypatch)
    cached = Options().replace(piflow_cache_steps=(8,))
    calls, latents, result = _run(tiny_distill, cached, REQUEST, monkeypatch)
    assert ref_calls == 10 and calls == 9
    assert len(latents) == len(ref_latents) == 10
    for step in range(9):  # the latents entering steps 0..8 were made before any cached prediction was used
        assert torch.equal(latents[step], ref_latents[step]), f"latents before step {step} differ"
    assert not torch.equal(latents[9], ref_latents[9])
    assert "9 DiT steps" in result.telemetry.summary() and "10 DiT steps" in ref.telemetry.summary()
    assert result.telemetry.cached_steps == 1


def test_a_base_checkpoint_does_not_apply_the_distilled_schedules_cache(tiny_checkpoints, monkeypatch) -> None:
    """`final` sets step 8 for the 10-step distilled schedule; on a 50-step Euler + CFG checkpoint that step lies in
    the first 20 % MagCache never skips, so a base checkpoint runs every step and says why."""
    base = open_checkpoint(tiny_checkpoints["base"])
    request = Request(prompt="A dog barks twice", width=32, height=32, frames=5, steps=4, guidance=5.0, seed=1)
    cached = Options().replace(piflow_cache_steps=(2, 3))
    ref_calls, ref_latents, ref = _run(base, Options(), request, monkeypatch, FlowMatchEulerDiscreteScheduler)
    calls, latents, result = _run(base, cached, request, monkeypatch, FlowMatchEulerDiscreteScheduler)
    assert calls == ref_calls == 8  # four steps x (cond + uncond)
    assert result.telemetry.cached_steps == 0 and result.telemetry.step_called == [True] * 4
    assert all(torch.equal(a, b) for a, b in zip(latents, ref_latents, strict=True))
    assert all(torch.equal(result.latents[k], ref.latents[k]) for k in ref.latents) and ref.latents
    assert fixed_cache_steps(base, cached) == () and fixed_cache_note(base, Options()) is None
    assert "K6_PIFLOW_CACHE_STEPS=2,3 not applied" in (fixed_cache_note(base, cached) or "")
    distilled = open_checkpoint(tiny_checkpoints["distill"])
    assert fixed_cache_steps(distilled, cached) == (2, 3) and fixed_cache_note(distilled, cached) is None


@pytest.mark.parametrize(
    ("steps", "message"),
    [((0,), "step 0 cannot be cached"), ((10,), "outside the schedule"), ((3, 12), "outside the schedule")],
)
def test_invalid_cache_steps_are_refused(tiny_distill, steps, message) -> None:
    pipe = Pipeline(tiny_distill, Options().replace(piflow_cache_steps=steps), device="cpu")
    with pytest.raises(RequestError, match=message):
        pipe.resolve(REQUEST)


@pytest.mark.parametrize(("kind", "warmup_steps"), [("base", 2), ("distill", 9)])
def test_the_servers_warm_up_runs_the_cached_step_only_where_it_applies(
    tiny_checkpoints, tmp_path, monkeypatch, caplog, kind, warmup_steps
) -> None:
    """The warm-up runs 2 steps, or as many as reach the last cached step where the checkpoint applies the cache (so
    the cached path is warmed too); a base checkpoint's server says the cache is not applied."""
    import logging

    from k6fast.server.config import ServerConfig
    from k6fast.server.worker import load_pipeline

    seen: list[int | None] = []
    original = Pipeline.generate
    monkeypatch.setattr(Pipeline, "generate", lambda self, request, **kw: seen.append(request.steps) or original(
        self, request, **kw))  # fmt: skip
    config = ServerConfig(model=str(tiny_checkpoints[kind]), served_model_name="k6", data_dir=tmp_path, device="cpu")
    with caplog.at_level(logging.INFO, logger="k6fast.server"):
        pipeline = load_pipeline(config, Options().replace(piflow_cache_steps=(8,)))
    pipeline.close()
    assert seen == [warmup_steps]
    assert ("K6_PIFLOW_CACHE_STEPS=8 not applied" in caplog.text) == (kind == "base")
