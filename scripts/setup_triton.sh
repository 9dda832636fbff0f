#!/usr/bin/env bash
# Creates the serving venv that runs the real `tritonserver` bundled in nvidia-pytriton and the
# python-backend models of an exported repository (ctrflow's own transform + torch on CPU).
#
#   scripts/setup_triton.sh [VENV]      (default: .venv-triton in the repository root)
#
# Its own venv because nvidia-pytriton 0.7.0 needs numpy < 2. Idempotent: a stamp file holds the
# requirement list it was built from; an unchanged list makes a second run a no-op.
set -euo pipefail

REPO="$(cd "$(dirname "$0")/.." && pwd)"
VENV="${1:-$REPO/.venv-triton}"
PYTHON="${PYTHON:-python3}"
# torch is pinned like the rest of the project (constraints.txt).
REQUIREMENTS=(
  "nvidia-pytriton==0.7.0"
  "numpy<2"
  "torch==2.13.0"
  "pyarrow<25"            # pyarrow 26 refuses numpy < 2 at import
  "pandas"
  "tritonclient[grpc,http]"  # the repository's config writer parses with Triton's protobuf
)
STAMP="$VENV/.ctrflow-serving"
WANTED="$(printf '%s\n' "${REQUIREMENTS[@]}" "ctrflow-editable:$REPO")"

if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$WANTED" && -x "$VENV/bin/python" ]]; then
  echo "serving venv up to date: $VENV"
  exit 0
fi

start=$(date +%s)
[[ -x "$VENV/bin/python" ]] || "$PYTHON" -m venv "$VENV"
pip_install() {
  # --no-compile: byte-compiling torch's files is half the install time; a local extra index
  # without a package prints one "is ignored" line per package, which says nothing here.
  "$VENV/bin/python" -m pip install -q --no-compile --disable-pip-version-check "$@" \
    2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
}
pip_install "${REQUIREMENTS[@]}"
# ctrflow's own dependencies (kfp, mlflow, onnx...) are not needed to serve: only its code.
pip_install --no-deps -e "$REPO"
"$VENV/bin/python" - <<'PY'
import sys, sysconfig
import numpy, torch, pytriton, tritonclient.http, ctrflow  # noqa: F401  (fails loudly when broken)
from pathlib import Path
root = Path(pytriton.__file__).parent / "tritonserver"
assert (root / "bin" / "tritonserver").exists(), f"no tritonserver binary under {root}"
version = f"{sys.version_info.major}.{sys.version_info.minor}"
assert (root / "python_backend_stubs" / version).is_dir(), f"nvidia-pytriton has no python backend stub for Python {version}"
# The stub links libpython3.X.so.1.0 by name: the server is pointed at this Python's own copy.
libdir, soname = sysconfig.get_config_var("LIBDIR"), sysconfig.get_config_var("INSTSONAME")
assert libdir and soname and Path(libdir, soname).exists(), \
    f"{sys.executable} has no shared libpython ({libdir}/{soname}): build it with --enable-shared or pick another PYTHON"
print(f"numpy {numpy.__version__}, torch {torch.__version__}, tritonserver at {root / 'bin'}")
PY
echo "$WANTED" > "$STAMP"
echo "serving venv ready in $(( $(date +%s) - start )) s: $VENV"
