"""Keep pandas out of a preprocessing process whose dataset never uses it.

pyarrow imports pandas the first time it converts numpy data or Python values (to tell pandas objects
apart, and for pandas' missing-value markers): ~0.4 CPU-s, paid in the main process before the workers
fork, while the cores wait. A described table's passes never hand pyarrow a pandas object, so the
`ctrflow preprocess` command runs them with pandas unimportable (`pandas_unavailable`), and pyarrow
works as it does where pandas is not installed. Criteo's passes use pandas themselves (its hash
lookup), so they import it as before.
"""

from __future__ import annotations

import sys
from contextlib import contextmanager
from typing import Iterator


class _RefusePandas:
    """An import finder (`sys.meta_path`) that answers every import of pandas with ModuleNotFoundError."""

    def find_spec(self, name, path=None, target=None):
        """Refuse `pandas` and its submodules; leave every other module to the other finders."""
        if name == "pandas" or name.startswith("pandas."):
            raise ModuleNotFoundError("pandas is kept out of this preprocessing process", name=name)
        return None


@contextmanager
def pandas_unavailable() -> Iterator[None]:
    """Within the block (and in processes forked in it), `import pandas` fails; nothing changes where
    pandas is already imported. Afterwards pyarrow keeps taking this process as one without pandas,
    except where it needs pandas itself (`to_pandas`): use it in a process that ends after the step."""
    if "pandas" in sys.modules:
        yield
        return
    finder = _RefusePandas()
    sys.meta_path.insert(0, finder)
    try:
        yield
    finally:
        sys.meta_path.remove(finder)
