"""Tests reach the package through its public names only.

A name that starts with `_` is the owning module's to rename or remove; a test that holds one breaks on a refactor that
changes no behaviour, and an internal a test needs is worth a deliberate public name (a reference `op_ref`, a
documented seam). This file reads every `tests/*.py` with `ast` and fails on any private name of k6fast (kernels,
switches and quality_gate are installed under it) that a test imports, reads as an attribute of something it imported
from the package, monkeypatches or names in a dotted string; and on a private name the package defines (a `_method`,
an attribute `self._x`) read from any object but the test's own `self`, as `pipe._free_budget` would be. Dunder names
(`__version__`) are public.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
PACKAGES = frozenset({"k6fast", "switches", "quality_gate"})
SOURCES = [TESTS.parent / package for package in sorted(PACKAGES)]
# Builtins and pytest calls whose (object, "name") arguments reach an attribute by name.
_BY_NAME = frozenset({"getattr", "setattr", "delattr", "hasattr", "setitem", "delitem"})


def is_private(name: str) -> bool:
    """`_x` and `__x` are private; `__x__` (a dunder) is not."""
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _in_packages(dotted: str) -> bool:
    return dotted.split(".")[0] in PACKAGES


def _private_segment(dotted: str) -> str | None:
    return next((part for part in dotted.split(".") if is_private(part)), None)


def _stored_names(body: list[ast.AST]) -> set[str]:
    """Names a scope assigns (not those of the functions and classes nested in it)."""
    names: set[str] = set()
    pending = list(body)
    while pending:
        node = pending.pop()
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
            continue
        if not isinstance(node, ast.Lambda):
            pending.extend(ast.iter_child_nodes(node))
    return names


def defined_private_names(source: str) -> set[str]:
    """The private names a package module defines: functions, classes, module variables and attributes it assigns
    (`self._x = ...`)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
    return {name for name in names if is_private(name)}


