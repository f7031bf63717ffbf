#!/usr/bin/env bash
# mypy over the three import packages, under the names they are installed as.
#
# Usage: bash scripts/typecheck.sh PYTHON   (the interpreter whose site-packages hold
# the dependencies and mypy; `make typecheck` passes .venv/bin/python)
#
# The source folders (daemon/, adapters/, pipeline/) are mapped onto inboxd.* by
# setuptools' package-dir, and the editable install exposes them through an import
# hook mypy cannot follow. So a tree of symlinks, .cache/typecheck/inboxd/<pkg> ->
# ../../../<pkg>, gives mypy the real package layout; the paths it prints are
# rewritten back to repository paths so editors and humans can jump to them.
# Settings: [tool.mypy] in pyproject.toml.
set -euo pipefail

if [[ $# -ne 1 ]]; then
    echo "usage: $0 PYTHON" >&2
    exit 2
fi
python=$1
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# Absolute, because mypy runs from the symlink tree, not from the caller's directory.
[[ $python == */* ]] && python=$(cd "$(dirname "$python")" && pwd)/$(basename "$python")

packages=(pipeline adapters daemon)
tree=$repo/.cache/typecheck
mkdir -p "$tree/inboxd"
for pkg in "${packages[@]}"; do
    # Relative links survive the repository being moved; -n replaces a stale link
    # instead of creating one inside the directory it points to.
    ln -sfn "../../../$pkg" "$tree/inboxd/$pkg"
done

args=()
for pkg in "${packages[@]}"; do
    args+=(-p "inboxd.$pkg")
done

status=0
# The symlink tree is the only place the inboxd.* names exist, so mypy must run there.
# sed turns "inboxd/pipeline/rows.py:12:" back into "pipeline/ingest/rows.py:12:".
(
    cd "$tree"
    "$python" -m mypy \
        --config-file "$repo/pyproject.toml" \
        --python-executable "$python" \
        --cache-dir "$repo/.cache/mypy" \
        "${args[@]}"
) | sed -E 's#^inboxd/(pipeline|adapters|daemon)/#\1/#' || status=$?
exit "$status"
