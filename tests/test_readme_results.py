"""README.md's results block is what `k6fast bench report` renders from the records, never typed by hand: the newest
full-size acceptance record's table (each run's request time against the peer's, computed) and one line per other
record, from the record's own files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from k6fast.bench.acceptance_report import PLAN_FILE, ROWS_FILE
from k6fast.bench.cli import main
from k6fast.bench.readme_results import (
    RESULTS_MARKERS,
    readme_block,
    record_line,
    replace_results,
    results_block,
    shown_groups,
)

ROOT = Path(__file__).resolve().parent.parent


def test_readme_results_block_is_what_the_records_render() -> None:
    expected = results_block(ROOT / "measurements" / "sessions", ROOT)
    found = readme_block((ROOT / "README.md").read_text(encoding="utf-8"))
    assert found == expected.strip(), "README.md's results block is stale: run `k6fast bench report --no-plot`"


def shown_records(sessions: Path) -> list:
    """The records the README shows in full, in its order (its groups, one after another)."""
    return [record for group in shown_groups(sessions) for record in group]


def _note(blocks: int, full: int, preset: str = "pro-distill") -> str:
    marker = {"synthetic": True, "preset": preset, "num_visual_blocks": blocks, "full_depth_blocks": full}
    return f"/tmp/syn (synthetic random weights, real shapes: {json.dumps(marker, indent=2)[:300]})"


def _row(arm: str, request_s: float, passed: bool = True) -> dict:
    return {"run": f"{arm} @ 32 GiB, cold", "arm": arm, "passed": passed, "request_s": request_s,
            "phases_s": {"denoise": request_s}, "gpu_name": "NVIDIA H200"}  # fmt: skip


def _acceptance(root: Path, name: str, started: str, geometry: str, note: str, rows: list[dict], **plan_fields) -> Path:
    folder = root / name
    folder.mkdir(parents=True)
    plan = {"geometry": geometry, "steps": 10, "started": started, "checkpoint_note": note, "versions": {}}
    plan.update(plan_fields)
    (folder / PLAN_FILE).write_text(json.dumps(plan))
    (folder / ROWS_FILE).write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / "README.md").write_text(f"# {name} — an acceptance run\n")
    return folder


@pytest.fixture
def sessions(tmp_path: Path) -> Path:
    root = tmp_path / "measurements" / "sessions"
    rows = [_row("reference", 100.0), _row("final", 80.0), _row("fast", 50.0, passed=False),
            _row("diffusers-offload", 120.0)]  # fmt: skip
    _acceptance(root, "2026-01-01_acceptance", "2026-01-01T10:00", "864x480x121", _note(60, 60), rows)
    # Newer, but not full size: a reduced-depth checkpoint, and a small geometry.
    _acceptance(root, "2026-01-02_acceptance-12", "2026-01-02T10:00", "864x480x121", _note(12, 60), rows[:1])
    _acceptance(root, "2026-01-03_acceptance-tiny", "2026-01-03T10:00", "64x64x5", "/tmp/tiny", rows[:1])
    (root / "2026-01-01_kernels").mkdir()
    (root / "2026-01-01_kernels" / "README.md").write_text("# 2026-01-01 (late) — the GEMM kernels against cuBLAS\n")
    (root / "2026-01-01_gate").mkdir()
    (root / "2026-01-01_gate" / "COMMAND.md").write_text("intro\n# Gate of the arms on a tiny model\n")
    (root / "2026-01-01_bench").mkdir()
    session = {"plan": {"component": "dit", "geometry": "864x480x121", "arms": ["reference", "arms/final.env"],
                        "switches": {"K6_VRAM_BUDGET_GB": "32"}}}  # fmt: skip
    (root / "2026-01-01_bench" / "session.json").write_text(json.dumps(session))
    (root / "2026-01-01_scratch").mkdir()  # holds no record: no line
    return root


def _table_rows(text: str) -> dict[str, list[str]]:
    """A rendered acceptance table's rows by their run name (cells split on ` | `)."""
    return {line.split(" | ")[0].lstrip("| "): line.split(" | ") for line in text.splitlines() if " @ " in line}


