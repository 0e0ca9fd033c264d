#!/usr/bin/env bash
# Refresh the web console's vendored JavaScript/CSS from the npm registry, at pinned versions.
#
# The console is served from the package (api/console/static/vendor/): clusters are often
# air-gapped, so nothing is loaded from a CDN. To upgrade, change a version below, run this
# script, look at the diff (and the library's changelog), and run the browser tests
# (tests/browser). Needs `npm` (for `npm pack`) and network access to the registry.
set -euo pipefail
cd "$(dirname "$0")/.."

HTMX_VERSION=2.0.11   # htmx.org, 0BSD: partial page updates (polling, forms)
UPLOT_VERSION=1.6.32  # uplot, MIT: the overview's time-series charts

out=api/console/static/vendor
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

fetch() {  # <package> <version>: unpack the npm tarball into $work/<package>
    local dir="$work/$1"
    mkdir -p "$dir"
    (cd "$dir" && npm pack --silent "$1@$2" >/dev/null && tar -xzf ./*.tgz)
}

fetch htmx.org "$HTMX_VERSION"
fetch uplot "$UPLOT_VERSION"

mkdir -p "$out"
rm -f "$out"/*
cp "$work/htmx.org/package/dist/htmx.min.js" "$out/htmx.min.js"
cp "$work/htmx.org/package/LICENSE" "$out/htmx.LICENSE.txt"
cp "$work/uplot/package/dist/uPlot.iife.min.js" "$out/uPlot.iife.min.js"
cp "$work/uplot/package/dist/uPlot.min.css" "$out/uPlot.min.css"
cp "$work/uplot/package/LICENSE" "$out/uPlot.LICENSE.txt"
cat > "$out/VERSIONS.txt" <<VERSIONS
Vendored by scripts/vendor-console.sh from the npm registry; do not edit by hand.
htmx.org $HTMX_VERSION (0BSD, htmx.LICENSE.txt)
uplot $UPLOT_VERSION (MIT, uPlot.LICENSE.txt)
VERSIONS
(cd "$out" && sha256sum -- *.js *.css > SHA256SUMS)
echo "vendored into $out:"
cat "$out/VERSIONS.txt"
