"""A measurement of a long schedule's per-step cost (`generate --stop-after-steps`, `acceptance --stop-after-steps`):
the first steps of the schedule, then the decode, in k6fast and in the peer alike."""

from __future__ import annotations

import pytest
import torch

from k6fast.bench.acceptance import Run, Workload, generate_command, peer_command
from k6fast.bench.acceptance_report import render_table
from k6fast.bench.peers import PhaseClock
from k6fast.pipeline import Pipeline, Request, RequestError
from k6fast.switches import load_options


def test_a_request_runs_the_first_steps_of_its_schedule_then_decodes(tiny_distill) -> None:
    pipe = Pipeline(tiny_distill, load_options(environ={}), device="cpu")
    try:
        request = Request(prompt="a lighthouse in fog", width=64, height=64, frames=9, steps=10)
        full_steps = []
        full = pipe.generate(request, on_step=lambda event: full_steps.append(event.index))
        part = pipe.generate(request, stop_after_steps=3)
        assert len(part.telemetry.step_seconds) == 3 and part.telemetry.dit_calls == 3
        assert part.telemetry.as_dict()["stopped_after_steps"] == [3, 10]
        assert "stopped_after_steps" not in full.telemetry.as_dict() and full_steps == list(range(10))
        assert part.frames.shape == full.frames.shape  # decoded all the same: the decode's cost is in the request
        assert not torch.equal(part.latents["video"], full.latents["video"])
        for wrong in (0, 11):
            with pytest.raises(RequestError, match=f"stop after {wrong} steps: expected 1..10"):
                pipe.generate(request, stop_after_steps=wrong)
    finally:
        pipe.close()


def test_the_peer_is_stopped_by_diffusers_own_interrupt_after_as_many_steps(capsys) -> None:
    from diffusers import Kandinsky6TI2VAPipeline

    clock = PhaseClock(torch.device("cpu"), stop_after=2)
    pipe = object.__new__(Kandinsky6TI2VAPipeline)  # its `interrupt` property is what its denoising loop reads
    clock.on_step(pipe, 0, None, {})
    assert getattr(pipe, "interrupt", False) is False
    clock.on_step(pipe, 1, None, {})
    assert pipe.interrupt is True and len(clock.telemetry.step_seconds) == 2
    # Each step's seconds on stderr as it ends: what a run killed at its timeout leaves in the record.
    lines = capsys.readouterr().err.splitlines()
    assert [line.split(" in ")[0] for line in lines] == ["peer: step 1", "peer: step 2"]
    assert all(float(line.split(" in ")[1].removesuffix(" s")) >= 0 for line in lines)


def test_the_acceptance_stops_every_run_and_says_so(tmp_path) -> None:
    w = Workload(model="/m", geometry="64x64x5", prompt="p", seed=1, steps=50, guidance=5.0, stop_after_steps=4)
    cmd = generate_command(Run("final", 32, "cold"), w, tmp_path, "python3")
    assert cmd[cmd.index("--stop-after-steps") + 1] == "4"
    peer_command(Run("diffusers-offload", 32, "cold"), w, tmp_path, "python3")
    assert '"stop_after_steps": 4' in (tmp_path / "spec.json").read_text()
    whole = Workload(model="/m", geometry="64x64x5", prompt="p", seed=1, steps=50, guidance=5.0)
    assert "--stop-after-steps" not in generate_command(Run("final", 32, "cold"), whole, tmp_path, "python3")
    table = render_table([], {"model": "/m", "steps": 50, "stop_after_steps": 4})
    assert "denoised only the first 4 of its 50 steps" in table
    assert "denoised only" not in render_table([], {"model": "/m", "steps": 50})


def test_the_peer_may_stop_after_fewer_steps_than_the_arms_and_the_record_says_so(tmp_path) -> None:
    w = Workload(model="/m", geometry="64x64x5", prompt="p", seed=1, steps=50, guidance=5.0, stop_after_steps=19,
                 peer_stop_after_steps=10)  # fmt: skip
    cmd = generate_command(Run("final", 32, "cold"), w, tmp_path, "python3")
    assert cmd[cmd.index("--stop-after-steps") + 1] == "19"
    peer_command(Run("diffusers-offload", 32, "cold"), w, tmp_path, "python3")
    assert '"stop_after_steps": 10' in (tmp_path / "spec.json").read_text()
    peer = [{"run": "diffusers-offload @ 32 GiB, cold", "arm": "diffusers-offload", "passed": True}]
    both = {"model": "/m", "steps": 50, "stop_after_steps": 19, "peer_stop_after_steps": 10}
    table = render_table(peer, both)
    assert "every run denoised only the first 19 of its 50 steps" in table and "the peer its first 10" in table
    # A part that ran no peer says nothing of the peer's stop.
    assert "every run denoised only the first 19 of its 50 steps (" in render_table([], both)
    alone = render_table(peer, {"model": "/m", "steps": 50, "peer_stop_after_steps": 10})
    assert "the peer denoised only the first 10 of its 50 steps" in alone and "every run" not in alone
    same = render_table(peer, {"model": "/m", "steps": 50, "stop_after_steps": 4, "peer_stop_after_steps": 4})
    assert "every run (the peer's too) denoised only the first 4 of its 50 steps" in same


def test_the_part_that_runs_the_peer_records_its_stop(tmp_path, monkeypatch) -> None:
    """A session run in parts: the peer's part may set its own stop; the record's plan says it."""
    import json

    import k6fast.bench.acceptance as acceptance

    monkeypatch.setattr(
        acceptance, "execute", lambda run, w, **kw: {"run": run.name, "arm": run.arm, "passed": True, "process_s": 1.0}
    )
    base = dict(model="/m", geometry="64x64x5", prompt="p", seed=1, steps=50, guidance=5.0, stop_after_steps=19)
    out, work = tmp_path / "rec", tmp_path / "work"
    acceptance.run_acceptance([Run("final", 32, "cold")], Workload(**base), out=out, work=work, log=lambda _: None)
    peer_part = Workload(**base, peer_model="/m-peer", peer_stop_after_steps=10)
    acceptance.run_acceptance([Run("diffusers-offload", 32, "cold")], peer_part, out=out, work=work, log=lambda _: None)
    plan = json.loads((out / "acceptance.json").read_text())
    assert plan["parts"] == 2 and plan["peer_stop_after_steps"] == 10 and plan["stop_after_steps"] == 19
    assert "the peer its first 10 (`--peer-stop-after-steps`)" in (out / "README.md").read_text()
