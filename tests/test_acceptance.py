"""`k6fast acceptance` on the CPU: the plan's order, a real session on the tiny checkpoint (fresh `k6fast generate`
processes, latents compared with the reference's, the table), a failing run recorded as such, the ballast's sizing,
the bytes a run reads from disk, and a synthetic checkpoint written with real-size text encoders in another folder
(recorded as such)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from k6fast.bench.acceptance import ProcessWatch, build_plan
from k6fast.bench.acceptance_cli import filesystem_type, text_encoder_note
from k6fast.bench.acceptance_report import COLUMNS, EXTRA_COLUMNS, latent_error, render_table, request_summary
from k6fast.bench.ballast import CHUNK, bytes_to_hold
from k6fast.bench.records import read_jsonl
from k6fast.cli import main


def test_plan_runs_cold_then_warm_then_other_budgets_then_ballast_then_peer() -> None:
    runs = build_plan(["reference", "final"], [32, 31], ballast_arms=["reference"], host_ram_gb=60,
                      peer="diffusers-offload")  # fmt: skip
    assert [r.slug for r in runs] == [
        "reference-32-cold", "final-32-cold", "reference-32-warm", "final-32-warm",
        "reference-31-warm", "final-31-warm", "reference-32-warm-host60", "diffusers-offload-32-cold",
    ]  # fmt: skip
    assert runs[-1].peer and not runs[0].peer
    assert runs[-2].name == "reference @ 32 GiB, warm, 60 GB host"
    with pytest.raises(ValueError, match="at least one arm"):
        build_plan([], [32])


def test_latent_error_is_zero_against_itself_and_measures_a_perturbation(tmp_path) -> None:
    g = torch.Generator().manual_seed(0)
    ref = {"video": torch.randn(1, 3, 4, 4, 16, generator=g), "audio": torch.randn(1, 7, 8, generator=g)}
    save_file(ref, str(tmp_path / "ref.safetensors"))
    save_file({"video": ref["video"] * 1.01, "audio": -ref["audio"]}, str(tmp_path / "arm.safetensors"))
    same = latent_error(tmp_path / "ref.safetensors", tmp_path / "ref.safetensors")
    assert same["video"] == {"rel_l2": 0.0, "cosine": pytest.approx(1.0)}
    err = latent_error(tmp_path / "arm.safetensors", tmp_path / "ref.safetensors")
    assert err["video"]["rel_l2"] == pytest.approx(0.01, rel=1e-5) and err["video"]["cosine"] == pytest.approx(1.0)
    assert err["audio"]["rel_l2"] == pytest.approx(2.0) and err["audio"]["cosine"] == pytest.approx(-1.0)


def test_ballast_leaves_what_was_asked_in_whole_chunks() -> None:
    total = 128 * 2**30
    held = bytes_to_hold(total, 60)
    assert held % CHUNK == 0 and 0 <= total - held - 60e9 < CHUNK
    assert bytes_to_hold(50 * 2**30, 60) == 0


def test_a_run_without_a_sidecar_reports_nothing_and_the_table_says_fail(tmp_path) -> None:
    assert request_summary(tmp_path) == {}
    row = {"run": "fast @ 32 GiB, cold", "passed": False, "error": "timed out after 900 s: compiling | x"}
    table = render_table([row], {"model": "m", "geometry": "864x480x121", "steps": 10, "argv": ["k6fast"]})
    assert "**FAIL**: timed out after 900 s: compiling / x" in table and "0 of 1 runs passed" in table


@pytest.mark.slow
def test_acceptance_session_on_the_tiny_checkpoint(tiny_distill, tmp_path) -> None:
    out, work = tmp_path / "record", tmp_path / "work"
    argv = ["acceptance", "--model", str(tiny_distill), "--arms", "reference,step-cache", "--budgets", "8",
            "--host-ram-gb", "0", "--peer", "none", "--geometry", "64x64x5", "--out", str(out), "--work", str(work),
            "--timeout", "300", "--only"]  # fmt: skip
    # In two parts, as a lease that must be polled runs it: the second continues the first's record. The first part
    # has no reference yet; its row is compared once the reference has run.
    assert main([*argv, "step-cache-8-cold"]) == 0
    assert "vs_reference" not in read_jsonl(out / "runs.jsonl")[0]
    assert main([*argv, "reference-8-cold,step-cache-8-warm"]) == 0
    assert main([*argv[:-1], "--seed", "7", "--only", "reference-8-cold"]) == 2  # another workload: refused
    rows = read_jsonl(out / "runs.jsonl")
    assert [r["run"] for r in rows] == [
        "step-cache @ 8 GiB, cold", "reference @ 8 GiB, cold", "step-cache @ 8 GiB, warm"
    ]  # fmt: skip
    assert all(r["passed"] and r["returncode"] == 0 for r in rows), [r.get("error") for r in rows]
    cached, ref, warm = rows
    assert ref["vs_reference"]["video"]["rel_l2"] == 0.0
    # The step cache skips one DiT call: its latents differ from the reference's, the same in both of its runs.
    assert 0 < cached["vs_reference"]["video"]["rel_l2"] == warm["vs_reference"]["video"]["rel_l2"]
    assert cached["dit_calls"] == ref["dit_calls"] - 1 and ref["steps"] == cached["steps"] == 10
    assert ref["peak_rss_bytes"] > 0 and ref["request_s"] > 0 and ref["residency"]["num_blocks"] == 2
    assert all(isinstance(r["disk_read_bytes"], int) for r in rows)  # /proc/PID/io of each `k6fast generate`
    assert set(ref["phases_s"]) >= {"text_encode", "denoise", "video_decode", "mux"}
    # Every row encodes the prompt, the warm one after a cold one too: the prompt cache is off in the runs.
    assert [r["text_source"] for r in rows] == ["encoded"] * 3
    plan = json.loads((out / "acceptance.json").read_text())
    assert plan["finished"] and plan["steps"] == 10 and len(plan["runs"]) == 3 and plan["parts"] == 2
    assert plan["variant"] == "custom-distill"  # README groups records by it (the tiny model: no released width)
    table = (out / "README.md").read_text()
    assert "3 of 3 runs passed" in table and table.count("| PASS |") == 3 and "| disk read GB |" in table
    assert ref["clip_bytes"] > 0 and (work / "runs" / "reference-8-cold" / "clip.mp4.json").is_file()


def _evicted_file(path, nbytes: int) -> None:
    """A file of random bytes that is on disk and not in the page cache (read again, it comes from storage)."""
    with open(path, "wb") as f:
        f.write(os.urandom(nbytes))
        f.flush()
        os.fsync(f.fileno())
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _disk_backed(tmp_path: Path) -> Path | None:
    """A writable folder on storage (not RAM): pytest's own, else one under /var/tmp; None where both are RAM."""
    if filesystem_type(tmp_path) != "tmpfs":
        return tmp_path
    var_tmp = Path("/var/tmp")
    if var_tmp.is_dir() and os.access(var_tmp, os.W_OK) and filesystem_type(var_tmp) != "tmpfs":
        return Path(tempfile.mkdtemp(dir=var_tmp, prefix="k6-watch-"))
    return None


