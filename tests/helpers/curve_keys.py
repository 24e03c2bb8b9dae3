"""Loading the CURVE key pairs of the `keys` fixture (tests/connectors/mooncake/conftest.py)."""

from __future__ import annotations

from connectors.mooncake.curve import load_curve


def load(keys_dir, name):
    return load_curve(str(keys_dir / f"{name}.key_secret"), str(keys_dir / "trusted"))
