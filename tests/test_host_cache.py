"""The host tier of streamed blocks (K6_HOST_CACHE_GB): weights and outputs bit-identical to streaming without it, each
tier block read from its files once across many forwards and the other streamed blocks once per forward, the `auto`
and numeric settings' arithmetic, and cancellation mid-cycle. On CPU the tier's buffers are plain; the CUDA path
(page-locked buffers, copy-stream events) is the `gpu` tests'."""

from __future__ import annotations

import dataclasses
import gc
import threading
from collections import Counter
from pathlib import Path

import pytest
import torch
from dit_testing import TOKENS, dit_inputs, tiny_dit
from safetensors.torch import save_file

from k6fast.checkpoint import open_checkpoint
from k6fast.dit.config import block_prefix
from k6fast.memory import HOST_OS_BYTES, PROCESS_HOST_BYTES, HostMemory
from k6fast.safetensors_index import index_safetensors
from k6fast.stream.host_cache import HostBlockCache
from k6fast.stream.page_locked import LockedBuffers, staging_buffers
from k6fast.stream.plan import GiB, HostCacheError, block_of, disk_bytes_per_step, plan_host_cache
from k6fast.stream.reader import FileReader
from k6fast.stream.streamer import BlockLayout, BlockStreamer
from k6fast.switches import SWITCHES_BY_NAME, SwitchError
from k6fast.telemetry import anon_rss_bytes

NUM_BLOCKS = 6
FIRST_STREAMED = 1  # blocks 1..5 stream
TIER = (4, 5)  # the last two streamed blocks
FORWARDS = 4
SLOTS = 2
# A host where nothing else competes: MemAvailable far above anything a test streams.
ROOMY = HostMemory(1 << 40, 1 << 40)


def _host_with_room(room_bytes: int) -> HostMemory:
    """A host whose page cache and host tier may take exactly `room_bytes` beside the process and the OS."""
    return HostMemory(1 << 40, room_bytes + PROCESS_HOST_BYTES + HOST_OS_BYTES)


class CountingReader(FileReader):
    """A FileReader that counts, per fused block, how many times a block's tensors are read."""

    def __init__(self, files: set[Path]):
        super().__init__(files)
        self.reads: Counter[int] = Counter()
        self._lock = threading.Lock()

    def read_into(self, buffer: torch.Tensor, pieces) -> None:
        with self._lock:
            self.reads.update({block_of(loc.name) for loc, _ in pieces})
        super().read_into(buffer, pieces)


@pytest.fixture(scope="module")
def blocks_file(tmp_path_factory) -> tuple[Path, dict[int, dict[str, torch.Tensor]]]:
    """A checkpoint of NUM_BLOCKS fused blocks of unequal sizes (odd shapes, so the slots' alignment is exercised)."""
    g = torch.Generator().manual_seed(0)
    tensors, expected = {}, {}
    for b in range(NUM_BLOCKS):
        own = {
            "ff.weight": torch.randn(37 + b, 29, generator=g),
            "norm.bias": torch.randn(13, generator=g),
            "modulation.out_layer.weight": torch.randn(7, 5 + b, generator=g),
        }
        expected[b] = own
        tensors.update({block_prefix(b) + name: t for name, t in own.items()})
    path = tmp_path_factory.mktemp("blocks") / "blocks.safetensors"
    save_file(tensors, str(path))
    return path, expected


def _streamer(path: Path, device: torch.device, tier: tuple[int, ...]):
    index = index_safetensors([path])
    reader = CountingReader({path})
    cache = None
    if tier:
        cache = HostBlockCache({b: BlockLayout.of(index, block_prefix(b)).nbytes for b in tier}, device)
    streamer = BlockStreamer(index, reader, NUM_BLOCKS, FIRST_STREAMED, SLOTS, device, torch.float32, cache)
    return streamer, reader, cache


def _forward(streamer: BlockStreamer, expected, device: torch.device, stop_after: int | None = None) -> dict:
    """One pass over the streamed blocks, checking each block's weights against the file's; `stop_after`: give up
    after that block has been handed out, as a forward that raises inside it does."""
    seen = {}
    streamer.begin_forward()
    for b in range(FIRST_STREAMED, NUM_BLOCKS):
        got = streamer.get(b)
        for name, want in expected[b].items():
            assert torch.equal(got[name], want.to(device)), (b, name)
        seen[b] = {name: t.cpu().clone() for name, t in got.items()}
        if b == stop_after:
            streamer.abort_forward()
            return seen
        streamer.release(b)
    return seen


