"""The build's last step: every module of the packages named as arguments imports, and pip finds
every declared requirement installed. An image that lacks a package fails its build here rather than
on a cluster. The only misses allowed are the GPU-only packages (`OPTIONAL`): a CPU base lacks them,
a CUDA PyTorch base brings them."""

import importlib
import pkgutil
import re
import subprocess
import sys

# GPU kernels and the GPU preprocess engine (the `gpu` extra); the python models of an exported
# repository, which import the module Triton provides only inside the server
OPTIONAL = {"triton", "cudf", "cupy", "triton_python_backend_utils"}


def import_all(package: str) -> tuple[int, list[str]]:
    """Import `package` and every module under it; returns how many imported, and the modules
    skipped for a missing GPU-only package."""
    root = importlib.import_module(package)
    # a package's main runs rather than imports; a package's own tests need pytest
    names = [info.name for info in pkgutil.walk_packages(getattr(root, "__path__", []), package + ".")
             if not re.search(r"\.(__main__|conftest|test_\w+|\w+_test)$", info.name)]
    skipped = []
    for name in names:
        try:
            importlib.import_module(name)
        except ModuleNotFoundError as err:
            if (err.name or "").split(".")[0] not in OPTIONAL:
                raise
            skipped.append(name)
    return len(names) + 1 - len(skipped), skipped


def main() -> None:
    """Import every module of sys.argv[1:], then `pip check`."""
    for package in sys.argv[1:]:
        count, skipped = import_all(package)
        print(f"imports ok: {package} ({count} modules)" + (f"; GPU-only, skipped: {', '.join(skipped)}" if skipped else ""))
    subprocess.run([sys.executable, "-m", "pip", "check"], check=True)


if __name__ == "__main__":
    main()
