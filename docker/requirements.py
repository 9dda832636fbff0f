"""Print the dependencies pyproject.toml declares (and those of the extras named as arguments), one a
line, so that an image installs them in a layer of their own, before ctrflow's source is copied."""

import sys
import tomllib

project = tomllib.load(open("pyproject.toml", "rb"))["project"]
extras = project.get("optional-dependencies", {})
print("\n".join(project["dependencies"] + [req for name in sys.argv[1:] for req in extras[name]]))
