"""The streaming runtime on CPU: reader, planner, slot rotation; streamed output bit-identical to resident."""

from __future__ import annotations

import pytest
import torch
from dit_testing import dit_inputs, tiny_dit
from safetensors import safe_open

from k6fast.checkpoint import open_checkpoint
from k6fast.safetensors_index import index_safetensors
from k6fast.stream.plan import RESERVE_BYTES, GiB, plan_residency
from k6fast.stream.reader import FileReader, torch_dtype


def test_reader_returns_the_file_bytes(tiny_distill) -> None:
    ckpt = open_checkpoint(tiny_distill)
    index = index_safetensors(ckpt.transformer_files)
    reader = FileReader({loc.file for loc in index.values()})
    try:
        for file in ckpt.transformer_files:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118
                    loc = index[name]
                    buf = torch.empty(loc.nbytes + 16, dtype=torch.uint8)
                    reader.read_into(buf, [(loc, 16)])
                    got = buf[16:].view(torch_dtype(loc)).view(loc.shape)
                    assert torch.equal(got, f.get_tensor(name))
    finally:
        reader.close()


@pytest.mark.parametrize(("max_resident", "prefetch"), [(0, 1), (1, 1), (0, 2)])
def test_streamed_forward_is_bit_identical_to_resident(tiny_distill, max_resident: int, prefetch: int) -> None:
    ckpt = open_checkpoint(tiny_distill)
    resident = tiny_dit(ckpt)
    streamed = tiny_dit(ckpt, max_resident=max_resident, prefetch=prefetch)
    try:
        assert resident.streamer is None and streamed.streamer is not None
        assert streamed.plan.resident_blocks == max_resident
        for seed in range(3):  # several forwards: the slots rotate through the cycle
            kwargs = dit_inputs(ckpt.dit, seed)
            a, b = resident.dit(**kwargs), streamed.dit(**kwargs)
            assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    finally:
        resident.close()
        streamed.close()


def test_an_interrupted_forward_does_not_desynchronise_the_stream(tiny_distill) -> None:
    ckpt = open_checkpoint(tiny_distill)
    resident, streamed = tiny_dit(ckpt), tiny_dit(ckpt, max_resident=0)
    try:
        blocks = streamed.dit.blocks
        blocks.begin_forward()
        blocks.get(0)
        blocks.release(0)  # stop after one of two streamed blocks, as a cancelled request would
        kwargs = dit_inputs(ckpt.dit, 5)
        assert torch.equal(resident.dit(**kwargs)[0], streamed.dit(**kwargs)[0])
        with pytest.raises(RuntimeError, match="requested"):
            streamed.dit.blocks.streamer.get(1)  # out of order: the stream holds block 0 next
    finally:
        resident.close()
        streamed.close()


def test_planner_keeps_what_fits_and_streams_the_rest() -> None:
    block, fixed, act = GiB, 2 * GiB, 6 * GiB
    plan = plan_residency(budget_bytes=32 * GiB, fixed_bytes=fixed, block_bytes=block, num_blocks=60,
                          activation_bytes=act)  # fmt: skip
    # 32 - 2 fixed - 6 activations - reserve = 22 GiB: 2 slots and 20 resident blocks.
    assert plan.slots == 2 and plan.resident_blocks == (32 * GiB - fixed - act - RESERVE_BYTES) // block - 2
    assert plan.weight_bytes + act + RESERVE_BYTES <= 32 * GiB
    assert "streamed: 40 blocks through 2 device slots" in plan.describe()
    everything = plan_residency(budget_bytes=139 * GiB, fixed_bytes=fixed, block_bytes=block, num_blocks=60,
                                activation_bytes=act)  # fmt: skip
    assert everything.resident_blocks == 60 and everything.slots == 0
    capped = plan_residency(budget_bytes=139 * GiB, fixed_bytes=fixed, block_bytes=block, num_blocks=12,
                            activation_bytes=act, max_resident=4, prefetch=2)  # fmt: skip
    assert capped.resident_blocks == 4 and capped.slots == 3 and capped.streamed_blocks == 8


def test_planner_refuses_a_budget_too_small_to_stream() -> None:
    with pytest.raises(ValueError, match="cannot hold.*at least"):
        plan_residency(budget_bytes=8 * GiB, fixed_bytes=2 * GiB, block_bytes=GiB, num_blocks=60,
                       activation_bytes=6 * GiB)  # fmt: skip
    with pytest.raises(ValueError, match="prefetch"):
        plan_residency(budget_bytes=80 * GiB, fixed_bytes=0, block_bytes=GiB, num_blocks=4, activation_bytes=0,
                       prefetch=0)  # fmt: skip


