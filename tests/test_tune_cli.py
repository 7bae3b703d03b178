"""`k6fast tune` from the command line: bad input refused in one line before any heavy import, "nothing passed" as exit
status 1, and one end-to-end run on the tiny checkpoint (CPU, the random LPIPS backbone marked as a test, budget 2):
the bench times the base, a probe and the candidates, the gate judges them against one shared set of reference clips,
and the winner's .env parses with the switch registry."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import json
import shlex
from pathlib import Path

import pytest
from cli_testing import assert_refused

from k6fast import entry
from k6fast.quality_gate import clips
from k6fast.switches import load_options, read_arm
from k6fast.tune import cli as tune_cli
from k6fast.tune import run as tune_run
from k6fast.tune.config import TuneConfig, space_for
from k6fast.tune.search import SearchResult, TuneError

TUNE = ["tune", "--lpips-max", "0.1"]
# (arguments, environment, the error line's words); {tiny} a tiny distilled checkpoint, {prompts} a one-prompt set,
# {empty} a set with no prompts, {here} the (empty) folder the command runs in.
CASES = {
    "prompts-missing": (
        [*TUNE, "--model", "{tiny}", "--prompts", "{here}/none.json"],
        {},
        "--prompts {here}/none.json: no such file",
    ),
    "prompts-empty": ([*TUNE, "--model", "{tiny}", "--prompts", "{empty}"], {}, 'a non-empty "prompts" list'),
    "lpips-max-zero": (
        ["tune", "--model", "{tiny}", "--prompts", "{prompts}", "--lpips-max", "0"],
        {},
        "--lpips-max: expected a number > 0",
    ),
    "lpips-max-negative": (
        ["tune", "--model", "{tiny}", "--prompts", "{prompts}", "--lpips-max", "-0.1"],
        {},
        "--lpips-max: expected a number > 0",
    ),
    "audio-max-nan": (
        [*TUNE, "--model", "{tiny}", "--prompts", "{prompts}", "--audio-max", "nan"],
        {},
        "--audio-max: expected a number > 0",
    ),
    "budget-zero": (
        [*TUNE, "--model", "{tiny}", "--prompts", "{prompts}", "--budget", "0"],
        {},
        "--budget: expected at least 1 gate run, found 0",
    ),
    "model-not-a-checkpoint": (
        [*TUNE, "--model", "{here}", "--prompts", "{prompts}"],
        {},
        "missing file {here}/model_index.json",
    ),
    "random-backbone": (
        [*TUNE, "--model", "{tiny}", "--prompts", "{prompts}", "--lpips-backbone", "random"],
        {},
        "--lpips-backbone random measures nothing",
    ),
    "random-backbone-switch": (
        [*TUNE, "--model", "{tiny}", "--prompts", "{prompts}"],
        {"K6_LPIPS_BACKBONE": "random"},
        "--lpips-backbone random measures nothing",
    ),
    "lossy-base": (
        [*TUNE, "--model", "{tiny}", "--prompts", "{prompts}", "--base-arm", "fast", "--knobs", "gemm,cache"],
        {},
        "--base-arm sets K6_GEMM=auto-lossy",
    ),
    "knobs": ([*TUNE, "--model", "{tiny}", "--prompts", "{prompts}", "--knobs", "speed"], {}, "--knobs: expected"),
    "geometry": ([*TUNE, "--model", "{tiny}", "--prompts", "{prompts}", "--geometry", "65x64x9"], {}, "width 65"),
}


@pytest.fixture(scope="module")
def paths(tiny_distill: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("tune-inputs")
    prompts = {"prompts": [{"id": "fox", "text": "A fox runs through snow, wind howling"}]}
    (root / "one.json").write_text(json.dumps(prompts))
    (root / "empty.json").write_text(json.dumps({"prompts": []}))
    return {"tiny": str(tiny_distill), "prompts": str(root / "one.json"), "empty": str(root / "empty.json")}


@pytest.mark.parametrize("case", CASES)
def test_every_tune_error_is_one_line_before_any_heavy_import(paths: dict[str, str], tmp_path, case: str) -> None:
    assert_refused(*CASES[case], tmp_path, paths)


def test_a_base_checkpoint_ignores_the_base_arms_distilled_cache(tiny_checkpoints, tmp_path) -> None:
    # `final` as the base arm sets K6_PIFLOW_CACHE_STEPS=8, a lossy switch the cache knob owns: refused on a distilled
    # checkpoint; a base checkpoint does not apply it, so tune neither refuses it nor predicts step 8 skipped.
    base = TuneConfig(model=str(tiny_checkpoints["base"]), prompts=tmp_path, lpips_max=0.1, out=tmp_path,
                      base_arm="final", knobs=("cache",))  # fmt: skip
    space, _, ckpt = space_for(base)
    assert not ckpt.distilled and "K6_PIFLOW_CACHE_STEPS" not in space.base
    distilled = dataclasses.replace(base, model=str(tiny_checkpoints["distill"]))
    with pytest.raises(TuneError, match="--base-arm sets K6_PIFLOW_CACHE_STEPS=8"):
        space_for(distilled)


def test_the_limits_scale_with_the_gate_proportions(tmp_path) -> None:
    from k6fast.quality_gate.thresholds import Thresholds

    gate = Thresholds()
    config = TuneConfig(model="m", prompts=tmp_path, lpips_max=0.06, audio_max=1.5, out=tmp_path)
    limits = config.thresholds
    assert limits.lpips_mean == 0.06 and limits.lpips_worst == pytest.approx(0.06 * gate.lpips_worst / gate.lpips_mean)
    assert limits.log_mel_db == 1.5 and limits.mrstft == pytest.approx(gate.mrstft / 2)
    assert limits.log_mel_worst_db == pytest.approx(gate.log_mel_worst_db / 2)
    assert TuneConfig(model="m", prompts=tmp_path, lpips_max=0.1, out=tmp_path).thresholds.mrstft == gate.mrstft


def test_the_recorded_command_parses_back_to_the_run_it_records(tmp_path) -> None:
    from k6fast.cli import build_parser
    from k6fast.telemetry import StartupClock

    argv = ["tune", "--model", "m", "--prompts", str(tmp_path / "p.json"), "--lpips-max", "0.05", "--knobs",
            "gemm,cache", "--seeds", "1,2", "--test", "--out", str(tmp_path / "t")]  # fmt: skip
    args = build_parser().parse_args(argv)
    args.startup = StartupClock(from_process_start=False)  # as `k6fast.cli.main` sets it on every command's namespace
    command = shlex.split(tune_cli.config_from_args(args).command)
    assert command[:2] == ["k6fast", "tune"] and "--startup" not in command
    again = vars(build_parser().parse_args(command[1:]))
    assert again == {name: value for name, value in vars(args).items() if name != "startup"}


def tune(argv: list[str]) -> tuple[int, str]:
    parser = argparse.ArgumentParser(prog="k6fast")
    tune_cli.register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["tune", *argv])
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        status = args.func(args)
    return status, out.getvalue()


def test_nothing_passing_exits_1_and_names_the_record(paths, tmp_path, monkeypatch) -> None:
    calls = []

    def no_winner(config, prepare=None):
        calls.append(config)
        from k6fast.tune.space import build_space

        built, _ = build_space({}, steps=4, num_blocks=2, distilled=True, knobs=("cache",))
        return SearchResult(None, {}, 3, 3, 3, 1.0, "budget of 3 gate runs spent"), built, {}

    monkeypatch.setattr(tune_run, "run_tune", no_winner)
    status, out = tune(["--model", paths["tiny"], "--prompts", paths["prompts"], "--lpips-max", "0.05",
                        "--budget", "3", "--out", str(tmp_path / "t")])  # fmt: skip
    assert status == 1 and len(calls) == 1
    assert "no candidate passed (3 gate runs, budget of 3 gate runs spent)" in out and "tune.json" in out


@pytest.mark.slow
def test_tune_end_to_end_on_the_tiny_checkpoint(paths, tmp_path, monkeypatch) -> None:
    # Others may edit k6fast's source while this runs; the clip cache keys on its digest, so pin it: the reuse of the
    # reference clips across gate runs is what is tested.
    monkeypatch.setattr(clips, "source_digest", lambda: "pinned-for-test")
    # What the command does to its process before each gate pipeline, recorded instead of done to the test process.
    prepared = []
    monkeypatch.setattr(entry, "prepare_pipeline_process", lambda o, d: prepared.append(str(d)))
    out = tmp_path / "tune"
    status, printed = tune(["--model", paths["tiny"], "--prompts", paths["prompts"], "--lpips-max", "10",
                            "--audio-max", "100", "--budget", "2", "--knobs", "gemm,cache", "--geometry", "64x64x9",
                            "--steps", "6", "--lpips-backbone", "random", "--test", "--device", "cpu",
                            "--out", str(out)])  # fmt: skip
    assert status == tune_cli.EXIT_PLUMBING, printed  # a winner, by a backbone that judges nothing
    record = json.loads((out / "tune.json").read_text())
    assert record["plumbing_only"] is True and record["steps"] == 6
    assert record["command"].startswith(f"k6fast tune --model {paths['tiny']} ") and "--test" in record["command"]
    assert record["geometry"] == {"width": 64, "height": 64, "frames": 9}
    rows = {row["label"]: row for row in record["candidates"]}
    assert len(rows) == 2 * 3 - 1  # gemm (2 levels) x cache (off, step 4, steps 3 and 4), less the base
    assert 1 <= record["gate_runs"] <= 2
    assert prepared and set(prepared) == {"cpu"}  # the gate's pipelines were prepared by the command
    for row in rows.values():
        assert row["status"] in ("pass", "fail", "slower", "pruned", "dominated", "unreached") and row["why"]
        if row["seconds"] is not None:  # timed: its bench session's record is there
            assert (out / row["timing"]["session"] / "visits.jsonl").is_file()
        if row["gate_order"] is not None:  # gated: its scores and report
            assert set(row["scores"]) >= {"lpips_mean", "log_mel_db"} and (out / row["gate_report"]).is_file()
    # The reference's clip was generated by the first gate run and reused by every later one.
    statuses = [status for run in record["reference_clips_per_gate_run"] for status in run.values()]
    assert statuses[0].startswith("generated") and all(s == "cached" for s in statuses[1:])
    assert len(record["reference_clips_per_gate_run"]) == record["gate_runs"]
    winner = rows[record["winner"]]
    assert winner["status"] == "pass"
    arm = out / "tuned.env"
    assert read_arm(arm) == winner["switches"]
    options = load_options(environ={}, arm=arm)
    # The winner depends on the measured times (the gemm-only candidate or one with cached steps): either parses back.
    cached = winner["switches"].get("K6_PIFLOW_CACHE_STEPS", "")
    assert options.piflow_cache_steps == tuple(int(s) for s in cached.split(",") if s)
    text = arm.read_text()
    assert "PLUMBING ONLY" in text and winner["gate_report"] in text and winner["timing"]["session"] in text
