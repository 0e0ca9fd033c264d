#!/usr/bin/env bash
# Make sure a headless browser and its WebDriver are installed for the console's browser tests
# (tests/browser): Debian's `chromium` and `chromium-driver` packages. A no-op when both are
# there (or KMQ_CHROMIUM / KMQ_CHROMEDRIVER point at others); installs them with apt-get when
# running as root, and otherwise says what to run.
set -euo pipefail

chromium="${KMQ_CHROMIUM:-$(command -v chromium || true)}"
driver="${KMQ_CHROMEDRIVER:-$(command -v chromedriver || true)}"
if [[ -n "$chromium" && -x "$chromium" && -n "$driver" && -x "$driver" ]]; then
  exit 0
fi

if [[ "$(id -u)" != "0" ]] || ! command -v apt-get >/dev/null 2>&1; then
  echo "The browser tests need Chromium and its WebDriver, and they are not installed." >&2
  echo "Install them: sudo apt-get install chromium chromium-driver" >&2
  echo "(or point KMQ_CHROMIUM and KMQ_CHROMEDRIVER at a Chromium and a matching chromedriver)." >&2
  exit 1
fi

echo "Installing chromium and chromium-driver with apt-get ..."
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends chromium chromium-driver fonts-dejavu-core >/dev/null
command -v chromium >/dev/null && command -v chromedriver >/dev/null
echo "chromium: $(chromium --version 2>/dev/null || echo '?')"