def _run_streamer_cycles(blocks_file, device: torch.device) -> None:
    path, expected = blocks_file
    tiered, reader, cache = _streamer(path, device, TIER)
    plain, plain_reader, _ = _streamer(path, device, ())
    try:
        assert cache.blocks == TIER and cache.nbytes == sum(tiered.layouts[b].nbytes for b in TIER)
        for _ in range(FORWARDS):
            a, b = _forward(tiered, expected, device), _forward(plain, expected, device)
            assert a.keys() == b.keys() and all(torch.equal(a[k][n], b[k][n]) for k in a for n in a[k])
    finally:
        tiered.close()
        plain.close()
    # After the last forward the reader may already hold the next cycle's first SLOTS blocks.
    ahead = set(range(FIRST_STREAMED, FIRST_STREAMED + SLOTS))
    for block in range(FIRST_STREAMED, NUM_BLOCKS):
        if block in TIER:
            assert reader.reads[block] == 1, block  # read once, served from its host buffer ever after
        else:
            allowed = {FORWARDS, FORWARDS + 1} if block in ahead else {FORWARDS}
            assert reader.reads[block] in allowed, (block, reader.reads[block])
        assert plain_reader.reads[block] in ({FORWARDS, FORWARDS + 1} if block in ahead else {FORWARDS})
    assert 0 not in reader.reads  # the resident block is never streamed
    if device.type == "cuda":
        assert all(cache.buffer(b).is_pinned() and cache.buffer(b).data_ptr() % 4096 == 0 for b in TIER)
    cache.close()
    reader.close()
    plain_reader.close()


def test_tier_blocks_are_read_once_and_the_others_once_per_forward(blocks_file) -> None:
    _run_streamer_cycles(blocks_file, torch.device("cpu"))


def _run_cancelled_cycles(blocks_file, device: torch.device) -> None:
    path, expected = blocks_file
    streamer, reader, cache = _streamer(path, device, TIER)
    try:
        _forward(streamer, expected, device, stop_after=2)  # cancelled before the tier's first use
        _forward(streamer, expected, device, stop_after=4)  # cancelled inside the tier, after its first block
        for _ in range(2):
            _forward(streamer, expected, device)  # whole forwards after the cancellations: every weight right
        with pytest.raises(RuntimeError, match="requested"):
            streamer.get(3)  # out of order: the stream holds block 1 next
    finally:
        streamer.close()
    assert reader.reads[5] == 1 and reader.reads[4] == 1  # no cancellation made a tier block be read again
    cache.close()
    reader.close()


def test_cancellation_mid_cycle_with_tier_blocks(blocks_file) -> None:
    _run_cancelled_cycles(blocks_file, torch.device("cpu"))


def test_a_refused_lock_shortens_the_tier_from_its_start_with_one_warning(caplog) -> None:
    """Locking may fail (a locked-memory limit, a cgroup): the tier keeps the run at the end of the cycle whose every
    block was locked, gives back the others, and says so once, naming the sizes."""
    sizes = {b: 4096 * b + 8 for b in range(3, 8)}  # distinct sizes name the blocks in the fakes below
    locked, unlocked = [], []

    def lock(buffer: torch.Tensor) -> bool:
        assert buffer.data_ptr() % 4096 == 0  # page-aligned, so no locked page is shared with other memory
        locked.append(buffer.numel())
        return buffer.numel() != sizes[5]

    with caplog.at_level("WARNING", logger="k6fast.stream.host_cache"):
        cache = HostBlockCache(sizes, torch.device("cpu"), lock, lambda t: unlocked.append(t.numel()))
    assert sorted(locked) == sorted(sizes.values())
    assert cache.blocks == (6, 7) and cache.nbytes == sizes[6] + sizes[7]
    assert sorted(unlocked) == [sizes[3], sizes[4]]  # locked, but outside the run: given back at once
    (warning,) = [r.getMessage() for r in caplog.records]
    assert f"could lock only {cache.nbytes / GiB:.2f} of the {sum(sizes.values()) / GiB:.2f} GiB asked" in warning
    assert "(2 of 5 blocks)" in warning
    cache.close()
    assert sorted(unlocked) == sorted(sizes[b] for b in (3, 4, 6, 7)) and cache.blocks == ()
    caplog.clear()
    with caplog.at_level("WARNING", logger="k6fast.stream.host_cache"):
        assert HostBlockCache(sizes, torch.device("cpu"), lambda t: t.numel() != sizes[7], lambda t: None).blocks == ()
        assert HostBlockCache(sizes, torch.device("cpu"), lambda t: True, lambda t: None).blocks == tuple(sizes)
    assert len(caplog.records) == 1  # the refused one only


