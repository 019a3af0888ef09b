"""The layers of DESIGN.md: imports only point downwards."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[2] / "hora"

# package -> packages it must never import
FORBIDDEN = {
    "hora/core": ("hora.torch", "hora.keras", "hora.mxnet", "hora.runner", "hora.kvstore"),
    "hora/kvstore": ("hora.torch", "hora.keras", "hora.mxnet", "hora.runner"),
    "hora/torch": ("hora.runner", "hora.keras", "hora.mxnet"),
    "hora/errors.py": ("hora.core", "hora.torch", "hora.runner"),
    "hora/config.py": ("hora.core", "hora.torch", "hora.runner"),
}


def _imports(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
    return names


def _files(target: str) -> list[Path]:
    p = PKG.parent / target
    return [p] if p.is_file() else sorted(p.rglob("*.py"))


@pytest.mark.parametrize("target", sorted(FORBIDDEN))
def test_no_upward_imports(target):
    bad = []
    for f in _files(target):
        for name in _imports(f):
            if any(name == x or name.startswith(x + ".") for x in FORBIDDEN[target]):
                bad.append(f"{f.relative_to(PKG.parent)} imports {name}")
    assert not bad, "layering violated:\n" + "\n".join(bad)


def test_bindings_do_not_touch_backends():
    """Bindings go through the engine, never a backend directly."""
    bad = [f"{f.relative_to(PKG.parent)} imports {n}" for f in _files("hora/torch") for n in _imports(f)
           if n.startswith("hora.core.backends")]
    assert not bad, "\n".join(bad)


def test_import_hora_is_light():
    import subprocess
    import sys

    code = "import sys, hora; print('torch' in sys.modules, 'hora.runner' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]
