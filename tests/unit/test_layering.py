"""The one rule of the house: services never import each other; ``bus`` imports no service.

An AST walk over every service's source (absolute and relative imports, ``importlib.import_module``
and ``__import__`` with a literal name, imports under ``TYPE_CHECKING`` too), with exactly the
exceptions the import-linter contracts in pyproject.toml list; plus ``lint-imports`` itself when
import-linter is installed.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import shutil
import subprocess
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path


from tests.conftest import needs

REPO = Path(__file__).resolve().parents[2]
SERVICES = ("placement", "hostagent", "imaged", "guard", "sdk")
BUS = "bus"


@dataclass(frozen=True)
class Import:
    importer: str  # dotted module doing the import
    imported: str  # dotted module imported
    where: str  # file:line

    def __str__(self) -> str:
        return f"{self.where}: {self.importer} -> {self.imported}"


def module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(root: Path, path: Path) -> list[Import]:
    """Every module ``path`` imports, resolved to absolute dotted names."""
    mod = module_name(root, path)
    is_pkg = path.name == "__init__.py"
    package = mod if is_pkg else mod.rpartition(".")[0]
    tree = ast.parse(path.read_text(), filename=str(path))
    out: list[Import] = []

    def add(name: str, node: ast.AST) -> None:
        out.append(Import(mod, name, f"{path.relative_to(root)}:{getattr(node, 'lineno', 0)}"))

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name, node)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".") if package else []
                up = node.level - 1
                if up > len(base):
                    add("." * node.level + (node.module or ""), node)  # beyond the top: report as is
                    continue
                base = base[: len(base) - up] if up else base
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if node.module is None:  # ``from . import a, b``: the names may be submodules
                for alias in node.names:
                    add(f"{target}.{alias.name}" if target else alias.name, node)
            else:
                add(target, node)
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
            fn = node.func
            name = fn.attr if isinstance(fn, ast.Attribute) else fn.id if isinstance(fn, ast.Name) else ""
            if name in ("import_module", "__import__"):
                add(node.args[0].value, node)
    return out


def _matches(pattern: str, module: str) -> bool:
    """import-linter's ignore syntax: exact names, ``*`` for one segment, ``**`` for any number."""
    pp, mp = pattern.split("."), module.split(".")

    def m(i: int, j: int) -> bool:
        if i == len(pp):
            return j == len(mp)
        if pp[i] == "**":
            return any(m(i + 1, k) for k in range(j, len(mp) + 1))
        return j < len(mp) and (pp[i] == "*" or pp[i] == mp[j]) and m(i + 1, j + 1)

    return m(0, 0)


def allowed_exceptions(pyproject: Path) -> list[tuple[str, str]]:
    cfg = tomllib.loads(pyproject.read_text()).get("tool", {}).get("importlinter", {})
    out = []
    for c in cfg.get("contracts", []):
        for entry in c.get("ignore_imports", []):
            a, _, b = entry.partition("->")
            out.append((a.strip(), b.strip()))
    return out


def violations(root: Path, exceptions: list[tuple[str, str]] = ()) -> list[Import]:
    """Service -> other service imports, and bus -> service imports, under ``root``."""
    bad: list[Import] = []
    for pkg in (*SERVICES, BUS):
        d = root / pkg
        if not d.is_dir():
            continue
        for path in sorted(d.rglob("*.py")):
            for imp in imports_of(root, path):
                top = imp.imported.lstrip(".").split(".")[0]
                if imp.imported.startswith("."):
                    bad.append(imp)  # a relative import climbing out of its package
                    continue
                if top not in SERVICES or top == pkg:
                    continue
                if any(_matches(a, imp.importer) and _matches(b, imp.imported) for a, b in exceptions):
                    continue
                bad.append(imp)
    return bad


# ----------------------------------------------------------------------------------------- the real tree
def test_services_never_import_each_other() -> None:
    bad = violations(REPO, allowed_exceptions(REPO / "pyproject.toml"))
    assert not bad, "services meet only on bus/ subjects, never by import:\n" + "\n".join(map(str, bad))


def test_bus_imports_no_service() -> None:
    bad = [v for v in violations(REPO) if v.importer.split(".")[0] == BUS]
    assert not bad, "bus/ must not depend on any service:\n" + "\n".join(map(str, bad))


def test_every_package_was_looked_at() -> None:
    seen = {p for p in (*SERVICES, BUS) if (REPO / p).is_dir() and any((REPO / p).rglob("*.py"))}
    assert {BUS, "placement", "hostagent", "sdk"} <= seen
    assert sum(len(imports_of(REPO, f)) for f in (REPO / "hostagent").rglob("*.py")) > 20


def test_the_contract_has_no_exceptions() -> None:
    """An exception to the house rule is a decision, not a drive-by: today there is none."""
    assert allowed_exceptions(REPO / "pyproject.toml") == []


