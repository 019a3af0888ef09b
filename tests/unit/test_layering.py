"""The layers of DESIGN.md: imports only point downwards."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[2] / "hora"

#: The deep-learning frameworks; only the bindings (and bench, examples) may import them.
FRAMEWORKS = ("torch", "tensorflow", "keras", "mxnet")
#: Every hora package or module above the errors/config/envvars floor.
_ABOVE_FLOOR = ("hora.core", "hora.torch", "hora.keras", "hora.tensorflow", "hora.mxnet", "hora.kvstore",
                "hora.runner", "hora.bench", "hora.testing", "hora.cli", "hora.timeline_cli")
#: The framework bindings; none imports another.
_BINDINGS = ("hora.torch", "hora.tensorflow", "hora.keras", "hora.mxnet")
#: The top of the stack: the commands and the benchmarks.
_COMMANDS = ("hora.bench", "hora.testing", "hora.cli", "hora.timeline_cli")

# package -> packages it must never import (anywhere in a file, function bodies included)
FORBIDDEN = {
    "hora/core": (*_BINDINGS, "hora.runner", "hora.kvstore", *_COMMANDS),
    "hora/kvstore": (*_BINDINGS, "hora.runner", *_COMMANDS),
    "hora/torch": (*(b for b in _BINDINGS if b != "hora.torch"), "hora.runner", *_COMMANDS),
    "hora/tensorflow": (*(b for b in _BINDINGS if b != "hora.tensorflow"), "hora.runner", *_COMMANDS),
    "hora/mxnet": (*(b for b in _BINDINGS if b != "hora.mxnet"), "hora.runner", *_COMMANDS),
    # the one exception, one way (docs/design.md): Keras 3 on its TensorFlow backend reduces inside TF graphs,
    # with hora.tensorflow's graph ops; test_hora_keras_loads_hora_tensorflow_only_when_it_runs_on_it below
    "hora/keras": ("hora.torch", "hora.mxnet", "hora.runner", *_COMMANDS),
    # what hora.keras and hora.tensorflow.keras share: no binding, no framework (checked below)
    "hora/_keras": (*_BINDINGS, "hora.runner", *_COMMANDS),
    "hora/runner": (*_COMMANDS, "hora.kvstore", "hora.core"),
    "hora/bench": ("hora.cli", "hora.timeline_cli"),
    "hora/testing": tuple(p for p in _ABOVE_FLOOR if p != "hora.testing"),
    "hora/errors.py": ("hora.config", "hora.envvars", *_ABOVE_FLOOR),
    "hora/envvars.py": ("hora.config", *_ABOVE_FLOOR),
    "hora/elastic_wire.py": ("hora.config", *_ABOVE_FLOOR),  # the driver<->worker wire: both sides import it
    "hora/config.py": _ABOVE_FLOOR,
}
#: package -> frameworks it must not import at module level (a function may, e.g. the torch self-check
#: ``python -m hora.runner.check`` that runs as a worker).  hora.core is checked by importing it, below.
NO_FRAMEWORK_AT_IMPORT = ("hora/runner", "hora/testing", "hora/errors.py", "hora/config.py", "hora/envvars.py",
                          "hora/elastic_wire.py",
                          "hora/cli.py", "hora/_keras")

# The Ray executor sits on the runner: it imports no binding (nor a framework at import), nothing below imports it.
FORBIDDEN["hora/ray"] = (*_BINDINGS, "hora.kvstore", *_COMMANDS)
for _below in ("hora/core", "hora/kvstore", "hora/torch", "hora/tensorflow", "hora/mxnet", "hora/keras", "hora/_keras",
               "hora/runner", "hora/testing", "hora/errors.py", "hora/envvars.py", "hora/config.py"):
    FORBIDDEN[_below] = (*FORBIDDEN[_below], "hora.ray")
NO_FRAMEWORK_AT_IMPORT = (*NO_FRAMEWORK_AT_IMPORT, "hora/ray")


def _imports(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
    return names


def _module_level_imports(path: Path) -> list[str]:
    """Imports that run when the module is imported: outside every function body."""
    names: list[str] = []

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                continue
            if isinstance(child, ast.Import):
                names.extend(a.name for a in child.names)
            elif isinstance(child, ast.ImportFrom) and child.module and child.level == 0:
                names.append(child.module)
            visit(child)

    visit(ast.parse(path.read_text()))
    return names


def _files(target: str) -> list[Path]:
    p = PKG.parent / target
    return [p] if p.is_file() else sorted(p.rglob("*.py"))  # a binding not written yet has no files


def _matches(name: str, packages: tuple[str, ...]) -> bool:
    return any(name == x or name.startswith(x + ".") for x in packages)


@pytest.mark.parametrize("target", sorted(FORBIDDEN))
def test_no_upward_imports(target):
    bad = []
    for f in _files(target):
        for name in _imports(f):
            if _matches(name, FORBIDDEN[target]):
                bad.append(f"{f.relative_to(PKG.parent)} imports {name}")
    assert not bad, "layering violated:\n" + "\n".join(bad)


@pytest.mark.parametrize("target", NO_FRAMEWORK_AT_IMPORT)
def test_no_framework_at_import_time(target):
    bad = [f"{f.relative_to(PKG.parent)} imports {name}" for f in _files(target)
           for name in _module_level_imports(f) if _matches(name, FRAMEWORKS)]
    assert not bad, "a framework imported at module level:\n" + "\n".join(bad)


#: binding -> the frameworks it may import (its own; Keras 3 runs on TensorFlow or torch).
OWN_FRAMEWORKS = {"hora/torch": ("torch",), "hora/tensorflow": ("tensorflow", "keras"), "hora/mxnet": ("mxnet",),
                  "hora/keras": ("keras", "tensorflow", "torch")}


@pytest.mark.parametrize("binding", sorted(OWN_FRAMEWORKS))
def test_a_binding_imports_only_its_own_framework(binding):
    others = tuple(f for f in FRAMEWORKS if f not in OWN_FRAMEWORKS[binding])
    bad = [f"{f.relative_to(PKG.parent)} imports {name}" for f in _files(binding) for name in _imports(f)
           if _matches(name, others)]
    assert not bad, "\n".join(bad)


def test_hora_keras_loads_hora_tensorflow_only_when_it_runs_on_it():
    """hora.keras may import hora.tensorflow (the one binding-to-binding import), but only inside functions:
    Keras 3 on torch must not load it."""
    bad = [f"{f.relative_to(PKG.parent)} imports {name}" for f in _files("hora/keras")
           for name in _module_level_imports(f) if _matches(name, ("hora.tensorflow",))]
    assert _files("hora/keras") and not bad, "\n".join(bad)


def test_importing_the_framework_neutral_layers_imports_no_framework():
    """``import hora.core, hora.config, hora.errors, hora.envvars`` and every module of hora.runner."""
    import subprocess
    import sys

    code = (
        "import importlib, pkgutil, sys\n"
        "import hora.core, hora.config, hora.errors, hora.envvars, hora.runner, hora.testing, hora.ray\n"
        "for m in pkgutil.walk_packages(hora.runner.__path__, 'hora.runner.'):\n"
        "    importlib.import_module(m.name)\n"
        f"print(sorted(f for f in {FRAMEWORKS!r} if f in sys.modules))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "[]", proc.stdout


def test_the_hora_command_mounts_bench_and_the_runner_does_not():
    from hora import cli
    from hora.runner import cli as runner_cli

    assert {"run", "bench"} <= set(cli.SUBCOMMANDS)
    assert set(runner_cli.SUBCOMMANDS) == {"run"}


def test_bindings_do_not_touch_backends():
    """Bindings go through the engine, never a backend directly."""
    bad = [f"{f.relative_to(PKG.parent)} imports {n}" for binding in OWN_FRAMEWORKS for f in _files(binding)
           for n in _imports(f) if n.startswith("hora.core.backends")]
    assert not bad, "\n".join(bad)


def test_mxnet_binding_imports_no_other_framework():
    """hora.mxnet runs in a venv without torch: no file of it imports torch, tensorflow or keras, anywhere."""
    bad = [f"{f.relative_to(PKG.parent)} imports {n}" for f in _files("hora/mxnet") for n in _imports(f)
           if _matches(n, ("torch", "tensorflow", "keras"))]
    assert _files("hora/mxnet") and not bad, "\n".join(bad)


def test_import_hora_is_light():
    import subprocess
    import sys

    code = "import sys, hora; print('torch' in sys.modules, 'hora.runner' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]


def _module_name(path: Path) -> str:
    parts = path.relative_to(PKG.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@pytest.mark.parametrize("target", ["hora/runner", "hora/ray", "hora/bench", "hora/testing"])
def test_no_import_cycles_between_files(target):
    """Two files never import each other, directly or round a longer loop (function-level imports count)."""
    files = {_module_name(f): f for f in _files(target)}
    graph = {name: {n for n in _imports(f) if n in files and n != name} for name, f in files.items()}
    cycles = []

    def walk(name: str, path: list[str]) -> None:
        for nxt in sorted(graph[name]):
            if nxt in path:
                cycles.append(" -> ".join([*path[path.index(nxt):], nxt]))
            elif nxt not in done:
                walk(nxt, [*path, nxt])
        done.add(name)

    done: set[str] = set()
    for name in sorted(graph):
        if name not in done:
            walk(name, [name])
    assert not cycles, "import cycles:\n" + "\n".join(sorted(set(cycles)))
