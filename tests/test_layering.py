"""The package layering of README.md ("Layout"), read from the source with `ast`.

Dependencies point one way, daemon → adapters → pipeline: pipeline imports
neither of the other two nor any provider SDK or web framework; an adapter
imports no other adapter (only the shared contract, inboxd.adapters.base) and
nothing of the daemon. And every source folder is a package setuptools installs:
a folder missing from pyproject.toml works in the editable checkout and is
absent from a wheel. And in tests/, no module imports a test module: what tests
share lives in tests/helpers/ or a rig module.

No database: these tests only read files.
"""

from __future__ import annotations

import ast
import importlib.metadata
import re
import sys
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PYPROJECT = REPO / "pyproject.toml"

#: Top-level modules pipeline may not import: provider SDKs (AWS, Microsoft Graph,
#: Google), JWT, and web frameworks and HTTP clients. Those belong to adapters and
#: daemon, so pipeline stays usable and testable without them.
PIPELINE_FORBIDDEN_THIRD_PARTY = frozenset(
    {
        "aioboto3",
        "aiobotocore",
        "boto3",
        "botocore",
        "msgraph",
        "msgraph_core",
        "kiota_abstractions",
        "google",
        "jwt",
        "aiohttp",
        "httpx",
        "requests",
        "starlette",
        "fastapi",
        "flask",
        "django",
    }
)


def _setuptools() -> dict[str, object]:
    table = tomllib.loads(PYPROJECT.read_text(encoding="utf-8"))["tool"]["setuptools"]
    assert isinstance(table, dict)
    return table


def _package_dirs() -> dict[str, str]:
    """Import package → repository folder, e.g. {"inboxd.daemon": "daemon"}."""
    package_dir = _setuptools()["package-dir"]
    assert isinstance(package_dir, dict)
    return {str(k): str(v) for k, v in package_dir.items()}


PACKAGE_DIRS = _package_dirs()
FOLDERS = {folder: package for package, folder in PACKAGE_DIRS.items()}


@dataclass(frozen=True)
class PyModule:
    path: Path
    module: str  # dotted name, e.g. inboxd.adapters.esp.ses
    is_package: bool  # an __init__.py: relative imports start from the module itself

    @property
    def rel(self) -> str:
        return self.path.relative_to(REPO).as_posix()

    @property
    def package(self) -> str:
        return self.module if self.is_package else self.module.rpartition(".")[0]


@dataclass(frozen=True)
class Import:
    line: int
    statement: str  # as written, for the failure message
    targets: tuple[str, ...]  # absolute dotted names it may load


def _py_files(folder: Path) -> Iterator[Path]:
    for path in sorted(folder.rglob("*.py")):
        parts = path.relative_to(folder).parts
        if "__pycache__" in parts or any(p.startswith(".") for p in parts):
            continue
        yield path