def test_staging_and_locked_buffers_are_exactly_the_size_asked_and_given_back() -> None:
    """The staging of every stream and the tier's buffers come from one helper: exactly the bytes asked (PyTorch's
    pinned allocator would round each up to a power of two), plain on a CPU device, page-aligned where they are
    locked, unlocked by `close`, by `drop`, or when their owner is collected without closing them."""
    cpu = torch.device("cpu")
    staging = staging_buffers(3 * 4096 + 5, 2, cpu)
    assert [b.numel() for b in staging.buffers] == [3 * 4096 + 5] * 2
    assert all(b.dtype == torch.uint8 and b.device == cpu and not b.is_pinned() for b in staging.buffers)
    staging.close()
    assert staging.buffers == []
    unlocked = []

    def unlock(t: torch.Tensor) -> None:
        unlocked.append(t.numel())

    memory = LockedBuffers([4097, 8191, 3], cpu, lambda t: t.numel() != 8191, unlock)
    assert [b.numel() for b in memory.buffers] == [4097, 8191, 3] and memory.refused == [1]
    assert all(b.data_ptr() % 4096 == 0 for b in memory.buffers)
    # The storage is the buffer itself, so `is_pinned()`, which asks about the storage's first byte, tells the
    # truth about a locked buffer (for a view into a larger allocation it answered False: the H200 found it).
    assert all(b.untyped_storage().data_ptr() == b.data_ptr() for b in memory.buffers)
    assert all(b.untyped_storage().nbytes() == b.numel() for b in memory.buffers)
    memory.close()
    # Their pages are the process's anonymous memory, what k6fast.memory counts (RssAnon), not shared memory.
    before = anon_rss_bytes()
    big = LockedBuffers([64 << 20], cpu, lambda t: t.fill_(1) is not None, unlock)
    assert anon_rss_bytes() - before >= 60 << 20
    big.close()
    unlocked.clear()
    memory = LockedBuffers([4097, 8191, 3], cpu, lambda t: t.numel() != 8191, unlock)
    memory.drop([0, 1])  # a locked one and the refused one: only the locked one is unlocked
    assert unlocked == [4097] and [b.numel() for b in memory.buffers] == [3] and memory.nbytes == 3
    memory.close()
    memory.close()
    assert unlocked == [4097, 3]
    forgotten = LockedBuffers([11], cpu, lambda t: True, unlock)
    del forgotten
    gc.collect()
    assert unlocked == [4097, 3, 11]  # never closed: unlocked when collected, no freed memory stays registered
    with pytest.raises(RuntimeError, match=r"could not page-lock 2 staging buffers of 0\.0 MiB"):
        staging_buffers(100, 2, cpu, lambda t: False, unlock)  # every lock refused
    assert unlocked == [4097, 3, 11]


