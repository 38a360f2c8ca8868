"""`pip install ./clients/python` works offline (no build isolation, no
index: the build backend is the system's setuptools) and gives an
importable `stasis` that is the installed copy."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import unittest

import support


class InstallTest(unittest.TestCase):
    def test_pip_install(self):
        tmp = tempfile.mkdtemp(prefix="stasis-py-install-")
        try:
            src = os.path.join(tmp, "src")
            # A copy, so the build's files land outside the repository.
            shutil.copytree(support.CLIENT_DIR, src, ignore=shutil.ignore_patterns("__pycache__", "build", "*.egg-info", "tests"))
            target = os.path.join(tmp, "site")
            p = subprocess.run(
                [sys.executable, "-m", "pip", "install", "--quiet", "--no-build-isolation", "--no-deps", "--no-index", "--target", target, src],
                capture_output=True, text=True, timeout=300,
            )
            self.assertEqual(p.returncode, 0, f"pip install failed ({sys.executable}):\n{p.stdout}\n{p.stderr}")
            code = "import stasis, sys; print(stasis.__file__); print(len(stasis.OPERATIONS)); print(stasis.Client.__name__)"
            env = dict(os.environ, PYTHONPATH=target)
            q = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp, env=env, timeout=60)
            self.assertEqual(q.returncode, 0, q.stderr)
            where, ops, name = q.stdout.split()
            self.assertTrue(where.startswith(target), f"imported {where}, not the installed copy")
            self.assertGreaterEqual(int(ops), 17)
            self.assertEqual(name, "Client")
            self.assertTrue(os.path.exists(os.path.join(target, "stasis", "py.typed")))
        finally:
            shutil.rmtree(tmp)


if __name__ == "__main__":
    unittest.main()
