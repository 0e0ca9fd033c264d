"""Loading the tracker's settings: a TOML file named on the command line, and a warning for
every ``KMQ_*`` environment variable that sets nothing.

Apart from the declarations (:mod:`tracker.settings`) because this is what the process's
factory and the CLI call, once, and what turns a bad file into a one-line error.
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tracker.settings import CONFIG_FILE_ENV, TrackerSettings


def load_settings(config_file: str | Path | None = None, **overrides: Any) -> TrackerSettings:
    """Build the settings from the environment, ``config_file`` (TOML) and ``overrides``.

    Raises ``pydantic.ValidationError`` or ``ConfigFileError`` with a readable message.
    """
    if config_file is not None:
        path = Path(config_file)
        if not path.is_file():
            raise ConfigFileError(f"config file {str(path)!r} does not exist")
        previous = os.environ.get(CONFIG_FILE_ENV)
        os.environ[CONFIG_FILE_ENV] = str(path)
        try:
            return TrackerSettings(**overrides)
        finally:
            if previous is None:
                del os.environ[CONFIG_FILE_ENV]
            else:
                os.environ[CONFIG_FILE_ENV] = previous
    return TrackerSettings(**overrides)


#: ``KMQ_*`` variables that are not settings but are read elsewhere (or by the test tooling).
NOT_SETTINGS = frozenset(
    {CONFIG_FILE_ENV, "KMQ_PURE_PYTHON", "KMQ_REQUIRE_SPEEDUPS", "KMQ_SOAK"}
    | {"KMQ_RELIABILITY_FIGURES"}
)


def unknown_environment(environ: Mapping[str, str]) -> list[str]:
    """One warning per ``KMQ_*`` variable that sets nothing (a typo falls back to a default).

    pydantic-settings ignores environment variables that match no field, so a misspelt
    ``KMQ_DATABSE_URL`` would silently leave the tracker on the default SQLite file.
    """
    prefix = "KMQ_"
    known = {prefix + name.upper() for name in TrackerSettings.model_fields}
    warnings = []
    for variable in sorted(environ):
        if not variable.startswith(prefix) or variable in NOT_SETTINGS:
            continue
        if variable in known or variable.split("__", 1)[0] in known:
            continue
        hint = difflib.get_close_matches(variable, known, n=1)
        suggestion = f" (did you mean {hint[0]}?)" if hint else ""
        warnings.append(
            f"environment variable {variable} is not a setting and is ignored{suggestion}"
        )
    return warnings


class ConfigFileError(ValueError):
    """The configuration file cannot be used."""
