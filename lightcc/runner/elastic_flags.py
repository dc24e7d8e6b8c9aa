"""lccrun's elastic flags (``--min-np``, ``--max-np``, ``--elastic-timeout``, ``--reset-limit``,
``--blacklist-after``, ``--host-discovery-script``) checked and turned into ``LCC_ELASTIC_*``
values (docs/elastic.md)."""
from __future__ import annotations

import argparse

from ..common.exceptions import ConfigError


def number_text(value: float) -> str:
    """``3`` for 3.0, ``2.5`` for 2.5."""
    return repr(value) if value != int(value) else str(int(value))


def elastic_flags_env(ns: argparse.Namespace, np_: int) -> dict[str, str]:
    """``LCC_ELASTIC_*`` for the elastic flags given (empty: not an elastic job)."""
    given = [f for f, v in (("--min-np", ns.min_np), ("--max-np", ns.max_np),
                            ("--elastic-timeout", ns.elastic_timeout),
                            ("--reset-limit", ns.reset_limit),
                            ("--blacklist-after", ns.blacklist_after),
                            ("--host-discovery-script", ns.host_discovery_script))
             if v is not None]
    if not given:
        return {}
    env = {"LCC_ELASTIC_MIN_NP": str(ns.min_np if ns.min_np is not None else 1)}
    if ns.min_np is not None and not 1 <= ns.min_np <= np_:
        raise ConfigError(f"--min-np {ns.min_np}: must be between 1 and -np ({np_})")
    if ns.max_np is not None and ns.max_np < np_:
        raise ConfigError(f"--max-np {ns.max_np} is below -np {np_} (start the job with at "
                         f"most --max-np ranks)")
    if ns.max_np is not None:
        env["LCC_ELASTIC_MAX_NP"] = str(ns.max_np)
    if not ns.host_discovery_period > 0:
        raise ConfigError(f"--host-discovery-period {number_text(ns.host_discovery_period)}: must be "
                         f"> 0 seconds")
    if ns.elastic_timeout is not None:
        if not ns.elastic_timeout > 0:
            raise ConfigError(f"--elastic-timeout {ns.elastic_timeout}: must be > 0 seconds")
        env["LCC_ELASTIC_TIMEOUT"] = number_text(ns.elastic_timeout)
    if ns.blacklist_after is not None:
        if ns.blacklist_after < 0:
            raise ConfigError(f"--blacklist-after {ns.blacklist_after}: must be >= 0 (0: never)")
        env["LCC_ELASTIC_BLACKLIST_AFTER"] = str(ns.blacklist_after)
    if ns.reset_limit is not None:
        if ns.reset_limit < 0:
            raise ConfigError(f"--reset-limit {ns.reset_limit}: must be >= 0 (0: no limit)")
        env["LCC_ELASTIC_RESET_LIMIT"] = str(ns.reset_limit)
    return env
