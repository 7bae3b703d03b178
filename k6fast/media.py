"""MP4 writing and reading: H.264 + mono AAC muxed with PyAV, string metadata, atomic writes.

`write_mp4` is the only way k6fast puts a clip on disk; `probe_mp4` and `read_mp4` read one back for tests and the
quality gate. What a written file guarantees:

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
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import Literal

import av
import numpy as np
from av.video.reformatter import ColorRange, Colorspace

from .atomic import atomic_path
from .cancel import StopCheck, check_stop

__all__ = ["Mp4Info", "prepare_audio", "probe_mp4", "read_mp4", "write_mp4"]

# crf 18 is x264's usual "visually lossless" point. K6 clips are short (5 s at 864x480 is a few MB at crf 18),
# so size is no concern, and a low crf keeps the quality gate measuring the model rather than the codec.
# preset medium is x264's default: slower presets save a little size at equal quality, faster ones cost quality
# per bit, and either way encoding is small next to generation (each record's mux phase says how small).
_CRF = 18
_PRESET = "medium"
# x264's bitstream depends on its thread count (frame threads constrain motion search), and "auto" follows the
# core count, so the same clip would encode differently on different machines. A fixed count makes a file a
# function of its inputs (and the x264 build); four threads keep a W1 clip's encode short on small machines.
_X264_THREADS = 4
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
    """
    path = Path(path)
    rgb = _check_frames(frames)
    rate = _check_fps(fps)
    tags = _check_metadata(metadata)
    wave: np.ndarray | None = None
    if audio is not None:
        if (
            isinstance(sample_rate, bool)
            or not isinstance(sample_rate, numbers.Integral)
            or sample_rate not in _AAC_RATES
        ):
            raise ValueError(f"write_mp4: expected sample_rate to be one AAC supports {_AAC_RATES}, got {sample_rate}")
        sample_rate = int(sample_rate)
        wave = _fit_audio(_check_audio(audio), rgb.shape[0], rate, sample_rate)
    if not path.parent.is_dir():
        raise FileNotFoundError(f"write_mp4: expected an existing directory for {path}, found none")
    if path.is_dir():
        raise IsADirectoryError(f"write_mp4: expected a file path, {path} is a directory")

    # atomic_path fsyncs the file and the rename: a job recorded as done must still find its clip after a crash.
    with atomic_path(path) as tmp:
        options = {"movflags": "+faststart+use_metadata_tags"}
        if wave is not None:
            # Edit lists are written in the movie timescale (1000 by default): the audio one, which trims the AAC
            # priming and padding, would cut the declared length to whole milliseconds (up to 44 samples short).
            options["movie_timescale"] = str(sample_rate)
        container = av.open(str(tmp), "w", format="mp4", options=options)
        try:
            _mux(container, rgb, rate, wave, sample_rate, tags, should_stop)
        except BaseException:
            # The original error is the one worth reporting; a second one from tearing down is not.
            with contextlib.suppress(Exception):
                container.close()
            raise
        container.close()


@dataclass(frozen=True)
class Mp4Info:
    """What `probe_mp4` found in an MP4 file. Audio fields are None when the file has no audio stream.

    video_duration_s and audio_duration_s are the container's stream durations (what a player shows; for audio
    this is after the encoder's priming and padding are trimmed). frame_count and audio_decoded_samples come from
    decoding; the decoder emits whole AAC frames, so audio_decoded_samples may exceed the declared length by up to
    1023 samples. audio_priming_samples is how many leading encoder-delay samples the file tells the decoder to drop
    (1024 for FFmpeg's AAC encoder); 0 means the priming is played and the audio starts that much late.
    metadata is every container tag, including the muxer's own (major_brand, minor_version, compatible_brands,
    encoder). top_level_boxes lists the MP4 box types in file order.
    """

    video_codec: str
    pix_fmt: str
    width: int
    height: int
    frame_count: int
    fps: float
    video_duration_s: float
    video_first_pts_s: float
    audio_codec: str | None
    audio_channels: int | None
    audio_sample_rate: int | None
    audio_duration_s: float | None
    audio_first_pts_s: float | None
    audio_decoded_samples: int | None
    audio_priming_samples: int | None
    metadata: dict[str, str] = field(hash=False)
    top_level_boxes: tuple[str, ...]
    moov_before_mdat: bool


