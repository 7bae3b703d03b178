"""What an acceptance run's files say, and the table they make: a row per run from the `k6fast generate` sidecar
(or the peer's visit record), latent errors between arms, and the Markdown table of a session.

Pure reading and formatting (no GPU, no model code): the CPU tests hold it against hand-made records.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .projection import PROJECTION_COLUMNS, PROJECTION_NOTES, projected_s, projection_cell
from .serve_report import serve_lines
from .table_cells import PHASES_HEADER, gb, gib, phase_split, secs

ROWS_FILE = "runs.jsonl"
PLAN_FILE = "acceptance.json"
SERVE_DIR = "serve"  # measurements/bench_serve_defaults.py's records of the same session


def is_peer_arm(arm: str) -> bool:
    """The peer rows of an acceptance run: diffusers' own pipeline (`diffusers`, `diffusers-offload`)."""
    return arm.startswith("diffusers")


def peer_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [row for row in rows if is_peer_arm(str(row.get("arm", "")))]


def latent_error(latents: Path, reference: Path) -> dict[str, dict[str, float]]:
    """Per stream (video, audio): relative L2 ‖a − r‖ / ‖r‖ and cosine similarity of the final latents, in fp64."""
    from safetensors.torch import load_file

    a, r = load_file(str(latents)), load_file(str(reference))
    out = {}
    for key in sorted(set(a) & set(r)):
        x, y = a[key].double().flatten(), r[key].double().flatten()
        if x.shape != y.shape:
            raise ValueError(f"{latents}: {key} latents {tuple(a[key].shape)} vs reference {tuple(r[key].shape)}")
        ref_norm = float(y.norm())
        rel = float((x - y).norm()) / ref_norm if ref_norm > 0 else float((x - y).norm())
        cos = float(x @ y) / (float(x.norm()) * ref_norm) if ref_norm > 0 and float(x.norm()) > 0 else 1.0
        out[key] = {"rel_l2": rel, "cosine": cos}
    return out


def _hidden_share(stream_steps: list[dict]) -> float | None:
    copy = sum(s.get("copy_s", 0.0) for s in stream_steps)
    exposed = sum(s.get("exposed_s", 0.0) for s in stream_steps)
    return None if copy <= 0 else 1 - exposed / copy


def request_summary(run_dir: Path, *, peer: bool = False) -> dict[str, Any]:
    """The figures of one run from what its process wrote: `clip.mp4.json` (k6fast) or `peer.json` (the peer's
    bench visit). Empty when the process wrote nothing (it failed before the end); `error` when it says so."""
    path = run_dir / ("peer.json" if peer else "clip.mp4.json")
    if not path.is_file():
        return {}
    record = json.loads(path.read_text())
    if peer:
        if "error" in record:
            return {"error": record["error"]}
        request = record["requests"][0]
        telemetry = request["telemetry"]
        extra = {"load_s": record.get("load_s"), "import_s": record.get("import_s"),
                 "child_peak_rss_anon_bytes": record.get("peak_rss_anon_bytes")}  # fmt: skip
        provenance = record.get("provenance", {})
        gpu = (record.get("environment") or {}).get("gpu_name")
    else:
        telemetry = record["telemetry"]
        extra = {"load_s": record.get("load_s"), "residency": record.get("residency")}
        provenance = record.get("provenance", {})
        gpu = record.get("gpu_name")
    phases = telemetry.get("phases_s", {})
    return {
        **extra,
        "request_s": sum(phases.values()),
        "phases_s": phases,
        "steps": len(telemetry.get("step_s", [])),
        "step_s": telemetry.get("step_s", []),
        "dit_calls": telemetry.get("dit_calls"),
        "compile_s": telemetry.get("compile_s", 0.0),
        "compiled_graphs": telemetry.get("compiled_graphs", 0),
        "peak_vram_bytes": telemetry.get("peak_vram_bytes", 0),
        "peak_vram_reserved_bytes": telemetry.get("peak_vram_reserved_bytes", 0),
        "phase_peaks": telemetry.get("phase_peaks", {}),
        "hidden_share": _hidden_share(telemetry.get("stream_steps", [])),
        "video_decode": telemetry.get("video_decode", ""),
        # Since the text phase streams its weights (absent from older records and the peer's).
        "text_source": telemetry.get("text_source"),
        "text_bytes_streamed": telemetry.get("text_bytes_streamed"),
        "text_ahead_s": telemetry.get("text_ahead_s"),  # encoded beside the load (generate, since 7dabbab)
        "dit_blocks_uploaded": telemetry.get("dit_blocks_uploaded"),
        "ru_maxrss_bytes": telemetry.get("peak_host_rss_bytes"),
        "commit": provenance.get("git_commit"),
        "dirty": provenance.get("git_dirty"),
        "arm_hash": provenance.get("arm_hash"),
        "gpu_name": gpu,
    }


