"""The import graph of k6fast's packages points one way: no cycles, and nothing imports upward.

The graph is read from the source with `ast`, imports inside functions included (an import deferred into a function
still ties the two modules together; deferring it only hides a cycle from the interpreter). Each import counts as an
edge to the module it names (`from pkg import name` names `pkg.name` where that is a module, else `pkg`); a package's
`__init__` is a module like the others, so re-exports through it count.

The layers (design card): `k6fast/kernels/` knows nothing of the runtime; the runtime knows nothing of the command
line (`k6fast.cli` and the subcommands' `cli` modules it registers).
"""

from __future__ import annotations

import ast
import importlib.metadata
from pathlib import Path

import networkx  # a dependency of torch
import pytest

ROOT = Path(__file__).resolve().parents[1]
# Source folder -> the package it is installed as (pyproject.toml's package-dir).
PACKAGES = {
    "k6fast": "k6fast",
    "switches": "k6fast.switches",
    "quality_gate": "k6fast.quality_gate",
}
KERNELS = "k6fast.kernels"


def _modules() -> dict[str, Path]:
    """Every module of the packages by its installed name (a package by its own name, for its __init__)."""
    found = {}
    for folder, package in PACKAGES.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = [p for p in path.relative_to(ROOT / folder).with_suffix("").parts if p != "__init__"]
            found[".".join([package, *parts])] = path
    return found


MODULES = _modules()


def _resolve(name: str) -> str | None:
    """The module of ours that the dotted `name` refers to: itself, else its longest prefix that is one; None if
    it is not ours (the standard library, torch, ...)."""
    while name:
        if name in MODULES:
            return name
        name = name.rpartition(".")[0]
    return None


def _imports(module: str) -> set[str]:
    """The modules of ours that `module` imports anywhere in its source (module level, functions, TYPE_CHECKING)."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    targets = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            names = [f"{base}.{alias.name}" for alias in node.names]  # resolves to `base` when not a module
        else:
            continue
        targets.update(t for t in map(_resolve, names) if t is not None and t != module)
    return targets


GRAPH = {module: _imports(module) for module in MODULES}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module, each sorted, in order."""
    components = networkx.strongly_connected_components(networkx.DiGraph(graph))
    return sorted(sorted(c) for c in components if len(c) > 1)


# `k6fast.server`'s __init__ re-exports its subcommand's `register` for `k6fast.cli` (its docstring says so): the
# package's face to the command line, so it belongs to that layer. (Importing one of the server's modules still runs
# it; nothing of the runtime below the server does.)
CLI_FACES = frozenset({"k6fast.server"})


def _is_cli(module: str) -> bool:
    """The command-line layer: `k6fast.cli`, the subcommands' modules it registers (`bench.cli`,
    `bench.acceptance_cli`, `server.cli`, `server.ray_cli`), `__main__` entry points and CLI_FACES.
    `k6fast.cli_args` holds argument checks the server and the gate share and is not part of it."""
    last = module.rpartition(".")[2]
    return last in ("cli", "__main__") or last.endswith("_cli") or module in CLI_FACES


def test_the_graph_is_read():
    # Guards the checks below against a reader that finds nothing: known edges of each kind are seen.
    assert len(MODULES) > 100
    assert "k6fast.kernels.adaln" in GRAPH["k6fast.dit.backend"]  # module level, relative
    assert "k6fast.kernels.qk_norm_rope" in GRAPH["k6fast.dit.backend"]
    assert "k6fast.dit.attention" in GRAPH["k6fast.dit.backend"]  # inside a function
    assert "k6fast.kernels.fp8_linear" in GRAPH["k6fast.kernels.adaln"]  # within kernels
    assert "k6fast.bench.cli" in GRAPH["k6fast.cli"]
    assert "k6fast" in GRAPH["k6fast.switches.provenance"]  # `from .. import __version__`: the root package
    assert {"k6fast.cli", "k6fast.server.cli", "k6fast.server.__main__", "k6fast.server"} <= {
        m for m in MODULES if _is_cli(m)
    }


def test_cycle_finder_finds_cycles():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"e"}, "f": set()}
    assert _cycles(graph) == [["a", "b", "c"]]
    assert _cycles({"x": {"y"}, "y": {"x", "z"}, "z": set()}) == [["x", "y"]]


def test_no_import_cycles():
    cycles = _cycles(GRAPH)
    assert not cycles, "import cycles (imports inside functions count):\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_kernels_import_nothing_of_the_runtime():
    upward = sorted(
        f"{module} imports {target}"
        for module, targets in GRAPH.items()
        if module.startswith(KERNELS + ".") or module == KERNELS
        for target in targets
        if not (target == KERNELS or target.startswith(KERNELS + "."))
    )
    assert not upward, "k6fast/kernels/ must not import the runtime:\n" + "\n".join(upward)


@pytest.mark.parametrize("cli", sorted(m for m in MODULES if _is_cli(m)))
def test_the_runtime_never_imports_the_command_line(cli):
    importers = sorted(m for m, targets in GRAPH.items() if cli in targets and not _is_cli(m))
    assert not importers, f"{cli} is the command line; imported by the runtime: {importers}"


def top_level_modules(root: Path) -> set[str]:
    """What `import NAME` finds in `root` when it is first on sys.path (as a process started there has it)."""
    folders = {p.name for p in root.iterdir() if (p / "__init__.py").is_file()}
    return folders | {p.stem for p in root.glob("*.py")}


def shadowed(root: Path, installed: dict[str, list[str]]) -> dict[str, list[str]]:
    """The installed distributions' top-level modules that a folder or file of `root` hides, by name."""
    return {name: installed[name] for name in top_level_modules(root) if name in installed and name != "k6fast"}


def test_no_top_level_folder_of_the_repository_shadows_an_installed_module(tmp_path) -> None:
    # `python -m k6fast.cli` in a clone's root, and the subprocesses the tests and bench visits start there, put the
    # root first on sys.path: a kernels/ there hid the PyPI `kernels` that transformers >= 5.25 imports.
    installed = importlib.metadata.packages_distributions()
    assert shadowed(ROOT, installed) == {}
    (tmp_path / "kernels").mkdir()
    (tmp_path / "kernels" / "__init__.py").write_text("")
    (tmp_path / "networkx.py").write_text("")
    assert shadowed(tmp_path, {"kernels": ["kernels"], "networkx": ["networkx"], "k6fast": ["k6fast"]}) == {
        "kernels": ["kernels"],
        "networkx": ["networkx"],
    }
