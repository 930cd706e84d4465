"""Every repository path the docs name exists, and every ``path::test`` names a test there:
a renamed module or test fails here, not in a reader's shell."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
_PATH = re.compile(r"(?<![\w/.-])((?:tests|mixedpolicy|docs|examples|tools|\.ci)/[\w./-]*\w)(?:::(\w+))?")
#: docs/contributing.md walks through adding a backend that does not exist (MLX)
_HYPOTHETICAL = "mlx"


def test_every_path_the_docs_name_exists():
    missing = []
    for doc in [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for m in _PATH.finditer(doc.read_text()):
            path, test = m.group(1), m.group(2)
            if _HYPOTHETICAL in path:
                continue
            target = ROOT / path
            if not target.exists():
                missing.append(f"{doc.name}: {path}")
            elif test and not re.search(rf"def {test}\b", target.read_text()):
                missing.append(f"{doc.name}: {path}::{test}")
    assert not missing, "paths in the docs that do not exist:\n" + "\n".join(missing)
