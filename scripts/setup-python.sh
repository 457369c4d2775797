#!/usr/bin/env bash
# Creates the project's own Python environment (.dice/venv) with the pinned PyTorch that the
# evaluator's workers run, and ninja for torch's C++ extension builds. Idempotent: a complete
# environment is left alone. Downloads are cached in .dice/pip-cache.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv=$root/.dice/venv
torch_pin=2.11.0
if [[ -x $venv/bin/python ]] && "$venv/bin/python" - "$torch_pin" <<'PY' 2>/dev/null
import sys, torch, ninja, numpy
sys.exit(0 if torch.__version__.split("+")[0] == sys.argv[1] else 1)
PY
then
  exit 0
fi
command -v python3 >/dev/null || { echo "python3 is required (3.10 or newer)" >&2; exit 1; }
echo "setting up $venv (torch $torch_pin; first time only, a few minutes)" >&2
python3 -m venv "$venv"
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check \
  --cache-dir "$root/.dice/pip-cache" "torch==$torch_pin" ninja numpy
"$venv/bin/python" -c "import torch, ninja; print('torch', torch.__version__)" >&2
