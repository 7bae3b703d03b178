"""`k6fast quantize --format df11`: the compressed checkpoint's layout, its exact round trip, and its checks at load.

The source is the tiny checkpoint with its transformer in BF16 except the norms (F32), as a mixed checkpoint would
be; every BF16 tensor is compressed (min_elements=1; the command's own threshold keeps small tensors raw), so each
tensor's blob is read back from the written shards and decoded with the reference decoder.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from dit_testing import tiny_dit
from safetensors import safe_open

from k6fast import df11
from k6fast.checkpoint import CheckpointError, open_checkpoint
from k6fast.df11_checkpoint import compress_checkpoint
from k6fast.memory import HostMemory
from k6fast.safetensors_index import DF11Location, index_safetensors
from k6fast.stream.plan import index_footprint

ROOMY = HostMemory(1 << 40, 1 << 40)  # a host with room for any host tier these tests ask for


@pytest.fixture(scope="module")
def compressed(tiny_bf16, tmp_path_factory):
    dst = tmp_path_factory.mktemp("df11") / "ckpt"
    lines: list[str] = []
    report = compress_checkpoint(tiny_bf16, dst, min_elements=1, log=lines.append)
    assert report.compressed > 0 and lines[-1] == f"wrote {dst}"
    return dst, report


def test_every_tensor_round_trips_bit_exact(tiny_bf16, compressed):
    dst, report = compressed
    ckpt = open_checkpoint(dst)
    assert ckpt.compression == "df11" and ckpt.quantization is None
    source = index_safetensors(open_checkpoint(tiny_bf16).transformer_files)
    stored = index_safetensors(ckpt.transformer_files)
    assert set(stored) == set(source)
    dtypes = set()
    for name, loc in source.items():
        with safe_open(loc.file, "pt") as f:
            want = f.get_tensor(name)
        with safe_open(stored[name].file, "pt") as f:  # the shards stay readable by safetensors itself
            got = f.get_tensor(name)
        dtypes.add(loc.dtype)
        if loc.dtype == "BF16":
            assert stored[name].dtype == "U8"
            blob = got.numpy()
            got = df11.decode_blob_ref(torch.from_numpy(blob), df11.parse_header(blob, blob.size, name=name))
        assert got.dtype == want.dtype and got.shape == want.shape, name
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), name
    assert dtypes == {"BF16", "F32"}
    assert report.tensors == len(source) and report.compressed == sum(s.dtype == "BF16" for s in source.values())


def test_shards_and_config_say_what_they_hold(tiny_bf16, compressed):
    dst, _ = compressed
    config = json.loads((dst / "transformer" / "config.json").read_text())
    assert config["k6fast_compression"] == {"format": "df11", "version": 1}
    for file in open_checkpoint(dst).transformer_files:
        with safe_open(file, "pt") as f:
            assert f.metadata()["k6fast_compression"] == "df11"
        header_len = int.from_bytes(file.read_bytes()[:8], "little")
        assert (8 + header_len) % 16 == 0  # blobs start aligned; each is a multiple of 16 bytes
    vae = next((tiny_bf16 / "vae").glob("*.safetensors"))
    assert (dst / "vae" / vae.name).stat().st_ino == vae.stat().st_ino  # other components hard-linked


def test_refuses_a_compressed_source_and_a_used_destination(tiny_bf16, compressed, tmp_path):
    dst, _ = compressed
    with pytest.raises(CheckpointError, match="already stored as df11"):
        compress_checkpoint(dst, tmp_path / "twice")
    from k6fast.quantize import quantize_checkpoint

    with pytest.raises(CheckpointError, match="already stored as df11"):  # fp8 from DF11 blobs would read garbage
        quantize_checkpoint(dst, tmp_path / "fp8", "fp8")
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "x").write_text("")
    with pytest.raises(FileExistsError, match="non-empty directory"):
        compress_checkpoint(tiny_bf16, tmp_path / "used")


def test_a_linked_component_folder_is_copied_through_its_link(tiny_bf16, tmp_path):
    """A component folder that is a link (the text encoders kept on another disk): its files are linked into the copy
    (the 2026-12-02 DF11 lease's write failed at its end with "missing component folder .../text_encoder"), and a
    link back up the tree does not loop."""
    src = tmp_path / "src"
    shutil.copytree(tiny_bf16, src, copy_function=os.link)
    elsewhere = tmp_path / "other-disk" / "text_encoder"
    elsewhere.parent.mkdir()
    (src / "text_encoder").rename(elsewhere)
    (src / "text_encoder").symlink_to(elsewhere, target_is_directory=True)
    (src / "scheduler" / "loop").symlink_to(src, target_is_directory=True)
    dst = tmp_path / "df11"
    compress_checkpoint(src, dst, min_elements=1, log=lambda line: None)
    assert open_checkpoint(dst).compression == "df11"
    copied = dst / "text_encoder"
    assert copied.is_dir() and not copied.is_symlink()
    for file in elsewhere.iterdir():
        assert (copied / file.name).stat().st_ino == file.stat().st_ino
    assert not (dst / "scheduler" / "loop" / "transformer").exists()


def test_a_component_folder_the_copy_lacks_stops_it_before_the_shards(tiny_bf16, tmp_path, monkeypatch):
    """A walk that misses a component folder (as the unfollowed link did) fails before any shard is compressed,
    not at the copy's validation after all of them."""
    walk = os.walk
    monkeypatch.setattr(os, "walk", lambda top, **kw: (e for e in walk(top, **kw) if "text_encoder_2" not in e[0]))
    lines: list[str] = []
    with pytest.raises(CheckpointError, match=r"could not copy the component folders \['text_encoder_2'\]"):
        compress_checkpoint(tiny_bf16, tmp_path / "df11", min_elements=1, log=lines.append)
    assert not any(line.startswith("wrote transformer/") for line in lines)
    assert not (tmp_path / "df11").exists()


def test_open_names_a_damaged_blob(compressed, tmp_path):
    dst, _ = compressed
    copy = tmp_path / "copy"
    shutil.copytree(dst, copy, copy_function=shutil.copy)  # real copies: the source's files stay untouched
    loc = next(loc for loc in index_safetensors(open_checkpoint(copy).transformer_files).values() if loc.dtype == "U8")
    with open(loc.file, "r+b") as f:
        f.seek(loc.offset + 28)  # the element count in the blob's header
        f.write(b"\xff")
    with pytest.raises(CheckpointError, match=rf"tensor {loc.name}: corrupt DF11 header"):
        open_checkpoint(copy)


def test_command_line_writes_it(tiny_bf16, tmp_path):
    from k6fast.cli import main

    assert main(["quantize", "--format", "df11", str(tiny_bf16), str(tmp_path / "cli")]) == 0
    ckpt = open_checkpoint(tmp_path / "cli")
    assert ckpt.compression == "df11"
    # The command's threshold keeps the tiny model's small tensors raw: nothing to decode, bytes unchanged.
    assert all(loc.dtype != "U8" for loc in index_safetensors(ckpt.transformer_files).values())


def _inputs(cfg, seed: int):
    g = torch.Generator().manual_seed(seed)
    return dict(
        hidden_states=torch.randn(1, 3, 4, 6, cfg.visual_in_channels, generator=g).bfloat16(),
        encoder_hidden_states=torch.randn(1, 5, cfg.in_text_dim, generator=g).bfloat16(),
        pooled_projections=torch.randn(1, cfg.in_text_dim2, generator=g).bfloat16(),
        timestep=torch.tensor([500.0]),
        audio_hidden_states=torch.randn(1, 4, cfg.in_audio_dim, generator=g).bfloat16(),
    )


@pytest.mark.parametrize(("max_resident", "prefetch", "host_cache"), [(None, 1, 0), (0, 1, 0), (1, 2, 0), (0, 1, 1.0)])
def test_dit_from_the_compressed_checkpoint_is_bit_identical(tiny_bf16, compressed, max_resident, prefetch, host_cache):
    """Resident (blobs decoded once at upload) and streamed (decoded as each block's views are made; with a host tier,
    from the blobs it holds): the DiT's outputs, hence the latents, equal the BF16 checkpoint's bit for bit."""
    plain_ckpt, packed_ckpt = open_checkpoint(tiny_bf16), open_checkpoint(compressed[0])
    kwargs = {} if max_resident is None else {"max_resident": max_resident, "prefetch": prefetch}
    kwargs |= {"host_cache": host_cache, "host": ROOMY}
    plain = tiny_dit(plain_ckpt, "cpu", torch.bfloat16)
    packed = tiny_dit(packed_ckpt, "cpu", torch.bfloat16, **kwargs)
    try:
        assert (packed.streamer is None) == (max_resident is None)
        assert (packed.host_cache is not None) == (host_cache > 0)  # every streamed block's blobs in the tier
        for seed in range(2):  # the slots rotate
            a, b = plain.dit(**_inputs(plain_ckpt.dit, seed)), packed.dit(**_inputs(plain_ckpt.dit, seed))
            assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    finally:
        plain.close()
        packed.close()


def test_the_plan_counts_blobs_as_the_bf16_they_decode_to(tiny_bf16, compressed):
    plain = index_safetensors(open_checkpoint(tiny_bf16).transformer_files)
    packed = index_safetensors(open_checkpoint(compressed[0]).transformer_files)
    assert any(isinstance(loc, DF11Location) for loc in packed.values())
    blocks = open_checkpoint(tiny_bf16).dit.num_visual_blocks
    assert index_footprint(packed, blocks, 2) == index_footprint(plain, blocks, 2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(("max_resident", "host_cache"), [(None, 0), (0, 0), (0, 1.0)])
def test_dit_from_the_compressed_checkpoint_is_bit_identical_on_gpu(tiny_bf16, compressed, max_resident, host_cache):
    """The same on the GPU: blobs decoded by the Triton kernel, streamed blocks through the copy stream's slots (with
    a host tier, from its locked buffers through the landing buffer)."""
    plain_ckpt, packed_ckpt = open_checkpoint(tiny_bf16), open_checkpoint(compressed[0])
    kwargs = {} if max_resident is None else {"max_resident": max_resident}
    kwargs |= {"host_cache": host_cache, "host": ROOMY}
    plain = tiny_dit(plain_ckpt, "cuda", torch.bfloat16)
    packed = tiny_dit(packed_ckpt, "cuda", torch.bfloat16, **kwargs)
    try:
        for seed in range(2):
            inputs = {k: v.cuda() for k, v in _inputs(plain_ckpt.dit, seed).items()}
            a, b = plain.dit(**inputs), packed.dit(**inputs)
            assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    finally:
        plain.close()
        packed.close()


def test_the_plan_counts_the_landing_buffer_of_a_compressed_checkpoint(tiny_bf16, compressed):
    from k6fast.stream.plan import landing_bytes

    blocks = open_checkpoint(tiny_bf16).dit.num_visual_blocks
    assert landing_bytes(index_safetensors(open_checkpoint(tiny_bf16).transformer_files), blocks) == 0
    packed = index_safetensors(open_checkpoint(compressed[0]).transformer_files)
    block0 = sum((loc.nbytes + 255) // 256 * 256 for name, loc in packed.items() if name.startswith(
        "visual_transformer_blocks.0."))  # fmt: skip
    assert landing_bytes(packed, blocks) >= block0 > 0


def test_pipeline_latents_from_the_compressed_checkpoint_are_bit_identical(tiny_bf16, compressed):
    from pipeline_testing import PROMPT

    from k6fast.pipeline import Pipeline, Request
    from k6fast.switches import Options

    request = Request(prompt=PROMPT, width=32, height=32, frames=5, steps=2, seed=3)
    plain = Pipeline(tiny_bf16, Options(), device="cpu").generate(request)
    packed = Pipeline(compressed[0], Options(), device="cpu").generate(request)
    assert set(plain.latents) == set(packed.latents) and plain.latents
    for name, want in plain.latents.items():
        assert torch.equal(packed.latents[name], want), name
    assert plain.frames.std() > 1e-3  # not a flat clip


def test_doctor_says_the_checkpoint_is_compressed_and_suggests_no_other_format(tiny_bf16, compressed):
    from k6fast.doctor import Gpu, Report, advise, dit_plan

    plan = dit_plan(compressed[0], 32 * 2**30)
    assert plan["stored_as"] == "df11" and dit_plan(tiny_bf16, 32 * 2**30)["stored_as"] is None
    host = Report([Gpu("NVIDIA GeForce RTX 5090", "12.0", 32 * 2**30, "580")], 60 * 10**9, 50 * 10**9, 10**12, "/")
    advice = "\n".join(advise(host, 80 * 10**9, plan, compressed=True))  # a DiT the host's page cache cannot hold
    assert "more RAM would help" in advice and "quantize" not in advice