# ------------------------------------------------------------------------------- the checker itself
def _tree(tmp: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        p = tmp / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return tmp


def test_checker_catches_every_kind_of_import(tmp_path: Path) -> None:
    root = _tree(tmp_path, {
        "bus/__init__.py": "",
        "bus/x.py": "import sdk\n",
        "placement/__init__.py": "from bus import codec\nfrom . import _table\n",
        "placement/_table.py": "import msgspec, os\n",
        "placement/a.py": "from hostagent._service import HostAgent\n",
        "placement/sub/__init__.py": "",
        "placement/sub/b.py": "from ...imaged import _build\n",
        "placement/c.py": "import importlib\nm = importlib.import_module('guard.policy')\n",
        "placement/d.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import sdk._async\n",
        "placement/e.py": "def f():\n    import hostagent\n",
        "placement/f.py": "from ...elsewhere import x\n",
        "placement/ok.py": "from .sub import b\nfrom placement._table import x\nimport bus.runtime\n",
        "sdk/__init__.py": "__import__('placement')\n",
        "hostagent/__init__.py": "",
        "imaged/__init__.py": "",
    })
    found = {(v.importer, v.imported) for v in violations(root)}
    assert found == {
        ("bus.x", "sdk"),
        ("placement.a", "hostagent._service"),
        ("placement.sub.b", "imaged"),  # relative, resolved to the top-level package
        ("placement.f", "...elsewhere"),  # climbs out of the tree
        ("placement.c", "guard.policy"),
        ("placement.d", "sdk._async"),
        ("placement.e", "hostagent"),
        ("sdk", "placement"),
    }, found
    # A relative import that stays inside the package resolves to it and is fine.
    imps = {i.imported for i in imports_of(root, root / "placement" / "ok.py")}
    assert imps == {"placement.sub", "placement._table", "bus.runtime"}
    imps = {i.imported for i in imports_of(root, root / "placement" / "__init__.py")}
    assert imps == {"bus", "placement._table"}


def test_exceptions_are_exact(tmp_path: Path) -> None:
    root = _tree(tmp_path, {
        "placement/__init__.py": "",
        "placement/_benchclient.py": "from sdk import AsyncSandbox\nfrom sdk._async import close_connections\n",
        "placement/other.py": "from sdk import AsyncSandbox\n",
        "sdk/__init__.py": "",
    })
    exc = [("placement._benchclient", "sdk"), ("placement._benchclient", "sdk._async")]
    assert [(v.importer, v.imported) for v in violations(root, exc)] == [("placement.other", "sdk")]
    assert _matches("placement.**", "placement.a.b") and _matches("*.x", "a.x") and not _matches("a", "a.b")


# ----------------------------------------------------------------------------------------- lint-imports
def _toml_value(v: object) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, (int, float)):
        return str(v)
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    raise TypeError(v)


def _present(module: str) -> bool:
    return (REPO / module.split(".")[0] / "__init__.py").exists()


def import_linter_config(dest: Path) -> Path:
    """pyproject's import-linter contracts, limited to the packages that exist yet (guard may not)."""
    cfg = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]
    lines = ["[tool.importlinter]"]
    for k, v in cfg.items():
        if k == "contracts":
            continue
        if k == "root_packages":
            v = [p for p in v if _present(p)]
        lines.append(f"{k} = {_toml_value(v)}")
    for c in cfg.get("contracts", []):
        lines.append("\n[[tool.importlinter.contracts]]")
        for k, v in c.items():
            if k in ("modules", "source_modules", "forbidden_modules", "layers", "containers"):
                v = [m for m in v if _present(m)]
            elif k == "ignore_imports":
                v = [e for e in v if all(_present(side.strip()) for side in e.split("->"))]
            lines.append(f"{k} = {_toml_value(v)}")
    dest.write_text("\n".join(lines) + "\n")
    return dest


def _lint_imports() -> list[str] | None:
    exe = shutil.which("lint-imports") or str(Path(sys.executable).parent / "lint-imports")
    if os.access(exe, os.X_OK):
        return [exe]
    if importlib.util.find_spec("importlinter") is not None:
        return [sys.executable, "-c", "import sys; from importlinter.cli import lint_imports_command; sys.exit(lint_imports_command())"]
    return None


@needs(None if _lint_imports() is not None else "import-linter is not installed (pip install import-linter)")
def test_lint_imports(tmp_path: Path) -> None:
    cmd = _lint_imports()
    assert cmd is not None
    config = import_linter_config(tmp_path / "importlinter.toml")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    r = subprocess.run([*cmd, "--config", str(config), "--no-cache"], cwd=str(REPO), env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert "broken" not in r.stdout.lower() or "0 broken" in r.stdout.lower(), r.stdout
