"""MP4 writing: H.264 + mono AAC muxed with PyAV, string metadata, atomic writes.

`write_mp4` (all frames at once) and `Mp4Writer` (frames handed over as they are made, the same file byte for byte)
are the only ways k6fast puts a clip on disk; `probe_mp4` and `read_mp4` (media_read.py, re-exported here) read one
back for tests and the quality gate. What a written file guarantees:

- video: H.264 (libx264), yuv420p, BT.709 limited range, tagged as such, constant frame rate `fps`;
- audio: AAC-LC mono at `sample_rate`, exactly round(T / fps * sample_rate) samples long as declared by the
  container (the input is zero-padded or trimmed to that length), first sample presented at t = 0;
- `moov` before `mdat` (`+faststart`), so a browser can start playback before the download ends;
- every metadata key/value pair is stored as an `mdta` tag and read back verbatim by `probe_mp4`;
- the file at `path` is either the complete new clip or what was there before: never a partial file.

Check: `pytest tests/test_media.py`.
"""

from __future__ import annotations

import contextlib
import numbers
from collections.abc import Mapping
from fractions import Fraction
from pathlib import Path
from typing import Literal

import av
import numpy as np
from av.video.reformatter import ColorRange, Colorspace

from .atomic import atomic_path
from .cancel import StopCheck, check_stop
from .media_read import Mp4Info, probe_mp4, read_mp4

__all__ = ["Mp4Info", "Mp4Writer", "prepare_audio", "probe_mp4", "read_mp4", "write_mp4"]

# crf 18 is x264's usual "visually lossless" point. K6 clips are short (5 s at 864x480 is a few MB at crf 18),
# so size is no concern, and a low crf keeps the quality gate measuring the model rather than the codec.
# preset medium is x264's default: slower presets save a little size at equal quality, faster ones cost quality
# per bit, and either way encoding is small next to generation (each record's mux phase says how small).
_CRF = 18
_PRESET = "medium"
# x264's bitstream depends on its thread count (PyAV asks for slice threads: one slice each), and "auto" follows the
# core count, so the same clip would encode differently on different machines. A fixed count makes a file a
# function of its inputs (and the x264 build); four threads keep a W1 clip's encode short on small machines.
_X264_THREADS = 4
# Even so, on the H200 host (a virtualised Xeon) the same frames encoded to other bytes from run to run, on one thread
# too. x264's cpu-independent mode (no CPU-specific approximations, which its macroblock tree uses: turning that off
# also helped) gave the same bytes in every run there (measurements/sessions/2026-12-02_streamed-mux).
_X264_PARAMS = "cpu-independent=1"
# FFmpeg's native AAC encoder (the wheels carry no libfdk) needs a generous bitrate: at 128 kb/s mono, noise-like
# content (breath, cymbals) came back with several times the error of 192 kb/s and the first frame of a full-scale
# tone overshot full scale (tests/test_media.py holds the encoder to its bounds at 192 kb/s). 192 kb/s mono is a
# small fraction of the video's bytes.
_AAC_BIT_RATE = 192_000
_AAC_FRAME = 1024
# Sample rates AAC can signal (ISO 14496-3 sampling_frequency_index); others make the encoder fail at open time.
_AAC_RATES = (96000, 88200, 64000, 48000, 44100, 32000, 24000, 22050, 16000, 12000, 11025, 8000, 7350)
# Written by the mp4 muxer itself: a caller's value would be overwritten (encoder) or would disagree with the ftyp
# box (the brands), so these keys are refused rather than silently lost.
_MUXER_KEYS = frozenset({"major_brand", "minor_version", "compatible_brands", "encoder"})
# Peaks below -80 dBFS are treated as silence: scaling them to 0.98 would turn numerical noise into full-scale hiss.
_SILENCE_PEAK = 1e-4
_PEAK_TARGET = 0.98
# AVCOL_* values for BT.709 primaries / transfer / matrix and for limited ("MPEG", 16-235) range.
_AVCOL_BT709 = 1
_AVCOL_RANGE_MPEG = 1


