"""Write a daemon configuration tree for a test: the main file and tenants/*.toml.

The layout `inboxd run` and `inboxd check-config` read (config.example.toml): a
main file whose [tenants] dir names a folder, one file per tenant in it. The
texts are the test's; this only puts them where the daemon looks.
"""

from __future__ import annotations

from pathlib import Path

#: The main file's name in every test tree (any name works; the CLI is given it).
MAIN_FILE = "inboxd.toml"
#: A main file with nothing but where the tenant files are: every other table
#: takes its defaults.
TENANTS_ONLY = '[tenants]\ndir = "tenants"\n'


def write_tenant_file(tmp: Path, name: str, text: str) -> Path:
    """tmp/tenants/<name>.toml with `text`; its path."""
    (tmp / "tenants").mkdir(exist_ok=True)
    path = tmp / "tenants" / f"{name}.toml"
    path.write_text(text)
    return path


def write_config_tree(tmp: Path, main: str = "", **tenants: str) -> Path:
    """tmp/inboxd.toml with `main` as its text and tmp/tenants/<name>.toml for each
    keyword (the tenants folder even without one); the main file's path."""
    (tmp / "tenants").mkdir(exist_ok=True)
    for name, text in tenants.items():
        write_tenant_file(tmp, name, text)
    config = tmp / MAIN_FILE
    config.write_text(main)
    return config
