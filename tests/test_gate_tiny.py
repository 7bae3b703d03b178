"""`k6fast gate` end to end on the tiny checkpoint on CPU: two prompts of set A at 64x64, 9 frames, 4 steps.

One gate run (module fixture) generates the reference, its noise-floor re-run, a lossless arm (every switch written
out at its default) and a lossy arm (the PiFlow step cache), scores them and writes the report. A second run on the
same output directory reuses the cached clips and declares the lossy arm exact, which must fail with exit status 1.
The first run uses the random LPIPS backbone: it must say it checked the plumbing only and give no verdict (exit
status 3); the verdicts (0 and 1) come from runs with a backbone file.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import PIL.Image
import pytest

from k6fast import entry
from k6fast.quality_gate import clips
from k6fast.quality_gate.clips import ClipCache, Geometry, Prompt, load_arm
from k6fast.quality_gate.command import EXIT_PLUMBING, register
from k6fast.quality_gate.config import SET_A
from k6fast.quality_gate.lpips_metric import RANDOM_LABEL
from k6fast.quality_gate.report import PLUMBING_VERDICT
from k6fast.switches import SWITCHES, Options

PROMPTS = ("a1-portrait-speech", "a3-sprint-start")
GEOMETRY = ["--size", "64x64", "--frames", "9", "--steps", "4", "--seeds", "42", "--lpips-backbone", "random"]

pytestmark = pytest.mark.slow


def gate(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="k6fast")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["gate", *argv])
    return args.func(args)


@pytest.fixture(scope="module")
def pinned_source() -> Iterator[None]:
    """The clip cache keys on a digest of k6fast's source. In a checkout that others edit while the tests run, that
    digest moves between the two gate runs and the second would regenerate; pin it so the reuse is what is tested."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(clips, "source_digest", lambda: "pinned-for-test")
        yield


@pytest.fixture(scope="module")
def setup(tiny_distill: Path, tmp_path_factory: pytest.TempPathFactory, pinned_source: None) -> dict:
    root = tmp_path_factory.mktemp("gate")
    # Every output-affecting switch written out at its reference value: must reproduce the reference exactly.
    lines = [f"{s.name}={s.format(s.default)}" for s in SWITCHES if s.affects_output and not s.secret]
    (root / "all-off.env").write_text("\n".join(lines) + "\n")
    (root / "step-cache.env").write_text("K6_PIFLOW_CACHE_STEPS=2\n")
    prompt_set = json.loads(SET_A.read_text())
    prompt_set["prompts"] = [p for p in prompt_set["prompts"] if p["id"] in PROMPTS]
    (root / "prompts.json").write_text(json.dumps(prompt_set))
    common = ["--model", str(tiny_distill), "--prompts", str(root / "prompts.json"), "--out", str(root / "out")]
    common += GEOMETRY
    log = io.StringIO()
    prepared: list[tuple[str, str]] = []
    with pytest.MonkeyPatch.context() as env, contextlib.redirect_stderr(log):
        # The gate builds each arm from its file alone; this variable must not reach any arm.
        env.setenv("K6_PIFLOW_CACHE_STEPS", "1")
        # What the command does to its process before each pipeline, recorded instead of done to the test process.
        env.setattr(entry, "prepare_pipeline_process", lambda o, d: prepared.append((o.arm_hash(), str(d))))
        rc = gate([*common, "--floor", "--exact", str(root / "all-off.env"), "--arm", str(root / "step-cache.env")])
    report = json.loads((root / "out" / "report.json").read_text())
    return {"root": root, "out": root / "out", "rc": rc, "report": report, "common": common, "log": log.getvalue(),
            "prepared": prepared}  # fmt: skip


def test_the_command_prepares_its_process_for_each_arms_pipeline(setup: dict) -> None:
    report = setup["report"]
    hashes = {report["reference"]["arm_hash"], *(a["arm_hash"] for a in report["arms"])}
    assert len(hashes) == 2  # all-off is the reference's hash: one pipeline serves both
    assert sorted(setup["prepared"]) == sorted((h, "cpu") for h in hashes)