def test_the_dit_with_a_host_tier_is_bit_identical_to_without(tiny_distill) -> None:
    ckpt = open_checkpoint(tiny_distill)
    index = index_safetensors(ckpt.transformer_files)
    last = ckpt.dit.num_visual_blocks - 1
    nbytes = BlockLayout.of(index, block_prefix(last)).nbytes
    one_block_gb = (nbytes + 0.5) / GiB  # exactly one block's bytes, whatever the float rounding
    resident = tiny_dit(ckpt)
    plain = tiny_dit(ckpt, max_resident=0, host_cache=0)
    tiered = tiny_dit(ckpt, max_resident=0, host_cache=one_block_gb, host=ROOMY)
    try:
        assert plain.host_cache is None and plain.plan.host_blocks == 0
        assert tiered.host_cache.blocks == (last,)  # the end of the cycle
        assert (tiered.plan.host_blocks, tiered.plan.host_bytes) == (1, nbytes)
        assert tiered.plan.as_dict()["host_bytes"] == nbytes
        assert f"host tier: the last 1 streamed blocks held in host memory ({nbytes / GiB:.2f} GiB)" in (
            tiered.plan.describe()
        )
        for seed in range(3):
            kwargs = dit_inputs(ckpt.dit, seed)
            want, a, b = resident.dit(**kwargs), plain.dit(**kwargs), tiered.dit(**kwargs)
            for x, y, z in zip(want, a, b, strict=True):
                assert torch.equal(x, y) and torch.equal(x, z)
        # A cancelled forward (stopped inside the first streamed block) leaves the tier and the cycle usable.
        blocks = tiered.dit.blocks
        blocks.begin_forward()
        blocks.get(0)
        blocks.abort_forward()
        kwargs = dit_inputs(ckpt.dit, 7)
        assert torch.equal(resident.dit(**kwargs)[0], tiered.dit(**kwargs)[0])
    finally:
        for runtime in (resident, plain, tiered):
            runtime.close()


def test_the_tier_outlives_a_refit_for_a_larger_request(tiny_distill) -> None:
    """A larger request streams more blocks (`fit` rebuilds the streamer): the tier's blocks are still the end of the
    cycle, so the same buffers, read once, serve the new streamer and every plan reports them."""
    ckpt = open_checkpoint(tiny_distill)
    last = ckpt.dit.num_visual_blocks - 1
    nbytes = BlockLayout.of(index_safetensors(ckpt.transformer_files), block_prefix(last)).nbytes
    runtime = tiny_dit(ckpt, max_resident=last, host_cache=(nbytes + 0.5) / GiB, host=ROOMY)
    reference = tiny_dit(ckpt)
    planner, large = runtime.planner, (400, 10)
    # As in test_request_planning: the larger geometry's plan is the real planner's with the residency lowered.
    runtime.planner = lambda tokens: dataclasses.replace(planner(tokens), resident_blocks=0, slots=2) \
        if tokens == large else planner(tokens)  # fmt: skip
    try:
        kwargs = dit_inputs(ckpt.dit, 3)
        want = reference.dit(**kwargs)
        assert runtime.host_cache.blocks == (last,) and runtime.plan.host_blocks == 1
        assert torch.equal(runtime.dit(**kwargs)[0], want[0])
        buffer = runtime.host_cache.buffer(last)
        assert runtime.host_cache.filled(last)
        runtime.fit(large)
        assert runtime.plan.resident_blocks == 0 and runtime.plan.host_blocks == 1
        assert runtime.streamer.host_cache is runtime.host_cache and runtime.host_cache.buffer(last) is buffer
        for _ in range(2):
            got = runtime.dit(**kwargs)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        runtime.fit(TOKENS)
        assert runtime.plan == runtime.base_plan and runtime.plan.host_bytes == nbytes
        assert torch.equal(runtime.dit(**kwargs)[0], want[0])
    finally:
        runtime.close()
        reference.close()


def test_the_tier_outlives_the_dit_leaving_the_device(tiny_distill) -> None:
    """The DiT leaves the device for a video decode (`Pipeline.drop_dit`): its host tier stays, read, and the next
    runtime serves from it without planning it again (MemAvailable no longer counts its memory in) or rereading it."""
    from k6fast.pipeline import Pipeline, Request
    from k6fast.switches import Options

    ckpt = open_checkpoint(tiny_distill)
    first = tiny_dit(ckpt, max_resident=0, host_cache=1.0, host=ROOMY)
    reference = tiny_dit(ckpt)
    kwargs = dit_inputs(ckpt.dit, 4)
    first.dit(**kwargs)
    tier = first.take_host_tier()
    first.close()
    try:
        assert tier.blocks == (0, 1) and all(tier.filled(b) for b in tier.blocks)  # read: never read again
        # A host with no room at all: planned again, a 1 GiB tier would be refused.
        second = tiny_dit(ckpt, max_resident=0, host_cache=1.0, host=HostMemory(0, 0), host_tier=tier)
        assert second.host_cache is tier and second.plan.host_blocks == 2
        got, want = second.dit(**kwargs), reference.dit(**kwargs)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        second.close()
        assert tier.blocks == ()  # the runtime that holds it gives it back
    finally:
        reference.close()
    request = Request(prompt="A kettle whistles", width=32, height=32, frames=5, steps=2)
    options = Options().replace(host_cache_gb=0.01, max_resident_blocks=0)
    pipe = Pipeline(tiny_distill, options, device="cpu", plan_geometry=(32, 32, 5))
    try:
        held = pipe.runtime.host_cache
        assert held is not None and held.blocks == (0, 1)
        before = pipe.generate(request)
        pipe.drop_dit()
        after = pipe.generate(request)  # reloads the DiT, with the same tier
        assert pipe.runtime.host_cache is held and "dit_load" in after.telemetry.phases
        assert (before.frames == after.frames).all()
    finally:
        pipe.close()
    assert held.blocks == ()


