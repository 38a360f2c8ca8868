import copy
import unittest

import appconfig


class TestConfig(unittest.TestCase):
    def setUp(self):
        self._saved = copy.deepcopy(appconfig.DEFAULTS)

    def tearDown(self):
        appconfig.DEFAULTS.clear()
        appconfig.DEFAULTS.update(self._saved)

    def test_load_without_overrides(self):
        cfg = appconfig.load()
        self.assertEqual(cfg["server"]["port"], 8080)
        self.assertEqual(cfg["log"]["level"], "info")

    def test_overrides_are_merged(self):
        cfg = appconfig.load({"server": {"port": 9000, "tls": {"enabled": True}}, "workers": 8})
        self.assertEqual(cfg["server"], {"host": "127.0.0.1", "port": 9000, "tls": {"enabled": True}})
        self.assertEqual(cfg["workers"], 8)
        self.assertEqual(cfg["log"], {"level": "info", "format": "text"})

    def test_parse_pairs(self):
        got = appconfig.parse_pairs(["server.port=9000", "server.tls.enabled=true", "log.level=debug"])
        self.assertEqual(got, {"server": {"port": 9000, "tls": {"enabled": True}}, "log": {"level": "debug"}})
        with self.assertRaises(ValueError):
            appconfig.parse_pairs(["no-equals-sign"])

    def test_defaults_unchanged_after_load(self):
        appconfig.load(appconfig.parse_pairs(["server.port=9000", "log.level=debug"]))
        self.assertEqual(appconfig.DEFAULTS, self._saved)

    def test_loads_are_independent(self):
        first = appconfig.load({"server": {"tls": {"enabled": True}}})
        second = appconfig.load()
        self.assertTrue(first["server"]["tls"]["enabled"])
        self.assertFalse(second["server"]["tls"]["enabled"])
        second["log"]["level"] = "error"
        self.assertEqual(appconfig.load()["log"]["level"], "info")


if __name__ == "__main__":
    unittest.main()
