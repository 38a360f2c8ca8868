"""What the tests share: the import path, the stasis binary, the OpenAPI
document, and a `stasis serve` that leaves nothing behind."""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from typing import Optional, Sequence

HERE = os.path.dirname(os.path.abspath(__file__))
CLIENT_DIR = os.path.dirname(HERE)  # clients/python
REPO = os.path.dirname(os.path.dirname(CLIENT_DIR))
if CLIENT_DIR not in sys.path:
    sys.path.insert(0, CLIENT_DIR)

from stasis.local import LocalServer, ScriptedModel, gateway_socket_dir  # noqa: E402

SPEC_PATH = os.path.join(REPO, "internal", "control", "openapi", "server.json")


def load_spec() -> dict:
    with open(SPEC_PATH) as f:
        return json.load(f)


def stasis_bin() -> str:
    """$STASIS_BIN, default REPO/bin/stasis (relative paths from the
    repository). Missing, the test fails: build it (make build)."""
    b = os.environ.get("STASIS_BIN") or os.path.join(REPO, "bin", "stasis")
    if not os.path.isabs(b):
        b = os.path.join(REPO, b)
    if not os.access(b, os.X_OK):
        raise RuntimeError(  # an error, not a skip: the suite must not pass without a server
            f"no stasis binary at {b}: run make build, or set STASIS_BIN to one (with stasis-sandbox beside it)"
        )
    return b


class Served:
    """A `stasis serve` on a fresh temporary state directory, and
    everything it started killed and removed at close (which says what it
    had to clean)."""

    def __init__(self, args: Sequence[str] = (), listen: Optional[str] = None, model: bool = False):
        self.tmp = tempfile.mkdtemp(prefix="stasis-py-")
        self.model: Optional[ScriptedModel] = None
        try:
            extra = list(args)
            if model:
                self.model = ScriptedModel(binary=stasis_bin(), log_path=os.path.join(self.tmp, "model.log"))
                extra += ["--model-upstream", self.model.start()]
            self.server = LocalServer(os.path.join(self.tmp, "state"), binary=stasis_bin(), listen=listen, args=extra)
            self.server.start()
        except BaseException:
            self.close()
            raise

    @property
    def state(self) -> str:
        return self.server.state_dir

    def client(self, **kw):
        return self.server.client(**kw)

    def close(self) -> list:
        """Stop and clean; returns the processes still alive after it
        (there must be none)."""
        left: list = []
        srv = getattr(self, "server", None)
        if srv is not None:
            srv.close()
            left = srv.leftovers()
            if os.path.exists(gateway_socket_dir(srv.state_dir)):
                left.append(gateway_socket_dir(srv.state_dir))
        if self.model is not None:
            self.model.close()
            if self.model.identity and self.model.identity.alive():
                left.append(self.model.identity)
        shutil.rmtree(self.tmp, ignore_errors=True)
        if os.path.exists(self.tmp):
            left.append(self.tmp)
        return left
