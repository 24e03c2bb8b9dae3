"""MkDocs hook: the parts of the site that are read from the repository at build time.

- The CLI reference (`cli.md`) is filled from the `kvpp` argparse parser itself, so it cannot drift
  from the code.
- A page may link or embed a repository file outside `docs/` (a plot or a results file under
  `bench/results/`) by its relative path, which also works when GitHub renders the page; the hook
  serves a copy of each such file at the same repository path on the site, so no copy is committed.
- Every plot in `bench/results/` must be embedded in some page: a new plot nobody shows fails the
  strict build.
"""

from __future__ import annotations

import argparse
import logging
import os
import posixpath
import re
import sys
from contextlib import contextmanager
from pathlib import Path

from mkdocs.exceptions import PluginError
from mkdocs.structure.files import File

# Under the `mkdocs` logger, so `mkdocs build --strict` counts its warnings as errors.
log = logging.getLogger("mkdocs.hooks.kvpp_docs")

CLI_PAGE = "cli.md"
CLI_MARKER = "<!-- kvpp-cli-reference -->"
PLOTS_DIR = "bench/results"
HELP_COLUMNS = "100"

# An inline Markdown link or image target: ](target) or ](target "title").
_LINK = re.compile(r'(\]\()([^)\s]+)((?:\s+"[^"]*")?\))')
_IMAGE = re.compile(r'!\[[^\]]*\]\(([^)\s]+)')


def _dirs(config) -> tuple[Path, Path]:
    """The repository root (where mkdocs.yml is) and the docs folder, both absolute."""
    return Path(os.path.abspath(config.config_file_path)).parent, Path(os.path.abspath(config.docs_dir))


@contextmanager
def _help_width():
    """argparse wraps help at the terminal's width; fix it so every build writes the same page."""
    old = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = HELP_COLUMNS
    try:
        yield
    finally:
        if old is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = old


def _subcommands(parser):
    """(summary, parser) of each subcommand of `parser`, in the order they were added."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            summaries = {choice.dest: choice.help for choice in action._choices_actions}
            for name, sub in action.choices.items():
                yield summaries.get(name) or "", sub


def _command_sections(parser, level: int) -> list[str]:
    lines = []
    for summary, sub in _subcommands(parser):
        lines += [f"{'#' * level} `{sub.prog}`", ""]
        if summary:
            lines += [summary[0].upper() + summary[1:] + ".", ""]
        lines += ["```text", sub.format_help().rstrip(), "```", ""]
        lines += _command_sections(sub, level + 1)
    return lines


def cli_reference(root: Path) -> str:
    """The help of `kvpp` and of every subcommand, read from `deploy.cli.main.build_parser()`."""
    # Document the checkout being built, whichever copy of the package an environment installed.
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    from deploy.cli.main import build_parser

    with _help_width():
        parser = build_parser()
        lines = ["## `kvpp`", "", "```text", parser.format_help().rstrip(), "```", ""]
        lines += _command_sections(parser, 3)
    return "\n".join(lines)


def _outside_target(root: Path, docs_dir: Path, page_uri: str, target: str) -> str | None:
    """The repository path a page's link target names when it leaves `docs/`, else None."""
    if target.startswith(("#", "/")) or re.match(r"^[a-z][a-z0-9+.-]*:", target):
        return None
    path = target.split("#", 1)[0]
    if not path:
        return None
    resolved = os.path.normpath(docs_dir / posixpath.dirname(page_uri) / path)
    if os.path.commonpath([resolved, str(docs_dir)]) == str(docs_dir):
        return None
    rel = os.path.relpath(resolved, root)
    return None if rel.startswith("..") else Path(rel).as_posix()


def on_files(files, config):
    """Serve each repository file a page links outside `docs/` at its repository path."""
    root, docs_dir = _dirs(config)
    linked, embedded = set(), set()
    for page in files.documentation_pages():
        text = Path(page.abs_src_path).read_text(encoding="utf-8")
        for match in _LINK.finditer(text):
            rel = _outside_target(root, docs_dir, page.src_uri, match.group(2))
            if rel and (root / rel).is_file():
                linked.add(rel)
        embedded.update(_outside_target(root, docs_dir, page.src_uri, src) for src in _IMAGE.findall(text))
    for rel in sorted(linked):
        if files.get_file_from_path(rel) is None:
            files.append(File.generated(config, rel, abs_src_path=str(root / rel)))
    for plot in sorted((root / PLOTS_DIR).glob("*.png")):
        rel = plot.relative_to(root).as_posix()
        if rel not in embedded:
            log.warning("%s is embedded in no page: show it (see docs/performance.md)", rel)
    return files


def on_page_markdown(markdown, page, config, files):
    """Point links that leave `docs/` at the served copies; fill the CLI reference."""
    root, docs_dir = _dirs(config)
    page_dir = posixpath.dirname(page.file.src_uri)

    def relink(match):
        rel = _outside_target(root, docs_dir, page.file.src_uri, match.group(2))
        if rel is None or files.get_file_from_path(rel) is None:
            return match.group(0)
        fragment = match.group(2)[len(match.group(2).split("#", 1)[0]):]
        return match.group(1) + posixpath.relpath(rel, page_dir or ".") + fragment + match.group(3)

    markdown = _LINK.sub(relink, markdown)
    if page.file.src_uri == CLI_PAGE:
        if CLI_MARKER not in markdown:
            raise PluginError(f"{CLI_PAGE} lost its marker {CLI_MARKER}: the CLI reference has no place")
        markdown = markdown.replace(CLI_MARKER, cli_reference(root))
    return markdown