def prepare_audio(wave: np.ndarray, mode: Literal["peak", "clip"] = "peak") -> np.ndarray:
    """Bring a vocoder waveform into AAC's [-1, 1] range.

    wave: [N] floating point, mono. Returns a new float32 [N] array.
    "peak" scales so that max |x| = 0.98 (louder input is attenuated, quieter input amplified); input whose peak
    is below 1e-4 (-80 dBFS, i.e. silence) is returned unscaled. "clip" clips to [-1, 1] and changes nothing else.
    Raises ValueError on non-finite samples, a shape other than [N], a non-float dtype or an unknown mode.
    """
    if mode not in ("peak", "clip"):
        raise ValueError(f"prepare_audio: expected mode 'peak' or 'clip', got {mode!r}")
    wave = _check_wave(wave, "prepare_audio")
    if mode == "clip":
        return np.clip(wave.astype(np.float32), -1.0, 1.0)
    peak = float(np.max(np.abs(wave))) if wave.size else 0.0
    if peak < _SILENCE_PEAK:
        return wave.astype(np.float32)
    # Scale in float64 so that the peak lands on 0.98 to float32 rounding, whatever the input precision.
    return (wave.astype(np.float64) * (_PEAK_TARGET / peak)).astype(np.float32)


def write_mp4(
    path: str | Path,
    frames: np.ndarray,
    fps: float,
    audio: np.ndarray | None = None,
    sample_rate: int = 44100,
    metadata: Mapping[str, str] | None = None,
    should_stop: StopCheck | None = None,
) -> None:
    """Encode frames (and optional mono audio) to an H.264/AAC MP4 at `path`, atomically.

    frames: uint8 [T, H, W, 3] RGB, H and W even (yuv420p halves both for chroma).
    fps: frames per second (> 0); stored as a fraction with denominator <= 1001, so 24000/1001 survives.
    audio: floating point [N] mono in [-1, 1] (see `prepare_audio`), at `sample_rate` Hz. It is zero-padded or
        trimmed to round(T / fps * sample_rate) samples so that the audio and video durations are equal. None writes
        a file without an audio stream (sample_rate is then unused).
    sample_rate: Hz, one AAC can signal (44100 for K6).
    metadata: str -> str, stored in the file and returned by `probe_mp4(path).metadata`. Keys must be non-empty,
        free of NUL and not one the muxer writes itself (major_brand, minor_version, compatible_brands, encoder).
    should_stop: checked before each frame is encoded (k6fast.cancel); when it says stop, `Cancelled` is raised and
        nothing is left at `path`.

    The clip is written to a hidden temporary file next to `path` (faststart rewrites the file in a second pass, so
    it must be a real seekable file on the same filesystem), flushed to disk, then renamed over `path`. On any error
    the temporary file is removed and `path` is left as it was. All inputs are validated before anything is created.
    `Mp4Writer` writes the same file from frames handed over a few at a time.
    """
    rgb = _check_frames(frames)
    t, h, w, _ = rgb.shape
    with Mp4Writer(path, t, h, w, fps, audio, sample_rate, metadata, should_stop) as writer:
        writer.write(rgb)


