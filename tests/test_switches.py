"""The switch registry, Options, arms, tables and provenance (plain CPU tests)."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import warnings
from pathlib import Path

import pytest

from k6fast.switches import (
    README_MARKERS,
    SWITCHES,
    SWITCHES_BY_NAME,
    Options,
    Switch,
    SwitchError,
    UnknownSwitchWarning,
    check_readme,
    list_arms,
    load_options,
    provenance,
    read_arm,
    readme_table,
    render_table,
    replace_readme_block,
    resolve_arm,
    validate_cache_steps,
)
from k6fast.switches.provenance import git_state
from k6fast.switches.registry import warn_unknown_switches

BOOL = Switch(name="K6_TEST_FLAG", kind="bool", default=False, doc="test flag")
INT = Switch(name="K6_EXACT_ATTN_BLOCKS", kind="int", default=0, doc="test int", min=0)
BOUNDED_INT = Switch(name="K6_TEST_INT", kind="int", default=2, doc="test int", min=1, max=8)
FLOAT = Switch(name="K6_TEST_FLOAT", kind="float", default=0.0, doc="test float", min=0.0, max=1.0)
ENUM = Switch(name="K6_TEST_ENUM", kind="enum", default="a", doc="test enum", choices=("a", "b"))
LIST = Switch(name="K6_TEST_LIST", kind="int_list", default=(), doc="test list", min=0, max=9)
STR = Switch(name="K6_TEST_STR", kind="str", default="", doc="test str")
PATH = Switch(name="K6_TEST_PATH", kind="path", default="", doc="test path", affects_output=False)
SECRET = Switch(name="K6_TEST_SECRET", kind="str", default="", doc="test", secret=True, affects_output=False)


def _error(switch: Switch, raw: str) -> str:
    with pytest.raises(SwitchError) as info:
        switch.parse(raw)
    return str(info.value)


@pytest.mark.parametrize(
    ("switch", "raw", "expected"),
    [
        (BOOL, "0", False),
        (BOOL, "1", True),
        (INT, "0", 0),
        (INT, " 42 ", 42),
        (BOUNDED_INT, "8", 8),
        (BOUNDED_INT, "+1", 1),
        (FLOAT, "0.25", 0.25),
        (FLOAT, "1", 1.0),
        (ENUM, "b", "b"),
        (LIST, "", ()),
        (LIST, "  ", ()),
        (LIST, "7, 3,5", (3, 5, 7)),
        (LIST, "0", (0,)),
        (STR, "", ""),
        (STR, " any thing ", " any thing "),
        (PATH, "", None),
        (PATH, "/data/k6", Path("/data/k6")),
    ],
)
def test_parse_good_values(switch: Switch, raw: str, expected: object) -> None:
    value = switch.parse(raw)
    assert value == expected and type(value) is type(expected)
    assert switch.parse(switch.format(value)) == value


@pytest.mark.parametrize(
    ("switch", "raw", "accepts"),
    [
        (BOOL, "true", "0 or 1"),
        (BOOL, "yes", "0 or 1"),
        (BOOL, "2", "0 or 1"),
        (BOOL, "", "0 or 1"),
        (BOOL, " 1", "0 or 1"),
        (INT, "abc", "an integer >= 0"),
        (INT, "-1", "an integer >= 0"),
        (INT, "1.5", "an integer >= 0"),
        (INT, "1_000", "an integer >= 0"),
        (INT, "", "an integer >= 0"),
        (BOUNDED_INT, "9", "an integer in [1, 8]"),
        (BOUNDED_INT, "0", "an integer in [1, 8]"),
        (FLOAT, "x", "a finite number in [0.0, 1.0]"),
        (FLOAT, "nan", "a finite number in [0.0, 1.0]"),
        (FLOAT, "inf", "a finite number in [0.0, 1.0]"),
        (FLOAT, "1.5", "a finite number in [0.0, 1.0]"),
        (ENUM, "c", "one of a, b"),
        (ENUM, "A", "one of a, b"),
        (ENUM, "", "one of a, b"),
        (LIST, "1,,2", "comma-separated distinct integers in [0, 9], or empty"),
        (LIST, "1,2,", "comma-separated distinct integers in [0, 9], or empty"),
        (LIST, "1,x", "comma-separated distinct integers in [0, 9], or empty"),
        (LIST, "3,1,3", "comma-separated distinct integers in [0, 9], or empty"),
        (LIST, "10", "comma-separated distinct integers in [0, 9], or empty"),
        (LIST, "1 2", "comma-separated distinct integers in [0, 9], or empty"),
    ],
)
def test_parse_bad_values_name_variable_value_and_accepts(switch: Switch, raw: str, accepts: str) -> None:
    message = _error(switch, raw)
    assert message.startswith(f"Unable to use {switch.name}={raw!r}: expected {accepts}"), message


def test_error_message_matches_the_documented_form() -> None:
    assert _error(INT, "abc") == "Unable to use K6_EXACT_ATTN_BLOCKS='abc': expected an integer >= 0"


def test_int_list_error_says_which_item_is_wrong() -> None:
    assert "repeated: 3" in _error(LIST, "3,1,3")
    assert "'x' is not an integer" in _error(LIST, "1,x")
    assert "out of range: 10" in _error(LIST, "10")


def test_secret_value_is_not_echoed_in_errors() -> None:
    with pytest.raises(SwitchError) as info:
        SECRET.coerce(12345)
    assert "12345" not in str(info.value) and "<set>" in str(info.value)


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"name": "PIFLOW_STEPS"}, "K6_UPPER_SNAKE"),
        ({"name": "K6_lower"}, "K6_UPPER_SNAKE"),
        ({"kind": "list"}, "kind must be one of"),
        ({"doc": "two\nlines"}, "one non-empty line"),
        ({"kind": "enum", "default": "a"}, "needs choices"),
        ({"choices": ("a",)}, "only enum switches take choices"),
        ({"kind": "str", "default": "", "min": 0}, "bounds apply"),
        ({"kind": "int", "default": 0, "min": 5, "max": 1}, "min must be <= max"),
        ({"secret": True}, "secret"),
        ({"lossy": True, "affects_output": False}, "lossy"),
        ({"default": 1}, "expected a bool"),
    ],
)
def test_bad_switch_declarations_are_rejected(kwargs: dict, fragment: str) -> None:
    spec = {"name": "K6_TEST_X", "kind": "bool", "default": False, "doc": "a test switch"} | kwargs
    with pytest.raises(SwitchError, match=re.escape(fragment)):
        Switch(**spec)


# Switches that only tune another switch (K6_GEMM_MIN_ROWS does nothing while K6_GEMM=bf16).
PARAMETER_SWITCHES = {
    "K6_GEMM_MIN_ROWS",
    "K6_SPARSE_ATTN_WINDOW",
    "K6_STEP_CACHE_THRESHOLD",
    "K6_STEP_CACHE_MAX_SKIP",
    "K6_STEP_CACHE_RETENTION",
}


def test_catalog_defaults_are_off_and_names_unique() -> None:
    assert len(SWITCHES_BY_NAME) == len(SWITCHES)
    for switch in SWITCHES:
        assert switch.attr == switch.name.removeprefix("K6_").lower()
        if not switch.affects_output or switch.name in PARAMETER_SWITCHES:
            continue  # runtime settings, and parameters of a switch that is itself off by default
        if switch.kind in ("bool", "int", "float"):
            assert not switch.default, switch.name
        if switch.kind in ("int_list", "str", "path"):
            assert switch.format(switch.default) == "", switch.name
    assert SWITCHES_BY_NAME["K6_PIFLOW_CACHE_STEPS"].lossy
    assert SWITCHES_BY_NAME["K6_AUDIO_NORM"].choices == ("peak", "clip")
    assert SWITCHES_BY_NAME["K6_API_KEY"].secret and not SWITCHES_BY_NAME["K6_API_KEY"].affects_output
    assert not SWITCHES_BY_NAME["K6_DATA_DIR"].affects_output


def test_unknown_k6_variable_warns_with_closest_switch() -> None:
    env = {"K6_PIFLOW_CACHE_STEP": "3", "K6_ZZZZZZZZZZZ": "1", "PATH": "/bin", "K6X_NOT_OURS": "1"}
    with pytest.warns(UnknownSwitchWarning) as record:
        options = load_options(env)
    messages = [str(w.message) for w in record]
    assert len(messages) == 2
    assert messages[0] == "Unknown switch K6_PIFLOW_CACHE_STEP is ignored; did you mean K6_PIFLOW_CACHE_STEPS?"
    # Nothing close: still the one nearest name, not a list of every switch.
    assert messages[1] == (
        "Unknown switch K6_ZZZZZZZZZZZ is ignored; the nearest switch is K6_GEMM (`k6fast switches` lists them all)"
    )
    assert record[0].filename == __file__, "the warning should point at the caller of load_options"
    assert options == Options()


def test_known_variables_do_not_warn() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert warn_unknown_switches({"K6_AUDIO_NORM": "clip", "HOME": "/root"}, SWITCHES) == []


def test_load_options_parses_environment() -> None:
    env = {"K6_PIFLOW_CACHE_STEPS": "6,3", "K6_AUDIO_NORM": "clip", "K6_DATA_DIR": "/srv/k6"}
    options = load_options(env)
    assert options.piflow_cache_steps == (3, 6)
    assert options.audio_norm == "clip"
    assert options.data_dir == Path("/srv/k6")
    assert options.api_key == ""
    assert options.arm_name == "env"
    assert options.value("K6_AUDIO_NORM") == "clip"


def test_load_options_reports_every_bad_variable() -> None:
    with pytest.raises(SwitchError) as info:
        load_options({"K6_PIFLOW_CACHE_STEPS": "a", "K6_AUDIO_NORM": "loud"})
    message = str(info.value)
    assert "K6_PIFLOW_CACHE_STEPS='a'" in message and "K6_AUDIO_NORM='loud': expected one of peak, clip" in message


def test_load_options_reads_os_environ_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("K6_AUDIO_NORM", "clip")
    assert load_options().audio_norm == "clip"


def test_options_are_immutable_and_replace_validates() -> None:
    options = Options()
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.audio_norm = "clip"  # type: ignore[misc]
    changed = options.replace(piflow_cache_steps=[5, 2], audio_norm="clip")
    assert changed.piflow_cache_steps == (2, 5) and options.piflow_cache_steps == ()
    with pytest.raises(SwitchError, match="K6_AUDIO_NORM='loud'"):
        options.replace(audio_norm="loud")
    with pytest.raises(SwitchError, match="K6_PIFLOW_CACHE_STEPS"):
        options.replace(piflow_cache_steps=(1, 1))
    with pytest.raises(TypeError, match="no attribute audio_nrom"):
        options.replace(audio_nrom="clip")
    assert hash(changed) == hash(Options(piflow_cache_steps=(2, 5), audio_norm="clip"))


def _write(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


def test_reference_arm_lists_every_output_switch_at_its_default() -> None:
    assert "reference" in list_arms()
    path = resolve_arm("reference")
    assert path.name == "reference.env" and path.is_file()
    values = read_arm(path)
    output_switches = {s.name for s in SWITCHES if s.affects_output}
    assert set(values) == output_switches
    for name, raw in values.items():
        assert SWITCHES_BY_NAME[name].parse(raw) == SWITCHES_BY_NAME[name].default
    assert "BF16 reference" in path.read_text(encoding="utf-8")


def test_arm_file_good(tmp_path: Path) -> None:
    arm = _write(tmp_path / "fast.env", "# a comment\n\n  K6_AUDIO_NORM = clip\nK6_PIFLOW_CACHE_STEPS=4,2\n")
    assert read_arm(arm) == {"K6_AUDIO_NORM": "clip", "K6_PIFLOW_CACHE_STEPS": "4,2"}
    options = load_options({}, arm=arm)
    assert options.audio_norm == "clip" and options.piflow_cache_steps == (2, 4)
    assert options.arm_name == str(arm)
    assert resolve_arm(str(arm)) == arm


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("K6_AUDIO_NORM=clip\nK6_AUDIO_NROM=clip\n", ":2: unknown switch K6_AUDIO_NROM; did you mean K6_AUDIO_NORM?"),
        (
            "K6_DEVICE=cuda\n",
            ":1: unknown switch K6_DEVICE; the nearest switch is K6_DIT_AHEAD (`k6fast switches` lists",
        ),
        ("# ok\nK6_AUDIO_NORM clip\n", ":2: expected KEY=VALUE"),
        ("export K6_AUDIO_NORM=clip\n", ":1: expected KEY=VALUE"),
        ("HOME=/root\n", ":1: expected a K6_* switch, found 'HOME'"),
        ("K6_AUDIO_NORM=clip\n\nK6_AUDIO_NORM=peak\n", ":3: K6_AUDIO_NORM is set twice (first on line 1)"),
        ("K6_AUDIO_NORM=clip # fast\n", ":1: Unable to use K6_AUDIO_NORM='clip # fast': expected one of peak, clip"),
        ("K6_API_KEY=hunter2\n", ":1: K6_API_KEY is a secret"),
    ],
)
def test_arm_file_errors_name_file_and_line(tmp_path: Path, text: str, fragment: str) -> None:
    arm = _write(tmp_path / "bad.env", text)
    with pytest.raises(SwitchError) as info:
        read_arm(arm)
    assert str(info.value).startswith(str(arm) + ":"), str(info.value)
    assert fragment in str(info.value)
    assert "hunter2" not in str(info.value)


def test_missing_arm_lists_available_ones(tmp_path: Path) -> None:
    with pytest.raises(SwitchError) as info:
        resolve_arm("no-such-arm")
    assert "Unknown arm 'no-such-arm'" in str(info.value)
    assert "reference" in str(info.value)
    with pytest.raises(SwitchError, match="does not exist"):
        resolve_arm(str(tmp_path / "absent.env"))
    with pytest.raises(SwitchError, match="Unknown arm"):
        resolve_arm("..")


def test_environment_overrides_arm(tmp_path: Path) -> None:
    arm = _write(tmp_path / "clip.env", "K6_AUDIO_NORM=clip\nK6_PIFLOW_CACHE_STEPS=3\n")
    options = load_options({"K6_AUDIO_NORM": "peak"}, arm=arm)
    assert options.audio_norm == "peak" and options.piflow_cache_steps == (3,)
    assert options.arm_name == f"{arm}+env"
    # Setting a variable to the arm's own value, or a non-output switch, leaves the arm name alone.
    same = load_options({"K6_AUDIO_NORM": "clip", "K6_DATA_DIR": "/x"}, arm=arm)
    assert same.arm_name == str(arm)
    assert load_options({}, arm="reference").arm_name == "reference"


def test_hash_equal_for_reference_arm_and_explicit_defaults_in_env() -> None:
    explicit = {s.name: s.format(s.default) for s in SWITCHES}
    from_env = load_options(explicit)
    from_arm = load_options({}, arm="reference")
    assert from_env.arm_hash() == from_arm.arm_hash() == Options().arm_hash()
    assert from_env == from_arm
    assert re.fullmatch(r"[0-9a-f]{16}", from_arm.arm_hash())


def test_hash_changes_with_output_switches_only() -> None:
    base = Options()
    cached = base.replace(piflow_cache_steps=(3,))
    assert cached.arm_hash() != base.arm_hash()
    assert cached.arm_hash() != base.replace(piflow_cache_steps=(3, 5)).arm_hash()
    assert base.replace(audio_norm="clip").arm_hash() != base.arm_hash()
    # Where jobs are kept and who may submit them cannot change a pixel.
    assert base.replace(data_dir="/elsewhere", api_key="secret").arm_hash() == base.arm_hash()
    assert base.replace(arm_name="mine").arm_hash() == base.arm_hash()


def test_secrets_redacted_everywhere() -> None:
    options = load_options({"K6_API_KEY": "hunter2", "K6_AUDIO_NORM": "clip"})
    assert options.api_key == "hunter2"
    assert options.snapshot()["K6_API_KEY"] == "<set>"
    assert Options().snapshot()["K6_API_KEY"] == ""
    assert options.non_default() == {"K6_API_KEY": "<set>", "K6_AUDIO_NORM": "clip"}
    shown = [repr(options), str(options), render_table(options), render_table(options, markdown=True)]
    shown.append(str(provenance(options)))
    assert all("hunter2" not in text for text in shown)


def test_snapshot_covers_every_switch_in_canonical_form() -> None:
    snapshot = load_options({"K6_PIFLOW_CACHE_STEPS": " 9 ,4"}).snapshot()
    assert list(snapshot) == [s.name for s in SWITCHES]
    assert snapshot["K6_PIFLOW_CACHE_STEPS"] == "4,9"
    assert snapshot["K6_AUDIO_NORM"] == "peak"


def test_render_table_plain_and_markdown_contain_every_switch() -> None:
    options = Options().replace(piflow_cache_steps=(2, 7))
    plain = render_table(options)
    markdown = render_table(options, markdown=True)
    for switch in SWITCHES:
        assert switch.name in plain and switch.doc in plain
        assert switch.name in markdown
    plain_lines = plain.splitlines()
    assert plain_lines[0].split() == ["Switch", "Value", "Default", "Lossy", "Description"]
    assert len(plain_lines) == 2 + len(SWITCHES)
    # Aligned: every row's description starts in the same column.
    starts = {line.index(s.doc) for line, s in zip(plain_lines[2:], SWITCHES, strict=True)}
    assert len(starts) == 1
    row = next(line for line in plain_lines if line.startswith("K6_PIFLOW_CACHE_STEPS"))
    assert row.split()[1:4] == ["2,7", "(empty)", "yes"]
    md_lines = markdown.splitlines()
    assert md_lines[0] == "| Switch | Value | Default | Lossy | Description |"
    assert md_lines[1] == "|---|---|---|---|---|"
    assert all(line.startswith("| ") and line.endswith(" |") for line in md_lines[2:])
    assert "| K6_PIFLOW_CACHE_STEPS | `2,7` | (empty) | yes |" in markdown


def _readme(table: str) -> str:
    start, end = README_MARKERS
    return f"# k6fast\n\nIntro.\n\n{start}\n{table}\n{end}\n\nMore text.\n"


def test_readme_table_documents_defaults() -> None:
    table = readme_table()
    for switch in SWITCHES:
        assert f"| {switch.name} |" in table and switch.accepts in table
    assert "| K6_AUDIO_NORM | `peak` | one of peak, clip | no |" in table


def test_check_readme_accepts_current_and_detects_stale_or_missing_block() -> None:
    current = _readme(readme_table())
    assert check_readme(current) is None
    stale = current.replace("one of peak, clip", "one of peak")
    message = check_readme(stale)
    assert message is not None and "out of date" in message and "one of peak, clip" in message
    shorter = _readme("\n".join(readme_table().splitlines()[:-1]))
    assert "<end of table>" in (check_readme(shorter) or "")
    assert "found 0 and 0" in (check_readme("# k6fast\n") or "")
    assert "found 1 and 0" in (check_readme(f"{README_MARKERS[0]}\n{readme_table()}\n") or "")
    assert "before" in (check_readme(f"{README_MARKERS[1]}\n{README_MARKERS[0]}\n") or "")


def test_replace_readme_block_makes_a_stale_readme_pass() -> None:
    stale = _readme("| old | table |")
    fixed = replace_readme_block(stale)
    assert check_readme(fixed) is None
    assert fixed.startswith("# k6fast\n\nIntro.\n") and fixed.endswith("More text.\n")
    assert replace_readme_block(fixed) == fixed
    with pytest.raises(ValueError, match="found 0 and 0"):
        replace_readme_block("no markers")


@pytest.mark.parametrize(
    ("steps", "num_steps", "fragments"),
    [
        ((0, 8), 10, ["K6_PIFLOW_CACHE_STEPS=0,8: step 0 cannot be cached (it has no previous prediction)"]),
        ((3, 12), 10, ["K6_PIFLOW_CACHE_STEPS=3,12: step 12 outside the schedule"]),
        ((10, 11), 10, ["steps 10, 11 outside the schedule"]),
        ((2, 2), 10, ["repeated: 2"]),
        ((1,), 1, ["no step can be cached in a 1-step schedule"]),
        ((2,), 2, ["the only valid step is 1 for a 2-step schedule"]),
    ],
)
def test_validate_cache_steps_errors(steps: tuple[int, ...], num_steps: int, fragments: list[str]) -> None:
    with pytest.raises(SwitchError) as info:
        validate_cache_steps(steps, num_steps)
    for fragment in fragments:
        assert fragment in str(info.value)
    if num_steps == 10:
        assert str(info.value).endswith("valid steps are 1..9 for a 10-step schedule")


def test_validate_cache_steps_accepts_valid_steps() -> None:
    validate_cache_steps((), 1)
    validate_cache_steps((1, 5, 9), 10)
    with pytest.raises(ValueError, match="num_steps must be >= 1, found 0"):
        validate_cache_steps((), 0)


def test_provenance_fields() -> None:
    options = load_options({"K6_AUDIO_NORM": "clip"})
    record = provenance(options)
    assert set(record) == {"k6fast_version", "git_commit", "git_dirty", "arm", "arm_hash", "switches"}
    import k6fast

    assert record["k6fast_version"] == k6fast.__version__
    assert record["arm"] == "env" and record["arm_hash"] == options.arm_hash()
    assert record["switches"] == options.snapshot()
    assert record["git_commit"] == "unknown" or re.fullmatch(r"[0-9a-f]{40}", record["git_commit"])
    assert isinstance(record["git_dirty"], bool) or record["git_commit"] == "unknown"
    assert provenance(options)["git_commit"] == record["git_commit"]


def _git(repo: Path, *args: str) -> str:
    ident = ["-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false"]
    return subprocess.run(["git", *ident, *args], cwd=repo, check=True, capture_output=True, text=True).stdout


def test_git_state_of_a_k6fast_checkout_and_of_other_directories(tmp_path: Path) -> None:
    assert git_state(tmp_path) == ("unknown", None)
    checkout = tmp_path / "checkout"
    (checkout / "switches").mkdir(parents=True)
    _write(checkout / "pyproject.toml", '[project]\nname = "k6fast"\n')
    _git(checkout, "init", "-q")
    _git(checkout, "add", "pyproject.toml")
    _git(checkout, "commit", "-q", "-m", "init")
    head = _git(checkout, "rev-parse", "HEAD").strip()
    assert git_state(checkout / "switches") == (head, False)
    _write(checkout / "switches" / "new.py", "")
    assert git_state(checkout / "switches") == (head, False), "cached per process"
    git_state.cache_clear()
    assert git_state(checkout / "switches") == (head, True)
    # Another project's repository (say, one holding a venv with k6fast installed) is not our checkout.
    other = tmp_path / "other"
    other.mkdir()
    _write(other / "pyproject.toml", '[project]\nname = "something-else"\n')
    _git(other, "init", "-q")
    _git(other, "add", "pyproject.toml")
    _git(other, "commit", "-q", "-m", "init")
    assert git_state(other) == ("unknown", None)