def test_process_watch_counts_the_bytes_a_child_reads_from_disk_per_window(tmp_path) -> None:
    folder = _disk_backed(tmp_path)
    on_disk = folder is not None
    folder = folder or tmp_path  # all RAM-backed: the same reads must then count as no storage reads at all
    mib = 2**20
    _evicted_file(folder / "a.bin", 8 * mib)
    _evicted_file(folder / "b.bin", 4 * mib)
    child = ("import sys\nfor name in sys.argv[1:]:\n    open(name, 'rb').read()\n    print(name, flush=True)\n"
             "    sys.stdin.readline()\n")  # fmt: skip
    proc = subprocess.Popen([sys.executable, "-c", child, str(folder / "a.bin"), str(folder / "b.bin")],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)  # fmt: skip
    watch = ProcessWatch(proc.pid, interval_s=0.05, smi="")
    try:
        proc.stdout.readline()
        peak_a, read_a = watch.mark()  # the start-up and the first file
        proc.stdin.write("\n")
        proc.stdin.flush()
        proc.stdout.readline()
        peak_b, read_b = watch.mark()  # the second file alone
        proc.stdin.write("\n")
        proc.stdin.flush()
        proc.wait(timeout=30)
    finally:
        proc.kill()
        row = watch.stop()
        if folder != tmp_path:
            shutil.rmtree(folder)
    assert row["disk_read_bytes"] >= read_a + read_b and row["peak_rss_bytes"] >= max(peak_a, peak_b) > 0
    if on_disk:
        assert read_a >= 8 * mib and 4 * mib <= read_b < 8 * mib, (read_a, read_b)
    else:  # RAM-backed files are never read from storage: the counter must not mistake them for disk reads
        assert read_b < mib, (read_a, read_b)


