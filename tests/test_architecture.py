"""The import layers hold (docs/architecture.md): import-linter's ``layers`` contract in
pyproject.toml is kept, no meshfold module takes part in an import cycle, and no meshfold
import hides inside a function unless it is listed (with its reason) below."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent

_spec = importlib.util.spec_from_file_location("import_graph", ROOT / "scripts" / "import_graph.py")
import_graph = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(import_graph)

# (module, imported module) -> why it is imported inside a function. Nothing may be listed
# to dodge a cycle.
LOCAL_IMPORTS_ALLOWED = {
    # The command line imports only the subcommand it runs (start-up time: `meshfold plot`
    # or `meshfold prepare` do not load the trainer).
    ("meshfold.cli", "meshfold.config"): "start-up time",
    ("meshfold.cli", "meshfold.launch"): "start-up time",
    ("meshfold.cli", "meshfold.train.trainer"): "start-up time",
    ("meshfold.cli", "meshfold.train.plot"): "start-up time",
    ("meshfold.cli", "meshfold.data.cost_calibration"): "start-up time",
    ("meshfold.cli", "meshfold.device"): "start-up time",
    ("meshfold.cli", "meshfold.planner.fit"): "start-up time",
    ("meshfold.cli", "meshfold.parallel.pp.timeline_plot"): "start-up time",
}


def _contract() -> dict:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    (contract,) = [c for c in config["contracts"] if c["id"] == "layers"]
    return contract


def _lint_imports(cwd: Path) -> subprocess.CompletedProcess:
    """import-linter's command line on the package under ``cwd`` (it reads pyproject.toml there)."""
    code = "import sys; from importlinter.cli import lint_imports_command; sys.exit(lint_imports_command())"
    return subprocess.run([sys.executable, "-c", code, "--no-cache"], cwd=cwd, env={**os.environ, "PYTHONPATH": str(cwd)},
                          capture_output=True, text=True, timeout=300)


def test_layers_contract_is_kept():
    run = _lint_imports(ROOT)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "1 kept, 0 broken" in run.stdout


def test_layers_contract_catches_an_upward_import(tmp_path):
    """The contract is not vacuous: the model importing the trainer breaks it."""
    shutil.copytree(ROOT / "meshfold", tmp_path / "meshfold", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    llama = tmp_path / "meshfold" / "models" / "llama.py"
    llama.write_text(llama.read_text() + "\nfrom meshfold.train.trainer import Trainer  # noqa: E402\n")
    run = _lint_imports(tmp_path)
    assert run.returncode != 0
    assert "meshfold.models is not allowed to import meshfold.train" in run.stdout


def test_every_module_is_in_a_layer():
    named = {name.strip() for layer in _contract()["layers"] for name in layer.split(":")}
    top = {".".join(m.split(".")[:2]) for m in import_graph.modules() if m != "meshfold"}
    assert top - named == set(), "add these to [tool.importlinter] layers in pyproject.toml"


def test_no_import_cycle():
    edges, local = import_graph.graph()
    both = {m: edges[m] | {t for t, _ in local.get(m, ())} for m in edges}
    assert import_graph.cycles(both) == []


def test_no_function_local_meshfold_import_beyond_the_allowed():
    _, local = import_graph.graph()
    found = {(m, t) for m, targets in local.items() for t, _ in targets}
    assert found - set(LOCAL_IMPORTS_ALLOWED) == set()
    assert set(LOCAL_IMPORTS_ALLOWED) - found == set(), "drop entries that are no longer needed"


def test_graph_sees_cycles_and_local_imports(tmp_path):
    """The scanner itself: a cycle through a function-local import is found, and an import
    under ``if TYPE_CHECKING:`` is not an edge."""
    pkg = tmp_path / "meshfold"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from meshfold.b import x\n")
    (pkg / "b.py").write_text("x = 1\n\ndef f():\n    from meshfold.a import x\n    return x\n")
    (pkg / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from meshfold.a import x\n")
    edges, local = import_graph.graph(tmp_path)
    assert edges["meshfold.a"] == {"meshfold.b"} and edges["meshfold.c"] == set()
    assert {t for t, _ in local["meshfold.b"]} == {"meshfold.a"}
    both = {m: edges[m] | {t for t, _ in local.get(m, ())} for m in edges}
    assert import_graph.cycles(both) == [["meshfold.a", "meshfold.b"]]