def _headline_then(sessions: Path, later_name: str) -> tuple[str, str]:
    """(the whole results block, its later session's part), checking the headline is the complete session and
    `later_name` the one shown below it."""
    assert [r.name for r in shown_records(sessions)] == ["2026-01-01_acceptance", later_name]
    block = results_block(sessions, sessions.parent.parent)
    headline, later = block.split("### Full-size acceptance, a later session")
    assert "2026-01-01_acceptance/README.md" in headline and f"{later_name}/README.md" in later
    return block, later


def test_the_newest_full_size_acceptance_record_is_shown_with_ratios_to_the_peer(sessions: Path) -> None:
    # The newer acceptance records are not full size (12 of 60 blocks; a small geometry): the headline stands alone.
    assert [r.name for r in shown_records(sessions)] == ["2026-01-01_acceptance"]
    block = results_block(sessions, sessions.parent.parent)
    assert "([record](measurements/sessions/2026-01-01_acceptance/README.md))" in block
    assert "60 of 60 fused blocks" in block and "3 of 4 runs passed" in block
    table = _table_rows(block)
    assert table["reference @ 32 GiB, cold"][2] == "1.20×"  # 120 s / 100 s
    assert table["final @ 32 GiB, cold"][2] == "1.50×"
    assert table["fast @ 32 GiB, cold"][2] == "—"  # a failed run has no ratio
    assert table["diffusers-offload @ 32 GiB, cold"][2] == "peer"


def test_a_later_full_size_session_without_a_peer_is_shown_below_the_headline(sessions: Path) -> None:
    # A session that ran only what the headline record lacked (a ballast run, say): its table follows, without
    # ratios; an older full-size record stays a one-line entry.
    _acceptance(sessions, "2025-12-01_acceptance", "2025-12-01T10:00", "864x480x121", _note(60, 60),
                [_row("reference", 90.0), _row("diffusers-offload", 100.0)])  # fmt: skip
    _acceptance(sessions, "2026-01-04_acceptance-rest", "2026-01-04T10:00", "864x480x121", _note(60, 60),
                [_row("reference", 101.0), _row("step-cache", 95.0)])  # fmt: skip
    block, later = _headline_then(sessions, "2026-01-04_acceptance-rest")
    rows = _table_rows(later)
    assert rows["step-cache @ 32 GiB, cold"][2] == "—" and "no peer ran in this session" in later
    others = block.split("### Other records (newest first)")[1]
    assert "2025-12-01_acceptance/README.md" in others and "2026-01-04_acceptance-rest" not in others


def test_a_later_session_with_its_own_peer_keeps_the_complete_headline(sessions: Path) -> None:
    # A later session that re-measured one arm beside the peer (no reference run): the complete session stays the
    # headline, and the later table shows ratios to its own peer row.
    _acceptance(sessions, "2026-01-05_acceptance-fast", "2026-01-05T10:00", "864x480x121", _note(60, 60),
                [_row("fast", 40.0), _row("diffusers-offload", 130.0)])  # fmt: skip
    _, later = _headline_then(sessions, "2026-01-05_acceptance-fast")
    rows = _table_rows(later)
    assert rows["fast @ 32 GiB, cold"][2] == "3.25×"  # 130 s / 40 s: its own session's peer
    assert "the peer is diffusers' own pipeline in the same session" in later


