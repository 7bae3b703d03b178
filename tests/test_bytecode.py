"""k6fast.bytecode: whether the start-up's packages have bytecode, and the doctor line that says how to add it."""

from __future__ import annotations

import compileall
import importlib
import sys

from k6fast.bytecode import Bytecode, bytecode_advice, check, package_bytecode


def _package(root, name: str) -> None:
    (root / name).mkdir()
    (root / name / "__init__.py").write_text("VALUE = 1\n")
    importlib.invalidate_caches()


def test_a_package_without_bytecode_is_found_and_compileall_fixes_it(tmp_path, monkeypatch) -> None:
    monkeypatch.syspath_prepend(str(tmp_path))
    _package(tmp_path, "k6_probe_pkg")
    state = package_bytecode("k6_probe_pkg", dont_write=True)
    assert state == Bytecode("k6_probe_pkg", tmp_path / "k6_probe_pkg", compiled=False, writable=False)
    assert package_bytecode("k6_probe_pkg", dont_write=False).writable  # tmp_path is writable
    line = bytecode_advice([state])
    assert "k6_probe_pkg not compiled" in line and "every process compiles it again" in line
    assert f"`{sys.executable} -m compileall -q -j 0 {tmp_path}`" in line  # this interpreter, not a bare python3
    assert compileall.compile_dir(tmp_path / "k6_probe_pkg", quiet=1)
    assert package_bytecode("k6_probe_pkg", dont_write=True).compiled
    assert "k6_probe_pkg" not in sys.modules  # looked at, never imported


def test_writable_missing_bytecode_says_the_first_process_pays_and_absent_packages_are_skipped(tmp_path) -> None:
    state = Bytecode("diffusers", tmp_path / "diffusers", compiled=False, writable=True)
    assert "the first process compiles and writes it" in bytecode_advice([state])
    assert bytecode_advice([Bytecode("torch", tmp_path / "torch", compiled=True, writable=False)]) is None
    assert package_bytecode("k6_no_such_package") is None
    assert check(("k6_no_such_package",)) is None


def test_doctor_reports_missing_bytecode(monkeypatch, tmp_path) -> None:
    import k6fast.doctor as doctor

    monkeypatch.setattr(doctor.bytecode, "PACKAGES", ("k6_probe_doctor",))
    monkeypatch.syspath_prepend(str(tmp_path))
    _package(tmp_path, "k6_probe_doctor")
    advice = doctor.run_doctor(None, measure=False).advice
    assert any(line.startswith("bytecode: k6_probe_doctor not compiled") for line in advice), advice
    compileall.compile_dir(tmp_path / "k6_probe_doctor", quiet=1)
    assert not any(line.startswith("bytecode:") for line in doctor.run_doctor(None, measure=False).advice)
