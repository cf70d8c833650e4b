"""One source of configuration: every RIVERBED_* variable is a Settings field, and every value
outside a field's declared type is one sentence naming the variable."""

from __future__ import annotations

import msgspec
import msgspec.inspect
import pytest

from riverbed.errors import ConfigError
from riverbed.settings import Settings, default_services_dir


def _fields() -> list[msgspec.inspect.Field]:
    info = msgspec.inspect.type_info(Settings)
    assert isinstance(info, msgspec.inspect.StructType)
    return list(info.fields)


def _bad_values(declared: msgspec.inspect.Type) -> list[str]:
    """Values a field of this type must refuse."""
    if isinstance(declared, msgspec.inspect.UnionType):
        (kind,) = [t for t in declared.types if not isinstance(t, msgspec.inspect.NoneType)]
        return _bad_values(kind)
    if isinstance(declared, msgspec.inspect.LiteralType):
        return ["not-one-of-them"]
    if isinstance(declared, msgspec.inspect.IntType | msgspec.inspect.FloatType):
        bad = ["abc"]
        if declared.ge is not None:
            bad.append(str(declared.ge - 1))
        if declared.gt is not None:
            bad.append(str(declared.gt))
        if declared.le is not None:
            bad.append(str(declared.le + 1))
        return bad
    if isinstance(declared, msgspec.inspect.BoolType):
        return ["maybe"]
    if isinstance(declared, msgspec.inspect.StrType) and declared.pattern:
        return ["Not Valid!"]
    return []


CASES = [(field.name, bad) for field in _fields() for bad in _bad_values(field.type)]


def test_the_declared_types_bound_the_settings_that_have_bounds() -> None:
    bounded = {name for name, _ in CASES}
    assert {
        "concurrency",
        "lease_seconds",
        "sandbox",
        "sandbox_network",
        "prefix",
        "serve_port",
        "log_level",
    } <= bounded


@pytest.mark.parametrize(("field", "bad"), CASES)
def test_a_value_outside_its_type_is_one_sentence_naming_the_variable(field: str, bad: str) -> None:
    variable = Settings.variable(field)
    with pytest.raises(ConfigError) as refused:
        Settings.from_env({variable: bad})
    message = str(refused.value)
    assert message.startswith(f"{variable}={bad!r} is not valid: "), message
    assert "\n" not in message
    assert "Expected" not in message  # said in words, not in msgspec's


def test_one_setting_is_read_as_all_of_them_are() -> None:
    assert Settings.one("log_level", {"RIVERBED_LOG_LEVEL": "DEBUG", "RIVERBED_CONCURRENCY": "abc"}) == "debug"
    assert Settings.one("serve_port", {}) == 8300
    with pytest.raises(ConfigError, match="RIVERBED_DEBUG='maybe' is not valid"):
        Settings.one("debug", {"RIVERBED_DEBUG": "maybe"})


def test_each_python_environment_keeps_its_own_embedded_services() -> None:
    one, other = default_services_dir("/srv/a/.venv"), default_services_dir("/srv/b/.venv")
    assert one != other  # two checkouts never share, or stop, each other's services
    assert default_services_dir("/srv/a/.venv") == one
    assert Settings.from_env({}).services_dir == str(default_services_dir())