def test_gate_runs_every_arm_and_gives_no_verdict_with_the_random_backbone(setup: dict) -> None:
    report = setup["report"]
    assert setup["rc"] == EXIT_PLUMBING and report["verdict"] == PLUMBING_VERDICT
    assert report["plumbing_only"] and report["passed"] is None
    assert [a["label"] for a in report["arms"]] == ["step-cache", "all-off"]  # --arm arms first, then --exact
    assert report["prompts"] == list(PROMPTS)
    assert report["random_backbone"] and report["warning"] == RANDOM_LABEL
    assert sum(s.startswith("generated") for s in report["clips"].values()) == 6  # reference, floor, step cache


def test_environment_does_not_leak_into_arms(setup: dict) -> None:
    assert "K6_PIFLOW_CACHE_STEPS=1 set in the environment; ignored" in setup["log"]
    reference_hash = Options().arm_hash()
    assert setup["report"]["reference"]["arm_hash"] == reference_hash
    sidecars = sorted((setup["out"] / "clips").rglob(f"*-{reference_hash}-*.mp4.json"))
    assert len(sidecars) == 2 * len(PROMPTS)  # first run and floor run of each prompt
    for sidecar in sidecars:
        record = json.loads(sidecar.read_text())
        assert record["provenance"]["switches"]["K6_PIFLOW_CACHE_STEPS"] == ""
        assert record["telemetry"]["cached_steps"] == 0


def test_floor_and_lossless_arm_score_exactly_zero(setup: dict) -> None:
    report = setup["report"]
    floor, lossless = report["floor"], report["arms"][1]
    for result in (floor, lossless):
        assert result["set"]["identical_clips"] == len(PROMPTS)
        for clip in result["clips"]:
            assert clip["identical"] and set(clip["lpips_per_frame"]) == {0.0}
            assert clip["audio"]["log_mel_db"] == 0.0 and clip["audio"]["mrstft"] == 0.0
    assert lossless["exact"] and lossless["passed"]
    assert lossless["checks"][-1] == {
        "metric": "differing_clips",
        "value": 0.0,
        "limit": 0.0,
        "rule": "exact: decoded video and audio bit-identical",
        "passed": True,
    }


def test_lossy_arm_is_scored_not_identical(setup: dict) -> None:
    lossy = setup["report"]["arms"][0]
    assert lossy["lossy_switches"] == ["K6_PIFLOW_CACHE_STEPS"] and not lossy["exact"]
    assert lossy["passed"] and lossy["set"]["identical_clips"] == 0
    assert 0.0 < lossy["set"]["lpips_mean"] <= lossy["set"]["lpips_worst"]
    for clip in lossy["clips"]:
        assert len(clip["lpips_per_frame"]) == 9
        assert clip["lpips_worst"] == max(clip["lpips_per_frame"])
        assert clip["audio"]["log_mel_db"] > 0.0
    # The cache skips step 2 of 4, so the frames differ but stay close to the reference's.
    assert lossy["set"]["lpips_worst"] < 0.25


def test_markdown_sheets_and_plots_are_written(setup: dict) -> None:
    out = setup["out"]
    markdown = (out / "report.md").read_text()
    assert markdown.startswith(f"# k6fast quality gate: {PLUMBING_VERDICT}")
    assert "| no verdict |" in markdown and "]: no verdict" in markdown and "PASS" not in markdown
    assert RANDOM_LABEL in markdown.splitlines()[2]
    assert "## step-cache [" in markdown and "## all-off [" in markdown and "## floor [" in markdown
    assert markdown.count("| **set** |") == 3
    for arm in ("all-off", "step-cache", "floor"):
        plot = out / "plots" / f"{arm}.png"
        assert f"]({plot.relative_to(out)})" in markdown
        with PIL.Image.open(plot) as image:
            assert image.format == "PNG" and image.width > 600
        for prompt in PROMPTS:
            sheet = out / "sheets" / arm / f"{prompt}-s42.png"
            assert f"]({sheet.relative_to(out)})" in markdown
            with PIL.Image.open(sheet) as image:
                pixels = np.asarray(image.convert("RGB"))
            assert image.width > 600 and pixels.std() > 10  # frames drawn, not a blank canvas
    assert not list(out.rglob(".*.tmp"))


@pytest.fixture(scope="module")
def backbone_file(setup: dict) -> Path:
    """AlexNet weights in torchvision's layout (seeded, not ImageNet's): a backbone file, so the gate gives verdicts."""
    import torch
    import torchvision

    path = setup["root"] / "alexnet.pth"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(5)
        torch.save(torchvision.models.alexnet().state_dict(), path)
    return path