class Mp4Writer:
    """`write_mp4` with the frames handed over a few at a time, as they are made: the file is byte for byte the one
    `write_mp4` writes for the same frames, audio, metadata and settings (the same encoder calls in the same order).

    num_frames, height, width: the clip's frame count and size, known up front (the audio is fitted to the clip's
    duration and interleaved with the frames as they are encoded). The other arguments are `write_mp4`'s.
    `write(frames)` encodes the next frames; `close()` finishes the file (all num_frames written) and renames it
    over `path`; `abort()` (or any error, or leaving a `with` block by an exception) removes the temporary file and
    leaves `path` as it was. Not thread-safe: one thread at a time (not necessarily the one that made it).
    """

    def __init__(
        self,
        path: str | Path,
        num_frames: int,
        height: int,
        width: int,
        fps: float,
        audio: np.ndarray | None = None,
        sample_rate: int = 44100,
        metadata: Mapping[str, str] | None = None,
        should_stop: StopCheck | None = None,
    ):
        path = Path(path)
        _check_size(num_frames, height, width)
        rate = _check_fps(fps)
        tags = _check_metadata(metadata)
        wave: np.ndarray | None = None
        if audio is not None:
            if (
                isinstance(sample_rate, bool)
                or not isinstance(sample_rate, numbers.Integral)
                or sample_rate not in _AAC_RATES
            ):
                raise ValueError(
                    f"write_mp4: expected sample_rate to be one AAC supports {_AAC_RATES}, got {sample_rate}"
                )
            sample_rate = int(sample_rate)
            wave = _fit_audio(_check_audio(audio), num_frames, rate, sample_rate)
        if not path.parent.is_dir():
            raise FileNotFoundError(f"write_mp4: expected an existing directory for {path}, found none")
        if path.is_dir():
            raise IsADirectoryError(f"write_mp4: expected a file path, {path} is a directory")
        self.path, self.num_frames, self.written = path, num_frames, 0
        self._shape = (height, width, 3)
        self._rate, self._wave, self._sample_rate, self._should_stop = rate, wave, sample_rate, should_stop
        self._audio_pos = 0
        self._container: av.container.OutputContainer | None = None
        # atomic_path fsyncs the file and the rename: a job recorded as done must still find its clip after a crash.
        self._atomic = atomic_path(path)
        tmp = self._atomic.__enter__()
        try:
            options = {"movflags": "+faststart+use_metadata_tags"}
            if wave is not None:
                # Edit lists are written in the movie timescale (1000 by default): the audio one, which trims the
                # AAC priming and padding, would cut the declared length to whole milliseconds (up to 44 samples
                # short).
                options["movie_timescale"] = str(sample_rate)
            self._container = av.open(str(tmp), "w", format="mp4", options=options)
            self._vstream, self._astream = _add_streams(self._container, height, width, rate, wave, sample_rate, tags)
        except BaseException as exc:
            self.abort(exc)
            raise

    def __enter__(self) -> Mp4Writer:
        return self

    def __exit__(self, kind, exc, tb) -> None:
        if exc is None:
            self.close()
        else:
            self.abort(exc)

    def write(self, frames: np.ndarray) -> None:
        """Encode the next frames: uint8 [n, H, W, 3] RGB (n >= 1, at most the frames still to come), interleaved
        with the audio up to the end of each frame."""
        self._check_open()
        try:
            if not isinstance(frames, np.ndarray) or frames.dtype != np.uint8 or frames.shape[1:] != self._shape:
                found = (
                    f"{frames.dtype} {list(frames.shape)}" if isinstance(frames, np.ndarray) else type(frames).__name__
                )
                raise ValueError(
                    f"Mp4Writer.write: expected uint8 frames [n, {', '.join(map(str, self._shape))}], got {found}"
                )
            if not 1 <= len(frames) <= self.num_frames - self.written:
                raise ValueError(
                    f"Mp4Writer.write: expected 1 to {self.num_frames - self.written} more frames (of "
                    f"{self.num_frames}), got {len(frames)}"
                )
            container, t, rate = self._container, self.num_frames, self._rate
            for rgb in frames:
                i = self.written
                check_stop(self._should_stop, "mux", f"before frame {i + 1} of {t}")
                frame = video_frame(np.ascontiguousarray(rgb))
                frame.pts, frame.time_base = i, 1 / rate
                for packet in self._vstream.encode(frame):
                    container.mux(packet)
                self.written += 1
                if self._astream is not None:
                    # Feed audio up to the end of this video frame so the muxer receives both streams in time order
                    # and the mdat is interleaved (a player streaming the file never has to seek far ahead for audio).
                    end = min(len(self._wave), round((i + 1) / rate * self._sample_rate))
                    self._audio_pos = _encode_audio(
                        container, self._astream, self._wave, self._audio_pos, end, self._sample_rate
                    )
        except BaseException as exc:
            self.abort(exc)
            raise

    def close(self) -> None:
        """Flush the encoders, finish the file and rename it over `path`. All num_frames must have been written."""
        self._check_open()
        try:
            if self.written != self.num_frames:
                raise ValueError(f"Mp4Writer.close: expected {self.num_frames} frames written, got {self.written}")
            container = self._container
            for packet in self._vstream.encode(None):
                container.mux(packet)
            if self._astream is not None:
                wave = self._wave
                _encode_audio(container, self._astream, wave, self._audio_pos, len(wave), self._sample_rate)
                for packet in self._astream.encode(None):
                    container.mux(packet)
            self._container = None
            container.close()
        except BaseException as exc:
            self.abort(exc)
            raise
        atomic, self._atomic = self._atomic, None
        atomic.__exit__(None, None, None)

    def abort(self, exc: BaseException | None = None) -> None:
        """Give up: close the container, remove the temporary file; `path` is left as it was. Idempotent."""
        container, self._container = self._container, None
        atomic, self._atomic = self._atomic, None
        if container is not None:
            # The original error is the one worth reporting; a second one from tearing down is not.
            with contextlib.suppress(Exception):
                container.close()
        if atomic is not None:
            exc = exc if exc is not None else RuntimeError("MP4 write abandoned")
            atomic.__exit__(type(exc), exc, exc.__traceback__)  # removes the temporary file; the error is not raised

    def _check_open(self) -> None:
        if self._atomic is None:
            raise RuntimeError(f"Mp4Writer: {self.path} is already closed or aborted")


