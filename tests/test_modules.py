"""docs/design.md's module table matches the tree, and no module imports one listed below it."""

import ast
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("flaxattn", "models", "train")


def _table() -> list[str]:
  """The modules of design.md's "Modules" table, in order, as paths from the root."""
  text = (ROOT / "docs" / "design.md").read_text()
  rows = re.findall(r"^\| `([^`]+)`(?:, `([^`]+)`)? \|", text, re.M)
  return [m if "/" in m else f"flaxattn/{m}" for row in rows for m in row if m]


def _imports(path: pathlib.Path) -> set[str]:
  """The project modules `path` imports, as paths from the root."""
  found = set()
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.ImportFrom) and node.module:
      base = node.module.replace(".", "/")
      if node.module.split(".")[0] not in PACKAGES:
        continue
      if (ROOT / base).is_dir():  # a package: `from train.data import sources`
        found |= {f"{base}/{a.name}.py" for a in node.names}
      else:
        found.add(base + ".py")
    elif isinstance(node, ast.Import):
      found |= {a.name.replace(".", "/") + ".py" for a in node.names
                if a.name.split(".")[0] in PACKAGES}
  return found


def test_design_doc_lists_every_module():
  tree = {str(p.relative_to(ROOT)) for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")
          if not (p.name == "__init__.py" and p.parent != ROOT / "flaxattn")}
  listed = _table()
  assert len(listed) == len(set(listed)), "a module is listed twice"
  assert set(listed) == tree, (f"missing from docs/design.md: {sorted(tree - set(listed))};"
                               f" listed but absent: {sorted(set(listed) - tree)}")


def test_modules_import_only_those_listed_above_them():
  order = {m: i for i, m in enumerate(_table())}
  upward = [(m, dep) for m in order for dep in _imports(ROOT / m)
            if dep in order and order[dep] >= order[m]]
  assert not upward, f"imports of modules listed below (or the module itself): {upward}"