def test_bf16_streamed_forward_matches_resident_and_fp32(tiny_distill) -> None:
    # The GPU path runs bf16 with fp32 modulation/time/pooled layers; this checks the dtype plumbing on CPU.
    ckpt = open_checkpoint(tiny_distill)
    fp32 = tiny_dit(ckpt, "cpu", torch.float32)
    bf16 = tiny_dit(ckpt, "cpu", torch.bfloat16)
    streamed = tiny_dit(ckpt, "cpu", torch.bfloat16, max_resident=0)
    try:
        assert bf16.dit.weights["video_time_embeddings.timestep_embedder.linear_1.weight"].dtype == torch.float32
        assert bf16.dit.weights["video_pooled_text_embeddings.in_layer.weight"].dtype == torch.float32
        assert bf16.dit.weights["visual_embeddings.in_layer.weight"].dtype == torch.bfloat16
        kwargs = {k: v.to(torch.bfloat16) if v.is_floating_point() and k != "timestep" else v
                  for k, v in dit_inputs(ckpt.dit, 2).items()}  # fmt: skip
        ref = fp32.dit(**dit_inputs(ckpt.dit, 2))
        a, b = bf16.dit(**kwargs), streamed.dit(**kwargs)
        assert a[0].dtype == torch.bfloat16
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
        for got, want in zip(a, ref, strict=True):
            assert ((got.float() - want).norm() / want.norm()).item() < 0.05
    finally:
        for rt in (fp32, bf16, streamed):
            rt.close()


def test_the_text_phase_never_evicts_the_dit_and_a_repeated_prompt_is_not_encoded_again(tiny_distill) -> None:
    """The text phase runs in the room the denoising activations take later (the plan keeps the larger of the two
    free), so the DiT stays loaded across requests even on a budget with no room to spare; a repeated prompt comes
    from the prompt cache, streaming no weights."""
    from k6fast.pipeline import Pipeline, Request
    from k6fast.stream.plan import RESERVE_BYTES
    from k6fast.switches import Options

    geometry = (32, 32, 5)
    request = Request(prompt="A kettle whistles", width=32, height=32, frames=5, steps=2)
    roomy = Pipeline(tiny_distill, Options(), device="cpu", plan_geometry=geometry)
    expected = roomy.generate(request)
    plan = roomy.runtime.plan
    assert plan.text_bytes == roomy.text.device_bytes() > 0
    # Exactly the streaming minimum beside the larger of the text phase and the activations.
    budget = plan.fixed_bytes + 2 * plan.block_bytes + max(plan.activation_bytes, plan.text_bytes) + RESERVE_BYTES
    tight = Pipeline(tiny_distill, Options().replace(vram_budget_gb=budget / 2**30), device="cpu",
                     plan_geometry=geometry)  # fmt: skip
    try:
        runtime = tight.runtime
        first, second = tight.generate(request), tight.generate(request)
        assert tight.runtime is runtime and "dit_load" not in first.telemetry.phases  # the DiT never left
        assert first.telemetry.text_source == "encoded" and first.telemetry.text_bytes_streamed > 0
        assert second.telemetry.text_source == "memory" and second.telemetry.text_bytes_streamed == 0
        assert (first.frames == expected.frames).all() and (second.frames == expected.frames).all()
    finally:
        roomy.close()
        tight.close()


def test_plan_counts_resident_modulation_layers_in_fp32(tiny_distill) -> None:
    # Resident blocks hold their modulation layers in fp32; the plan must count them so, or a full-depth Pro plan
    # would overrun its budget by ≈ 150 MB per resident block.
    from k6fast.stream.plan import index_footprint

    ckpt = open_checkpoint(tiny_distill)
    index = index_safetensors(ckpt.transformer_files)
    stored = sum(loc.nbytes for name, loc in index.items() if name.startswith("visual_transformer_blocks.0."))
    modulation = sum(
        loc.elements
        for name, loc in index.items()
        if name.startswith("visual_transformer_blocks.0.") and "modulation." in name
    )
    _, block_bf16 = index_footprint(index, ckpt.dit.num_visual_blocks, torch.bfloat16.itemsize)
    # The tiny checkpoint is stored in fp32: in bf16 every tensor halves except the modulation layers.
    assert block_bf16 == (stored - 4 * modulation) // 2 + 4 * modulation