def test_auto_pins_nothing_when_the_streamed_blocks_fit_the_page_cache(tiny_distill) -> None:
    streamed = [(b, GiB) for b in range(17, 60)]  # 43 streamed blocks of 1 GiB
    assert plan_host_cache("auto", streamed, _host_with_room(43 * GiB)) == ()
    assert disk_bytes_per_step(43 * GiB, 0, _host_with_room(43 * GiB)) == 0
    ckpt = open_checkpoint(tiny_distill)
    runtime = tiny_dit(ckpt, max_resident=0, host=ROOMY)  # the default: auto
    try:
        assert runtime.host_cache is None and runtime.plan.host_blocks == runtime.plan.host_bytes == 0
        assert "host tier" not in runtime.plan.describe()
    finally:
        runtime.close()


def test_auto_pins_what_the_room_holds_when_they_do_not_fit(tiny_distill) -> None:
    streamed = [(b, GiB) for b in range(17, 60)]
    host = _host_with_room(int(26.5 * GiB))
    tier = plan_host_cache("auto", streamed, host)
    assert tier == tuple(range(34, 60))  # the last 26 blocks: 26 GiB of the 26.5 the room holds
    # Without the tier a cyclic scan through a smaller page cache misses every block; with it, all but the tier.
    assert disk_bytes_per_step(43 * GiB, 0, host) == 43 * GiB
    assert disk_bytes_per_step(43 * GiB, 26 * GiB, host) == 17 * GiB
    # The process's memory at load is counted out of MemAvailable already: it is not reserved twice.
    loaded = HostMemory(1 << 40, host.available_bytes - 3 * GiB, process_bytes=3 * GiB)
    assert plan_host_cache("auto", streamed, loaded) == tier
    ckpt = open_checkpoint(tiny_distill)
    index = index_safetensors(ckpt.transformer_files)
    sizes = [BlockLayout.of(index, block_prefix(b)).nbytes for b in range(ckpt.dit.num_visual_blocks)]
    runtime = tiny_dit(ckpt, max_resident=0, host=_host_with_room(sum(sizes) - 1))  # one byte short of them all
    try:
        held = runtime.host_cache.blocks
        assert held and held[-1] == ckpt.dit.num_visual_blocks - 1 and sum(sizes[b] for b in held) < sum(sizes)
        assert runtime.plan.host_blocks == len(held) and runtime.plan.host_bytes == sum(sizes[b] for b in held)
    finally:
        runtime.close()


