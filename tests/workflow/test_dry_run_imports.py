"""What the dry run loads: no import circle among posttrain's modules, and `snakemake -n` imports no torch.

A circle is found from every import a module makes, inside functions too: an import moved into a
function is how a circle is hidden, not removed. torch is watched through
`python -X importtime`, which lists every module the process imported, as a user runs the dry run.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

from snakemake_testing import copy_repo

REPO = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "transformers", "vllm", "ray")


def module_imports(package: Path) -> dict[str, set[str]]:
    """Module -> the modules of the same package it imports, anywhere in its code."""
    files = {}
    for path in package.rglob("*.py"):
        parts = path.relative_to(package.parent).with_suffix("").parts
        files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        found = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.module:
                found |= {f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in files else node.module
                          for a in node.names}
            elif isinstance(node, ast.Import):
                found |= {a.name for a in node.names}
        graph[name] = {m for m in found if m in files and m != name}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan's algorithm, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                group = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.append(member)
                    if member == node:
                        break
                if len(group) > 1:
                    found.append(sorted(group))
    return found


def test_the_circle_finder_finds_a_circle_through_three_modules(tmp_path):
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from pkg.b import f\n")
    (package / "b.py").write_text("import pkg.c\ndef f(): pass\n")
    (package / "c.py").write_text("from pkg import a\n")
    (package / "d.py").write_text("from pkg.a import x\n")
    (package / "e.py").write_text("def g():\n    from pkg import d, e\n")  # inside a function; itself
    (package / "f.py").write_text("import pkg.e\n")
    assert circles(module_imports(package)) == [["pkg.a", "pkg.b", "pkg.c"]]
    (package / "d.py").write_text("from pkg.a import x\ndef h():\n    import pkg.f\n")
    assert circles(module_imports(package)) == [["pkg.a", "pkg.b", "pkg.c"], ["pkg.d", "pkg.e", "pkg.f"]]


def test_posttrain_has_no_import_circle():
    graph = module_imports(REPO / "posttrain")
    assert "posttrain.workflow.preflight" in graph["posttrain.workflow.schema"]  # the graph is posttrain's
    assert circles(graph) == []


def imported_heavy(proc: subprocess.CompletedProcess) -> list[str]:
    """The heavy top-level packages `-X importtime` lists as imported."""
    names = {line.rsplit("|", 1)[-1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")}
    return sorted(set(HEAVY) & names)


def dry_run(root: Path, *args: str) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "snakemake", "--dry-run", "--quiet", "rules",
                           "--config", f"results={root / 'results'}", *args],
                          cwd=root, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "import time:" in proc.stderr
    return proc


def test_the_dry_run_imports_no_torch(tmp_path):
    """The default config, and an environment scored by its own reward (its class is loaded and checked)."""
    root = tmp_path / "wf"
    root.mkdir()
    copy_repo(root, ("Snakefile", "workflow", "envs", "profiles", "config", "stages", "posttrain"))
    assert imported_heavy(subprocess.run([sys.executable, "-X", "importtime", "-c", "import posttrain.models"],
                                         capture_output=True, text=True)) == ["torch"]  # the watch sees torch
    assert imported_heavy(dry_run(root)) == []
    overlay = root / "game.yaml"
    overlay.write_text(textwrap.dedent("""
        environment: {fn: guess_number, max_turns: 5, max_tokens: 96, args: {high: 16}}
        reward: {verifiers: [environment]}
    """))
    assert imported_heavy(dry_run(root, "--configfile", str(root / "config" / "config.yaml"), str(overlay))) == []
