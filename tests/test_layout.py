"""The project's shape: packages in layers, imports only downwards (commands -> training /
weights / measure / generate / data -> model -> machine), no cycles, a model file that holds
only the model, every file short enough to read, a plain training run that imports only
what it uses, and no file that tells how the project was built rather than what it is."""

import ast
import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def project_modules() -> dict[str, Path]:
    # skip tests/ and hidden folders (.venv, .git, a user's own)
    files = [p for p in REPO.rglob("*.py") if not any(
        part == "tests" or part.startswith(".") for part in p.relative_to(REPO).parts)]
    names = {}
    for path in files:
        parts = list(path.relative_to(REPO).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        names[".".join(parts)] = path
    return names


def imports(path: Path, modules: dict[str, Path]) -> set[str]:
    """The project modules that `path` imports, at the top, inside a function or for type
    checking alone (a type named upwards ties the layers as an import does)."""
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


def test_the_model_file_imports_only_the_machine_of_the_project():
    modules = project_modules()
    assert {dep.split(".")[0] for dep in imports(modules["model"], modules)} <= {"machine"}
    # short enough to read in one sitting: GPT-2's layout, its switches (each with the help
    # that train.py's --help shows) and the KV cache; the gradients written out for CPUs live
    # in machine/
    assert len(modules["model"].read_text().splitlines()) <= 400


def test_every_source_file_says_what_it_is_for_and_how_to_use_it():
    for name, path in project_modules().items():
        text = path.read_text()
        doc = ast.get_docstring(ast.parse(text))
        assert doc and "Usage:" in doc, f"{name} needs a docstring with a usage line"
        assert len(text.splitlines()) <= 500, f"{name} is over 500 lines: split it"


# Each top-level package or root module, and its layer. A module imports only from lower
# layers, or from its own package. The commands are the root's other modules, one layer
# up; benchmarks/ stands above them and imports the layers, and of the commands only train.
LAYERS = {
    "machine": 0,
    "model": 1,
    "data": 2, "cdecode": 2, "viz": 2,
    "weights": 3, "generate": 3,
    "training": 4, "measure": 4, "cli": 4,
    "serving": 5,  # scores as measure/ does: one owner of logprobs
}
COMMANDS = 6
BENCHMARKS = 7
OLD_NAMES = {("gpt2", "export")}  # gpt2.py is export.py's old name, and runs it


def layer(name: str) -> int:
    top = name.split(".")[0]
    if top == "benchmarks":
        return BENCHMARKS
    return LAYERS.get(top, COMMANDS)


def test_imports_flow_down_the_layers():
    modules = project_modules()
    commands = {name for name in modules if "." not in name and layer(name) == COMMANDS}
    assert {"train", "sample", "evaluate", "export"} <= commands
    assert set(LAYERS) <= {name.split(".")[0] for name in modules}
    for name, path in modules.items():
        for dep in imports(path, modules):
            same_package = dep.split(".")[0] == name.split(".")[0]
            # no package imports a command; benchmarks/ may call train.train, as tests do
            if "." in name and not (layer(name) == BENCHMARKS and dep == "train"):
                assert dep not in commands, f"{name} imports the command {dep}"
            if not same_package and layer(name) != BENCHMARKS and (name, dep) not in OLD_NAMES:
                assert layer(dep) < layer(name), (
                    f"{name} (layer {layer(name)}) imports {dep} (layer {layer(dep)}): imports "
                    f"flow down, commands -> training / weights / generate -> model -> machine")


def test_the_root_holds_the_commands_the_model_and_generation():
    # a helper of one command or package lives in that package; the root is what a user runs,
    # and the two files a reader starts from
    root = {name for name in project_modules() if (REPO / f"{name}.py").is_file()}
    assert root == {"train", "sample", "evaluate", "export", "serve", "gpt2", "model", "generate"}


def test_machine_imports_nothing_of_the_project():
    modules = project_modules()
    for name, path in modules.items():
        if name.startswith("machine"):
            assert {dep for dep in imports(path, modules) if not dep.startswith("machine")} == set()


def module_level_imports(path: Path, modules: dict[str, Path]) -> set[str]:
    """The project modules that `path` imports when it is imported: at its top level (under
    an `if` or a `try` too), not inside a function."""
    found, stack = set(), list(ast.parse(path.read_text()).body)
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If | ast.Try):
            stack += node.body + node.orelse + [n for h in getattr(node, "handlers", []) for n in h.body]
        elif isinstance(node, ast.Import | ast.ImportFrom):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module] + [f"{node.module}.{a.name}" for a in node.names]
                     if node.level == 0 and node.module else [])
            for name in names:  # importing a module also imports its package's __init__
                parts = name.split(".")
                found |= {".".join(parts[:i]) for i in range(1, len(parts) + 1)} & modules.keys()
    return found


