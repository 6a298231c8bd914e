#!/usr/bin/env bash
# Re-render every Graphviz source in docs/diagrams/ to SVG and PNG beside it.
#   docs/diagrams/render.sh              (needs `dot`: apt-get install graphviz fonts-dejavu-core)
# The sources name their fonts (DejaVu Sans); tests/unit/test_diagrams.py checks that the paths
# and names in them still exist and that imports.dot matches the package's imports.
set -euo pipefail
cd "$(dirname "$0")"
command -v dot >/dev/null || { echo "render.sh: Graphviz 'dot' not found (apt-get install graphviz)" >&2; exit 1; }
for src in *.dot; do
  name="${src%.dot}"
  dot -Tsvg "$src" -o "$name.svg"
  dot -Tpng -Gdpi=110 "$src" -o "$name.png"
  echo "rendered $name.svg $name.png"
done
