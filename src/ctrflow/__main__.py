"""`python -m ctrflow <step>`."""

import sys

from ctrflow.cli import main

sys.exit(main())