def _add_streams(
    container: av.container.OutputContainer,
    h: int,
    w: int,
    rate: Fraction,
    wave: np.ndarray | None,
    sample_rate: int,
    tags: dict[str, str],
) -> tuple[av.video.stream.VideoStream, av.audio.stream.AudioStream | None]:
    """The metadata, the H.264 stream and (with audio) the AAC stream of an open mp4 container."""
    for key, value in tags.items():
        container.metadata[key] = value
    vstream = container.add_stream(
        "libx264", rate=rate, options={"crf": str(_CRF), "preset": _PRESET, "x264-params": _X264_PARAMS}
    )
    vstream.width, vstream.height, vstream.pix_fmt = w, h, "yuv420p"
    vcc = vstream.codec_context
    vcc.thread_count = _X264_THREADS
    # Tagging the matrix we convert with; untagged, players guess (BT.601 for SD sizes in browsers) and shift hues.
    vcc.colorspace = vcc.color_primaries = vcc.color_trc = _AVCOL_BT709
    vcc.color_range = _AVCOL_RANGE_MPEG
    astream = None
    if wave is not None:
        astream = container.add_stream("aac", rate=sample_rate, layout="mono")
        astream.codec_context.bit_rate = _AAC_BIT_RATE
    return vstream, astream


def _encode_audio(
    container: av.container.OutputContainer,
    astream: av.audio.stream.AudioStream,
    wave: np.ndarray,
    start: int,
    end: int,
    sample_rate: int,
) -> int:
    """Encode wave[start:end] in whole AAC frames (a shorter one only at the very end); return the new position."""
    while end - start >= _AAC_FRAME or (end == len(wave) and start < end):
        stop = min(start + _AAC_FRAME, end)
        frame = av.AudioFrame.from_ndarray(wave[None, start:stop], format="fltp", layout="mono")
        frame.sample_rate = sample_rate
        # An explicit pts from 0 lets the encoder stamp its 1024 priming samples at negative pts, which the muxer
        # turns into an edit list; with pts left unset the priming is played and the audio starts 23 ms late.
        frame.pts, frame.time_base = start, Fraction(1, sample_rate)
        for packet in astream.encode(frame):
            container.mux(packet)
        start = stop
    return start


def video_frame(rgb: np.ndarray) -> av.VideoFrame:
    """rgb: uint8 [H, W, 3] -> yuv420p VideoFrame in BT.709 limited range (the matrix the stream is tagged with).
    The mux converts every frame through this name, so a caller may wrap it to count, pause or fail the mux frame by
    frame."""
    frame = av.VideoFrame.from_ndarray(rgb, format="rgb24")
    return frame.reformat(format="yuv420p", dst_colorspace=Colorspace.ITU709, dst_color_range=ColorRange.MPEG)


