#!/usr/bin/env bash
# Type-check the packages CI checks (common, producer) under their import names: setuptools maps
# batchfleet.<pkg> to the top-level folders, which mypy cannot follow, so a temporary tree of links
# gives it batchfleet/<pkg> -> <pkg>.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
tree="$(mktemp -d)"
trap 'rm -rf "$tree"' EXIT
mkdir "$tree/batchfleet"
for pkg in common producer worker gateway; do ln -s "$root/$pkg" "$tree/batchfleet/$pkg"; done
cd "$tree"
python3 -m mypy --config-file "$root/pyproject.toml" -p batchfleet.common -p batchfleet.producer "$@"