def test_another_checkpoint_kind_gets_its_own_headline_and_a_failed_peer_gives_no_ratio(sessions: Path) -> None:
    # A newer full-size record on the Pro base (another schedule) whose peer timed out: it is shown after the
    # Pro-distill group, which stays whole, and a failed peer row makes neither a headline nor ratios.
    failed_peer = _row("diffusers-offload", 0.0, passed=False)
    _acceptance(sessions, "2026-01-06_acceptance-pro", "2026-01-06T10:00", "864x480x121", _note(60, 60, "pro"),
                [_row("reference", 300.0), _row("final", 200.0), failed_peer])  # fmt: skip
    _acceptance(sessions, "2026-01-07_acceptance-pro", "2026-01-07T10:00", "864x480x121", _note(60, 60, "pro"),
                [_row("fast-base", 90.0)])  # fmt: skip
    names = [r.name for r in shown_records(sessions)]
    # No passed peer: every pro record (the later one ran an arm the first lacks), oldest first.
    assert names == ["2026-01-01_acceptance", "2026-01-06_acceptance-pro", "2026-01-07_acceptance-pro"]
    _acceptance(sessions, "2026-01-08_acceptance-pro", "2026-01-08T10:00", "864x480x121", _note(60, 60, "pro"),
                [_row("reference", 300.0), _row("diffusers-offload", 600.0)])  # fmt: skip
    names = [r.name for r in shown_records(sessions)]
    assert names == ["2026-01-01_acceptance", "2026-01-08_acceptance-pro"]
    block = results_block(sessions, sessions.parent.parent)
    distill, pro = block.split("2026-01-08_acceptance-pro/README.md")
    assert "2026-01-01_acceptance/README.md" in distill
    assert _table_rows(pro)["reference @ 32 GiB, cold"][2] == "2.00×"  # 600 s / 300 s: the pro session's own peer
    assert "real pro shapes" in pro and "real pro-distill shapes" in distill
    others = block.split("### Other records (newest first)")[1]
    assert "2026-01-06_acceptance-pro/README.md" in others and "2026-01-07_acceptance-pro/README.md" in others


def test_groups_keep_their_order_and_a_stopped_record_says_how_far_it_ran(sessions: Path) -> None:
    # The Pro base's record is newer than Pro-distill's headline; a still newer Pro-distill headline does not move
    # Pro-distill's group below it. The stopped record's heading and text say it ran 16 of 50 steps.
    _acceptance(sessions, "2026-01-06_acceptance-pro", "2026-01-06T10:00", "864x480x121", _note(60, 60, "pro"),
                [_row("reference", 300.0)], steps=50, stop_after_steps=16)  # fmt: skip
    _acceptance(sessions, "2026-01-09_acceptance", "2026-01-09T10:00", "864x480x121", _note(60, 60),
                [_row("reference", 95.0), _row("diffusers-offload", 120.0)])  # fmt: skip
    assert [r.name for r in shown_records(sessions)] == ["2026-01-09_acceptance", "2026-01-06_acceptance-pro"]
    block = results_block(sessions, sessions.parent.parent)
    pro = block.split("2026-01-06_acceptance-pro/README.md")[0].rsplit("###", 1)[1]
    assert pro.startswith(" Full-size acceptance: 864x480x121, 16 of 50 steps, NVIDIA H200")
    assert "denoised only the first 16 of its 50 steps" in block.split("2026-01-06_acceptance-pro/README.md")[1]
    assert "864x480x121, 10 steps, NVIDIA H200 ([record](measurements/sessions/2026-01-09_acceptance" in block


def test_real_checkpoints_are_grouped_by_their_variant_not_their_path(tmp_path: Path) -> None:
    # Two leases of one real checkpoint at two paths are one group; two kinds at one path are two.
    root = tmp_path / "measurements" / "sessions"
    rows = [_row("reference", 100.0), _row("diffusers-offload", 120.0)]
    for i, (model, variant) in enumerate([("/a/k6", "pro-distill"), ("/b/k6", "pro-distill"), ("/a/k6", "pro")]):
        _acceptance(root, f"2026-01-0{i + 1}_acceptance", f"2026-01-0{i + 1}T10:00", "864x480x121", model, rows,
                    model=model, variant=variant)  # fmt: skip
    assert [r.name for r in shown_records(root)] == ["2026-01-02_acceptance", "2026-01-03_acceptance"]


