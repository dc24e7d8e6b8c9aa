"""Every default a document states for an ``LCC_*`` knob equals ``config.py``'s.

Three places state defaults: README's knob table (``| `LCC_X` | `default` | ...``), the flag
tables of docs/launcher.md (``| `--flag V` | `LCC_X` | default | ...``, in the flag's unit) and
prose in README.md and docs/*.md (```LCC_X`` ... (default 600 s)``, ``defaults to 1``,
```LCC_X`` (600 s by default)``, ```LCC_X=auto`` (the default)``). A document that says
something else fails here, naming the file and line.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from lightcc.common.config import KNOBS
from lightcc.runner.args import KNOB_FLAGS, default_text

REPO = Path(__file__).resolve().parents[2]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
KNOB = {k.env: k for k in KNOBS}

_PROSE = (
    # `LCC_X` ... default V / defaults to V / default is V (no other knob in between)
    re.compile(r"`(LCC_[A-Z0-9_]+)`(?:(?!LCC_)[^|])*?\bdefaults?(?: to| is)? `?"
               r"(\d{1,3}(?:[ , ]\d{3})+\b|\d+(?:\.\d+)?|[a-z]+)\b"),
    # `LCC_X` (V unit by default)
    re.compile(r"`(LCC_[A-Z0-9_]+)` \((\d[\d.]*)[^)]*? by default\)"),
    # `LCC_X=V` (the default)
    re.compile(r"`(LCC_[A-Z0-9_]+)=([\w.]+)` \(the default\)"),
)
_WORDS_NOT_VALUES = {"the", "a", "an", "and", "when", "it", "this", "for", "of", "with",
                     "one", "never", "no", "not", "on", "in"}


def _same(stated: str, default) -> bool:
    stated = stated.replace(" ", "").replace(" ", "").replace(",", "")
    if isinstance(default, bool):
        return stated.lower() in (("1", "true", "on") if default else ("0", "false", "off"))
    if isinstance(default, (int, float)):
        try:
            return float(stated) == float(default)
        except ValueError:
            return False
    return stated.lower() == str(default).lower()


def _prose_claims() -> list[tuple[str, str, str]]:
    """(where, knob, stated default) for every default stated in prose."""
    claims = []
    for path in DOCS:
        for number, line in enumerate(path.read_text().splitlines(), start=1):
            for pattern in _PROSE:
                for m in pattern.finditer(line):
                    env, value = m.group(1), m.group(2).strip()
                    if env in KNOB and value.lower() not in _WORDS_NOT_VALUES:
                        claims.append((f"{path.name}:{number}", env, value))
    return claims


def test_the_prose_patterns_find_claims():
    """The test sees the stated defaults it is meant to check (not an empty pass)."""
    found = {(env, value) for _, env, value in _prose_claims()}
    assert ("LCC_ELASTIC_TIMEOUT", "600") in found
    assert ("LCC_MIN_COMPRESS_BYTES", "4096") in found
    assert ("LCC_STALL_SHUTDOWN_TIME", "600") in found


@pytest.mark.parametrize("where,env,value", _prose_claims(),
                         ids=lambda x: x if isinstance(x, str) else "")
def test_prose_default_matches_config(where, env, value):
    assert _same(value, KNOB[env].default), \
        f"{where} says {env} defaults to {value}; config.py says {KNOB[env].default!r}"


def test_readme_table_defaults_match_config():
    rows = re.findall(r"^\| `(LCC_[A-Z0-9_]+)` \| `([^`]*)` \|", (REPO / "README.md").read_text(),
                      flags=re.M)
    assert len(rows) >= len(KNOBS) - 5, "README's knob table was not found"
    wrong = [(env, shown, repr(KNOB[env].default)) for env, shown in rows
             if env in KNOB and shown != repr(KNOB[env].default)]
    assert not wrong, f"README table defaults differ from config.py: {wrong}"


def test_launcher_flag_table_defaults_match_config():
    text = (REPO / "docs" / "launcher.md").read_text()
    checked = 0
    for kf in KNOB_FLAGS:
        m = re.search(rf"^\| `{re.escape(kf.flag)}[^`]*` \| `{kf.env}`[^|]*\| ([^|]+) \|", text,
                      flags=re.M)
        assert m, f"docs/launcher.md has no table row for {kf.flag}"
        assert m.group(1).strip() == default_text(kf), \
            f"docs/launcher.md gives {kf.flag} a default of {m.group(1).strip()!r}; " \
            f"config.py's is {default_text(kf)!r}"
        checked += 1
    assert checked == len(KNOB_FLAGS)