def _latents(row: dict[str, Any]) -> str:
    errors = row.get("vs_reference")
    if not errors:
        return "—"
    return " / ".join(f"{key} {e['rel_l2']:.2e}, cos {e['cosine']:.5f}" for key, e in errors.items())


def _result(row: dict[str, Any]) -> str:
    if row.get("passed"):
        return "PASS"
    return "**FAIL**: " + str(row.get("error", "")).replace("|", "/")[:160]


COLUMNS = (
    "run", "result", "request vs peer", "process s", "request s", PHASES_HEADER,
    "compile s (graphs)", "peak VRAM alloc / reserved GiB", "denoise peak GiB", "nvidia-smi peak GiB",
    "peak host RSS GiB", "copies hidden", "final latents vs reference (rel. L2, cosine)",
)  # fmt: skip
COLUMN_NOTES = (
    "Columns: request vs peer = the peer row's request seconds over this row's (> 1: faster than the peer); process "
    "s = the whole `k6fast generate` process (imports, load, request, exit); request s = the sum of the request's "
    "phases; peak VRAM = the caching allocator's peaks over the request (what the budget caps); denoise peak = "
    "reserved during denoising alone (what the residency planner's estimate covers); nvidia-smi peak = device memory "
    "in use above the idle level while the process ran (CUDA context included); peak host RSS = VmRSS sampled every "
    "0.25 s; copies hidden = share of the streamed weight copies overlapped with compute."
)
# Shown where a record has them (rows measured since the disk-read column was added): older tables stay as they were.
EXTRA_COLUMNS = ("text source", "disk read GB", "DiT re-uploads")
EXTRA_NOTES = (
    'text source = where the prompt\'s embeddings came from (encoded, or a prompt-cache hit; "at load (N s)": '
    "encoded on a thread beside the load, its N seconds overlapping it, the text phase column only the wait); disk "
    "read GB = bytes the process caused to be read from storage (read_bytes of /proc/PID/io, sampled with the RSS; "
    "page-cache hits and files in a RAM-backed folder such as /dev/shm read nothing); DiT re-uploads = resident DiT "
    "blocks uploaded during the request, and the seconds of its `dit_load` phase where the DiT left the device for "
    "the text phase."
)


# Shown where a record's residency plan has the host tier's figures (rows measured since K6_HOST_CACHE_GB): the
# streamed blocks the process held in locked host memory, each read from disk once.
TIER_COLUMNS = ("host tier GB (blocks)",)
TIER_NOTES = (
    "host tier = the streamed DiT blocks the process held in locked host memory (K6_HOST_CACHE_GB), read from disk "
    "once and copied to the GPU from there every step: their stored GB and how many; none = it held none."
)


# Shown where a row ran beside the host-memory ballast with doctor's prediction (`disk_prediction.py`): rows since
# then; older tables stay as they were.
PREDICTION_COLUMNS = ("disk GB/step predicted / measured", "s/step floor / measured")
PREDICTION_NOTES = (
    "disk GB/step: doctor's prediction (`k6fast doctor`'s predict_disk_per_step for the row's arm, budget and "
    "geometry, with the host's MemAvailable once the ballast held its memory, the host tier the run's "
    "K6_HOST_CACHE_GB gives, and the session's disk read speed by doctor's read test) of the bytes one scan of the "
    "streamed blocks reads from disk, against the run's: (read_bytes when step k1 had ended − when step k0 had ended) "
    "/ DiT forwards in steps k0+1..k1, k0 the first step boundary the watcher saw at or after the first step (which "
    "fills the host tier; before it come the load and the text phase), k1 the last (read_bytes of /proc/PID/io, read "
    "just after the step count in the process's progress bar); s/step: the reading's floor at that speed against the "
    "run's seconds per DiT forward over the same steps. No run passes or fails on them."
)


