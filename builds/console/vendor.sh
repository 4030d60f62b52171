#!/usr/bin/env bash
# Install the console's front-end libraries from the npm registry, exactly as package-lock.json
# pins them, and copy their minified files into nexa/control/console/static/vendor/ (gitignored), where
# the controller serves them and builds/nexa.spec bundles them into the binary.
# Run by .ci/dev (run and test) and builds/build.sh. Usage: bash builds/console/vendor.sh
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(cd "$here/../.." && pwd)
dest="$root/nexa/control/console/static/vendor"

command -v npm >/dev/null 2>&1 || { echo "vendor.sh: npm is required (apt-get install npm)" >&2; exit 1; }
(cd "$here" && npm ci --ignore-scripts --no-audit --no-fund --loglevel=error)

mkdir -p "$dest"
install -m 0644 "$here/node_modules/htmx.org/dist/htmx.min.js" "$dest/htmx.min.js"
install -m 0644 "$here/node_modules/uplot/dist/uPlot.iife.min.js" "$dest/uPlot.iife.min.js"
install -m 0644 "$here/node_modules/uplot/dist/uPlot.min.css" "$dest/uPlot.min.css"
echo "vendor.sh: console libraries in $dest" >&2
