"""The library and its trainer, one way: ``qsdp_train`` uses only qsdp's public names, and
nothing in ``qsdp`` imports ``qsdp_train`` (``import qsdp`` loads no trainer code).

Public names are those in the ``__all__`` of ``qsdp`` or of a public subpackage's
``__init__`` (``qsdp.fsdp``, ``qsdp.comm``, ...). The trainer's sources are read with ``ast``,
not imported: this file runs without the trainer's dependencies."""

from __future__ import annotations

import ast
import importlib
import pkgutil
import subprocess
import sys
from pathlib import Path

import qsdp

SRC = Path(__file__).resolve().parents[1] / "src"

#: The trainer's private imports still waiting for a public replacement (issue 31), as
#: (module, name). Empty it, never grow it: add the name to a public ``__all__`` instead.
ALLOWED_PRIVATE: set[tuple[str, str]] = set()


def _public_modules() -> set[str]:
    """``qsdp`` and its subpackages whose names do not start with ``_``."""
    return {"qsdp"} | {
        f"qsdp.{m.name}"
        for m in pkgutil.iter_modules(qsdp.__path__)
        if m.ispkg and not m.name.startswith("_")
    }


def _absolute(node: ast.ImportFrom, path: Path) -> str:
    """The absolute module a ``from ... import`` in ``path`` (under ``SRC``) names."""
    if node.level == 0:
        return node.module or ""
    package = list(path.relative_to(SRC).parts[:-1])  # a module's or an __init__'s package
    base = package[: len(package) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _is_qsdp(module: str) -> bool:
    return module == "qsdp" or module.startswith("qsdp.")


def private_uses(path: Path) -> list[str]:
    """Every use of a non-public qsdp name in ``path``: imports from a module that is not
    public, names not in their module's ``__all__``, and ``alias.attr`` on an imported qsdp
    module where ``attr`` is not in its ``__all__``. ``ALLOWED_PRIVATE`` is not reported."""
    public = _public_modules()
    tree = ast.parse(path.read_text(), filename=str(path))
    found: list[str] = []
    modules: dict[str, str] = {}  # local name -> the qsdp module it is bound to

    def where(node: ast.AST) -> str:
        return f"{path.relative_to(SRC)}:{node.lineno}"

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if not _is_qsdp(alias.name):
                    continue
                if alias.name not in public:
                    found.append(f"{where(node)}: import {alias.name} (not a public module)")
                if alias.asname:
                    modules[alias.asname] = alias.name
        elif isinstance(node, ast.ImportFrom):
            module = _absolute(node, path)
            if not _is_qsdp(module):
                continue
            for alias in node.names:
                if (module, alias.name) in ALLOWED_PRIVATE:
                    continue
                if f"{module}.{alias.name}" in public:  # a public subpackage
                    modules[alias.asname or alias.name] = f"{module}.{alias.name}"
                    continue
                if module not in public:
                    found.append(
                        f"{where(node)}: from {module} import {alias.name} (not a public module)"
                    )
                elif alias.name not in getattr(importlib.import_module(module), "__all__", ()):
                    found.append(
                        f"{where(node)}: from {module} import {alias.name} "
                        f"({alias.name} is not in {module}.__all__)"
                    )
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in modules
        ):
            module = modules[node.value.id]
            names = getattr(importlib.import_module(module), "__all__", ())
            if node.attr not in names and f"{module}.{node.attr}" not in public:
                found.append(f"{where(node)}: {module}.{node.attr} is not in {module}.__all__")
    return found


