"""What the plan reads from a stage script's source: the config keys it declares, and its code.

A stage's code fingerprint covers its script and every `posttrain` module the script imports,
transitively: `import posttrain.a.b` and `from posttrain.a import b` (b a module or a name in
posttrain/a/__init__.py), at module level or inside a function, each with the package
`__init__.py` files on its path (Python runs them on the way). Each file is hashed as its syntax
tree with docstrings removed, so comments, docstrings and formatting do not count; a change of
what the code does does. The tree's text is Python's `ast.dump`, so a new Python minor version may
change every fingerprint.

Everything is read from the files under one repository directory (the workflow's), without
importing them: planning never imports torch, and a copied repository fingerprints its own files.
Parsed files are cached per process and parsed again only when their bytes change.
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

PACKAGE = "posttrain"
READS_NAME = "READS"
_DOTTED_KEY = re.compile(r"^[a-z_][a-z0-9_]*(\.[a-z_][a-z0-9_]*)*$")
HASH_LENGTH = 16


class StageSourceError(ValueError):
    """A stage script or an imported module the plan cannot read: the message names the file."""


@dataclass(frozen=True)
class _Parsed:
    tree: ast.Module  # docstrings removed
    digest: str  # of the tree's dump
    imports: tuple[tuple[str, int, tuple[str, ...], int], ...]  # (module, relative level, names, line)


_CACHE: dict[Path, tuple[bytes, _Parsed]] = {}  # path -> (its bytes when parsed, the parse)


def stage_script(repo: str | os.PathLike, stage: str) -> Path:
    return Path(repo).resolve() / "stages" / f"{stage}.py"


def declared_reads(script: str | os.PathLike) -> tuple[str, ...]:
    """The script's module-level `READS`: a tuple of dotted config keys, as string literals."""
    path = Path(script)
    for node in _parse(path).tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        if not any(isinstance(t, ast.Name) and t.id == READS_NAME for t in targets):
            continue
        try:
            reads = ast.literal_eval(node.value)
        except ValueError:
            raise StageSourceError(f"{path}:{node.lineno}: {READS_NAME} must be a tuple of string literals") from None
        if not isinstance(reads, tuple) or not all(isinstance(r, str) and _DOTTED_KEY.match(r) for r in reads):
            raise StageSourceError(f"{path}:{node.lineno}: {READS_NAME} must be a tuple of dotted config keys "
                                   f"('seed', 'model.policy', ...), got {reads!r}")
        return reads
    raise StageSourceError(f"{path}: no module-level {READS_NAME} = (...): a stage declares the config keys it reads")


def module_hashes(script: str | os.PathLike, repo: str | os.PathLike, package: str | None = PACKAGE) -> dict[str, str]:
    """Path relative to `repo` -> hash, of the script and every `package` module it imports (an import of
    `package` that has no file under `repo` is an error). `package` None: every imported module that has
    a file under `repo`, the others (the standard library, installed packages) left out: a user's code."""
    repo = Path(repo).resolve()
    seen: set[Path] = set()
    todo = [Path(script).resolve()]
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        todo += _imported_files(path, repo, package)
    return {path.relative_to(repo).as_posix(): _parse(path).digest for path in sorted(seen)}


def fingerprint(hashes: dict[str, str]) -> str:
    """One hash over a `module_hashes` result."""
    text = json.dumps(hashes, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:HASH_LENGTH]


def _parse(path: Path) -> _Parsed:
    """The file's parse, redone only when its bytes changed (reading is cheap, parsing is not)."""
    try:
        source = path.read_bytes()
    except FileNotFoundError:
        raise StageSourceError(f"{path}: no such file") from None
    cached = _CACHE.get(path)
    if cached is not None and cached[0] == source:
        return cached[1]
    try:
        tree = ast.parse(source, filename=str(path))
    except SyntaxError as err:
        raise StageSourceError(f"{path}:{err.lineno}: {err.msg}") from None
    imports = _strip_docstrings_and_list_imports(tree)
    parsed = _Parsed(tree, hashlib.sha256(ast.dump(tree).encode()).hexdigest()[:HASH_LENGTH], imports)
    _CACHE[path] = (source, parsed)
    return parsed


def _strip_docstrings_and_list_imports(tree: ast.Module) -> tuple[tuple[str, int, tuple[str, ...], int], ...]:
    """Remove every docstring (in place) and return every import, anywhere in the file: (module,
    relative level, names, line). One walk over the tree for both."""
    imports = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            first = node.body[0] if node.body else None
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
                node.body = node.body[1:]
        elif isinstance(node, ast.Import):
            imports += [(alias.name, 0, (), node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            imports.append((node.module or "", node.level, tuple(alias.name for alias in node.names), node.lineno))
    return tuple(imports)


def _absolute(module: str, level: int, path: Path, repo: Path) -> str:
    """The absolute name of an import in `path` (`from ..a import b` in posttrain/x/y.py: posttrain.a)."""
    if not level:
        return module
    package = list(path.relative_to(repo).parent.parts)
    base = package[: len(package) - (level - 1)]
    return ".".join([*base, *([module] if module else [])])


def _imported_files(path: Path, repo: Path, package: str | None) -> list[Path]:
    """The files of the `package` modules `path` imports, with the package `__init__.py` files on their way."""
    files: list[Path] = []
    for module, level, names, line in _parse(path).imports:
        module = _absolute(module, level, path, repo)
        if package is not None and module.split(".")[0] != package:
            continue
        found = _module_files(module, repo)
        if found is None and package is None:
            continue
        if found is None:
            raise StageSourceError(f"{path}:{line}: imports {module}, which is not a module under {repo}")
        files += found
        for name in names:
            files += (_module_files(f"{module}.{name}", repo) or [])[-1:]  # a submodule, or a name in `module`
    return files


def _module_files(module: str, repo: Path) -> list[Path] | None:
    """[posttrain/__init__.py, ..., the module's own file], or None when `module` has no file."""
    parts = module.split(".")
    files = []
    for i in range(1, len(parts)):
        init = repo.joinpath(*parts[:i], "__init__.py")
        if not init.is_file():
            return None
        files.append(init)
    package, plain = repo.joinpath(*parts, "__init__.py"), repo.joinpath(*parts[:-1], f"{parts[-1]}.py")
    own = package if package.is_file() else plain if plain.is_file() else None
    return None if own is None else [*files, own]