def test_disk_read_columns_only_where_the_rows_have_them() -> None:
    plan = {"model": "m", "geometry": "864x480x121", "steps": 10, "argv": ["k6fast"]}
    old = {"run": "final @ 32 GiB, warm", "arm": "final", "passed": True, "request_s": 50.0,
           "phases_s": {"text_encode": 1.0, "denoise": 40.0, "video_decode": 8.0, "mux": 1.0}}  # fmt: skip
    header = "| " + " | ".join(COLUMNS) + " |"
    assert header in render_table([old], plan) and "disk read" not in render_table([old], plan)
    new = {**old, "disk_read_bytes": 12_340_000_000, "phases_s": {**old["phases_s"], "dit_load": 2.5},
           "text_source": "encoded", "dit_blocks_uploaded": 0}  # fmt: skip
    cached = {**old, "disk_read_bytes": 0, "text_source": "disk", "dit_blocks_uploaded": 3}
    ahead = {**new, "text_ahead_s": 2.345}
    table = render_table([old, new, cached, ahead], plan)
    assert "| " + " | ".join(COLUMNS + EXTRA_COLUMNS) + " |" in table
    rows = [line for line in table.splitlines() if line.startswith("| final")]
    assert rows[0].endswith("| — | — | — |") and rows[1].endswith("| encoded | 12.34 | 0 blocks, 2.5 s reload |")
    assert rows[2].endswith("| disk | 0.00 | 3 blocks |")
    assert rows[3].endswith("| encoded at load (2.35 s) | 12.34 | 0 blocks, 2.5 s reload |")
    assert "read_bytes of /proc/PID/io" in table


def test_acceptance_writes_full_text_encoders_into_a_folder_and_records_them(tmp_path, monkeypatch) -> None:
    from test_synthetic import REDUCED_CLIP, REDUCED_QWEN_TEXT, REDUCED_QWEN_VISION

    from k6fast.testing import synthetic, synthetic_text

    for name, reduced in (("QWEN_7B_TEXT", REDUCED_QWEN_TEXT), ("QWEN_7B_VISION", REDUCED_QWEN_VISION),
                          ("CLIP_L_TEXT", REDUCED_CLIP)):  # fmt: skip
        monkeypatch.setattr(synthetic_text, name, {**getattr(synthetic_text, name), **reduced})
    calls = []
    real = synthetic.make_synthetic

    def one_block(out_dir, **kwargs):  # the acceptance writes full depth; one block keeps the test small
        calls.append(kwargs)
        return real(out_dir, blocks=1, **kwargs)

    monkeypatch.setattr(synthetic, "make_synthetic", one_block)
    model, text_dir = tmp_path / "syn", tmp_path / "shm" / "k6-text"
    argv = ["acceptance", "--model", str(model), "--make-synthetic", "lite-distill", "--only", "no-such-run"]
    assert main([*argv, "--text-encoder-dir", str(text_dir)]) == 2  # a folder holds full-size encoders only
    assert not calls
    assert main([*argv, "--text-encoders", "full", "--text-encoder-dir", str(text_dir)]) == 2  # --only refused
    assert calls == [{"preset": "lite-distill", "text_encoders": "full", "text_encoder_dir": str(text_dir)}]
    note = text_encoder_note(model)
    marker = json.loads((model / "synthetic.json").read_text())
    assert note["linked"] and note["folder"] == str(text_dir.resolve())
    # The files' bytes (what a run reads), the tensors' bytes that synthetic.json notes and their headers.
    assert note["bytes"] == sum(f.stat().st_size for f in text_dir.rglob("*.safetensors"))
    assert note["bytes"] > marker["text_encoder_bytes"] > 0 and note["synthetic"] == marker["text_encoders"]
    assert note["filesystem"] == filesystem_type(text_dir.resolve())
    table = render_table([], {"model": str(model), "text_encoders": note})
    assert "- text encoders: real shapes, random weights" in table and "linked from the checkpoint" in table


