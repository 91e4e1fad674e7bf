"""pagedserve/core stays pure Python: no torch, no device code, no config package at runtime."""
from __future__ import annotations

import ast
import pathlib

import pagedserve.core.scheduler

CORE_DIR = pathlib.Path(pagedserve.core.scheduler.__file__).parent
# The config package imports torch (ModelConfig dtypes), so core reads it only for type checking.
FORBIDDEN_PREFIXES = ("torch", "numpy", "pagedserve.worker", "pagedserve.layers", "pagedserve.models",
                      "pagedserve.attention", "pagedserve.config")


def runtime_imports(tree: ast.Module) -> list[str]:
    names: list[str] = []

    def visit(statements: list[ast.stmt]) -> None:
        for statement in statements:
            if isinstance(statement, ast.If) and "TYPE_CHECKING" in ast.unparse(statement.test):
                visit(statement.orelse)
                continue
            for node in ast.walk(statement):
                if isinstance(node, ast.Import):
                    names.extend(alias.name for alias in node.names)
                elif isinstance(node, ast.ImportFrom) and node.module:
                    names.append(node.module)

    visit(tree.body)
    return names


def test_core_modules_import_no_torch_or_device_code() -> None:
    files = sorted(CORE_DIR.glob("*.py"))
    assert {"scheduler.py", "kv_cache_manager.py", "block_pool.py", "block_hash.py"} <= {f.name for f in files}
    for path in files:
        for name in runtime_imports(ast.parse(path.read_text(), filename=str(path))):
            assert not name.startswith(FORBIDDEN_PREFIXES), f"{path.name} imports {name}"