def probe_mp4(path: str | Path) -> Mp4Info:
    """Describe the first video stream, the first audio stream (if any), the tags and the box order of an MP4.

    Decodes every frame and audio packet (frame_count, first pts and sample counts are measured, not trusted from
    headers), so it costs about as much as `read_mp4`. Raises ValueError if the file has no video stream.
    """
    path = Path(path)
    boxes = _top_level_boxes(path)
    with av.open(str(path)) as container:
        tags = dict(container.metadata)
        if not container.streams.video:
            raise ValueError(f"probe_mp4: expected a video stream in {path}, found none")
        vstream = container.streams.video[0]
        astream = container.streams.audio[0] if container.streams.audio else None
        frame_count = 0
        video_first_pts_s: float | None = None
        audio_first_pts_s: float | None = None
        audio_decoded_samples = 0
        first_audio_packet: av.Packet | None = None
        for packet in container.demux(*(s for s in (vstream, astream) if s is not None)):
            is_video = packet.stream.index == vstream.index
            if not is_video and first_audio_packet is None and packet.pts is not None:
                first_audio_packet = packet
            for frame in packet.decode():
                if is_video:
                    if video_first_pts_s is None:
                        video_first_pts_s = _seconds(frame.pts, frame.time_base)
                    frame_count += 1
                else:
                    if audio_first_pts_s is None:
                        audio_first_pts_s = _seconds(frame.pts, frame.time_base)
                    audio_decoded_samples += frame.samples
        if frame_count == 0:
            raise ValueError(f"probe_mp4: expected at least one decodable video frame in {path}, found none")
        vcc = vstream.codec_context
        video_codec, pix_fmt, width, height = vcc.name, vcc.format.name, vcc.width, vcc.height
        declared = _seconds(vstream.duration, vstream.time_base)
        rate = vstream.average_rate or vstream.guessed_rate
        if rate is None and declared:
            rate = Fraction(frame_count) / Fraction(declared)
        fps = float(rate)
        video_duration_s = declared if declared is not None else frame_count / fps

        audio_codec = audio_channels = audio_sample_rate = audio_duration_s = audio_priming_samples = None
        if astream is not None:
            acc = astream.codec_context
            audio_codec, audio_channels, audio_sample_rate = acc.name, acc.channels, acc.sample_rate
            audio_priming_samples = 0
            if first_audio_packet is not None and first_audio_packet.pts < 0:
                priming_s = -first_audio_packet.pts * first_audio_packet.time_base
                audio_priming_samples = round(priming_s * audio_sample_rate)
            audio_duration_s = _seconds(astream.duration, astream.time_base)
            if audio_duration_s is None:
                audio_duration_s = audio_decoded_samples / audio_sample_rate
        else:
            audio_decoded_samples = None
    return Mp4Info(
        video_codec=video_codec,
        pix_fmt=pix_fmt,
        width=width,
        height=height,
        frame_count=frame_count,
        fps=fps,
        video_duration_s=video_duration_s,
        video_first_pts_s=video_first_pts_s,
        audio_codec=audio_codec,
        audio_channels=audio_channels,
        audio_sample_rate=audio_sample_rate,
        audio_duration_s=audio_duration_s,
        audio_first_pts_s=audio_first_pts_s,
        audio_decoded_samples=audio_decoded_samples,
        audio_priming_samples=audio_priming_samples,
        metadata=tags,
        top_level_boxes=boxes,
        moov_before_mdat="moov" in boxes and "mdat" in boxes and boxes.index("moov") < boxes.index("mdat"),
    )