def _serve_record() -> dict:
    """What measurements/bench_serve_defaults.py writes, cut to the fields the tables read."""

    def job(name: str, plan: str, outcome: str, **more) -> dict:
        return {"name": name, "geometry": "864x480x121", "plan": plan, "outcome": outcome, "done_after_s": 80.0,
                "run_s": 75.0, **more}  # fmt: skip

    phases = {"text_encode": 1.2, "denoise": 60.0, "audio_decode": 0.4, "video_decode": 8.0, "mux": 0.5}
    telemetry = {"phases_s": phases, "text_source": "encoded"}
    return {
        "arm": "final", "budget_gb": 32.0, "client": "openai 2.8.0 SDK", "passed": True, "problems": [],
        "startup": {"ready_s": 41.5, "disk_read_bytes": 3_000_000_000}, "peak_rss_bytes": 9 * 2**30,
        "peak_smi_used_mib": 32000, "disk_read_bytes": 5_000_000_000,
        "jobs": [job("large-first-prompt", "complete", "completed", telemetry=telemetry, disk_read_bytes=10**9,
                     peak_rss_bytes=8 * 2**30),
                 job("large-deleted", "delete", "deleted", delete={"progress": 36, "took_effect_s": 0.42,
                                                                   "phase": "denoise"})],
        "oversize": {"geometry": "1280x720x241", "status": 400, "queued": False,
                     "message": "1280x720 with 241 frames does not fit the VRAM budget of 32.0 GiB: at 1280x720 at "
                                "most 121 frames fit"},
    }  # fmt: skip


