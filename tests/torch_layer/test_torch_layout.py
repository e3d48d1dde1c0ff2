"""The PyTorch layer's layout: every function and method of extsrc/torch is at most 60 lines
long (from its ``def`` to its last line, docstring and decorators' lines after ``def``
included), so each reads at once."""

from __future__ import annotations

import ast
import os
from typing import List

import extsrc

LIMIT = 60
TORCH_LAYER = os.path.join(os.path.dirname(extsrc.__file__), "torch")


def long_functions(folder: str, limit: int = LIMIT) -> List[str]:
    """``file:line name (n lines)`` of each function in the ``.py`` files of ``folder`` longer
    than ``limit`` lines (nested ones and those of classes too)."""
    found = []
    for name in sorted(os.listdir(folder)):
        if not name.endswith(".py"):
            continue
        with open(os.path.join(folder, name)) as file:
            tree = ast.parse(file.read())
        functions = [node for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))]
        for node in sorted(functions, key=lambda node: node.lineno):
            length = node.end_lineno - node.lineno + 1
            if length > limit:
                found.append(f"{name}:{node.lineno} {node.name} ({length} lines)")
    return found


def test_no_function_of_the_torch_layer_is_longer_than_60_lines():
    assert long_functions(TORCH_LAYER) == []


def test_the_check_finds_a_long_function_and_a_long_method(tmp_path):
    def lines(indent, count):
        return "".join(f"{indent}x{i} = {i}\n" for i in range(count))

    (tmp_path / "short.py").write_text("def fits():\n" + lines("    ", 59))  # 60 lines: the limit
    (tmp_path / "long.py").write_text("class C:\n    async def method(self):\n" + lines("        ", 60)
                                      + "\n\ndef function():\n" + lines("    ", 60))
    assert long_functions(str(tmp_path)) == ["long.py:2 method (61 lines)", "long.py:65 function (61 lines)"]
