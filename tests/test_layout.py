"""The project's shape: no module imports another that imports it back (data flows one
way, text -> tokens -> batches -> model -> loss / tokens), and the model file stays the
model alone."""

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def project_modules() -> dict[str, Path]:
    files = [p for p in REPO.rglob("*.py")
             if not {".venv", "tests", ".git"} & set(p.relative_to(REPO).parts)]
    names = {}
    for path in files:
        parts = list(path.relative_to(REPO).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        names[".".join(parts)] = path
    return names


def imports(path: Path, modules: dict[str, Path]) -> set[str]:
    """The project modules that `path` imports, at the top or inside a function."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            candidates = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            candidates = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        else:
            continue
        found |= {name for name in candidates if name in modules}
    return found


def test_no_import_cycles():
    modules = project_modules()
    graph = {name: imports(path, modules) - {name} for name, path in modules.items()}
    assert {"model", "generate", "train", "sample", "cdecode"} <= graph.keys()
    state: dict[str, str] = {}  # name -> "open" while on the path, "done" after

    def visit(name: str, path: list[str]) -> None:
        state[name] = "open"
        for dep in sorted(graph[name]):
            assert state.get(dep) != "open", f"import cycle: {' -> '.join(path + [dep])}"
            if dep not in state:
                visit(dep, path + [dep])
        state[name] = "done"

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])


def test_the_model_file_imports_nothing_of_the_project():
    modules = project_modules()
    assert imports(modules["model"], modules) == set()
    # about two screens: GPT-2's layout, its switches, and the two gradients and the CPU's
    # bf16 attention written out for speed, read in one sitting
    assert len(modules["model"].read_text().splitlines()) < 425


def test_every_source_file_says_what_it_is_for_and_how_to_use_it():
    for name, path in project_modules().items():
        text = path.read_text()
        doc = ast.get_docstring(ast.parse(text))
        assert doc and "Usage:" in doc, f"{name} needs a docstring with a usage line"
        assert len(text.splitlines()) <= 500, f"{name} is over 500 lines: split it"
