"""Tests for k6fast.media: MP4 layout, A/V sync, metadata, atomic writes, audio preparation, input checks."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from k6fast import media
from k6fast.media import prepare_audio, probe_mp4, read_mp4, write_mp4

FPS = 24.0
SR = 44100
T, H, W = 24, 64, 64
AAC_FRAME = 1024


def _frames(t: int = T, h: int = H, w: int = W) -> np.ndarray:
    """uint8 [t, h, w, 3]: smooth gradients that move a little each frame (cheap to encode, easy to compare)."""
    y, x = np.mgrid[0:h, 0:w]
    out = np.empty((t, h, w, 3), np.uint8)
    for i in range(t):
        out[i, ..., 0] = x * 200 // (w - 1) + 2 * i
        out[i, ..., 1] = y * 255 // (h - 1)
        out[i, ..., 2] = 128
    return out


def _tone(n: int, freq: float = 440.0, amp: float = 0.5) -> np.ndarray:
    return (amp * np.sin(2 * np.pi * freq * np.arange(n) / SR)).astype(np.float32)


def _listing(directory: Path) -> list[str]:
    return sorted(os.listdir(directory))


def test_write_probe_layout_and_metadata(tmp_path: Path) -> None:
    path = tmp_path / "clip.mp4"
    tags = {
        "k6fast.version": "0.1.0",
        "k6fast.commit": "0123456789abcdef0123456789abcdef01234567",
        "k6fast.switches": json.dumps({"K6_ATTN": "sage", "K6_FP8": "1", "note": "héllo\nwörld"}),
        "k6fast.snapshot_hash": "f" * 64,
        "k6fast.long": "x" * 10_000,
    }
    write_mp4(path, _frames(), FPS, _tone(SR), SR, tags)
    info = probe_mp4(path)

    assert _listing(tmp_path) == ["clip.mp4"]
    assert (info.video_codec, info.pix_fmt, info.width, info.height) == ("h264", "yuv420p", W, H)
    assert info.frame_count == T
    assert info.fps == pytest.approx(FPS)
    assert info.video_duration_s == pytest.approx(T / FPS)
    assert info.video_first_pts_s == 0.0
    assert (info.audio_codec, info.audio_channels, info.audio_sample_rate) == ("aac", 1, SR)
    assert abs(info.audio_duration_s - info.video_duration_s) < AAC_FRAME / SR
    assert abs(info.audio_decoded_samples / SR - info.frame_count / info.fps) < AAC_FRAME / SR
    # The priming must be trimmed by the container (negative first packet pts), not played at t = 0.
    assert info.audio_first_pts_s == 0.0
    assert info.audio_priming_samples == AAC_FRAME
    assert info.top_level_boxes[0] == "ftyp"
    assert info.moov_before_mdat
    assert {k: info.metadata.get(k) for k in tags} == tags


@pytest.mark.parametrize("seconds", [0.15, 0.5])
def test_audio_padded_or_trimmed_to_video_duration(tmp_path: Path, seconds: float) -> None:
    # 7 frames = 0.291666 s = 12862.5 samples: not a whole number of milliseconds, so a declared audio length
    # rounded to the default 1 ms movie timescale would be caught here.
    t = 7
    path = tmp_path / "clip.mp4"
    n_in = round(seconds * SR)
    wave = _tone(n_in)
    write_mp4(path, _frames(t=t), FPS, wave, SR)
    frames, audio, sample_rate = read_mp4(path)
    info = probe_mp4(path)

    assert frames.shape == (t, H, W, 3) and frames.dtype == np.uint8
    assert sample_rate == SR and audio.dtype == np.float32
    assert audio.shape == (round(t / FPS * SR),)
    assert info.audio_duration_s == pytest.approx(t / FPS, abs=1 / SR)
    kept = min(n_in, len(audio))
    # AAC at 192 kb/s reproduces a mid-level tone closely away from the first frame and the edges of the tone.
    body = slice(2 * AAC_FRAME, kept - AAC_FRAME)
    assert np.abs(audio[body] - wave[body]).max() < 0.05
    if n_in < len(audio):
        assert np.abs(audio[n_in + AAC_FRAME :]).max() < 0.01


def test_read_mp4_colours_round_trip(tmp_path: Path) -> None:
    # Saturated flat blocks: a BT.601/BT.709 mismatch between encode and decode would move green by ~25 levels.
    colours = np.array([[255, 0, 0], [0, 255, 0], [0, 0, 255], [40, 200, 120]], np.uint8)
    frames = np.empty((4, 32, 128, 3), np.uint8)
    for j, colour in enumerate(colours):
        frames[:, :, 32 * j : 32 * (j + 1)] = colour
    path = tmp_path / "colours.mp4"
    write_mp4(path, frames, FPS)
    decoded, audio, sample_rate = read_mp4(path)

    assert audio is None and sample_rate == 0
    assert decoded.shape == frames.shape
    for j, colour in enumerate(colours):
        centre = decoded[:, 8:24, 32 * j + 8 : 32 * j + 24].reshape(-1, 3).astype(np.float64).mean(axis=0)
        np.testing.assert_allclose(centre, colour, atol=4)
    smooth = _frames()
    write_mp4(path, smooth, FPS)
    assert np.abs(read_mp4(path)[0].astype(np.int16) - smooth).mean() < 2.0


def test_same_input_same_bytes(tmp_path: Path) -> None:
    # output.py relies on this: two runs with the same switches must produce identical files.
    first, second = tmp_path / "a.mp4", tmp_path / "b.mp4"
    for path in (first, second):
        write_mp4(path, _frames(t=6), FPS, _tone(SR // 4), SR, {"k6fast.commit": "abc"})
    assert first.read_bytes() == second.read_bytes()


def test_no_audio_stream(tmp_path: Path) -> None:
    path = tmp_path / "silent.mp4"
    write_mp4(path, _frames(t=6), FPS)
    info = probe_mp4(path)
    assert info.frame_count == 6
    assert info.audio_codec is None and info.audio_duration_s is None and info.audio_first_pts_s is None
    assert info.moov_before_mdat


def test_ntsc_frame_rate_kept_exact(tmp_path: Path) -> None:
    path = tmp_path / "ntsc.mp4"
    fps = 24000 / 1001
    write_mp4(path, _frames(t=6), fps, _tone(SR // 4), SR)
    info = probe_mp4(path)
    assert info.fps == pytest.approx(fps, rel=1e-9)
    assert info.video_duration_s == pytest.approx(6 / fps, abs=1e-6)
    assert abs(info.audio_duration_s - info.video_duration_s) < 1 / SR


@pytest.mark.parametrize("k", [5, 17])
def test_av_sync_flash_and_beep(tmp_path: Path, k: int) -> None:
    frames = np.zeros((T, H, W, 3), np.uint8)
    frames[k] = 255
    wave = np.zeros(SR, np.float32)
    onset = round(k / FPS * SR)
    n_beep = round(0.08 * SR)
    wave[onset : onset + n_beep] = _tone(n_beep, freq=1000.0, amp=0.5)
    path = tmp_path / "sync.mp4"
    write_mp4(path, frames, FPS, wave, SR)
    decoded, audio, sample_rate = read_mp4(path)
    info = probe_mp4(path)

    flash = int(np.argmax(decoded.reshape(T, -1).mean(axis=1)))
    assert flash == k
    window = 64
    rms = np.sqrt((audio[: len(audio) // window * window].reshape(-1, window).astype(np.float64) ** 2).mean(axis=1))
    beep_start = int(np.argmax(rms > 0.25 * rms.max())) * window
    t_flash = info.video_first_pts_s + flash / info.fps
    t_beep = info.audio_first_pts_s + beep_start / sample_rate
    assert abs(t_flash - t_beep) < 1 / FPS
    # Tighter than a frame: unplayed priming would put the beep 1024 samples (23 ms) late, inside one 24 fps frame.
    assert abs(t_flash - t_beep) < 0.5 * AAC_FRAME / SR


def test_failed_write_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen_midway: list[list[str]] = []
    real = media.video_frame

    def fail_on_fifth(rgb: np.ndarray):
        if len(seen_midway) == 4:
            raise RuntimeError("encoder exploded")
        seen_midway.append(_listing(tmp_path))
        return real(rgb)

    monkeypatch.setattr(media, "video_frame", fail_on_fifth)
    path = tmp_path / "clip.mp4"
    with pytest.raises(RuntimeError, match="encoder exploded"):
        write_mp4(path, _frames(), FPS, _tone(SR), SR, {"a": "b"})
    # The write really was under way (a temporary file existed) and was cleaned up.
    assert len(seen_midway[-1]) == 1 and seen_midway[-1][0] != "clip.mp4"
    assert _listing(tmp_path) == []


def test_failed_overwrite_keeps_existing_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "clip.mp4"
    write_mp4(path, _frames(t=4), FPS)
    before = path.read_bytes()

    def explode(rgb: np.ndarray):
        raise RuntimeError("encoder exploded")

    monkeypatch.setattr(media, "video_frame", explode)
    with pytest.raises(RuntimeError, match="encoder exploded"):
        write_mp4(path, _frames(), FPS, _tone(SR), SR)
    assert _listing(tmp_path) == ["clip.mp4"]
    assert path.read_bytes() == before


@pytest.mark.parametrize("audio", [True, False])
def test_mp4_writer_in_chunks_writes_the_bytes_write_mp4_writes(tmp_path: Path, audio: bool) -> None:
    # 13 frames in chunks of 1, 4, 5 and 3 (the chunks a streamed decode hands over), against all at once.
    frames, wave = _frames(t=13), _tone(SR // 3) if audio else None
    whole, chunked = tmp_path / "whole.mp4", tmp_path / "chunked.mp4"
    write_mp4(whole, frames, FPS, wave, SR, {"k6fast.commit": "abc"})
    with media.Mp4Writer(chunked, 13, H, W, FPS, wave, SR, {"k6fast.commit": "abc"}) as writer:
        for start, stop in ((0, 1), (1, 5), (5, 10), (10, 13)):
            assert not chunked.exists()  # published only when closed
            writer.write(frames[start:stop])
    assert chunked.read_bytes() == whole.read_bytes()
    assert _listing(tmp_path) == ["chunked.mp4", "whole.mp4"]


def test_mp4_writer_refuses_wrong_frames_and_an_early_close_and_leaves_the_old_file(tmp_path: Path) -> None:
    path = tmp_path / "clip.mp4"
    path.write_bytes(b"the previous clip")

    def attempt(use) -> None:
        writer = media.Mp4Writer(path, 6, H, W, FPS, _tone(SR // 4), SR)
        assert len(_listing(tmp_path)) == 2  # the temporary file beside the old clip
        use(writer)

    with pytest.raises(ValueError, match=rf"expected uint8 frames \[n, {H}, {W}, 3\], got uint8 \[2, {H}, 32, 3\]"):
        attempt(lambda w: w.write(_frames(t=2, w=32)))
    with pytest.raises(ValueError, match=r"expected 1 to 6 more frames \(of 6\), got 7"):
        attempt(lambda w: w.write(_frames(t=7)))
    with pytest.raises(ValueError, match="expected 6 frames written, got 4"):
        attempt(lambda w: (w.write(_frames(t=4)), w.close()))
    with pytest.raises(RuntimeError, match="already closed or aborted"):
        attempt(lambda w: (w.abort(), w.write(_frames(t=1))))
    with pytest.raises(ValueError, match="num_frames as an integer >= 1, got 0"):
        media.Mp4Writer(path, 0, H, W, FPS)
    assert _listing(tmp_path) == ["clip.mp4"] and path.read_bytes() == b"the previous clip"


def test_written_file_mode_follows_umask(tmp_path: Path) -> None:
    path = tmp_path / "clip.mp4"
    write_mp4(path, _frames(t=2), FPS)
    reference = tmp_path / "reference"
    reference.touch()
    assert path.stat().st_mode & 0o777 == reference.stat().st_mode & 0o777


def test_prepare_audio_peak() -> None:
    wave = np.array([0.0, 0.1, -0.25, 0.2], np.float64)
    out = prepare_audio(wave)
    assert out.dtype == np.float32 and out.shape == wave.shape
    assert np.abs(out).max() == pytest.approx(0.98, abs=1e-7)
    np.testing.assert_allclose(out, wave * (0.98 / 0.25), rtol=1e-6)
    assert wave[2] == -0.25  # input untouched
    loud = np.array([3.0, -1.5], np.float32)
    np.testing.assert_allclose(prepare_audio(loud, "peak"), [0.98, -0.49], rtol=1e-6)


def test_prepare_audio_clip() -> None:
    wave = np.array([-2.0, -0.5, 0.0, 0.7, 1.5], np.float32)
    np.testing.assert_array_equal(prepare_audio(wave, "clip"), np.array([-1.0, -0.5, 0.0, 0.7, 1.0], np.float32))
    assert wave[0] == -2.0


@pytest.mark.parametrize("level", [0.0, 1e-6])
def test_prepare_audio_silence_not_amplified(level: float) -> None:
    wave = np.full(100, level, np.float32)
    wave[::2] *= -1
    out = prepare_audio(wave)
    np.testing.assert_array_equal(out, wave)
    assert np.isfinite(out).all()


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("mode", ["peak", "clip"])
def test_prepare_audio_rejects_non_finite(bad: float, mode: str) -> None:
    wave = np.zeros(10, np.float32)
    wave[3] = bad
    with pytest.raises(ValueError, match="finite"):
        prepare_audio(wave, mode)


def test_prepare_audio_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="mode"):
        prepare_audio(np.zeros(4, np.float32), "normalize")
    with pytest.raises(ValueError, match=r"\[N\]"):
        prepare_audio(np.zeros((2, 4), np.float32))
    with pytest.raises(ValueError, match="floating"):
        prepare_audio(np.zeros(4, np.int16))


_OK = _frames(t=2)


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"frames": _frames(t=2, w=63)}, ValueError, "even"),
        ({"frames": _frames(t=2, h=33)}, ValueError, "even"),
        ({"frames": _OK.astype(np.float32)}, ValueError, "uint8"),
        ({"frames": _OK[0]}, ValueError, r"\[T, H, W, 3\]"),
        ({"frames": np.zeros((2, 8, 8, 4), np.uint8)}, ValueError, r"\[T, H, W, 3\]"),
        ({"frames": _OK[:0]}, ValueError, "at least one frame"),
        ({"frames": _OK.tolist()}, TypeError, "numpy array"),
        ({"fps": 0.0}, ValueError, "fps"),
        ({"fps": float("nan")}, ValueError, "fps"),
        ({"fps": "24"}, ValueError, "fps"),
        ({"audio": np.full(100, 1.5, np.float32)}, ValueError, "prepare_audio"),
        ({"audio": np.zeros((1, 100), np.float32)}, ValueError, r"\[N\]"),
        ({"audio": np.array([0.0, np.nan], np.float32)}, ValueError, "finite"),
        ({"audio": np.zeros(0, np.float32)}, ValueError, "at least one audio sample"),
        ({"audio": np.zeros(100, np.float32), "sample_rate": 44000}, ValueError, "sample_rate"),
        ({"audio": np.zeros(100, np.float32), "sample_rate": 44100.0}, ValueError, "sample_rate"),
        ({"metadata": {"encoder": "me"}}, ValueError, "muxer"),
        ({"metadata": {"": "x"}}, ValueError, "non-empty"),
        ({"metadata": {"k": 1}}, TypeError, "str"),
    ],
)
def test_write_mp4_rejects_bad_input(tmp_path: Path, kwargs: dict, error: type, message: str) -> None:
    args = {"path": tmp_path / "clip.mp4", "frames": _OK, "fps": FPS} | kwargs
    with pytest.raises(error, match=message):
        write_mp4(**args)
    assert _listing(tmp_path) == []


def test_probe_rejects_non_mp4(tmp_path: Path) -> None:
    path = tmp_path / "junk.mp4"
    path.write_bytes(b"\x00\x00\x00\x04abcd")
    with pytest.raises(ValueError, match="box size"):
        probe_mp4(path)
