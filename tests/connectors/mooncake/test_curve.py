"""CURVE keys: generation, loading with every problem named, and agreement between handle and decode."""

from __future__ import annotations

import os
import stat

import pytest

from connectors.mooncake import messages as m
from connectors.mooncake.curve import CurveConfigError, create_keys, load_curve, server_key
from tests.helpers.curve_keys import load

pytestmark = pytest.mark.unit


def test_keygen_writes_an_owner_only_secret(keys):
    assert stat.S_IMODE(os.stat(keys / "p.key_secret").st_mode) == 0o600
    assert stat.S_IMODE(os.stat(keys / "p.key").st_mode) == 0o644
    with pytest.raises(FileExistsError):
        create_keys(str(keys), "p")
    k = load(keys, "p")
    assert k.public in k.trusted and len(k.trusted) == 2


@pytest.mark.parametrize("secret, directory, fragments", [
    ("p.key_secret", None, ["curve_public_keys_dir is missing"]),
    (None, "trusted", ["curve_secret_key_file is missing"]),
    ("p.key", "trusted", ["holds no secret key"]),
    ("nope.key_secret", "nowhere", ["cannot be read", "is not a directory"]),  # all problems at once
    ("p.key_secret", "empty", ["holds no public certificates"]),
])
def test_curve_settings_errors_name_the_key(keys, secret, directory, fragments):
    (keys / "empty").mkdir()
    with pytest.raises(CurveConfigError) as info:
        load_curve(str(keys / secret) if secret else "", str(keys / directory) if directory else "")
    for fragment in fragments:
        assert fragment in str(info.value)
    assert "python -m connectors.mooncake.curve" in str(info.value)


def test_world_readable_secret_is_refused(keys):
    os.chmod(keys / "p.key_secret", 0o644)
    with pytest.raises(CurveConfigError, match="readable by others.*chmod 600"):
        load(keys, "p")


def test_curve_agreement_between_handle_and_decode(keys):
    d = load(keys, "d")
    p_key = load(keys, "p").public.decode()
    x_key = load_curve(str(keys / "x.key_secret"), str(keys / "trusted")).public.decode()
    assert server_key(None, None) is None and server_key(d, p_key) == p_key.encode()
    for local, advertised, fragment in ((None, p_key, "requires CURVE"), (d, None, "unencrypted"),
                                        (d, x_key, "not among the trusted keys")):
        with pytest.raises(m.MessageError, match=fragment):
            server_key(local, advertised)


def test_curve_keygen_cli(tmp_path, capsys):
    from connectors.mooncake.curve import main

    assert main([str(tmp_path / "k"), "node1"]) == 0
    assert "node1.key" in capsys.readouterr().out
    assert main([str(tmp_path / "k"), "node1"]) == 1
    assert main([]) == 2