def trainer_imports(path: Path) -> list[str]:
    """Every import of ``qsdp_train`` (or the old ``qsdp.train``) in ``path``, relative ones
    resolved, ``importlib.import_module("...")`` calls included."""
    tree = ast.parse(path.read_text(), filename=str(path))
    names: list[tuple[ast.AST, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [(node, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            module = _absolute(node, path)
            names += [(node, module)] + [(node, f"{module}.{a.name}") for a in node.names]
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute | ast.Name)
            and getattr(node.func, "attr", getattr(node.func, "id", None)) == "import_module"
            and node.args
            and isinstance(node.args[0], ast.Constant)
        ):
            names.append((node, str(node.args[0].value)))
    return sorted(
        {
            f"{path.relative_to(SRC)}:{node.lineno}: {name}"
            for node, name in names
            if any(name == t or name.startswith(t + ".") for t in ("qsdp_train", "qsdp.train"))
        }
    )


def test_trainer_uses_only_public_names():
    files = sorted((SRC / "qsdp_train").glob("*.py"))
    assert len(files) > 10, files
    found = [use for f in files for use in private_uses(f)]
    assert not found, "qsdp_train reaches past qsdp's public API:\n" + "\n".join(found)


def test_allowed_private_imports_are_still_used():
    """An allow-list entry nothing needs any more goes (the allow-list only shrinks)."""
    used = set()
    for f in sorted((SRC / "qsdp_train").glob("*.py")):
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ImportFrom):
                used |= {(_absolute(node, f), a.name) for a in node.names}
    assert ALLOWED_PRIVATE <= used, ALLOWED_PRIVATE - used


def test_adapters_use_only_public_names():
    """``qsdp.integrations`` is a layer above ``qsdp.fsdp`` and ``qsdp.ddp``: it calls their
    public entry points, as a user would, and reaches past none of them (what the adapters
    share among themselves, ``qsdp.integrations._installed``, is the layer's own)."""
    files = sorted((SRC / "qsdp" / "integrations").glob("*.py"))
    assert len(files) >= 2, files
    own = "from qsdp.integrations."
    found = [use for f in files for use in private_uses(f) if own not in use]
    assert not found, "qsdp.integrations reaches past qsdp's public API:\n" + "\n".join(found)


def test_nothing_below_imports_the_adapters():
    files = sorted(f for f in (SRC / "qsdp").rglob("*.py") if "integrations" not in f.parts)
    found = []
    for f in files:
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ImportFrom):
                module = _absolute(node, f)
                names = [module] + [f"{module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            if any(n == "qsdp.integrations" or n.startswith("qsdp.integrations.") for n in names):
                found.append(f"{f.relative_to(SRC)}:{node.lineno}")
    assert not found, "qsdp imports its adapters:\n" + "\n".join(found)


def test_library_never_imports_the_trainer():
    files = sorted((SRC / "qsdp").rglob("*.py"))
    assert len(files) > 30, files
    found = [imp for f in files for imp in trainer_imports(f)]
    assert not found, "qsdp imports the trainer:\n" + "\n".join(found)
    assert not (SRC / "qsdp" / "train").exists()


def test_import_qsdp_loads_no_trainer_code():
    """In a fresh process: ``import qsdp`` and every public subpackage (``qsdp.integrations``
    included), then no trainer module (nor matplotlib or tiktoken of the ``train`` extra; its
    tqdm is loaded by ``torch.hub``), and no framework of the ``hf``, ``lightning`` or
    ``torchtitan`` extras: an adapter loads them only when imported itself."""
    code = (
        "import importlib, importlib.util, pkgutil, sys\n"
        "import qsdp\n"
        "for m in pkgutil.iter_modules(qsdp.__path__):\n"
        "    if not m.name.startswith('_'):\n"
        "        importlib.import_module('qsdp.' + m.name)\n"
        "bad = ('qsdp_train', 'qsdp.train', 'matplotlib', 'tiktoken', 'transformers',\n"
        "       'accelerate', 'qsdp.integrations.hf', 'lightning', 'pytorch_lightning',\n"
        "       'qsdp.integrations.lightning', 'torchtitan', 'qsdp.integrations.torchtitan')\n"
        "hit = lambda n: any(n == b or n.startswith(b + '.') for b in bad)\n"
        "print(sorted(filter(hit, sys.modules)))\n"
        "print(importlib.util.find_spec('qsdp.train'))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    assert out.splitlines() == ["[]", "None"], out
