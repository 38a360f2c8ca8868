"""A small INI-file reader.

Lines are ``key = value`` pairs, ``[section]`` headers, blank lines, or
comments starting with ``#`` or ``;``. Keys that appear before the first
section header belong to the section named "" (the empty string).
"""


class ParseError(ValueError):
    def __init__(self, lineno, message):
        super().__init__(f"line {lineno}: {message}")
        self.lineno = lineno


def parse(text):
    """Parse INI text into a dict of sections, each a dict of key -> value."""
    data = {"": {}}
    section = ""
    for lineno, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line[0] in "#;":
            continue
        if line.startswith("["):
            if not line.endswith("]"):
                raise ParseError(lineno, "unterminated section header")
            section = line[1:-1].strip()
            data.setdefault(section, {})
            continue
        if "=" not in line:
            raise ParseError(lineno, f"expected key = value, got {line!r}")
        key, _, value = line.rpartition("=")
        key = key.strip()
        if not key:
            raise ParseError(lineno, "empty key")
        data[section][key.lower()] = value.strip()
    return data


def get(data, section, key, default=None):
    """Look up section/key, falling back to the "" section, then default."""
    key = key.lower()
    if key in data.get(section, {}):
        return data[section][key]
    return data.get("", {}).get(key, default)
