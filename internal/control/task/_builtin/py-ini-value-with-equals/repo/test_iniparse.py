import unittest

import iniparse

SAMPLE = """\
; global settings
name = demo

[server]
Host = example.internal
port=8080

# logging
[log]
level = debug
"""


class TestParse(unittest.TestCase):
    def test_sections_and_keys(self):
        data = iniparse.parse(SAMPLE)
        self.assertEqual(data[""], {"name": "demo"})
        self.assertEqual(data["server"], {"host": "example.internal", "port": "8080"})
        self.assertEqual(data["log"], {"level": "debug"})

    def test_errors_report_line_number(self):
        with self.assertRaises(iniparse.ParseError) as cm:
            iniparse.parse("[ok]\na = 1\n[broken\n")
        self.assertEqual(cm.exception.lineno, 3)
        with self.assertRaises(iniparse.ParseError):
            iniparse.parse("just some words\n")

    def test_get_falls_back_to_global(self):
        data = iniparse.parse(SAMPLE)
        self.assertEqual(iniparse.get(data, "server", "PORT"), "8080")
        self.assertEqual(iniparse.get(data, "server", "name"), "demo")
        self.assertEqual(iniparse.get(data, "server", "missing", "x"), "x")

    def test_value_containing_equals(self):
        data = iniparse.parse("[db]\ndsn = host=db1 port=5432\n")
        self.assertEqual(data["db"], {"dsn": "host=db1 port=5432"})

    def test_base64_padding_kept(self):
        data = iniparse.parse("token = YWJjZA==\n")
        self.assertEqual(iniparse.get(data, "any", "token"), "YWJjZA==")


if __name__ == "__main__":
    unittest.main()