def read_mp4(path: str | Path) -> tuple[np.ndarray, np.ndarray | None, int]:
    """Decode an MP4 to (frames uint8 [T, H, W, 3] RGB, audio float32 [N] mono or None, sample rate).

    Colour conversion follows the stream's tags (BT.709 limited for files from `write_mp4`). Audio is the first
    audio stream, channels averaged to mono (a stereo file holding duplicated mono gives that mono back), trimmed to
    the container's declared duration so the AAC frame padding is not returned; sample i is presented at
    `probe_mp4(path).audio_first_pts_s + i / sample_rate`. The sample rate is 0 when there is no audio.
    """
    path = Path(path)
    with av.open(str(path)) as container:
        if not container.streams.video:
            raise ValueError(f"read_mp4: expected a video stream in {path}, found none")
        vstream = container.streams.video[0]
        astream = container.streams.audio[0] if container.streams.audio else None
        images: list[np.ndarray] = []
        chunks: list[np.ndarray] = []
        resampler: av.AudioResampler | None = None
        for frame in container.decode(*(s for s in (vstream, astream) if s is not None)):
            if isinstance(frame, av.VideoFrame):
                images.append(frame.to_ndarray(format="rgb24"))
                continue
            if frame.format.name != "fltp":
                # Format conversion only (same layout and rate), so swresample adds no delay and no mixing.
                resampler = resampler or av.AudioResampler(format="fltp", layout=frame.layout, rate=frame.rate)
                converted = resampler.resample(frame)
            else:
                converted = [frame]
            chunks.extend(f.to_ndarray().mean(axis=0, dtype=np.float64) for f in converted)
        if not images:
            raise ValueError(f"read_mp4: expected at least one decodable video frame in {path}, found none")
        frames = np.stack(images)
        if astream is None:
            return frames, None, 0
        sample_rate = astream.codec_context.sample_rate
        declared = _seconds(astream.duration, astream.time_base)
    wave = np.concatenate(chunks).astype(np.float32) if chunks else np.zeros(0, np.float32)
    if declared is not None:
        wave = wave[: round(declared * sample_rate)]
    return frames, wave, sample_rate


def _mux(
    container: av.container.OutputContainer,
    rgb: np.ndarray,
    rate: Fraction,
    wave: np.ndarray | None,
    sample_rate: int,
    tags: dict[str, str],
    should_stop: StopCheck | None = None,
) -> None:
    """Encode rgb [T, H, W, 3] uint8 and wave [N] float32 into an open mp4 container, interleaved in time order."""
    for key, value in tags.items():
        container.metadata[key] = value
    t, h, w, _ = rgb.shape
    vstream = container.add_stream("libx264", rate=rate, options={"crf": str(_CRF), "preset": _PRESET})
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

    audio_pos = 0
    for i in range(t):
        check_stop(should_stop, "mux", f"before frame {i + 1} of {t}")
        frame = _video_frame(np.ascontiguousarray(rgb[i]))
        frame.pts, frame.time_base = i, 1 / rate
        for packet in vstream.encode(frame):
            container.mux(packet)
        if astream is not None:
            # Feed audio up to the end of this video frame so the muxer receives both streams in time order and
            # the mdat is interleaved (a player streaming the file never has to seek far ahead for audio).
            audio_end = min(len(wave), round((i + 1) / rate * sample_rate))
            audio_pos = _encode_audio(container, astream, wave, audio_pos, audio_end, sample_rate)
    for packet in vstream.encode(None):
        container.mux(packet)
    if astream is not None:
        _encode_audio(container, astream, wave, audio_pos, len(wave), sample_rate)
        for packet in astream.encode(None):
            container.mux(packet)


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


def _video_frame(rgb: np.ndarray) -> av.VideoFrame:
    """rgb: uint8 [H, W, 3] -> yuv420p VideoFrame in BT.709 limited range (the matrix the stream is tagged with)."""
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


def _top_level_boxes(path: Path) -> tuple[str, ...]:
    """Types of the top-level ISO BMFF boxes in file order (e.g. ('ftyp', 'moov', 'free', 'mdat'))."""
    boxes = []
    size_total = path.stat().st_size
    with open(path, "rb") as f:
        offset = 0
        while offset < size_total:
            f.seek(offset)
            header = f.read(8)
            if len(header) < 8:
                raise ValueError(f"probe_mp4: expected an 8-byte box header at offset {offset} of {path}, file ends")
            size = int.from_bytes(header[:4], "big")
            if size == 1:
                large = f.read(8)
                if len(large) < 8:
                    raise ValueError(f"probe_mp4: expected a 64-bit box size at offset {offset + 8} of {path}")
                size = int.from_bytes(large, "big")
            elif size == 0:
                size = size_total - offset
            if size < 8:
                raise ValueError(f"probe_mp4: expected a box size >= 8 at offset {offset} of {path}, found {size}")
            boxes.append(header[4:8].decode("latin-1"))
            offset += size
    return tuple(boxes)


def _seconds(pts: int | None, time_base: Fraction | None) -> float | None:
    if pts is None or time_base is None:
        return None
    return float(pts * time_base)
