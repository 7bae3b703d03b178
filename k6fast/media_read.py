"""Reading MP4 files back: `probe_mp4` says what a file holds (streams, durations, tags, box order), `read_mp4`
decodes it. For tests and the quality gate; `media.write_mp4` is what writes them (and re-exports both).

Check: `pytest tests/test_media.py`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path

import av
import numpy as np

__all__ = ["Mp4Info", "probe_mp4", "read_mp4"]


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