def _check_frames(frames: np.ndarray) -> np.ndarray:
    if not isinstance(frames, np.ndarray):
        raise TypeError(f"write_mp4: expected frames as a numpy array, got {type(frames).__name__}")
    if frames.dtype != np.uint8:
        raise ValueError(f"write_mp4: expected frames of dtype uint8, got {frames.dtype}")
    if frames.ndim != 4 or frames.shape[-1] != 3:
        raise ValueError(f"write_mp4: expected frames of shape [T, H, W, 3], got {list(frames.shape)}")
    t, h, w, _ = frames.shape
    if t == 0:
        raise ValueError("write_mp4: expected at least one frame, got T = 0")
    if h == 0 or w == 0 or h % 2 or w % 2:
        raise ValueError(f"write_mp4: expected even, non-zero H and W (yuv420p subsamples chroma 2x2), got {h}x{w}")
    return frames


def _check_size(num_frames: int, height: int, width: int) -> None:
    for name, value in (("num_frames", num_frames), ("height", height), ("width", width)):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
            raise ValueError(f"write_mp4: expected {name} as an integer >= 1, got {value!r}")
    if height % 2 or width % 2:
        raise ValueError(f"write_mp4: expected even H and W (yuv420p subsamples chroma 2x2), got {height}x{width}")


def _check_fps(fps: float) -> Fraction:
    if isinstance(fps, bool) or not isinstance(fps, numbers.Real) or not np.isfinite(fps) or fps <= 0:
        raise ValueError(f"write_mp4: expected fps as a finite number > 0, got {fps!r}")
    return Fraction(float(fps)).limit_denominator(1001)


def _check_wave(wave: np.ndarray, who: str) -> np.ndarray:
    if not isinstance(wave, np.ndarray):
        raise TypeError(f"{who}: expected audio as a numpy array, got {type(wave).__name__}")
    if wave.ndim != 1:
        raise ValueError(f"{who}: expected mono audio of shape [N], got {list(wave.shape)}")
    if not np.issubdtype(wave.dtype, np.floating):
        raise ValueError(f"{who}: expected floating-point audio, got {wave.dtype}")
    bad = int(np.count_nonzero(~np.isfinite(wave)))
    if bad:
        raise ValueError(f"{who}: expected finite audio samples, found {bad} NaN/inf of {wave.size}")
    return wave


def _check_audio(audio: np.ndarray) -> np.ndarray:
    wave = _check_wave(audio, "write_mp4")
    if wave.size == 0:
        raise ValueError("write_mp4: expected at least one audio sample, got N = 0 (pass audio=None for no audio)")
    peak = float(np.max(np.abs(wave)))
    if peak > 1.0:
        raise ValueError(f"write_mp4: expected audio in [-1, 1], found peak {peak:.4g}; run prepare_audio first")
    return wave.astype(np.float32)


def _fit_audio(wave: np.ndarray, num_frames: int, rate: Fraction, sample_rate: int) -> np.ndarray:
    """Zero-pad or trim wave [N] float32 to the video's duration, round(T / fps * sample_rate) samples."""
    target = round(num_frames / rate * sample_rate)
    if len(wave) >= target:
        return np.ascontiguousarray(wave[:target])
    return np.concatenate([wave, np.zeros(target - len(wave), np.float32)])


def _check_metadata(metadata: Mapping[str, str] | None) -> dict[str, str]:
    if metadata is None:
        return {}
    if not isinstance(metadata, Mapping):
        raise TypeError(f"write_mp4: expected metadata as a mapping of str to str, got {type(metadata).__name__}")
    tags = {}
    for key, value in metadata.items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise TypeError(
                f"write_mp4: expected metadata keys and values of type str, got {type(key).__name__} "
                f"-> {type(value).__name__} for key {key!r}"
            )
        if not key or "\0" in key or "\0" in value:
            raise ValueError(f"write_mp4: expected a non-empty metadata key and no NUL characters, got {key!r}")
        if key in _MUXER_KEYS:
            raise ValueError(f"write_mp4: metadata key {key!r} is written by the muxer itself; choose another key")
        tags[key] = value
    return tags