def test_serve_records_of_a_session_show_in_its_readme_and_the_projects(tmp_path) -> None:
    from k6fast.bench.acceptance import write_readme
    from k6fast.bench.readme_results import results_block

    root = tmp_path / "measurements" / "sessions"
    record = root / "2026-12-03_acceptance-user"
    (record / "serve").mkdir(parents=True)
    note = {"synthetic": True, "preset": "pro-distill", "num_visual_blocks": 60, "full_depth_blocks": 60}
    plan = {"model": "/tmp/syn", "geometry": "864x480x121", "steps": 10, "started": "2026-12-03T10:00",
            "argv": ["k6fast"], "checkpoint_note": f"/tmp/syn (synthetic: {json.dumps(note)})"}  # fmt: skip
    (record / "acceptance.json").write_text(json.dumps(plan))
    rows = [{"run": "final @ 32 GiB, warm", "arm": "final", "passed": True, "request_s": 70.0, "gpu_name": "H200",
             "phases_s": {"text_encode": 1.0}, "disk_read_bytes": 0},
            {"run": "diffusers-offload @ 32 GiB, cold", "arm": "diffusers-offload", "passed": True,
             "request_s": 99.0}]  # fmt: skip
    (record / "runs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert not write_readme(tmp_path / "no-record")  # no plan yet: nothing to render
    (record / "serve" / "final-32.json").write_text(json.dumps(_serve_record()))
    assert write_readme(record)
    readme = (record / "README.md").read_text()
    block = results_block(root, tmp_path)
    for text, heading in ((readme, "## "), (block, "#### ")):
        assert f"\n{heading}`k6fast serve` at its defaults\n" in text
        assert "- `final @ 32 GiB` (openai 2.8.0 SDK): PASS; ready in 41.5 s (read 3.00 GB)" in text
        assert "DELETE at 36 % took effect in 0.42 s (denoise)" in text
        assert "oversize 1280x720x241: 400, not queued: '1280x720 with 241 frames does not fit" in text
        assert ("| final @ 32 GiB | large-first-prompt | 864x480x121 | completed | 80.0 | 75.0 | "
                "1.2 / 60.0 / 0.4 / 8.0 / 0.5 | encoded | 1.00 | 8.00 |") in text  # fmt: skip
        assert "| final @ 32 GiB | large-deleted | 864x480x121 | deleted |" in text
        assert "disk read GB = bytes the process caused to be read" in text  # the extra columns' notes


def test_the_peer_reads_its_own_checkpoint_where_one_is_given(tiny_distill, tmp_path) -> None:
    from k6fast.bench.acceptance import Run, Workload, peer_command

    w = Workload(model="/ckpt/full-text", geometry="64x64x5", prompt="p", seed=1, steps=2, guidance=1.0,
                 peer_model="/ckpt/one-layer-text")  # fmt: skip
    peer_command(Run("diffusers-offload", 32.0, "cold"), w, tmp_path, sys.executable)
    assert json.loads((tmp_path / "spec.json").read_text())["model"] == "/ckpt/one-layer-text"
    peer_command(Run("diffusers-offload", 32.0, "cold"), Workload(**{**w.__dict__, "peer_model": ""}), tmp_path, "py")
    assert json.loads((tmp_path / "spec.json").read_text())["model"] == "/ckpt/full-text"
    argv = ["acceptance", "--model", str(tiny_distill), "--out", str(tmp_path / "rec"), "--work", str(tmp_path / "w"),
            "--only", "diffusers-offload-32-cold", "--peer-model", str(tmp_path / "nowhere")]  # fmt: skip
    assert main(argv) == 2  # not a checkpoint: refused before any run
    assert not (tmp_path / "rec" / "runs.jsonl").exists()


def test_a_peer_only_part_reads_its_defaults_from_the_peer_copy(tiny_distill, tmp_path, monkeypatch, capsys) -> None:
    """A lease frees the main checkpoint's RAM-backed text encoders before the peer runs (the peer needs the host
    memory): the part that runs only the peer must not need them; it still continues the main checkpoint's record."""
    import k6fast.bench.acceptance as acceptance

    main_copy = tmp_path / "main"
    shutil.copytree(tiny_distill, main_copy)
    shutil.rmtree(main_copy / "text_encoder")  # what `drop-text` leaves
    seen = []
    monkeypatch.setattr(acceptance, "run_acceptance", lambda runs, workload, **kw: seen.append((runs, workload)))
    argv = ["acceptance", "--model", str(main_copy), "--out", str(tmp_path / "rec"), "--work", str(tmp_path / "w"),
            "--geometry", "64x64x5", "--only"]  # fmt: skip
    assert main([*argv, "diffusers-offload-32-cold", "--peer-model", str(tiny_distill)]) == 0
    ((runs, workload),) = seen
    assert [r.slug for r in runs] == ["diffusers-offload-32-cold"]
    assert workload.model == str(main_copy) and workload.peer_model == str(tiny_distill)
    assert workload.steps == 10  # the tiny distilled checkpoint's default, read from the peer's copy
    capsys.readouterr()
    # A k6fast arm still needs the main checkpoint whole: refused, naming what is missing.
    assert main([*argv, "final-32-cold", "--peer-model", str(tiny_distill)]) == 2
    assert "text_encoder" in capsys.readouterr().err and len(seen) == 1


def test_the_host_tier_column_only_where_the_rows_have_it() -> None:
    plan = {"model": "m", "geometry": "864x480x121", "steps": 10, "argv": ["k6fast"]}
    old = {"run": "final @ 32 GiB, warm", "arm": "final", "passed": True, "request_s": 50.0, "disk_read_bytes": 0,
           "residency": {"num_blocks": 60, "resident_blocks": 17}}  # fmt: skip
    before = render_table([old], plan)
    assert "host tier" not in before  # older records render as they did, residency or none
    assert before == render_table([{k: v for k, v in old.items() if k != "residency"}], plan)
    tiered = {**old, "residency": {**old["residency"], "host_blocks": 22, "host_bytes": 26_400_000_000}}
    untiered = {**old, "residency": {**old["residency"], "host_blocks": 0, "host_bytes": 0}}
    peer = {"run": "diffusers peer", "arm": "diffusers-offload", "passed": True, "request_s": 90.0}
    table = render_table([old, tiered, untiered, peer], plan)
    assert "| " + " | ".join(COLUMNS + EXTRA_COLUMNS + ("host tier GB (blocks)",)) + " |" in table
    rows = [line for line in table.splitlines() if line.startswith(("| final", "| diffusers"))]
    assert [r.rsplit(" | ", 1)[1] for r in rows] == ["— |", "26.40 (22) |", "none |", "— |"]
    assert len({r.count(" | ") for r in rows}) == 1  # every row has every column
    assert "locked host memory (K6_HOST_CACHE_GB)" in table