# Shown where a record has runs on the lossless compressed checkpoint (`Run.checkpoint == "df11"`).
DF11_COLUMNS = ("latents vs the BF16 checkpoint's",)
DF11_NOTES = (
    "latents vs the BF16 checkpoint's: a run on the DF11 copy of the checkpoint (`k6fast quantize --format df11`, "
    "lossless) against the same run on the BF16 checkpoint: bit-identical final latents, or the streams that differ "
    "(the run then fails); — for runs on the BF16 checkpoint."
)


def latents_identical(latents: Path, other: Path) -> dict[str, bool]:
    """Per stream (video, audio): whether the two runs' final latents are equal bit for bit."""
    import torch
    from safetensors.torch import load_file

    a, b = load_file(str(latents)), load_file(str(other))
    return {key: key in b and torch.equal(a[key], b[key]) for key in sorted(a)}


def _vs_bf16(row: dict[str, Any]) -> str:
    if not row.get("checkpoint"):
        return "—"
    same = row.get("vs_bf16")
    if same is None:
        return "not compared"
    differ = [key for key, equal in same.items() if not equal]
    return "bit-identical" if not differ else f"**differ**: {', '.join(differ)}"


def _predicted_vs_measured(row: dict[str, Any]) -> list[str]:
    d = row.get("disk_per_step")
    if d is None:
        return ["—", "—"]
    return [f"{gb(d.get('predicted_bytes'))} / {gb(d.get('measured_bytes'))}",
            f"{secs(d.get('predicted_min_s'))} / {secs(d.get('measured_s'))}"]  # fmt: skip


def _host_tier(row: dict[str, Any]) -> str:
    residency = row.get("residency") or {}
    if "host_blocks" not in residency:
        return "—"
    if not residency["host_blocks"]:
        return "none"
    return f"{residency.get('host_bytes', 0) / 1e9:.2f} ({residency['host_blocks']})"


def peer_request_s(rows: list[dict[str, Any]]) -> tuple[str, float, bool] | None:
    """(arm, request seconds, projected) of the first passing peer row, None without one: its projected whole
    request where it was stopped (`projection`)."""
    for row in peer_rows(rows):
        if row.get("passed") and row.get("request_s"):
            projected = projected_s(row)
            return str(row["arm"]), projected or float(row["request_s"]), projected is not None
    return None


def _vs_peer(row: dict[str, Any], peer: tuple[str, float, bool] | None) -> str:
    """The peer's request over this row's; for stopped runs (either side projected or meant to be) only the two
    projections are compared: stopped requests are not the requests a user waits for."""
    if is_peer_arm(str(row.get("arm", ""))):
        return "peer"
    if peer is None or not row.get("passed"):
        return "—"
    if peer[2] or row.get("projected") is not None:
        mine = projected_s(row)
        if not (peer[2] and mine):
            return "— (no projection)"
        return f"{peer[1] / mine:.2f}× (projected)"
    mine = row.get("request_s")
    return f"{peer[1] / mine:.2f}×" if mine else "—"


def table_row(row: dict[str, Any], peer: tuple[str, float] | None = None, groups: tuple[ColumnGroup, ...] = ()) -> str:
    phases = row.get("phases_s") or {}
    denoise_peak = (row.get("phase_peaks") or {}).get("denoise", {}).get("reserved")
    smi = row.get("peak_smi_used_mib")
    hidden = row.get("hidden_share")
    cells = [
        row.get("run", "?"),
        _result(row),
        _vs_peer(row, peer),
        secs(row.get("process_s")),
        secs(row.get("request_s")) if row.get("request_s") else "—",
        phase_split(phases) if phases else "—",
        f"{secs(row.get('compile_s'))} ({row.get('compiled_graphs', 0)})" if row.get("phases_s") else "—",
        f"{gib(row.get('peak_vram_bytes'))} / {gib(row.get('peak_vram_reserved_bytes'))}",
        gib(denoise_peak),
        "—" if not smi else f"{smi / 1024:.2f}",
        gib(row.get("peak_rss_bytes")),
        "—" if hidden is None else f"{100 * hidden:.1f} %",
        _latents(row),
    ]
    for group in groups:
        cells += group.cells(row)
    return "| " + " | ".join(str(c) for c in cells) + " |"


def _reuploads(row: dict[str, Any]) -> str:
    blocks, reload = row.get("dit_blocks_uploaded"), (row.get("phases_s") or {}).get("dit_load")
    if blocks is None and reload is None:
        return "—"
    return f"{blocks or 0} blocks" + (f", {reload:.1f} s reload" if reload else "")


