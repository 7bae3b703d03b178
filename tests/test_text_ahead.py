"""The first request's prompt encoded beside the load (`Pipeline(first_request=...)`, what `k6fast generate` does):
the same latents as a pipeline that encodes in the request, the encode's own seconds in the telemetry, and the
request encoding its prompt itself when the early encode failed or was for another prompt (tiny checkpoints, CPU)."""

from __future__ import annotations

import dataclasses
import threading
import time

import pytest
import torch

from k6fast.cli import main
from k6fast.pipeline import Pipeline, Request, RequestError, negative_prompt
from k6fast.switches import load_options
from k6fast.text_phase import TextPhase

REQUEST = Request(prompt="a kettle whistles on a gas stove", width=64, height=64, frames=9, steps=2, seed=5)


def _run(model, first_request: Request | None, request: Request = REQUEST):
    pipe = Pipeline(model, load_options(environ={}), device="cpu", first_request=first_request)
    try:
        return pipe.generate(request)
    finally:
        pipe.close()


@pytest.mark.parametrize("variant", ["distill", "base"])  # without and with CFG (a negative prompt)
def test_an_encode_at_load_gives_the_latents_of_one_in_the_request(tiny_checkpoints, variant) -> None:
    model = tiny_checkpoints[variant]
    inline = _run(model, None)
    ahead = _run(model, REQUEST)
    for name in inline.latents:
        assert torch.equal(inline.latents[name], ahead.latents[name]), name
    assert inline.telemetry.text_ahead_s is None and inline.telemetry.text_source == "encoded"
    assert ahead.telemetry.text_source == "encoded"  # encoded, not a cache hit, and its seconds are the encode's
    assert ahead.telemetry.text_ahead_s > 0
    assert ahead.telemetry.text_bytes_streamed == inline.telemetry.text_bytes_streamed > 0
    assert "text_ahead_s" in ahead.telemetry.as_dict() and "text_ahead_s" not in inline.telemetry.as_dict()


def test_another_prompt_is_encoded_in_the_request(tiny_distill) -> None:
    other = dataclasses.replace(REQUEST, prompt="rain on a tin roof")
    result = _run(tiny_distill, REQUEST, other)
    assert result.telemetry.text_ahead_s is None
    assert result.telemetry.text_source == "encoded"


def test_a_failed_encode_at_load_is_done_again_in_the_request(tiny_distill, monkeypatch, caplog) -> None:
    real, calls = TextPhase.encode_with_stats, []

    def fail_first(self, prompt, negative=None, pad_to=None):
        calls.append(prompt)
        if len(calls) == 1:
            raise torch.OutOfMemoryError("CUDA out of memory (stand-in)")
        return real(self, prompt, negative, pad_to)

    monkeypatch.setattr(TextPhase, "encode_with_stats", fail_first)
    result = _run(tiny_distill, REQUEST)
    assert calls == [REQUEST.prompt, REQUEST.prompt]
    assert result.telemetry.text_ahead_s is None and result.telemetry.text_source == "encoded"
    assert "encoding the prompt during the load failed" in caplog.text


def test_the_negative_prompt_follows_guidance() -> None:
    assert negative_prompt(REQUEST, 1.0) is None
    custom = dataclasses.replace(REQUEST, negative_prompt="blurry")
    assert negative_prompt(custom, 5.0) == "blurry"
    assert negative_prompt(REQUEST, 5.0)  # the default negative prompt under CFG


def test_an_error_after_the_load_waits_for_the_encode(tiny_distill, tmp_path, monkeypatch) -> None:
    """`generate` refusing its request once loaded (here a stand-in refusal) returns only after the encode's thread
    has ended: no thread may run into the interpreter's shutdown."""
    real = TextPhase.encode_with_stats

    def slow(self, *args, **kwargs):
        time.sleep(1.5)  # longer than the tiny load: the thread is still encoding when the refusal comes
        return real(self, *args, **kwargs)

    def refuse(self, request):
        raise RequestError("refused after the load (stand-in)")

    monkeypatch.setattr(TextPhase, "encode_with_stats", slow)
    monkeypatch.setattr(Pipeline, "resolve", refuse)
    started = time.perf_counter()
    args = ["generate", "--model", str(tiny_distill), "--prompt", "a gong", "--size", "32x32", "--frames", "9",
            "--steps", "2", "--out", str(tmp_path / "x.mp4")]  # fmt: skip
    assert main(args) == 2
    assert not any(t.name == "k6-text-ahead" and t.is_alive() for t in threading.enumerate())
    assert time.perf_counter() - started >= 1.5
