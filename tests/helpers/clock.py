"""A clock the test moves by hand."""

from __future__ import annotations


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now
