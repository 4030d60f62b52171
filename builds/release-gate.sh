#!/usr/bin/env bash
# The release gate: the quality gates, an SBOM of the binary's Python dependencies, a secret scan,
# image pinning, the node's isolation boundary and a public-answer leak scan of a `nexa sim` run.
# One line per check (`PASS name — detail` / `FAIL name — detail`); exit 0 only when all pass.
#
#   bash builds/release-gate.sh [--json FILE [--sign-key KEY]] [--sim-answers FILE [--sim-state-dir DIR]]
#                               [--sbom FILE] [--only CHECK,CHECK]
#
# --json writes a GateReport for `nexa evidence --gate FILE`; with --sign-key (an Ed25519 key,
# `nexa keygen --signing`) a SignedGateReport, which a controller trusting the key counts as verified. Without --sim-answers the gate runs
# `nexa sim --public-answers` itself (a few minutes). The checks and the boundary are defined in
# builds/gate/gate.py and builds/gate/scans.py. Runs from a fresh clone: it needs the project's
# .venv with the test extra (`bash .ci/dev test` makes it), or PYTHON naming such an interpreter.
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
python=${PYTHON:-}
if [ -z "$python" ]; then
  if [ -x .venv/bin/python ]; then python=.venv/bin/python; else python=python3; fi
fi
exec "$python" builds/gate/gate.py --root "$root" "$@"
