"""Where the tests find the repository's files, whatever folder a test lives in."""

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
