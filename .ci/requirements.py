"""Print the requirements of pyproject.toml's dependencies and the named extras, the
project's own extras (`flaxattn[a,b]`) expanded, one per line: what `pip install -e
".[EXTRAS]"` installs besides the project, for an install that builds nothing in the tree.

  python3 .ci/requirements.py aot train pytest
"""

import pathlib
import re
import sys
import tomllib

project = tomllib.loads((pathlib.Path(__file__).parents[1] / "pyproject.toml").read_text())
name, extras = project["project"]["name"], project["project"]["optional-dependencies"]


def expand(requirements: list[str], seen: set[str]) -> list[str]:
  out = []
  for r in requirements:
    own = re.fullmatch(rf"{name}\[([^\]]+)\]", r.strip())
    if not own:
      out.append(r)
      continue
    for extra in own.group(1).split(","):
      if extra.strip() not in seen:
        seen.add(extra.strip())
        out += expand(extras[extra.strip()], seen)
  return out


wanted = sys.argv[1:]
unknown = [e for e in wanted if e not in extras]
if unknown:
  sys.exit(f"no extra {unknown} in pyproject.toml (it has {sorted(extras)})")
print("\n".join(dict.fromkeys(expand(project["project"]["dependencies"]
                                     + [f"{name}[{','.join(wanted)}]"], set()))))
