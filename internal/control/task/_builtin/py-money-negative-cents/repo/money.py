"""Formatting and parsing of money amounts held as integer minor units."""

from decimal import Decimal, InvalidOperation

SYMBOLS = {"USD": "$", "EUR": "€", "GBP": "£"}


def _group(digits, sep):
    """'1234567' -> '1,234,567'."""
    parts = []
    while len(digits) > 3:
        parts.insert(0, digits[-3:])
        digits = digits[:-3]
    parts.insert(0, digits)
    return sep.join(parts)


def format_cents(cents, currency="USD", sep=","):
    """Format an integer number of cents.

    >>> format_cents(123456)
    '$1,234.56'
    >>> format_cents(-250)
    '-$2.50'
    """
    if not isinstance(cents, int):
        raise TypeError("cents must be an int")
    symbol = SYMBOLS.get(currency, currency + " ")
    sign = "-" if cents < 0 else ""
    units, rest = divmod(cents, 100)
    return f"{sign}{symbol}{_group(str(abs(units)), sep)}.{rest:02d}"


def parse_amount(text):
    """Parse '1,234.56', '-0.05' or '$12' into cents. Raises ValueError."""
    cleaned = text.strip().replace(",", "")
    for symbol in SYMBOLS.values():
        cleaned = cleaned.replace(symbol, "")
    try:
        value = Decimal(cleaned)
    except InvalidOperation:
        raise ValueError(f"not an amount: {text!r}") from None
    cents = value * 100
    if cents != cents.to_integral_value():
        raise ValueError(f"more than two decimal places: {text!r}")
    return int(cents)
