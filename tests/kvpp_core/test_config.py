"""additional_config parsing: every accepted form and every refusal message."""

import pytest

from kvpp_core.config import KvppConfig, KvppConfigError, parse_additional_config

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    "value, enabled",
    [(True, True), (False, False), ("true", True), ("TRUE", True), (" False ", False), ("fAlSe", False)],
)
def test_enable_accepts_bool_and_case_insensitive_strings(value, enabled):
    assert parse_additional_config({"enable_kvpp": value}).enabled is enabled


def test_defaults_and_foreign_keys():
    """A mode not named is None: where it runs decides (kvpp_core.modes), not the parser."""
    assert parse_additional_config(None) == KvppConfig(enabled=False, staging_buffers=None)
    assert parse_additional_config({"enable_kvpp": True, "kvpp_staging_buffers": 2}).staging_buffers == 2
    assert parse_additional_config({"ascend_scheduler_config": {}, "other": 1}) == KvppConfig()


@pytest.mark.parametrize("value", ["yes", 1, 0, None, "", "on"])
def test_enable_refuses_other_values(value):
    with pytest.raises(KvppConfigError) as err:
        parse_additional_config({"enable_kvpp": value})
    msg = str(err.value)
    assert "additional_config.enable_kvpp must be true or false" in msg
    assert repr(value) in msg
    assert '\'{"enable_kvpp": true}\'' in msg


def test_legacy_kvpp_size_is_refused_with_replacement():
    with pytest.raises(KvppConfigError) as err:
        parse_additional_config({"enable_kvpp": True, "kvpp_size": 8})
    msg = str(err.value)
    assert "kvpp_size is not supported" in msg and "remove kvpp_size" in msg and '{"enable_kvpp": true}' in msg


def test_unknown_kvpp_keys_are_named():
    with pytest.raises(KvppConfigError) as err:
        parse_additional_config({"enable_kvpp": True, "kvpp_granularity": 1, "kvpp_broadcast": "x"})
    msg = str(err.value)
    assert "unknown KVPP option(s) kvpp_broadcast, kvpp_granularity" in msg
    assert "enable_kvpp and kvpp_staging_buffers" in msg


@pytest.mark.parametrize("value", [0, 1, 2, 3])
def test_staging_range(value):
    cfg = parse_additional_config({"enable_kvpp": True, "kvpp_staging_buffers": value})
    assert cfg.staging_buffers == value


@pytest.mark.parametrize("value", [4, -1, True, "2", 2.0])
def test_staging_refused(value):
    with pytest.raises(KvppConfigError) as err:
        parse_additional_config({"kvpp_staging_buffers": value})
    msg = str(err.value)
    assert "kvpp_staging_buffers must be an integer from 0 to 3" in msg and "0 copies nothing" in msg and repr(value) in msg


def test_config_error_is_a_value_error():
    assert issubclass(KvppConfigError, ValueError)


# ---- parse_struct: the one reading of a connector's settings -----------------------------------------
def _struct():
    from typing import Annotated, Literal

    import msgspec

    class Opts(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
        mode: Literal["fast", "safe"]
        port: Annotated[int, msgspec.Meta(ge=1, le=65535)] = 80
        verbose: bool = False

    return Opts


@pytest.mark.parametrize("value, parsed", [(True, True), ("TRUE", True), (" false ", False)])
def test_struct_flags_use_the_one_bool_parser(value, parsed):
    from kvpp_core.config import parse_bool, parse_struct

    assert parse_struct({"mode": "fast", "verbose": value}, _struct(), "x").value.verbose is parsed
    assert parse_bool(value) is parsed
    assert parse_bool("yes") is None and parse_bool(1) is None


def test_struct_reports_every_problem_with_its_option():
    from kvpp_core.config import parse_struct

    parsed = parse_struct({"mdoe": "fast", "port": 0, "verbose": "yes", "bogus": 1}, _struct(), "x", {"mode": "pick one"})
    assert parsed.value is None and parsed.given == {}
    assert parsed.problems == [
        ("x.mdoe", "unknown option; did you mean mode? valid options: mode, port, verbose"),
        ("x.bogus", "unknown option; valid options: mode, port, verbose"),
        ("x.mode", "is required; pick one"),
        ("x.port", "Expected `int` >= 1, got 0"),
        ("x.verbose", 'must be true or false (a JSON bool, or the string "true"/"false"), got \'yes\''),
    ]
    bad_choice = parse_struct({"mode": "turbo", "port": "80"}, _struct(), "x")
    assert bad_choice.problems == [("x.mode", "must be one of fast, safe, got 'turbo'"),
                                   ("x.port", "Expected `int`, got `str` ('80')")]


def test_struct_groups_are_read_the_same_way_under_their_own_path():
    from typing import Annotated

    import msgspec

    from kvpp_core.config import parse_struct

    class Group(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
        size: Annotated[int, msgspec.Meta(ge=0)] | None = None
        on: bool = False

    class Outer(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
        name: str
        group: Group | None = None

    good = parse_struct({"name": "x", "group": {"size": 3, "on": "TRUE"}}, Outer, "w")
    assert good.value == Outer(name="x", group=Group(size=3, on=True)) and not good.problems
    bad = parse_struct({"name": 1, "group": {"sise": 3, "size": -1, "on": "yes"}}, Outer, "w",
                       {"group.size": "a count of things"})
    assert bad.value is None
    problems = dict(bad.problems)
    assert list(problems) == ["w.name", "w.group.sise", "w.group.size", "w.group.on"]  # every one at once
    assert problems["w.group.sise"].startswith("unknown option; did you mean size?")
    assert problems["w.group.size"].endswith("; a count of things")
    assert "must be true or false" in problems["w.group.on"]
    assert "Expected `object | null`" in dict(parse_struct({"name": "x", "group": 5}, Outer, "w").problems)["w.group"]
