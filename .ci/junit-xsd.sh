#!/usr/bin/env bash
# Fetches the Jenkins/Ant JUnit schema that tests/unit/test_compare_gate.py validates the
# gate's JUnit XML against, and prints its path on the last line of stdout. The file is not in
# this repository (it is the xunit-plugin's, MIT-licensed: Copyright (c) 2014, Gregory
# Boissinot); it is pinned by commit and checked by sha256, and reused when present.
#   TIMWATCH_JUNIT_XSD  where it lives (default ~/.cache/timwatch/junit-10.xsd)
set -euo pipefail
COMMIT=8c515de2804b3fd591a3b0f1ff8908a1b1a41887
URL="https://raw.githubusercontent.com/jenkinsci/xunit-plugin/$COMMIT/src/main/resources/org/jenkinsci/plugins/xunit/types/model/xsd/junit-10.xsd"
SHA=a1a816f58d1bf95ebabf371994df0b9246dee66ea9572fbec4f9296f1b2c0ff6
DEST="${TIMWATCH_JUNIT_XSD:-$HOME/.cache/timwatch/junit-10.xsd}"
if [ -f "$DEST" ] && echo "$SHA  $DEST" | sha256sum -c --quiet - 2>/dev/null; then
  echo "$DEST"
  exit 0
fi
mkdir -p "$(dirname "$DEST")"
curl -fsSL "$URL" -o "$DEST.tmp"
echo "$SHA  $DEST.tmp" | sha256sum -c --quiet -
mv "$DEST.tmp" "$DEST"
echo "$DEST"