CEILING_COLUMNS = ("DiT step vs ceiling",)
CEILING_NOTES = (
    "DiT step vs ceiling = the steady step's ceiling over its measured time (median of the steps past the exact first "
    "ones and the process's first, before the exact last ones, cached steps left out): the ceiling is the step's "
    "video self-attention and video-token GEMMs (twice under CFG) at the fastest kernel times measured on this GPU "
    "(`k6fast.bench.roofline`, its sources named there), nothing else counted; — where none were measured for the "
    "GPU, shape or format."
)


DECODE_COLUMNS = ("video decode vs ceiling",)
DECODE_NOTES = (
    "video decode vs ceiling = the exact decode's least work (counted on the meta device, the whole clip, nothing "
    "recomputed: TFLOP in the cell) at the fastest dense BF16 rate measured on this GPU, over the run's video decode "
    "seconds (`k6fast.bench.decode_ceiling`): what a plan recomputes to fit the budget and a first call's set-up count "
    "against it; — where no rate was measured for the GPU."
)


def _ceiling(row: dict[str, Any], key: str = "step_ceiling", measured: str = "steady_s") -> str:
    c = row.get(key) or {}
    if "share" not in c:
        return "—"
    flops = f", {c['tflop']:.0f} TFLOP" if "tflop" in c else ""
    return f"{c['share']:.0%} ({c['ceiling_s']:.2f} of {c[measured]:.2f} s{flops})"


def _text_source(row: dict[str, Any]) -> str:
    source, ahead = row.get("text_source") or "—", row.get("text_ahead_s")
    return source if ahead is None else f"{source} at load ({ahead:.2f} s)"


@dataclass(frozen=True)
class ColumnGroup:
    """Columns a table shows only where one of its rows has them (rows measured since they were added): an older
    record's table renders as it did."""

    columns: tuple[str, ...]
    notes: str
    present: Callable[[dict[str, Any]], bool]  # whether a row has them
    cells: Callable[[dict[str, Any]], list[str]]


OPTIONAL_GROUPS = (
    ColumnGroup(EXTRA_COLUMNS, EXTRA_NOTES, lambda r: "disk_read_bytes" in r,
                lambda r: [_text_source(r), gb(r.get("disk_read_bytes")), _reuploads(r)]),
    ColumnGroup(TIER_COLUMNS, TIER_NOTES, lambda r: "host_blocks" in (r.get("residency") or {}),
                lambda r: [_host_tier(r)]),
    ColumnGroup(PREDICTION_COLUMNS, PREDICTION_NOTES, lambda r: "disk_per_step" in r, _predicted_vs_measured),
    ColumnGroup(DF11_COLUMNS, DF11_NOTES, lambda r: bool(r.get("checkpoint")), lambda r: [_vs_bf16(r)]),
    ColumnGroup(CEILING_COLUMNS, CEILING_NOTES, lambda r: bool(r.get("step_ceiling")), lambda r: [_ceiling(r)]),
    ColumnGroup(DECODE_COLUMNS, DECODE_NOTES, lambda r: bool(r.get("decode_ceiling")),
                lambda r: [_ceiling(r, "decode_ceiling", "decode_s")]),
    ColumnGroup(PROJECTION_COLUMNS, PROJECTION_NOTES, lambda r: bool(r.get("projected")), projection_cell),
)  # fmt: skip


def shown_groups(rows: list[dict[str, Any]]) -> tuple[ColumnGroup, ...]:
    return tuple(g for g in OPTIONAL_GROUPS if any(g.present(r) for r in rows))


def table_lines(rows: list[dict[str, Any]]) -> list[str]:
    """The Markdown table of an acceptance run: a header and a row per run, each row's request against the peer's
    (with each optional column group some row has)."""
    peer, groups = peer_request_s(rows), shown_groups(rows)
    columns = COLUMNS + tuple(c for g in groups for c in g.columns)
    header = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    return [*header, *(table_row(r, peer, groups) for r in rows)]


