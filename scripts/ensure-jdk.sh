#!/usr/bin/env bash
# Make sure a JDK compiler (javac) is installed: the Spark pipeline's JVM marker decoder
# (pipeline/jvm_jar.py) is compiled with it, and `make test` requires it. A no-op when
# javac is found ($JAVA_HOME/bin/javac or on the PATH); installs Debian's
# openjdk-17-jdk-headless with apt-get when running as root, and otherwise says what to run.
set -euo pipefail

if [[ -n "${JAVA_HOME:-}" && -x "${JAVA_HOME}/bin/javac" ]] || command -v javac >/dev/null 2>&1; then
  exit 0
fi

if [[ "$(id -u)" != "0" ]] || ! command -v apt-get >/dev/null 2>&1; then
  echo "The pipeline's JVM marker decoder needs a JDK compiler (javac), and none is installed." >&2
  echo "Install one: sudo apt-get install openjdk-17-jdk-headless (or set JAVA_HOME to a JDK)." >&2
  exit 1
fi

echo "Installing openjdk-17-jdk-headless with apt-get ..."
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends openjdk-17-jdk-headless >/dev/null
command -v javac >/dev/null
echo "javac: $(javac -version 2>&1)"
