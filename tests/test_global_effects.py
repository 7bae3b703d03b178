"""No process-wide effect outside the entry points: read from the package's source, nothing but the entry points and
switches/ writes an environment variable, sets the CUDA allocator (its cap, its settings) or a `torch.backends` flag
(cuDNN's algorithm timing, TF32, ...: one per process, not per thread, even inside a scope that restores it), and the
functions that do it for the entry points (k6fast/entry.py) are called by the entry points only.
A library user's two pipelines in one process must not re-cap each other, rewrite each other's environment or change
the algorithms each other's kernels run."""

from __future__ import annotations

import ast
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
PACKAGE_DIRS = ("k6fast", "switches", "quality_gate")

# The entry points: a process starts in them and they own it.
ENTRY_MODULES = frozenset(
    {
        "k6fast/entry.py",  # what the entry points set for their process
        "k6fast/cli.py",  # `k6fast ...`
        "k6fast/server/cli.py",  # `python -m k6fast.server`
        "k6fast/server/worker.py",  # the server's start-up (`load_pipeline`), in-process and in each Ray replica
        "k6fast/bench/visit.py",  # one bench visit, its own process
        "quality_gate/command.py",  # `k6fast gate`: its pipelines, one per arm
        "k6fast/tune/cli.py",  # `k6fast tune`: the gate's pipelines (its timings run in bench visits)
    }
)
EFFECT_MODULES = ENTRY_MODULES | {"switches/"}  # switches/ owns the environment (every K6_* variable)
# Functions that change the whole process: defined for the entry points, called by nobody else.
PROCESS_FUNCTIONS = {
    "k6fast/entry.py": {
        "quiet_warnings",
        "configure_allocator_environment",
        "configure_compile_caches",
        "cap_device_memory",
        "expandable_segments_now",
        "prepare_pipeline_process",
        "allow_recompiles_per_geometry",
    },
}
WATCHED_CALLS = {"set_per_process_memory_fraction", "_set_allocator_settings", "putenv", "unsetenv"}
MUTATORS = {"setdefault", "update", "pop", "popitem", "clear", "__setitem__", "__delitem__"}
BACKENDS = "torch.backends"
# Functions of torch.backends' modules that set their flags (`flags` and `sdp_kernel` are scopes that set them).
BACKEND_SETTERS = ("flags", "sdp_kernel", "enable_", "set_", "preferred_")