def sources(folder: str) -> list[PyModule]:
    """Every module under the repository folder `folder` (a key of package-dir)."""
    root = REPO / folder
    found = []
    for path in _py_files(root):
        parts = list(path.relative_to(root).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        if is_package:
            parts.pop()
        found.append(PyModule(path, ".".join([FOLDERS[folder], *parts]), is_package))
    return found


def imports(source: PyModule) -> list[Import]:
    """Every import statement of the module, at any depth (functions, TYPE_CHECKING)."""
    tree = ast.parse(source.path.read_bytes(), filename=str(source.path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = tuple(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = _resolve_from(source, node)
            # `from pkg import name` may load the submodule pkg.name, so it counts as
            # a target too ("from inboxd.adapters import maildir").
            targets = (base, *(f"{base}.{a.name}" for a in node.names if a.name != "*"))
        else:
            continue
        found.append(Import(node.lineno, ast.unparse(node), targets))
    return sorted(found, key=lambda i: i.line)


def _resolve_from(source: PyModule, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    package = source.package.split(".")
    up = node.level - 1
    assert up < len(package), (
        f"{source.rel}:{node.lineno}: {ast.unparse(node)} climbs above the top package"
    )
    base = package[: len(package) - up]
    return ".".join([*base, node.module] if node.module else base)


def _is_within(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def _where(source: PyModule, imp: Import) -> str:
    return f"{source.rel}:{imp.line}: {imp.statement}"


def test_pipeline_imports_neither_adapters_nor_daemon_nor_sdks() -> None:
    problems = []
    for source in sources(PACKAGE_DIRS["inboxd.pipeline"]):
        for imp in imports(source):
            for target in imp.targets:
                if _is_within(target, "inboxd.daemon") or _is_within(target, "inboxd.adapters"):
                    problems.append(f"{_where(source, imp)}  (pipeline must not import {target})")
                    break
                top = target.partition(".")[0]
                if top in PIPELINE_FORBIDDEN_THIRD_PARTY:
                    problems.append(
                        f"{_where(source, imp)}  (pipeline imports no provider SDK or "
                        f"web framework: {top})"
                    )
                    break
    assert not problems, "layering: daemon → adapters → pipeline\n" + "\n".join(problems)


def test_adapters_import_no_other_adapter_and_no_daemon() -> None:
    problems = []
    root = REPO / PACKAGE_DIRS["inboxd.adapters"]
    subpackages = {
        p.relative_to(root).parts[0] for p in _py_files(root) if len(p.relative_to(root).parts) > 1
    }
    for source in sources(PACKAGE_DIRS["inboxd.adapters"]):
        # The adapter is the folder under adapters/ (adapters/esp/ses.py → "esp");
        # None for the modules directly in adapters/ (the package itself and base).
        folders = source.path.relative_to(root).parts
        own = folders[0] if len(folders) > 1 else None
        for imp in imports(source):
            for target in imp.targets:
                if _is_within(target, "inboxd.daemon"):
                    problems.append(f"{_where(source, imp)}  (adapters must not import {target})")
                    break
                parts = target.split(".")
                if (
                    len(parts) > 2
                    and parts[:2] == ["inboxd", "adapters"]
                    and parts[2] in subpackages
                    and parts[2] != own
                ):
                    problems.append(
                        f"{_where(source, imp)}  (an adapter imports no other adapter, only "
                        f"inboxd.adapters.base: {target})"
                    )
                    break
    assert not problems, "layering: each adapter stands alone\n" + "\n".join(problems)


def test_every_source_folder_is_an_installed_package() -> None:
    listed = _setuptools()["packages"]
    assert isinstance(listed, list)
    listed_set = {str(p) for p in listed}
    on_disk: dict[str, str] = {}  # package → folder
    for folder, package in FOLDERS.items():
        for path in _py_files(REPO / folder):
            rel = path.parent.relative_to(REPO / folder)
            on_disk[".".join([package, *rel.parts])] = path.parent.relative_to(REPO).as_posix()
    problems = [
        f"{folder}/ holds .py files but is not in [tool.setuptools] packages of "
        f'pyproject.toml; add the line: "{package}",'
        for package, folder in sorted(on_disk.items())
        if package not in listed_set
    ]
    for package in sorted(listed_set - set(on_disk)):
        top = next((p for p in PACKAGE_DIRS if _is_within(package, p)), None)
        if top is None:
            where = f"no package-dir entry maps it to a folder of {', '.join(FOLDERS)}"
        else:
            folder = "/".join([PACKAGE_DIRS[top], *package.split(".")[top.count(".") + 1 :]])
            where = f"{folder}/ holds no .py files"
        problems.append(
            f"pyproject.toml [tool.setuptools] packages lists {package}, but {where}; "
            f'remove the line: "{package}",'
        )
    assert not problems, "\n".join(problems)


def test_no_module_imports_another_modules_private_names() -> None:
    """A private name imported from another module is a seam in the wrong place
    (CONTRIBUTING.md "Shape"): what two modules share is public in one of them."""
    problems = []
    for folder in PACKAGE_DIRS.values():
        for source in sources(folder):
            tree = ast.parse(source.path.read_bytes(), filename=str(source.path))
            for node in ast.walk(tree):
                if not isinstance(node, ast.ImportFrom):
                    continue
                base = _resolve_from(source, node)
                if not _is_within(base, "inboxd") or base == source.module:
                    continue
                private = [
                    a.name for a in node.names if a.name.startswith("_") and a.name != "__version__"
                ]
                if private:
                    problems.append(
                        f"{source.rel}:{node.lineno}: {ast.unparse(node)}  "
                        f"(private: {', '.join(private)}; make it public where it lives, "
                        f"or move it to the module both use)"
                    )
    assert not problems, "private names across modules\n" + "\n".join(problems)


#: The module names every door folder has (CONTRIBUTING.md "Adding a door"): its
#: errors, and the module implementing its kind of door (adapters/base.py), a pull
#: `Source` in source.py or a `QueueDoor` in door.py.
DOOR_MODULES = ("__init__.py", "errors.py")
DOOR_CONTRACT_MODULES = ("source.py", "door.py")


def test_every_door_folder_has_the_fixed_module_names() -> None:
    root = REPO / PACKAGE_DIRS["inboxd.adapters"]
    doors = [
        d
        for d in sorted(root.iterdir())
        if d.is_dir() and any((d / name).is_file() for name in DOOR_CONTRACT_MODULES)
    ]
    assert doors, "no door folder found under adapters/"
    problems = [
        f"adapters/{d.name}/ lacks {name}"
        for d in doors
        for name in DOOR_MODULES
        if not (d / name).is_file()
    ]
    assert not problems, "door folders (CONTRIBUTING.md, Adding a door)\n" + "\n".join(problems)


#: A string that starts like an SQL statement (after blank space).
SQL_STATEMENT = re.compile(
    r"^\s*(SELECT|INSERT\s+INTO|UPDATE\s+\w+\s+SET|DELETE\s+FROM|WITH\s+\w+\s+AS|CREATE|ALTER|"
    r"DROP|TRUNCATE|LOCK\s+TABLE|COPY|LISTEN|UNLISTEN|NOTIFY)\b",  # as the code writes SQL
)
#: Statements that read no table: a liveness probe and the name of the database.
SQL_PROBES = frozenset({"SELECT 1", "SELECT current_database()"})


def _docstring_nodes(tree: ast.Module) -> set[int]:
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                found.add(id(body[0].value))
    return found


def code_strings(source: PyModule) -> Iterator[tuple[int, str]]:
    """Every string literal of the module that is not a docstring: (line, text)."""
    tree = ast.parse(source.path.read_bytes(), filename=str(source.path))
    docstrings = _docstring_nodes(tree)
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and id(node) not in docstrings
        ):
            yield node.lineno, node.value


def test_sql_lives_in_pipeline_or_in_a_doors_tables_module() -> None:
    """SQL is written in pipeline/ or in a door's own tables.py (CONTRIBUTING.md
    "Adding a door"), so every statement on a table is found in one of those places.
    The embedded server's bootstrap (daemon/embedded_pg/) creates the database itself."""
    problems = []
    for package in ("inboxd.daemon", "inboxd.adapters"):
        for source in sources(PACKAGE_DIRS[package]):
            rel = source.rel
            if rel.startswith("daemon/embedded_pg/") or (
                rel.startswith("adapters/") and rel.endswith("/tables.py")
            ):
                continue
            for line, text in code_strings(source):
                if SQL_STATEMENT.match(text) and text.strip() not in SQL_PROBES:
                    first = text.strip().splitlines()[0][:60]
                    problems.append(f"{rel}:{line}: {first}")
    assert not problems, (
        "SQL outside pipeline/ and the doors' tables.py (move it into a function there)\n"
        + "\n".join(problems)
    )


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def test_every_third_party_import_is_a_declared_dependency() -> None:
    """A module imported only because another dependency happens to install it
    breaks when that one changes its own dependencies: declare what you import."""
    project = tomllib.loads(PYPROJECT.read_text(encoding="utf-8"))["project"]
    declared = {
        _canonical(re.split(r"[\[<>=!~; ]", requirement, maxsplit=1)[0])
        for requirement in project["dependencies"]
    }
    distributions = importlib.metadata.packages_distributions()
    problems = []
    for folder in PACKAGE_DIRS.values():
        for source in sources(folder):
            for imp in imports(source):
                top = imp.targets[0].partition(".")[0]
                if not top or top == "inboxd" or top in sys.stdlib_module_names:
                    continue
                names = {_canonical(d) for d in distributions.get(top, [])}
                if not names & declared:
                    problems.append(
                        f"{_where(source, imp)}  ({top}, from {sorted(names) or '?'}, "
                        "is not in [project] dependencies)"
                    )
    assert not problems, "undeclared imports\n" + "\n".join(problems)


TESTS = REPO / "tests"


def _test_module_imports(path: Path) -> Iterator[tuple[int, str]]:
    """(line, statement) of each import of a `test_*` module in `path`, in either
    form: `from test_x import ...` (its folder on sys.path) or the dotted
    `from tests.daemon.test_x import ...`, `import tests.daemon.test_x`."""
    tree = ast.parse(path.read_bytes(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            names = [base, *(f"{base}.{a.name}" for a in node.names)]
            if node.level:  # relative: within the importing module's own package
                names = [f"tests.{name}" for name in names]
        else:
            continue
        if any(_is_test_module(name) for name in names):
            yield node.lineno, ast.unparse(node)


def _is_test_module(name: str) -> bool:
    """`test_x` (a folder of tests/ on sys.path) or `tests.….test_x`; not a library's
    module that happens to be named so (aiohttp.test_utils)."""
    parts = name.split(".")
    if parts[0] == "tests":
        return any(part.startswith("test_") for part in parts[1:])
    return parts[0].startswith("test_")


def test_no_test_module_imports_another_test_module() -> None:
    """What tests share lives in tests/helpers/ or in a rig module (tests/daemon/*_rig.py,
    harness.py), never in a test module (CONTRIBUTING.md "Tests", 12): importing one ties
    two files' tests together, and a `test_*` function imported is collected twice."""
    problems = [
        f"{path.relative_to(REPO).as_posix()}:{line}: {statement}"
        for path in _py_files(TESTS)
        for line, statement in _test_module_imports(path)
    ]
    assert not problems, (
        "test modules importing test modules (move what they share to tests/helpers/ "
        "or a rig module)\n" + "\n".join(problems)
    )


#: Modules that hold a connection of their own (never a pooled one) and may keep
#: session state on it: LISTEN, the presence lock.
OWN_CONNECTION_MODULES = frozenset(
    {
        "daemon/http/events.py",
        "daemon/sync/doorbell.py",
        "pipeline/delivery/worker.py",
        "pipeline/mailbox/presence.py",
    }
)
SESSION_STATE_SQL = re.compile(
    r"^\s*(SET\s+(?!LOCAL\b)|LISTEN\b|DECLARE\b.*\bWITH\s+HOLD\b)"
    r"|\bpg_(try_)?advisory_lock(_shared)?\s*\(",
    re.DOTALL,  # SQL keywords are upper case here (CONTRIBUTING.md); prose is not SQL
)


def test_no_session_state_is_left_on_a_pooled_connection() -> None:
    """The daemon's pool does not reset a connection on the server when it goes back
    (daemon/database.py keep_session: a round trip per acquisition saved). So nothing
    may leave session state on one: a session SET (SET LOCAL is fine), a LISTEN or
    add_listener, a session advisory lock, a WITH HOLD cursor — only the modules with
    a connection of their own (OWN_CONNECTION_MODULES) may."""
    problems = []
    for package in ("inboxd.pipeline", "inboxd.daemon", "inboxd.adapters"):
        for source in sources(PACKAGE_DIRS[package]):
            if source.rel in OWN_CONNECTION_MODULES:
                continue
            for line, text in code_strings(source):
                if SESSION_STATE_SQL.search(text):
                    problems.append(f"{source.rel}:{line}: {text.strip()[:60]}")
            tree = ast.parse(source.path.read_bytes(), filename=str(source.path))
            problems += [
                f"{source.rel}:{node.lineno}: add_listener"
                for node in ast.walk(tree)
                if isinstance(node, ast.Attribute) and node.attr == "add_listener"
            ]
    assert not problems, (
        "session state on what may be a pooled connection (use SET LOCAL, a "
        "transaction-scoped lock, or a connection of its own listed here)\n" + "\n".join(problems)
    )
