"""The architecture's dependency rules, checked on the source and at import time.

The rules, in one place (docs/architecture.md explains the parts):

1. ``worker_client`` never imports ``ps_server``, and ``ps_server`` never
   imports ``worker_client``; ``wehub_ps`` (shared by both) imports neither.
2. Inside each side, layers are ordered: a module may import its own layer
   and the layers listed before it, never a later one (``LAYERS``).
3. Some modules must not load gRPC or protobuf at all, even indirectly
   (``NO_WIRE``): the server's core, and the shared pure modules it uses.
   The source check covers direct imports; a subprocess imports each such
   module and looks at ``sys.modules`` for the indirect ones.
"""

from __future__ import annotations

import ast
import json
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGES = ("wehub_ps", "ps_server", "worker_client")

#: Each side's layers, lowest first. A module belongs to the layer of the
#: longest prefix that names it; every module of the three packages must
#: belong to one (so a new module is placed deliberately).
LAYERS: dict[str, list[tuple[str, tuple[str, ...]]]] = {
    "wehub_ps": [
        ("pure shared code", ("wehub_ps.errors", "wehub_ps.dtypes", "wehub_ps.placement", "wehub_ps.specs",
                              "wehub_ps.cluster", "wehub_ps.kernels", "wehub_ps.process", "wehub_ps.initializers")),
        ("generated stubs", ("wehub_ps.v1",)),
        ("wire code", ("wehub_ps.wire", "wehub_ps.specs_proto")),
        ("package facade", ("wehub_ps.__init__",)),
    ],
    "ps_server": [
        # A leaf beside the rest: etcd and shard elections, no shard state.
        ("coordination: generated etcd stubs", ("ps_server.coordination.etcdpb",)),
        ("coordination: etcd client, leases, shard elections", ("ps_server.coordination",)),
        ("core: state and rules", ("ps_server.core",)),
        ("durability: checkpoints and the spec log", ("ps_server.durability",)),
        ("settings and instruments", ("ps_server.ops.config", "ps_server.ops.metrics",
                                      "ps_server.ops.pod_label", "ps_server.ops.disk_tier")),
        ("service: gRPC in and out", ("ps_server.service",)),
        ("replication: replica roles, the update log, the Follow stream", ("ps_server.replication",)),
        ("composition root", ("ps_server.server",)),
        ("entry points", ("ps_server.ops", "ps_server.__init__", "ps_server.__main__")),
    ],
    "worker_client": [
        ("leaf helpers", ("worker_client.errors", "worker_client.arrays", "worker_client.gpu",
                          "worker_client.topk", "worker_client.out_arrays",
                          "worker_client.blas_threads", "worker_client.id_groups")),
        ("transport", ("worker_client.transport",)),
        ("client parts", ("worker_client.shard_info", "worker_client.session", "worker_client.registry",
                          "worker_client.pull_receiver", "worker_client.prefetch", "worker_client.pulls",
                          "worker_client.push_framing", "worker_client.pushes", "worker_client.step",
                          "worker_client.replicas", "worker_client.background", "worker_client.overlap")),
        ("the PSClient facade", ("worker_client.client",)),
        ("tools and package facade", ("worker_client.admin", "worker_client.__init__")),
        ("the PyTorch adapter (torch extra)", ("worker_client.torch",)),
    ],
}

#: Modules (by prefix) that must not load these, directly or indirectly.
WIRE_MODULES = ("grpc", "google.protobuf", "wehub_ps.v1", "wehub_ps.wire", "wehub_ps.specs_proto")
NO_WIRE = ("ps_server.core", "wehub_ps.errors", "wehub_ps.dtypes", "wehub_ps.placement", "wehub_ps.specs",
           "wehub_ps.cluster", "wehub_ps.kernels", "wehub_ps.process", "wehub_ps.initializers")

#: Which other top-level packages each package may import.
ALLOWED_PACKAGES = {"wehub_ps": set(), "ps_server": {"wehub_ps"}, "worker_client": {"wehub_ps"}}


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts)


def _modules() -> dict[str, pathlib.Path]:
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            found[_module_name(path)] = path
    return found


MODULES = _modules()


