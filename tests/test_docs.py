"""What the README and the docs site name must exist in the checkout.

Both point readers at files (`kvpp_core/capacity.py`, `bench/results/goodput.json`), modules
(`connectors.launch`), test files and test functions. A move or rename that forgets them fails here
instead of leaving a dead pointer. Only tokens that look like this repository's own names are
checked: a path under a known top-level folder (or a known top-level file), a dotted module of one of
its packages, or a `test_*` name; everything else in backticks (vLLM's paths, commands, options) is
left alone. Links are checked wherever they point inside the repository; mkdocs validates the site's
links between pages, but nothing else reads the README's.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parent.parent
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]

PACKAGES = {"kvpp_core", "connectors", "deploy", "bench", "tests"}
# Fixed, so that a folder which disappears is still checked; folders added later are found on disk.
TOP_FOLDERS = PACKAGES | {"docs", ".ci"} | {
    p.name for p in ROOT.iterdir()
    if p.is_dir() and not p.name.startswith(".") and p.name not in {"build", "dist", "site", "__pycache__"}
    and not p.name.endswith(".egg-info")
}
TOP_FILES = {"README.md", "Makefile", "pyproject.toml", "mkdocs.yml"}

_FENCE = re.compile(r"^```.*?^```", re.S | re.M)
_COMMENT = re.compile(r"<!--.*?-->", re.S)
_CODE = re.compile(r"(`+)(.+?)\1", re.S)  # a code span may wrap onto the next line
_LINK = re.compile(r"\]\(([^)\s]+)")
_MODULE = re.compile(r"^(?:%s)(?:\.[A-Za-z_]\w*)+$" % "|".join(sorted(PACKAGES)))
_DEFINED = r"^(?:async\s+def|def|class)\s+{0}\b|^{0}\s*[:=]"


def references(text: str) -> tuple[list[str], list[str]]:
    """(words of inline code spans, link targets) of a Markdown text, code blocks left out."""
    text = _COMMENT.sub("", _FENCE.sub("", text))
    # Surrounding punctuation is not part of a name: `build_parser()` names build_parser.
    words = [word.strip("'\"()[],;:") for span in _CODE.finditer(text) for word in span.group(2).split()]
    return [w for w in words if w], _LINK.findall(text)


def _path_exists(rel: str) -> bool:
    if any(c in rel for c in "*?["):
        return any(ROOT.glob(rel))
    return (ROOT / rel).exists()


def _module_exists(dotted: str) -> bool:
    """A module or package of this repository, or one name defined at a module's top level."""
    parts = dotted.split(".")
    for n in range(len(parts), 1, -1):
        base = ROOT.joinpath(*parts[:n])
        source = base.with_suffix(".py") if base.with_suffix(".py").is_file() else base / "__init__.py"
        if source.is_file():
            rest = parts[n:]
            if not rest:
                return True
            return len(rest) == 1 and re.search(_DEFINED.format(re.escape(rest[0])),
                                                source.read_text(encoding="utf-8"), re.M) is not None
    return False


def _test_names() -> tuple[set[str], set[str]]:
    files, functions = set(), set()
    for path in (ROOT / "tests").rglob("test_*.py"):
        files.add(path.name)
        source = path.read_text(encoding="utf-8")
        functions.update(re.findall(r"^\s*(?:async\s+)?def\s+(test_\w+)", source, re.M))
    return files, functions


TEST_FILES, TEST_FUNCTIONS = _test_names()


def missing_word(word: str) -> bool:
    """Whether a word of inline code names something of this repository that does not exist."""
    if any(c in word for c in "<>{}$=") or word.startswith(("/", "~", "-")):
        return False  # a placeholder, a variable, an option or a path outside the checkout
    if word in TOP_FILES:
        return not (ROOT / word).is_file()
    if "/" in word and word.split("/", 1)[0] in TOP_FOLDERS:
        return not _path_exists(word)
    if _MODULE.match(word):
        return not _module_exists(word)
    if re.fullmatch(r"test_\w+\.py", word):
        return word not in TEST_FILES
    if re.fullmatch(r"test_\w+", word):
        return word not in TEST_FUNCTIONS
    return False


def missing_link(document: Path, target: str) -> bool:
    """Whether a link leads to a path inside the repository that does not exist."""
    if target.startswith("#") or re.match(r"^[a-z][a-z0-9+.-]*:", target):
        return False
    path = target.split("#", 1)[0]
    resolved = (document.parent / path).resolve()
    if not path or not resolved.is_relative_to(ROOT):
        return False
    return not resolved.exists()


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_name_in_the_docs_exists(document):
    words, links = references(document.read_text(encoding="utf-8"))
    missing = sorted({w for w in words if missing_word(w)} | {t for t in links if missing_link(document, t)})
    assert not missing, f"{document.relative_to(ROOT)} names what this checkout lacks: {missing}"


def test_the_checks_report_what_is_missing():
    """A negative control: names that do not exist are reported, real ones and foreign ones are not."""
    words, links = references(
        "`kvpp_core/nothing.py` `bench/results/goodput.json` `connectors.launch` `connectors.nowhere` "
        "`deploy.cli.main.build_parser()` `deploy.cli.main.no_such_function()` `test_no_such_test` "
        "`test_no_such_file.py` `vllm/v1/worker/gpu/attn_utils` `test_<module>_engine.py` "
        "[a](docs/kvpp.md) [b](docs/nothing.md) [c](https://example.org/x)\n"
        "```\n`kvpp_core/ignored_in_a_code_block.py`\n```\n"
    )
    assert sorted(w for w in words if missing_word(w)) == [
        "connectors.nowhere", "deploy.cli.main.no_such_function", "kvpp_core/nothing.py",
        "test_no_such_file.py", "test_no_such_test",
    ]
    assert [t for t in links if missing_link(ROOT / "README.md", t)] == ["docs/nothing.md"]


def test_the_readme_fits_one_screen_and_starts_with_the_two_commands():
    """The README is the newcomer's screen (issue 30): the detail lives in docs/, and CI runs the test
    command the README names."""
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 200, f"README.md has {len(lines)} lines; move detail into docs/"
    head = "\n".join(lines[:30])
    assert "make demo" in head and "make test" in head, "the two commands belong in its first 30 lines"
    assert "make test" in (ROOT / ".ci" / "run").read_text(encoding="utf-8")