def test_a_failed_peer_row_says_so_instead_of_giving_ratios(tmp_path: Path) -> None:
    root = tmp_path / "measurements" / "sessions"
    _acceptance(root, "2026-01-01_acceptance", "2026-01-01T10:00", "864x480x121", _note(60, 60),
                [_row("reference", 100.0), _row("diffusers-offload", 0.0, passed=False)])  # fmt: skip
    block = results_block(root, tmp_path)
    assert "the peer's run failed (its row says why), so its rows have no ratio" in block
    assert _table_rows(block)["reference @ 32 GiB, cold"][2] == "—"


def test_every_other_record_gets_one_line_from_its_own_files(sessions: Path) -> None:
    block = results_block(sessions, sessions.parent.parent)
    others = block.split("### Other records (newest first)")[1].strip().splitlines()
    assert others == [
        "- [2026-01-03_acceptance-tiny](measurements/sessions/2026-01-03_acceptance-tiny/README.md): an acceptance run",
        "- [2026-01-02_acceptance-12](measurements/sessions/2026-01-02_acceptance-12/README.md): an acceptance run",
        "- [2026-01-01_kernels](measurements/sessions/2026-01-01_kernels/README.md): the GEMM kernels against cuBLAS",
        "- [2026-01-01_gate](measurements/sessions/2026-01-01_gate/COMMAND.md): Gate of the arms on a tiny model",
        "- [2026-01-01_bench](measurements/README.md#2026-01-01_bench): `k6fast bench` session, dit at 864x480x121, "
        "arms `reference`, `final.env`; K6_VRAM_BUDGET_GB=32",
    ]
    assert record_line(sessions / "2026-01-01_scratch", "x", "y") is None


def test_without_a_full_size_record_the_block_says_so(tmp_path: Path) -> None:
    (tmp_path / "sessions").mkdir()
    block = results_block(tmp_path / "sessions", tmp_path)
    assert "No full-size acceptance record yet" in block and "None yet." in block


def test_bench_report_rewrites_the_block_and_leaves_the_rest(sessions: Path, capsys) -> None:
    root = sessions.parent.parent
    start, end = RESULTS_MARKERS
    (root / "README.md").write_text(f"# k6fast\n\nIntro.\n\n{start}\n| typed | by hand |\n{end}\n\nMore.\n")
    argv = ["bench", "report", "--sessions", str(sessions), "--no-plot"]
    assert main(argv) == 0
    text = (root / "README.md").read_text()
    assert text.startswith("# k6fast\n\nIntro.\n\n") and text.endswith(f"{end}\n\nMore.\n")
    assert readme_block(text) == results_block(sessions, root).strip() and "typed" not in text
    assert (root / "measurements" / "README.md").is_file()
    assert main(argv) == 0
    assert "results block already current" in capsys.readouterr().out
    (root / "other.md").write_text("no markers\n")
    assert main([*argv, "--project-readme", str(root / "other.md")]) == 2
    assert "must hold the results between one" in capsys.readouterr().err


def test_replace_results_needs_one_pair_of_markers_in_order() -> None:
    start, end = RESULTS_MARKERS
    assert replace_results(f"a\n{start}\nold\n{end}\nb\n", "new") == f"a\n{start}\nnew\n{end}\nb\n"
    for broken in ("no markers", f"{end}\n{start}\n", f"{start}\n{start}\n{end}\n"):
        with pytest.raises(ValueError, match="must hold the results"):
            replace_results(broken, "new")


def test_the_readme_explains_every_column_group_its_headline_table_shows(tmp_path: Path) -> None:
    from k6fast.bench.acceptance_report import TIER_NOTES

    root = tmp_path / "measurements" / "sessions"
    tiered = _row("final", 80.0) | {"residency": {"host_blocks": 22, "host_bytes": 26_400_000_000}}
    rows = [_row("reference", 100.0), tiered, _row("diffusers-offload", 120.0)]
    _acceptance(root, "2026-01-01_acceptance", "2026-01-01T10:00", "864x480x121", _note(60, 60), rows)
    block = results_block(root, root.parent.parent)
    assert "| 26.40 (22) |" in block and TIER_NOTES in block  # the column and what it means, as the record says