def test_a_size_over_what_the_host_can_spare_is_refused(tiny_distill) -> None:
    streamed = [(b, GiB) for b in range(10)]
    host = _host_with_room(8 * GiB)
    assert plan_host_cache(8.0, streamed, host) == tuple(range(2, 10))
    assert plan_host_cache(0.0, streamed, host) == ()
    with pytest.raises(HostCacheError, match=r"K6_HOST_CACHE_GB=9 is more than this host can spare.*at most 8\.0"):
        plan_host_cache(9.0, streamed, host)
    ckpt = open_checkpoint(tiny_distill)
    for streaming in (0, None):  # refused where it is set, even while every block is resident
        with pytest.raises(HostCacheError, match="K6_HOST_CACHE_GB=1 is more"):
            tiny_dit(ckpt, max_resident=streaming, host_cache=1.0, host=_host_with_room(GiB // 2))
    switch = SWITCHES_BY_NAME["K6_HOST_CACHE_GB"]
    assert switch.default == "auto" and switch.parse("26") == 26.0 and switch.parse("0") == 0.0
    with pytest.raises(SwitchError, match="expected auto, or a finite number >= 0"):
        switch.parse("-2")


def test_doctor_predicts_the_disk_reads_per_step_with_and_without_the_tier() -> None:
    from k6fast.doctor import GB, Report, predict_disk_per_step, render

    plan = {"variant": "pro-distill", "dit_file_bytes": 60 * 10**9, "describe": "plan", "text_describe": "text",
            "resident_blocks": 17, "num_blocks": 60, "block_bytes": int(1.2 * GB),
            "streamed_stored_bytes": [10**9] * 43}  # fmt: skip
    available = 30 * 10**9 + PROCESS_HOST_BYTES + HOST_OS_BYTES  # 30 GB for the page cache and the tier
    p = predict_disk_per_step(plan, available, 2.0)
    assert (p["host_blocks"], p["host_bytes"]) == (30, 30 * 10**9)
    assert (p["without_tier_bytes"], p["with_tier_bytes"]) == (43 * 10**9, 13 * 10**9)
    assert (p["without_tier_min_s"], p["with_tier_min_s"]) == pytest.approx((21.5, 6.5))
    report = Report([], 64 * 10**9, available, 10**12, "/", read_gb_s=2.0, plan=plan, disk_per_step=p)
    assert (
        "without the host tier 43.0 GB (>= 21.5 s a step at 2.00 GB/s); with K6_HOST_CACHE_GB=auto 30 blocks "
        "(30.0 GB) in host memory, 13.0 GB (>= 6.5 s a step at 2.00 GB/s)"
    ) in render(report)
    roomy = predict_disk_per_step(plan, 100 * 10**9, None)
    assert roomy["without_tier_bytes"] == roomy["with_tier_bytes"] == roomy["host_blocks"] == 0
    assert roomy["with_tier_min_s"] is None
    report.disk_per_step = roomy
    assert "none after the first step, the page cache holds them all" in render(report)
    assert predict_disk_per_step({**plan, "resident_blocks": 60, "streamed_stored_bytes": []}, available, 2.0) is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_tier_blocks_cross_from_locked_host_buffers_gpu(blocks_file) -> None:
    device = torch.device("cuda", torch.cuda.current_device())
    _run_streamer_cycles(blocks_file, device)
    _run_cancelled_cycles(blocks_file, device)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_dit_with_a_host_tier_matches_resident_on_the_gpu(tiny_distill) -> None:
    device = torch.device("cuda", torch.cuda.current_device())
    ckpt = open_checkpoint(tiny_distill)
    resident = tiny_dit(ckpt, device)
    tiered = tiny_dit(ckpt, device, max_resident=0, host_cache=1.0, host=ROOMY)  # every streamed block in the tier
    try:
        assert tiered.host_cache.blocks == tuple(range(ckpt.dit.num_visual_blocks))
        assert all(tiered.host_cache.buffer(b).is_pinned() for b in tiered.host_cache.blocks)
        for seed in range(3):
            kwargs = {k: v.to(device) for k, v in dit_inputs(ckpt.dit, seed).items()}
            want, got = resident.dit(**kwargs), tiered.dit(**kwargs)
            assert torch.equal(want[0], got[0]) and torch.equal(want[1], got[1])
    finally:
        resident.close()
        tiered.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_staging_is_page_locked_at_its_exact_size_until_close_gpu(blocks_file) -> None:
    device = torch.device("cuda", torch.cuda.current_device())
    before = torch.cuda.host_memory_stats()["num_host_alloc"]
    staging = staging_buffers(int(1.1 * 2**20) + 7, 2, device)
    buffers = list(staging.buffers)
    assert [b.numel() for b in buffers] == [int(1.1 * 2**20) + 7] * 2
    assert all(b.is_pinned() and b.data_ptr() % 4096 == 0 for b in buffers)
    staging.close()
    assert not any(b.is_pinned() for b in buffers)  # unregistered: the view's memory is plain again
    path, _ = blocks_file
    streamer, reader, _ = _streamer(path, device, ())
    held = streamer.staging
    assert len(held) == 2 and all(b.is_pinned() for b in held)
    assert all(b.numel() == max(layout.nbytes for layout in streamer.layouts.values()) for b in held)
    streamer.close()
    reader.close()
    assert not any(b.is_pinned() for b in held)
    assert torch.cuda.host_memory_stats()["num_host_alloc"] == before  # none from PyTorch's pinned allocator
