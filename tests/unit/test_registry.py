"""ftkit.storage.registry and ftkit.levelnames: a registered redundancy level joins the valid
level names (configuration, fault injection) in encode order; bad or duplicate names are
refused."""
from __future__ import annotations

import pytest

from ftkit import levelnames
from ftkit.config import Config, parse_levels
from ftkit.errors import ConfigError
from ftkit.faults import parse_faults
from ftkit.storage import registry


@pytest.fixture
def clean_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    """Registrations made by a test are forgotten after it."""
    monkeypatch.setattr(levelnames, "_REDUNDANCY", list(levelnames._REDUNDANCY))
    monkeypatch.setattr(registry, "_BUILDERS", dict(registry._BUILDERS))


def _never(site: object) -> object:
    raise AssertionError("not built in a unit test")


def test_built_in_levels_in_write_order() -> None:
    assert levelnames.names() == ("local", "partner", "xor", "rs", "pfs")
    assert levelnames.redundancy() == ("partner", "xor", "rs")
    assert all(callable(registry.builder(name)) for name in levelnames.redundancy())


def test_a_registered_level_is_configured_and_ordered(clean_registry: None) -> None:
    with pytest.raises(ConfigError, match="unknown level 'mirror'"):
        parse_levels("local:1,mirror:2")
    registry.register("mirror", _never)       # type: ignore[arg-type]
    assert levelnames.names() == ("local", "partner", "xor", "rs", "mirror", "pfs")
    config = Config(levels=parse_levels("pfs:4,mirror:2,local:1,partner:1"))
    assert config.levels_due(4) == ("local", "partner", "mirror", "pfs")
    assert parse_faults("corrupt:level=mirror:step=2")[0].level == "mirror"
    with pytest.raises(ConfigError, match="'mirror' needs the 'local' level"):
        Config(levels=parse_levels("mirror:1"))


def test_bad_or_duplicate_names_are_refused(clean_registry: None) -> None:
    for bad in ("local", "pfs", "Mirror", "a-b", "", "x" * 33):
        with pytest.raises(ValueError, match="level name"):
            registry.register(bad, _never)    # type: ignore[arg-type]
    with pytest.raises(ValueError, match="'xor' is registered already"):
        registry.register("xor", _never)      # type: ignore[arg-type]
    with pytest.raises(KeyError, match="no redundancy level 'nope'.*registered: partner, xor"):
        registry.builder("nope")
