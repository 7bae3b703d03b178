"""Arms that say what they rest on: the dense last step (K6_EXACT_ATTN_LAST_STEPS) in the attention policy and the
sampler, and the packaged arms' sparse settings keeping their first and last steps dense."""

from __future__ import annotations

import pytest
import torch

from k6fast.dit.attention import AttentionDispatch
from k6fast.pipeline import Pipeline, Request
from k6fast.switches import Options, list_arms, load_options
from k6fast.switches.arms import read_arm, resolve_arm


def _lossy_steps(options: Options, num_steps: int | None, steps: int = 6, blocks: int = 4) -> list[int]:
    """The steps at which a middle block of a `blocks`-block DiT runs sparse."""
    # The sparse policy does not depend on the quantized backend; `auto` would need a device to resolve.
    policy = AttentionDispatch(options.replace(attn="exact"), torch.device("cpu"))
    lossy = []
    for step in range(steps):
        policy.begin_step(step, num_steps)
        if policy.sparsifies_block(blocks // 2, blocks):
            lossy.append(step)
    return lossy


def test_the_last_steps_stay_exact_when_the_schedule_length_is_known() -> None:
    options = Options().replace(sparse_attn=0.5, exact_attn_blocks=1, exact_attn_steps=1, exact_attn_last_steps=2)
    assert _lossy_steps(options, num_steps=6) == [1, 2, 3]
    # A caller that does not say the schedule's length (a bench block visit at one step) gets the first-steps rule.
    assert _lossy_steps(options, num_steps=None) == [1, 2, 3, 4, 5]
    assert _lossy_steps(options.replace(exact_attn_last_steps=0), num_steps=6) == [1, 2, 3, 4, 5]


@pytest.mark.parametrize("arm", list_arms())
def test_every_sparse_arm_keeps_its_first_and_last_steps_dense(arm: str) -> None:
    options = load_options(environ={}, arm=arm)
    if options.sparse_attn > 0.0:
        assert options.exact_attn_steps >= 1 and options.exact_attn_last_steps >= 1, arm
        schedules = {n: _lossy_steps(options, num_steps=n, steps=n, blocks=60) for n in (10, 50)}  # distilled, base
        assert any(schedules.values()), arm  # the arm's sparse attention runs somewhere
        for num_steps, lossy in schedules.items():
            assert 0 not in lossy and num_steps - 1 not in lossy, (arm, num_steps, lossy)


def test_fast_says_its_sparse_setting_is_unproven_and_how_to_find_a_safe_one() -> None:
    text = resolve_arm("fast").read_text(encoding="utf-8")
    comments = " ".join(line[1:].strip() for line in text.splitlines() if line.startswith("#"))
    assert "UNPROVEN on a 10-step distilled model" in comments
    for source in ("2508.10774", "sub-10 step", "radial-attention #51", "SVG2", "k6fast tune"):
        assert source in comments, source
    assert read_arm(resolve_arm("fast"))["K6_EXACT_ATTN_LAST_STEPS"] == "1"


class StepRecorder:
    """Wraps the pipeline's DiT and records what the sampler announces before each call."""

    def __init__(self, dit):
        self.dit, self.announced = dit, []

    def begin_step(self, step: int, num_steps: int | None = None) -> None:
        self.announced.append((step, num_steps))
        self.dit.begin_step(step, num_steps)

    def __call__(self, **kwargs):
        return self.dit(**kwargs)


def test_the_sampler_announces_the_schedule_length_with_each_step(tiny_distill) -> None:
    pipe = Pipeline(tiny_distill, Options().replace(piflow_cache_steps=(2,)), device="cpu")
    pipe.dit = StepRecorder(pipe.dit)
    pipe.generate(Request(prompt="Waves on rocks, gulls calling", width=32, height=32, frames=5, steps=4, seed=1))
    assert pipe.dit.announced == [(0, 4), (1, 4), (3, 4)]  # step 2 is cached: no DiT call, nothing announced