def _module_names(tree: ast.AST) -> dict[str, str]:
    """The dotted module or attribute each name bound by this module's imports stands for (`import torch.backends as
    b` → b: torch.backends; `from torch.backends import cudnn` → cudnn: torch.backends.cudnn)."""
    names = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                names[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names |= {a.asname or a.name: f"{node.module}.{a.name}" for a in node.names}
    return names


def _environ_names(tree: ast.AST) -> tuple[set[str], set[str]]:
    """(names bound to the os module, names bound to os.environ itself) by this module's imports."""
    os_names, environ_names = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            os_names |= {a.asname or a.name for a in node.names if a.name == "os"}
        elif isinstance(node, ast.ImportFrom) and node.module == "os":
            environ_names |= {a.asname or a.name for a in node.names if a.name == "environ"}
    return os_names, environ_names


class _Effects(ast.NodeVisitor):
    """Writes to os.environ (directly, or through a name bound to it such as `env = os.environ if e is None else e`)
    , calls of the watched process-wide functions, and writes to torch.backends' flags (assigned, set with setattr or
    through its setters); `found` holds one line per effect."""

    def __init__(self, os_names: set[str], environ_names: set[str], modules: dict[str, str]):
        self.os_names, self.modules, self.found = os_names, modules, []
        self.aliases = [set(environ_names)]

    def _dotted(self, node: ast.AST) -> str | None:
        """`torch.backends.cudnn.benchmark` for an attribute chain on a name an import bound; None for anything
        else."""
        if isinstance(node, ast.Attribute):
            base = self._dotted(node.value)
            return None if base is None else f"{base}.{node.attr}"
        return self.modules.get(node.id) if isinstance(node, ast.Name) else None

    def _in_backends(self, node: ast.AST) -> str | None:
        name = self._dotted(node)
        return name if name is not None and (name + ".").startswith(BACKENDS + ".") else None

    def _is_environ(self, node: ast.AST) -> bool:
        if isinstance(node, ast.Attribute) and node.attr == "environ":
            return isinstance(node.value, ast.Name) and node.value.id in self.os_names
        return isinstance(node, ast.Name) and any(node.id in scope for scope in self.aliases)

    def _holds_environ(self, node: ast.AST) -> bool:
        if isinstance(node, ast.IfExp):
            return self._holds_environ(node.body) or self._holds_environ(node.orelse)
        if isinstance(node, ast.BoolOp):
            return any(self._holds_environ(v) for v in node.values)
        return self._is_environ(node)

    def _function(self, node: ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda) -> None:
        self.aliases.append(set())
        self.generic_visit(node)
        self.aliases.pop()

    visit_FunctionDef = visit_AsyncFunctionDef = visit_Lambda = _function

    def visit_Assign(self, node: ast.Assign) -> None:
        if self._holds_environ(node.value):
            self.aliases[-1] |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        self.generic_visit(node)

    def visit_Attribute(self, node: ast.Attribute) -> None:
        if isinstance(node.ctx, (ast.Store, ast.Del)) and (name := self._in_backends(node)):
            self.found.append(f"line {node.lineno}: {name} set")
        self.generic_visit(node)

    def visit_Subscript(self, node: ast.Subscript) -> None:
        if isinstance(node.ctx, (ast.Store, ast.Del)) and self._is_environ(node.value):
            self.found.append(f"line {node.lineno}: os.environ[...] assigned or deleted")
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None
        if isinstance(func, ast.Attribute) and name in MUTATORS and self._is_environ(func.value):
            self.found.append(f"line {node.lineno}: os.environ.{name}(...)")
        elif name in WATCHED_CALLS:
            self.found.append(f"line {node.lineno}: {name}(...)")
        elif name == "setattr" and node.args and (target := self._in_backends(node.args[0])):
            self.found.append(f"line {node.lineno}: setattr({target}, ...)")
        elif name is not None and name.startswith(BACKEND_SETTERS) and (setter := self._in_backends(func)):
            self.found.append(f"line {node.lineno}: {setter}(...)")
        self.generic_visit(node)


def effects_in(source: str) -> list[str]:
    """The process-wide effects in one module's source, one line each."""
    tree = ast.parse(source)
    finder = _Effects(*_environ_names(tree), _module_names(tree))
    finder.visit(tree)
    return finder.found


def _names_used(tree: ast.AST) -> set[str]:
    used = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            used.add(node.id)
        elif isinstance(node, ast.Attribute):
            used.add(node.attr)
        elif isinstance(node, ast.ImportFrom):
            used |= {a.name for a in node.names}
    return used


def package_modules(root: Path = ROOT) -> dict[str, str]:
    """Every module of the package, by its path relative to the repository root."""
    return {
        path.relative_to(root).as_posix(): path.read_text(encoding="utf-8")
        for folder in PACKAGE_DIRS
        for path in sorted((root / folder).rglob("*.py"))
    }


def violations(modules: dict[str, str]) -> list[str]:
    """Effects outside EFFECT_MODULES, and PROCESS_FUNCTIONS used outside the entry points and their own module."""
    problems = []
    for rel, source in modules.items():
        if not any(rel == m or (m.endswith("/") and rel.startswith(m)) for m in EFFECT_MODULES):
            problems += [f"{rel}: {effect}" for effect in effects_in(source)]
        used = _names_used(ast.parse(source))
        for owner, names in PROCESS_FUNCTIONS.items():
            if rel != owner and rel not in ENTRY_MODULES:
                problems += [f"{rel}: calls {owner}'s {name}, which only entry points may" for name in names & used]
    return problems


def test_no_process_wide_effect_outside_the_entry_points() -> None:
    problems = violations(package_modules())
    assert not problems, "process-wide effects outside the entry points:\n" + "\n".join(problems)


def test_every_entry_module_exists() -> None:
    assert all((ROOT / m).is_file() for m in ENTRY_MODULES), "an entry point moved: update ENTRY_MODULES"


@pytest.mark.parametrize(
    "source",
    [
        "import os\nos.environ['A'] = '1'",
        "import os\ndel os.environ['A']",
        "import os\nos.environ.setdefault('A', '1')",
        "import os\nos.environ.update(A='1')",
        "import os\nos.environ.pop('A', None)",
        "import os\nos.putenv('A', '1')",
        "import os as system\nsystem.environ['A'] = '1'",
        "from os import environ\nenviron['A'] = '1'",
        "import os\ndef f(env=None):\n    env = os.environ if env is None else env\n    env['A'] = '1'",
        "import torch\ntorch.cuda.set_per_process_memory_fraction(0.5, 0)",
        "import torch\ntorch.cuda.memory._set_allocator_settings('expandable_segments:True')",
        "import torch\ntorch.backends.cudnn.benchmark = True",
        "import torch\ntorch.backends.cuda.matmul.allow_tf32 = True",
        "import torch.backends.cudnn\ntorch.backends.cudnn.allow_tf32 = False",
        "import torch.backends.cudnn as cudnn\ncudnn.benchmark = True",
        "from torch.backends import cudnn\ncudnn.deterministic = True",
        "from torch import backends\nbackends.cudnn.benchmark = True",
        "import torch\nsetattr(torch.backends.cudnn, 'benchmark', True)",
        "import torch\nwith torch.backends.cudnn.flags(enabled=True, benchmark=True):\n    pass",
        "import torch\ntorch.backends.cuda.enable_flash_sdp(False)",
    ],
)
def test_each_kind_of_effect_is_found(source: str) -> None:
    assert len(effects_in(source)) == 1


def test_a_scope_that_restores_a_backends_flag_is_still_an_effect() -> None:
    # The video decode's cuDNN scope before issue #37: while it is open, every other thread's convolutions run under
    # its flag.
    source = """
import contextlib
import torch

@contextlib.contextmanager
def cudnn_benchmark_scope(on: bool):
    before = torch.backends.cudnn.benchmark
    torch.backends.cudnn.benchmark = on
    try:
        yield
    finally:
        torch.backends.cudnn.benchmark = before
"""
    assert effects_in(source) == [
        "line 8: torch.backends.cudnn.benchmark set",
        "line 12: torch.backends.cudnn.benchmark set",
    ]
    assert violations({"k6fast/video_decode/decode.py": source}) == [
        "k6fast/video_decode/decode.py: line 8: torch.backends.cudnn.benchmark set",
        "k6fast/video_decode/decode.py: line 12: torch.backends.cudnn.benchmark set",
    ]


@pytest.mark.parametrize(
    "source",
    [
        "import os\nx = os.environ.get('A')",
        "import os\nx = os.environ['A']",
        "import os\nenv = dict(os.environ)\nenv['A'] = '1'",
        "import os\nenv = os.environ.copy()\nenv.update(A='1')",
        "import os\ndef f(environ):\n    environ['A'] = '1'\ndef g():\n    environ = os.environ\n    return environ",
        "import torch\non = torch.backends.cudnn.benchmark",
        "import torch\nok = torch.backends.cudnn.is_available() and torch.backends.cuda.matmul.allow_tf32",
        "import torch\ntorch.nn.Conv3d(1, 1, 3).benchmark = True",
        "from torch import nn\nsetattr(nn, 'backends', 1)",
    ],
)
def test_reads_and_copies_are_not_effects(source: str) -> None:
    assert effects_in(source) == []


def test_a_library_module_calling_an_entry_function_is_refused() -> None:
    modules = {"k6fast/pipeline.py": "from .entry import prepare_pipeline_process\nprepare_pipeline_process(o, d)\n"}
    assert violations(modules) == [
        "k6fast/pipeline.py: calls k6fast/entry.py's prepare_pipeline_process, which only entry points may"
    ]


def test_the_entry_points_leave_cudnn_algorithm_timing_as_it_was(monkeypatch) -> None:
    # cuDNN's timing (torch.backends.cudnn.benchmark) gained the W1 video decode nothing and cost a process's first
    # audio decode 3-5 s on the H200 (measurements/sessions/2026-12-02_acceptance-envelope2): the entry points leave it.
    from k6fast import entry

    for name in ("configure_compile_caches", "expandable_segments_now", "cap_device_memory"):
        monkeypatch.setattr(entry, name, lambda *args: None)  # their CUDA calls; only the cuDNN flag is asked here
    options = SimpleNamespace(inductor_cache_dir=None, vram_budget_gb=32.0, compile=False)
    for before in (False, True):
        monkeypatch.setattr(torch.backends.cudnn, "benchmark", before)
        entry.prepare_pipeline_process(options, "cuda:0")
        assert torch.backends.cudnn.benchmark is before


def test_a_compiling_process_keeps_a_graph_per_geometry(monkeypatch) -> None:
    import torch._dynamo.config

    from k6fast import entry

    for name in ("configure_compile_caches", "expandable_segments_now", "cap_device_memory"):
        monkeypatch.setattr(entry, name, lambda *args: None)
    with torch._dynamo.config.patch(recompile_limit=8):  # restored after (monkeypatch cannot undo a config entry)
        entry.prepare_pipeline_process(
            SimpleNamespace(inductor_cache_dir=None, vram_budget_gb=32.0, compile=False), "cpu"
        )
        assert torch._dynamo.config.recompile_limit == 8  # nothing compiles: Dynamo's setting stays the user's
        entry.prepare_pipeline_process(
            SimpleNamespace(inductor_cache_dir=None, vram_budget_gb=32.0, compile=True), "cpu"
        )
        assert torch._dynamo.config.recompile_limit == entry.RECOMPILE_LIMIT