def _text_encoders(plan: dict[str, Any]) -> list[str]:
    te = plan.get("text_encoders")
    if not te:
        return []
    where = te.get("folder") or "?"
    fs = f" ({te['filesystem']})" if te.get("filesystem") else ""
    link = ", linked from the checkpoint" if te.get("linked") else ""
    kind = te.get("synthetic") or "the checkpoint's own"
    lines = [f"- text encoders: {kind}; {gb(te.get('bytes'))} GB in {where}{fs}{link}"]
    peer = plan.get("peer_text_encoders")
    if peer:
        lines.append(f"- the peer read {plan.get('peer_model', '?')}: text encoders {peer.get('synthetic') or '?'}, "
                     f"{gb(peer.get('bytes'))} GB (it holds them and the DiT in host memory)")  # fmt: skip
    return lines


def stopped_note(plan: dict[str, Any], rows: list[dict[str, Any]]) -> list[str]:
    """The plan's `--stop-after-steps` (and the peer's own, `--peer-stop-after-steps`), said in a line of its own;
    the peer is named only where a peer row is in `rows` (a part without the peer ran none); none for runs of the
    whole schedule."""
    k, steps = plan.get("stop_after_steps"), plan.get("steps")
    peer_k = (plan.get("peer_stop_after_steps") or k) if peer_rows(rows) else None
    if not (k or peer_k):
        return []
    ours = f"the first {k} of its {steps} steps (`--stop-after-steps`)"
    if peer_k == k:
        who = f"every run (the peer's too) denoised only {ours}"
    elif not k:
        who = f"the peer denoised only the first {peer_k} of its {steps} steps (`--peer-stop-after-steps`)"
    else:
        who = f"every run denoised only {ours}" + (
            f", the peer its first {peer_k} (`--peer-stop-after-steps`)" if peer_k else ""
        )
    return [f"- {who} and decoded what they left: the per-step times are the figures; the request's is not a finished "
            "clip's"]  # fmt: skip


def _df11_model(plan: dict[str, Any]) -> list[str]:
    where = plan.get("df11_model")
    return [f"- the df11 runs read {where}, the checkpoint's lossless compressed copy"] if where else []


def _read_test(plan: dict[str, Any]) -> list[str]:
    test = plan.get("disk_read_test")
    if not test:
        return []
    return [f"- checkpoint read speed before the ballast runs: {test['read_gb_s']:.2f} GB/s (`k6fast doctor`'s read "
            f"test: {test.get('note', '')}); the disk GB/step column's predictions use it"]  # fmt: skip


def column_notes(rows: list[dict[str, Any]]) -> list[str]:
    """What the table's columns mean: the base columns' notes, then those of each optional column group the rows
    have (a record's README and the project README's results say the same)."""
    return [COLUMN_NOTES, *(line for g in shown_groups(rows) for line in ("", g.notes))]


def render_table(rows: list[dict[str, Any]], plan: dict[str, Any], serve: list[dict[str, Any]] = ()) -> str:
    """The session's README: what ran, on what, a row per run, and the `serve` records of the session."""
    commits = sorted({str(r.get("commit")) + (" (dirty)" if r.get("dirty") else "") for r in rows if r.get("commit")})
    gpus = sorted({r["gpu_name"] for r in rows if r.get("gpu_name")})
    passed = sum(1 for r in rows if r.get("passed"))
    lines = [
        f"# Acceptance: {plan.get('model')} at {plan.get('geometry')}, {plan.get('steps')} steps",
        "",
        f"Generated by `k6fast acceptance` (`{' '.join(plan.get('argv', []))}`); started {plan.get('started')}"
        + (f", finished {plan['finished']}" if plan.get("finished") else ", still running or interrupted")
        + ".",
        "",
        f"- GPU: {', '.join(gpus) or 'none'}; versions: {json.dumps(plan.get('versions', {}))}",
        f"- commit(s): {', '.join(commits) or 'unknown'}",
        f"- checkpoint: {plan.get('checkpoint_note', plan.get('model'))}",
        *_df11_model(plan),
        *stopped_note(plan, rows),
        *_text_encoders(plan),
        *_read_test(plan),
        f"- each run a fresh process: `k6fast generate --arm ARM` under `K6_VRAM_BUDGET_GB`; cold = empty Inductor and "
        "Triton caches, warm = the caches a cold run of the same arm left; seed "
        f"{plan.get('seed')}, prompt: {plan.get('prompt')!r}",
        f"- {passed} of {len(rows)} runs passed",
        "",
        *table_lines(rows),
        "",
        *column_notes(rows),
        "",
        *(serve_lines(list(serve)) if serve else []),
    ]
    return "\n".join(lines)