def test_a_plain_training_run_reads_only_what_it_uses():
    modules = project_modules()
    seen, todo = set(), ["train"]
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            todo += module_level_imports(modules[name], modules) - seen
    # FSDP, torchrun, sharded checkpoints, resuming and reading a checkpoint, data preparation
    # and its shard writer, fine-tuning, chat batches, sampling, timing a CPU's peak and a GPU's
    # datasheet peak are imported where a run needs them
    assert not seen & {"training.fsdp", "training.torchrun", "weights.sharded", "training.resume",
                       "weights.safe_load", "weights.fields", "data.prepare", "data.shards",
                       "data.assets", "data.bpe", "training.init_from", "data.chat", "generate",
                       "cdecode", "viz", "machine.peak", "machine.datasheets"}, seen
    lines = sum(len(modules[name].read_text().splitlines()) for name in seen)
    assert lines <= 3500, f"train.py's imports reach {len(seen)} modules, {lines} lines"


# Phrases that tell how the project was built rather than what it is: stretches of work,
# machines lent for them, the device time they had, the issues that asked for them, and the
# counts of successive readers. Each is narrow, so that "a chat session", "an SSH session",
# "rounds of the race" or "the most device time" of a GPU kernel never match.
HISTORY = re.compile("|".join([
    r"\bthis session\b",
    r"\b(?:earlier|later|previous|next|last|first|second|third|fourth|fifth|sixth|seventh|eighth) session\b",
    r"\bthe session (?:before|after)\b",
    r"\bsession's\b",
    r"\bthe round's\b",
    r"\b(?:this|that|next|earlier|previous|last) round\b",
    r"\b(?:earlier|previous|later) rounds\b",
    r"\brounds? of work\b",
    r"\blent (?:for|to)\b",
    r"\b(?:was|were|been|is|machine|machines|gpu|gpus|cpu|cpus) lent\b",
    r"\b(?:minutes|hours|left) of device time\b",
    r"\bissues? #?\d+\b",
    r"\bthe issue's\b",
    r"\breader \d\b",
    r"\b(?:successive|eight|seven|six|five|four|three|two) readers\b",
]), re.IGNORECASE)


def tracked_files() -> list[Path]:
    """The repository's tracked files outside tests/ (which holds the phrases above)."""
    listed = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True)
    names = listed.stdout.splitlines() if listed.returncode == 0 else [
        str(p.relative_to(REPO)) for p in REPO.rglob("*")
        if p.is_file() and not any(part.startswith(".") for part in p.relative_to(REPO).parts)]
    return [REPO / name for name in names if not name.startswith("tests/")]


def test_the_history_phrases_match_history_and_not_plain_words():
    for history in ["measured in this session", "a GPU lent for fifteen minutes",
                    "the round's sixth session", "as issue 77 asks", "reader 8 needed 559 lines",
                    "not run in this session's device time", "in earlier rounds"]:
        assert HISTORY.search(history), history
    for plain in ["a chat session", "the terminal or SSH session closed", "3 rounds of the race",
                  "the kernels that took the most device time", "session fixtures",
                  "sessionStorage.getItem", "rounds to nearest even", "the readers of the file"]:
        assert not HISTORY.search(plain), plain


def test_no_file_speaks_of_how_the_project_was_built():
    found = []
    for path in tracked_files():
        if path.suffix in (".png", ".jpg", ".pt", ".bin") or not path.is_file():
            continue
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if HISTORY.search(line):
                found.append(f"{path.relative_to(REPO)}:{number}: {line.strip()}")
    assert not found, ("say what the software is and does; how it was built is in git log:\n"
                       + "\n".join(found))