def _covers(prefix: str, module: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def _is_package(module: str) -> bool:
    return module.endswith(".__init__")


def _imports(module: str, path: pathlib.Path) -> set[str]:
    """Every module name this file imports, anywhere in it, resolved to absolute names."""
    tree = ast.parse(path.read_text(), str(path))
    package = module[: -len(".__init__")] if _is_package(module) else module.rsplit(".", 1)[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            found.add(target)
            for alias in node.names:  # ``from pkg import module`` imports pkg.module
                candidate = f"{target}.{alias.name}"
                if candidate in MODULES or f"{candidate}.__init__" in MODULES:
                    found.add(candidate)
    return {name for name in found if name}


def _layer_of(module: str) -> tuple[str, int, str]:
    side = module.split(".", 1)[0]
    best: tuple[int, int, str] | None = None
    for index, (name, prefixes) in enumerate(LAYERS[side]):
        for prefix in prefixes:
            if _covers(prefix, module) and (best is None or len(prefix) > best[0]):
                best = (len(prefix), index, name)
    if best is None:
        raise AssertionError(f"{module} is in no layer of LAYERS[{side!r}]: add it where it belongs")
    return side, best[1], best[2]


def _source_violations() -> list[str]:
    problems = []
    for module, path in MODULES.items():
        side, layer, layer_name = _layer_of(module)
        for target in sorted(_imports(module, path)):
            top = target.split(".", 1)[0]
            if top in PACKAGES and top != side and top not in ALLOWED_PACKAGES[side]:
                problems.append(f"{module} imports {target}: {side} may not import {top}")
                continue
            if top == side:
                known = target if target in MODULES else f"{target}.__init__"
                if known not in MODULES:
                    continue
                _, target_layer, target_name = _layer_of(known)
                if target_layer > layer:
                    problems.append(f"{module} ({layer_name}) imports {target} ({target_name}), a higher layer")
            if any(_covers(prefix, module) for prefix in NO_WIRE) and any(
                    _covers(wire, target) for wire in WIRE_MODULES):
                problems.append(f"{module} imports {target}, but it must not load gRPC or protobuf")
    return problems


def test_every_module_sits_in_a_layer():
    for module in MODULES:
        _layer_of(module)


def test_no_module_imports_against_the_layers():
    problems = _source_violations()
    assert not problems, "\n".join(problems)


def _loaded_after_import(*modules: str) -> list[str]:
    """The names in ``sys.modules`` after a fresh interpreter imports ``modules``."""
    script = "import importlib, json, sys\nfor name in sys.argv[1:]: importlib.import_module(name)\n" \
             "print(json.dumps(sorted(sys.modules)))\n"
    result = subprocess.run([sys.executable, "-c", script, *modules], capture_output=True, text=True,
                            cwd=ROOT, timeout=120, env=_environment())
    assert result.returncode == 0, f"importing {', '.join(modules)} failed:\n{result.stderr}"
    return json.loads(result.stdout.strip().splitlines()[-1])


def _wire_loaded(loaded: list[str]) -> list[str]:
    return [name for name in loaded if any(_covers(wire, name) for wire in WIRE_MODULES)]


def _environment() -> dict[str, str]:
    import os

    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


def _importable(prefixes: tuple[str, ...]) -> list[str]:
    names = []
    for module in MODULES:
        if any(_covers(prefix, module) for prefix in prefixes) and not module.endswith("__main__"):
            names.append(module[: -len(".__init__")] if _is_package(module) else module)
    return sorted(names)


def test_coordination_is_a_leaf():
    """ps_server.coordination uses gRPC, its own stubs and the pure shared modules, nothing else of ours."""
    allowed = ("ps_server.coordination",) + tuple(p for p in NO_WIRE if p.startswith("wehub_ps."))
    problems = [f"{module} imports {target}"
                for module, path in MODULES.items() if _covers("ps_server.coordination", module)
                for target in sorted(_imports(module, path))
                if target.split(".", 1)[0] in PACKAGES and not any(_covers(a, target) for a in allowed)]
    assert not problems, "\n".join(problems)


@pytest.mark.timeout(600)
def test_modules_without_wire_load_no_grpc_or_protobuf():
    """The transitive rule: importing a core or pure module alone loads no gRPC and no protobuf."""
    modules = _importable(NO_WIRE)
    if not _wire_loaded(_loaded_after_import(*modules)):  # all at once: the quick common case
        return
    problems = [f"import {module} loads {', '.join(bad[:5])}" for module in modules
                if (bad := _wire_loaded(_loaded_after_import(module)))]
    assert problems, "the modules load gRPC or protobuf together but none alone"
    pytest.fail("\n".join(problems))


@pytest.mark.timeout(300)
def test_each_side_loads_without_the_other():
    eager = [m for m in _loaded_after_import("ps_server") if m.split(".")[0] in ("grpc", "worker_client")]
    assert not eager, f"import ps_server must load nothing eagerly, loaded {eager[:5]}"
    server = _loaded_after_import("ps_server.server", "ps_server.ops.cli")
    assert not [m for m in server if _covers("worker_client", m)]
    client = _loaded_after_import("worker_client", "worker_client.admin")
    assert not [m for m in client if _covers("ps_server", m)]
    assert not [m for m in client if _covers("torch", m) or _covers("worker_client.torch", m)], \
        "import worker_client must not load torch (the optional torch extra)"


def test_only_the_torch_adapter_imports_torch():
    problems = [f"{module} imports {target}" for module, path in MODULES.items()
                if not _covers("worker_client.torch", module)
                for target in sorted(_imports(module, path))
                if _covers("torch", target) or _covers("worker_client.torch", target)]
    assert not problems, "\n".join(problems)
