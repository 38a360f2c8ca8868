"""Application configuration: built-in defaults plus user overrides."""

import copy

DEFAULTS = {
    "server": {"host": "127.0.0.1", "port": 8080, "tls": {"enabled": False}},
    "log": {"level": "info", "format": "text"},
    "workers": 4,
}


def deep_update(target, source):
    """Recursively merge source into target, in place, and return target.

    Nested dicts are merged key by key; any other value in source replaces
    the one in target.
    """
    for key, value in source.items():
        if isinstance(value, dict) and isinstance(target.get(key), dict):
            deep_update(target[key], value)
        else:
            target[key] = value
    return target


def parse_pairs(pairs):
    """Turn ["server.port=9000", "log.level=debug"] into a nested dict.

    Values that look like integers or booleans are converted.
    """
    result = {}
    for pair in pairs:
        path, sep, raw = pair.partition("=")
        if not sep or not path:
            raise ValueError(f"expected dotted.key=value, got {pair!r}")
        keys = path.split(".")
        node = result
        for key in keys[:-1]:
            node = node.setdefault(key, {})
        node[keys[-1]] = _coerce(raw)
    return result


def _coerce(raw):
    if raw.lower() in ("true", "false"):
        return raw.lower() == "true"
    try:
        return int(raw)
    except ValueError:
        return raw


def load(overrides=None):
    """Return the effective configuration: DEFAULTS with overrides applied.

    The returned dict belongs to the caller; DEFAULTS is never modified.
    """
    config = copy.deepcopy(DEFAULTS)
    if overrides:
        deep_update(config, overrides)
    return config