def _rerun(setup: dict, name: str, backbone: Path, *arms: str) -> tuple[int, Path]:
    """The gate again on the first run's clips (nothing is generated) with a backbone file."""
    out = setup["root"] / name
    shutil.copytree(setup["out"] / "clips", out / "clips")
    argv = [str(backbone) if a == "random" else a for a in setup["common"]]
    argv[argv.index("--out") + 1] = str(out)
    return gate([*argv, *arms]), out


def test_with_a_backbone_file_an_exact_arm_that_is_exact_passes(setup: dict, backbone_file: Path, capsys) -> None:
    rc, out = _rerun(setup, "exact-passes", backbone_file, "--exact", str(setup["root"] / "all-off.env"))
    assert rc == 0
    assert "PASS  all-off" in capsys.readouterr().out
    report = json.loads((out / "report.json").read_text())
    assert set(report["clips"].values()) == {"cached"}
    assert report["verdict"] == "PASS" and report["passed"] and not report["plumbing_only"]


def test_lossless_arm_that_differs_fails_with_status_1(setup: dict, backbone_file: Path, capsys) -> None:
    rc, out = _rerun(setup, "exact-fails", backbone_file, "--exact", str(setup["root"] / "step-cache.env"))
    assert rc == 1
    assert "FAIL  step-cache" in capsys.readouterr().out
    report = json.loads((out / "report.json").read_text())
    assert set(report["clips"].values()) == {"cached"}
    assert report["verdict"] == "FAIL"
    checks = {c["metric"]: c for c in report["arms"][0]["checks"]}
    assert not checks["differing_clips"]["passed"] and checks["differing_clips"]["value"] == len(PROMPTS)
    assert checks["lpips_mean"]["passed"]  # only exactness fails: the arm is close, but not identical


def test_missing_backbone_stops_before_generating(setup: dict, capsys: pytest.CaptureFixture) -> None:
    out = setup["root"] / "no-backbone"
    argv = [a if a != "random" else str(setup["root"] / "absent.pth") for a in setup["common"]]
    argv[argv.index("--out") + 1] = str(out)
    rc = gate([*argv, "--arm", str(setup["root"] / "step-cache.env")])
    assert rc == 2
    err = capsys.readouterr().err
    assert "error: LPIPS needs torchvision's ImageNet AlexNet weights" in err and "absent.pth" in err
    assert not (out / "clips").exists()


def test_usage_errors_exit_2(setup: dict, capsys: pytest.CaptureFixture) -> None:
    assert gate(setup["common"]) == 2
    assert "nothing to do" in capsys.readouterr().err
    assert gate([*setup["common"], "--arm", "reference", "--relative", "3"]) == 2
    assert "add --floor" in capsys.readouterr().err
    assert gate([*setup["common"], "--arm", str(setup["root"] / "step-cache.env"), "--steps", "2"]) == 2
    assert "K6_PIFLOW_CACHE_STEPS=2" in capsys.readouterr().err


def test_cache_key_names_what_decides_the_clip(tiny_distill: Path, setup: dict) -> None:
    import torch

    geometry = Geometry(64, 64, 9, 4, 1.0)
    cache = ClipCache(setup["root"] / "keys", str(tiny_distill), torch.device("cpu"), torch.float32, geometry)
    reference = load_arm("reference", "reference")
    lossy = load_arm(str(setup["root"] / "step-cache.env"), "step-cache")
    prompt = Prompt("p", "a violinist")
    key = cache.key(prompt, 42, reference)
    assert key == cache.key(prompt, 42, load_arm(str(setup["root"] / "all-off.env"), "x"))  # same arm hash
    others = {cache.key(prompt, 43, reference), cache.key(Prompt("p", "a cellist"), 42, reference)}
    others.add(cache.key(prompt, 42, lossy))
    others.add(
        ClipCache(setup["root"] / "keys", str(tiny_distill), torch.device("cpu"), torch.float64, geometry).key(
            prompt, 42, reference
        )
    )
    others.add(
        ClipCache(
            setup["root"] / "keys", str(tiny_distill), torch.device("cpu"), torch.float32, Geometry(64, 64, 9, 5, 1.0)
        ).key(prompt, 42, reference)
    )
    assert key not in others and len(others) == 5
    assert cache.path(prompt, 42, reference).name == f"s42-{reference.hash}-{key}.mp4"
    assert cache.path(prompt, 42, reference, floor=True).name == f"s42-{reference.hash}-{key}-floor.mp4"