class _Scanner(ast.NodeVisitor):
    """Collects `(line, what)` for every private package name a module's source reaches.

    Names bound by an import from the package are tracked per scope (module, function, lambda): a function that
    rebinds the name (an argument, an assignment) shadows the import inside it, so an instance that happens to share
    a module's name is not mistaken for the module. Any other object (an instance the test made) is judged by the
    attribute's name: one of `package_privates` is the package's own.
    """

    def __init__(self, package_privates: frozenset[str]) -> None:
        self.found: list[tuple[int, str]] = []
        self._package_privates = package_privates
        self._scopes: list[set[str]] = [set()]  # names bound to package objects, innermost last
        self._foreign: set[str] = set()  # names bound to other libraries (torch._dynamo is torch's business)

    # Bindings.
    def _bound(self, name: str) -> bool:
        return any(name in scope for scope in reversed(self._scopes))

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            if not _in_packages(alias.name):
                self._foreign.add(alias.asname or alias.name.split(".")[0])
                continue
            if (part := _private_segment(alias.name)) is not None:
                self.found.append((node.lineno, f"import {alias.name} ({part})"))
            self._scopes[-1].add(alias.asname or alias.name.split(".")[0])

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.level or node.module is None or not _in_packages(node.module):
            self._foreign.update(alias.asname or alias.name for alias in node.names)
            return
        if (part := _private_segment(node.module)) is not None:
            self.found.append((node.lineno, f"from {node.module} import ... ({part})"))
        for alias in node.names:
            if is_private(alias.name):
                self.found.append((node.lineno, f"from {node.module} import {alias.name}"))
            self._scopes[-1].add(alias.asname or alias.name)

    def _scoped(self, arguments: ast.arguments | None, body: list[ast.AST]) -> None:
        local: set[str] = set()
        shadowed: set[str] = set()
        if arguments is not None:
            args = [*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs]
            args += [a for a in (arguments.vararg, arguments.kwarg) if a is not None]
            shadowed |= {a.arg for a in args}
            for default in [*arguments.defaults, *arguments.kw_defaults]:
                if default is not None:
                    self.visit(default)
        shadowed |= _stored_names(body)
        # An enclosing import stays visible unless this scope binds the name itself.
        self._scopes.append(local)
        hidden = [scope & shadowed for scope in self._scopes[:-1]]
        for scope, names in zip(self._scopes[:-1], hidden, strict=True):
            scope -= names
        for statement in body:
            self.visit(statement)
        for scope, names in zip(self._scopes[:-1], hidden, strict=True):
            scope |= names
        self._scopes.pop()

    def visit_FunctionDef(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        for decorator in node.decorator_list:
            self.visit(decorator)
        self._scoped(node.args, node.body)

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_Lambda(self, node: ast.Lambda) -> None:
        self._scoped(node.args, [node.body])

    # Uses.
    def visit_Attribute(self, node: ast.Attribute) -> None:
        root: ast.AST = node
        chain: list[str] = []
        while isinstance(root, ast.Attribute):
            chain.append(root.attr)
            root = root.value
        if isinstance(root, ast.Name) and self._bound(root.id):
            dotted = ".".join([root.id, *reversed(chain)])
            if (part := _private_segment(".".join(reversed(chain)))) is not None:
                self.found.append((node.lineno, f"{dotted} ({part})"))
            return  # the whole chain is judged here; its inner attributes are not visited again
        if self._owned(root) and node.attr in self._package_privates:
            self.found.append((node.lineno, f"{ast.unparse(node)} (a private name of the package)"))
        self.generic_visit(node)

    def _owned(self, root: ast.AST) -> bool:
        """Whether an attribute read from an expression rooted at `root` may be a package object's: not the test's
        own `self` or `cls`, nor another library's module."""
        return not (isinstance(root, ast.Name) and root.id in {"self", "cls"} | self._foreign)

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None
        if name in _BY_NAME and len(node.args) >= 2:
            target, attr = node.args[0], node.args[1]
            if isinstance(attr, ast.Constant) and isinstance(attr.value, str) and is_private(attr.value):
                root = target
                while isinstance(root, ast.Attribute):
                    root = root.value
                imported = isinstance(target, (ast.Name, ast.Attribute)) and self._reaches_package(target)
                if imported or (self._owned(root) and attr.value in self._package_privates):
                    self.found.append((node.lineno, f"{name}(..., {attr.value!r})"))
        self.generic_visit(node)

    def _reaches_package(self, node: ast.AST) -> bool:
        while isinstance(node, ast.Attribute):
            node = node.value
        return isinstance(node, ast.Name) and self._bound(node.id)

    def visit_Constant(self, node: ast.Constant) -> None:
        # "k6fast.dit.model._fused_block" as monkeypatch.setattr's or mock.patch's target, or importlib's argument.
        value = node.value
        dotted = isinstance(value, str) and " " not in value and "." in value and _in_packages(value)
        if dotted and (part := _private_segment(value)) is not None:
            self.found.append((node.lineno, f"{value!r} ({part})"))


def private_references(source: str, package_privates: frozenset[str] = frozenset()) -> list[tuple[int, str]]:
    """`(line, what)` for each private k6fast name `source` (a test module) reaches; `package_privates`: the private
    names the package defines (`defined_private_names` of its modules)."""
    scanner = _Scanner(package_privates)
    scanner.visit(ast.parse(source))
    return sorted(scanner.found)


def package_private_names() -> frozenset[str]:
    modules = [path for root in SOURCES for path in root.rglob("*.py")]
    assert len(modules) > 50, f"expected the package's modules under {SOURCES}, found {len(modules)}"
    return frozenset().union(*(defined_private_names(path.read_text(encoding="utf-8")) for path in modules))


def test_no_test_reaches_a_private_package_name():
    sources = sorted(TESTS.glob("*.py"))
    assert len(sources) > 50, f"expected the test suite under {TESTS}, found {len(sources)} files"
    privates = package_private_names()
    assert {"_fp8_fp16acc_kernel", "_device"} <= privates, "the package's private names were not read"
    offences = [
        f"{path.name}:{line}: {what}"
        for path in sources
        for line, what in private_references(path.read_text(encoding="utf-8"), privates)
    ]
    assert not offences, "tests reach private names of the package:\n" + "\n".join(offences)


@pytest.mark.parametrize(
    "source",
    [
        "from k6fast.video_decode import _decode",
        "from k6fast.video_decode import _decode as decode",
        "from k6fast.kernels._private_module import op",
        "import k6fast.kernels._private_module as m",
        "from k6fast.video_decode import decode as vd\nvd._decode(1)",
        "import k6fast.video_decode.decode as vd\nvd._decode(1)",
        "import k6fast\nk6fast.video_decode._decode(1)",
        "from k6fast import dit\ndef test():\n    return dit.block._fused_block",
        "def test():\n    from k6fast.dit import block\n    assert block._fused_block",
        "from k6fast.dit import block\ndef test(monkeypatch):\n    monkeypatch.setattr(block, '_fused_block', None)",
        "from k6fast.dit import block\ndef test():\n    getattr(block, '_fused_block')",
        "def test(monkeypatch):\n    monkeypatch.setattr('k6fast.dit.block._fused_block', None)",
        "from k6fast.pipeline import Pipeline\nPipeline._load",
        "import k6fast.video_decode as vd\nf = lambda: vd._plan",
    ],
)
def test_scanner_flags_a_private_reference(source):
    assert private_references(source), source


@pytest.mark.parametrize(
    "source",
    [
        "import k6fast\nk6fast.__version__",
        "from k6fast.video_decode import decode_video_fast\ndecode_video_fast(1)",
        "from k6fast.dit import block\ndef test(block):\n    block._anything",  # an argument shadows the import
        "from k6fast.dit import block\ndef test():\n    block = object()\n    block._anything",
        "import torch\ntorch._dynamo.reset()",  # other libraries' privates are theirs
        "x = object()\nx._private",
        "from k6fast.dit import block\ndef test(monkeypatch):\n    monkeypatch.setattr(block, 'public', None)",
        "message = 'k6fast._private is a sentence, not a target'",
    ],
)
def test_scanner_passes_public_references(source):
    assert private_references(source) == [], source


@pytest.mark.parametrize(
    ("source", "flagged"),
    [
        ("def test(pipe):\n    pipe._free_budget()", True),
        ("def test(pipe):\n    pipe.dit.runtime._free_budget = None", True),
        ("def test(pipe, monkeypatch):\n    monkeypatch.setattr(pipe, '_free_budget', lambda: 0)", True),
        ("def test(state):\n    getattr(state.store, '_free_budget')", True),
        ("def test(pipe):\n    pipe._a_name_the_package_does_not_define", False),
        ("class Fake:\n    def budget(self):\n        return self._free_budget", False),
        ("import torch\ntorch._free_budget", False),
    ],
)
def test_scanner_judges_instances_by_the_packages_private_names(source, flagged):
    assert bool(private_references(source, frozenset({"_free_budget"}))) is flagged, source


def test_the_package_defines_what_the_scanner_reads():
    defined = defined_private_names(
        "_TABLE = {}\ndef _helper(): ...\nclass _Thing:\n    def __init__(self):\n        self._state = 1\n"
        "def public(): ...\n__all__ = []"
    )
    assert defined == {"_TABLE", "_helper", "_Thing", "_state"}


def test_every_kernel_body_is_reachable_by_name():
    """`kernels.aot.body` is the public way to a private Triton body: every name resolves to the body its module
    launches, so a body renamed or moved fails here, not in a SASS check that skips on another machine."""
    from k6fast.kernels import aot, gluon_hopper

    gluon = {"fp16acc_wgmma", "quant_attention_wgmma"}
    for name, (module, attr) in aot.BODIES.items():
        if name in gluon and not gluon_hopper.GLUON_AVAILABLE:
            with pytest.raises(LookupError, match="Gluon"):
                aot.body(name)
            continue
        assert aot.body(name).__name__ == attr, (name, module)
    with pytest.raises(KeyError, match="no kernel body 'gemm'; expected one of"):
        aot.body("gemm")
