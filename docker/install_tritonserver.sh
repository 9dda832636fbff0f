#!/bin/sh
# Puts the tritonserver bundled in nvidia-pytriton (installed by pip just before) on PATH as
# /usr/local/bin/tritonserver: its python backend with the stub built for this image's Python in
# /opt/tritonserver/backends, and its own libraries and this Python's libpython on the loader's path.
set -eu
ROOT="$(python3 -c 'import os, pytriton; print(os.path.dirname(pytriton.__file__))')"
VERSION="$(python3 -c 'import sys; print(f"{sys.version_info.major}.{sys.version_info.minor}")')"
LIBPYTHON="$(python3 -c 'import sysconfig; print(sysconfig.get_config_var("LIBDIR"))')"
STUB="$ROOT/tritonserver/python_backend_stubs/$VERSION/triton_python_backend_stub"
[ -x "$STUB" ] || { echo "nvidia-pytriton has no python backend stub for Python $VERSION" >&2; exit 1; }
mkdir -p /opt/tritonserver/backends/python
find "$ROOT/tritonserver/backends/python" -maxdepth 1 -type f -exec cp {} /opt/tritonserver/backends/python/ \;
cp "$STUB" /opt/tritonserver/backends/python/
cat > /usr/local/bin/tritonserver <<SCRIPT
#!/bin/sh
export LD_LIBRARY_PATH="$LIBPYTHON:$(dirname "$ROOT")/nvidia_pytriton.libs\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}"
exec "$ROOT/tritonserver/bin/tritonserver" --backend-directory=/opt/tritonserver/backends "\$@"
SCRIPT
chmod +x /usr/local/bin/tritonserver
