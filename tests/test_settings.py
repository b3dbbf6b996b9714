"""gdnviz.settings: the one table of environment variables and its parsing rule."""
import re
from pathlib import Path

import pytest

from gdnviz import settings
from gdnviz.errors import BadSetting

PKG = Path(__file__).resolve().parent.parent / "gdnviz"


def test_package_reads_environment_only_through_settings():
    """No module but gdnviz/settings.py reads a GDNVIZ_* variable from the environment."""
    offenders = []
    for path in PKG.rglob("*.py"):
        if path.name == "settings.py":
            continue
        for i, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(r"os\.environ|getenv", line) and "GDNVIZ_" in line:
                offenders.append(f"{path.relative_to(PKG.parent)}:{i}: {line.strip()}")
    assert not offenders, "\n".join(offenders)


def test_every_named_setting_is_in_the_table():
    """Every GDNVIZ_* name the package's Python code mentions is a row of the table (docstrings included), so a
    reader never meets a switch that does not exist; the preprocessor macros of the package's CUDA sources (builds
    of a kernel, not environment variables) are the only other GDNVIZ_* names."""
    names, macros = set(), set()
    for path in PKG.rglob("*.py"):
        names |= set(re.findall(r"GDNVIZ_[A-Z0-9_]*[A-Z0-9]", path.read_text()))
    for path in PKG.rglob("*.cu"):
        macros |= set(re.findall(r"#\s*(?:ifdef|ifndef|define|if defined\()\s*(GDNVIZ_[A-Z0-9_]+)", path.read_text()))
    assert names - macros <= set(settings.SETTINGS), sorted(names - macros - set(settings.SETTINGS))
    assert len(settings.SETTINGS) <= 13


def test_defaults(monkeypatch):
    for name in settings.SETTINGS:
        monkeypatch.delenv(name, raising=False)
    assert settings.get("GDNVIZ_DEFAULT_MODEL") == "demo"
    assert settings.get("GDNVIZ_CACHE_DIR") is None
    assert settings.get("GDNVIZ_MEMO_GB") == 20.0
    assert settings.get("GDNVIZ_MAX_TOKENS") == 32768
    assert settings.get("GDNVIZ_KERNEL_CACHE") is None
    assert settings.get("GDNVIZ_WARMUP") is True
    assert settings.get("GDNVIZ_NO_WORKER") is False
    assert settings.get("GDNVIZ_TEST_CRASH") == 0


@pytest.mark.parametrize("value, expected", [("1", True), ("yes", True), ("ON", True), ("0", False),
                                             ("false", False), (" no ", False), ("", True)])
def test_flags(monkeypatch, value, expected):
    monkeypatch.setenv("GDNVIZ_WARMUP", value)
    assert settings.get("GDNVIZ_WARMUP") is expected


def test_path_or_off(monkeypatch, tmp_path):
    monkeypatch.setenv("GDNVIZ_KERNEL_CACHE", "0")
    assert settings.get("GDNVIZ_KERNEL_CACHE") is False
    monkeypatch.setenv("GDNVIZ_KERNEL_CACHE", str(tmp_path))
    assert settings.get("GDNVIZ_KERNEL_CACHE") == tmp_path


@pytest.mark.parametrize("name, value", [("GDNVIZ_MAX_TOKENS", "abc"), ("GDNVIZ_MAX_TOKENS", "0"),
                                         ("GDNVIZ_MAX_TOKENS", "2.5"), ("GDNVIZ_MEMO_GB", "-1"),
                                         ("GDNVIZ_WARMUP", "maybe"), ("GDNVIZ_POLL_SECONDS", "fast")])
def test_bad_values_raise_naming_the_variable(monkeypatch, name, value):
    monkeypatch.setenv(name, value)
    with pytest.raises(BadSetting, match=name):
        settings.get(name)


def test_unknown_name():
    with pytest.raises(KeyError):
        settings.get("GDNVIZ_NOT_A_SETTING")


def test_every_setting_is_documented():
    """User settings are in the README's table, developer settings in docs/settings.md."""
    root = PKG.parent
    docs = {"user": (root / "README.md").read_text(), "developer": (root / "docs" / "settings.md").read_text()}
    for s in settings.table():
        assert f"| `{s.name}` |" in docs[s.audience], (s.name, s.audience)
