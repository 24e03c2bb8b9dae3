"""Argument types of the `kvpp` command: each refuses a bad value at parse time with one line naming
the accepted range (deploy.bounds holds the ceilings), so no subcommand meets NaN, an out-of-range port or
a 10**30-rank topology.
"""

from __future__ import annotations

import argparse
import math
import unicodedata
from collections.abc import Callable
from pathlib import Path
from urllib.parse import urlsplit

from kvpp_core.config import shown

from connectors.common.hosts import host_problem

from deploy.bounds import MAX_IN_FLIGHT, MAX_PARALLEL, MAX_SECONDS


def bounded_int(low: int, high: int) -> Callable[[str], int]:
    """An integer in [low, high]."""

    def parse(text: str) -> int:
        try:
            value = int(text, 10)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer from {low} to {high}, got {shown(text)}") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"expected an integer from {low} to {high}, got {value}")
        return value

    parse.__name__ = "integer"
    return parse


def bounded_float(low: float, high: float, low_inclusive: bool = False) -> Callable[[str], float]:
    """A finite number in (low, high] (or [low, high]); NaN and infinities are refused."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        above = value >= low if low_inclusive else value > low
        if not (math.isfinite(value) and above and value <= high):
            bracket = "[" if low_inclusive else "("
            raise argparse.ArgumentTypeError(
                f"expected a number in {bracket}{_num(low)}, {_num(high)}], got {shown(text)}")
        return value

    parse.__name__ = "number"
    return parse


def printable(text: str) -> str:
    """`text` with control and other unprintable characters escaped, so a message stays one line."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def _num(x: float) -> str:
    return str(int(x)) if x.is_integer() else f"{x:g}"


port = bounded_int(1, 65535)
parallel_size = bounded_int(1, MAX_PARALLEL)
seconds = bounded_float(0.0, MAX_SECONDS)
in_flight = bounded_int(1, MAX_IN_FLIGHT)


def host(text: str) -> str:
    problem = host_problem(text)
    if problem:
        raise argparse.ArgumentTypeError(problem)
    return text


def url_problem(url: str) -> str | None:
    """Why `url` is not an http(s) base URL with a valid host and port, or None."""
    if any(c.isspace() or not c.isprintable() for c in url):
        return f"{shown(url)} contains whitespace or control characters"
    try:
        parts = urlsplit(url)
        parsed_port = parts.port
    except ValueError as exc:
        return f"{shown(url)} is not a valid URL ({exc})"
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return f"{shown(url)} is not an http(s) URL; write e.g. http://127.0.0.1:8100"
    if parsed_port == 0:
        return f"{shown(url)}: port must be from 1 to 65535"
    problem = host_problem(parts.hostname)
    return f"{shown(url)}: host {problem}" if problem else None


def url_list(text: str) -> str:
    """Comma-separated http(s) base URLs; returned unchanged once every one is valid."""
    urls = [u.strip() for u in text.split(",") if u.strip()]
    if not urls:
        raise argparse.ArgumentTypeError("needs at least one http(s) URL")
    for url in urls:
        problem = url_problem(url)
        if problem:
            raise argparse.ArgumentTypeError(problem)
    return text


def zmq_endpoint(text: str) -> str:
    """A ZMQ endpoint to connect to: tcp://HOST:PORT (a bracketed IPv6 host too) or ipc://PATH."""
    if text.startswith("ipc://"):
        path_text(text[len("ipc://"):])
        return text
    try:
        parts = urlsplit(text)
        parsed_port = parts.port
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{shown(text)} is not a valid endpoint ({exc})") from None
    if parts.scheme != "tcp" or not parts.hostname or not parsed_port or parts.path:
        raise argparse.ArgumentTypeError(f"{shown(text)} is not a ZMQ endpoint; write e.g. tcp://127.0.0.1:5557")
    problem = host_problem(parts.hostname)
    if problem:
        raise argparse.ArgumentTypeError(f"{shown(text)}: host {problem}")
    return text


def value_list(item: Callable[[str], float], what: str, max_items: int) -> Callable[[str], tuple]:
    """Comma-separated values, each parsed by `item`, at most `max_items` of them; `what` describes
    the expected text for the error (e.g. "comma-separated integers like 38,40")."""

    def parse(text: str) -> tuple:
        parts = text.split(",")
        if len(parts) > max_items:
            raise argparse.ArgumentTypeError(f"takes at most {max_items} comma-separated values, got {len(parts)}")
        try:
            return tuple(item(part.strip()) for part in parts)
        except argparse.ArgumentTypeError as exc:
            raise argparse.ArgumentTypeError(f"takes {what}: {exc}") from None

    parse.__name__ = "list"
    return parse


def path_text(text: str) -> str:
    """A file system path: non-empty and free of control characters (NUL reaches no system call; a
    newline in a path is a typo far more often than a name)."""
    if not text or any(unicodedata.category(c) == "Cc" for c in text):
        raise argparse.ArgumentTypeError(f"{shown(text)} is not a usable path (empty, or has control characters)")
    return text


def path(text: str) -> Path:
    return Path(path_text(text))


IMAGE_FORMATS = ("png", "svg", "pdf")


def image_path(text: str) -> str:
    """A path for a plot: a usable path ending in one of IMAGE_FORMATS."""
    path = path_text(text)
    if path.rsplit(".", 1)[-1].lower() not in IMAGE_FORMATS:
        raise argparse.ArgumentTypeError(f"{text!r}: the plot file must end in .{', .'.join(IMAGE_FORMATS)}")
    return path
