import unittest

import money


class TestFormat(unittest.TestCase):
    def test_positive_amounts(self):
        self.assertEqual(money.format_cents(0), "$0.00")
        self.assertEqual(money.format_cents(5), "$0.05")
        self.assertEqual(money.format_cents(123456789), "$1,234,567.89")

    def test_other_currencies(self):
        self.assertEqual(money.format_cents(100050, "EUR", sep="."), "€1.000.50")
        self.assertEqual(money.format_cents(999, "CHF"), "CHF 9.99")

    def test_negative_whole_amounts(self):
        self.assertEqual(money.format_cents(-200), "-$2.00")
        self.assertEqual(money.format_cents(-100000), "-$1,000.00")

    def test_negative_with_cents(self):
        self.assertEqual(money.format_cents(-250), "-$2.50")
        self.assertEqual(money.format_cents(-123456), "-$1,234.56")

    def test_small_negative_amount(self):
        self.assertEqual(money.format_cents(-5), "-$0.05")


class TestParse(unittest.TestCase):
    def test_parse_amounts(self):
        self.assertEqual(money.parse_amount("$1,234.56"), 123456)
        self.assertEqual(money.parse_amount("-0.05"), -5)
        self.assertEqual(money.parse_amount("12"), 1200)
        with self.assertRaises(ValueError):
            money.parse_amount("1.234")
        with self.assertRaises(ValueError):
            money.parse_amount("abc")


if __name__ == "__main__":
    unittest.main()
