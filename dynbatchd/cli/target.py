"""Where dynbatchctl finds the daemon: its request and control sockets, and the CURVE keys for them."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable

from dynbatchd import config as cfgmod
from dynbatchd.cli.output import fail
from dynbatchd.client import CurveKeys, control_call


# CURVE keys of dynbatchctl (a daemon with [daemon] curve on, over tcp://): --curve-key and
# --server-key, else these variables, else the defaults below. Read by hand, not as typer
# envvars, so `--help` never prints a key path taken from the environment as a default.
CURVE_KEY_ENV = "DYNBATCHD_CURVE_KEY"
SERVER_KEY_ENV = "DYNBATCHD_SERVER_KEY"


def user_keys_dir() -> Path:
    """Where `keygen` puts a client's key pair and dynbatchctl looks for it: ~/.config/dynbatchd."""
    base = os.environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    return Path(base) / "dynbatchd"


class Target:
    """Where the daemon listens: flags, else the config file (the one search order), else the defaults.

    The file is read only when an endpoint is asked for and no flag gave it,
    so `plan`, `simulate`, or a command given both endpoints, never trip over
    a config file they do not need. The default control socket is the daemon's
    own default (`dynbatchd.config.default_control`): its runtime directory.
    """

    def __init__(self, endpoint: str | None, control: str | None, config: Path | None,
                 curve_key: Path | None = None, server_key: Path | None = None,
                 control_call: Callable[..., Any] = control_call):
        self.config = config
        self._control_call = control_call   # dynbatchctl passes its own, the one a test may replace
        self._endpoint, self._control = endpoint, control
        self._curve_key = curve_key or (Path(os.environ[CURVE_KEY_ENV]) if os.environ.get(CURVE_KEY_ENV) else None)
        self._server_key = server_key or (Path(os.environ[SERVER_KEY_ENV]) if os.environ.get(SERVER_KEY_ENV) else None)
        self._daemon: cfgmod.DaemonSettings | None = None
        self._keys: CurveKeys | None = None

    def _settings(self) -> cfgmod.DaemonSettings:
        if self._daemon is None:
            path = cfgmod.find_config(self.config)
            try:
                self._daemon = cfgmod.load(path).daemon if path is not None else cfgmod.DaemonSettings()
            except cfgmod.ConfigError as exc:
                raise fail(str(exc), 2) from None
        return self._daemon

    @property
    def endpoint(self) -> str:
        return self._endpoint or self._settings().listen

    @property
    def control(self) -> str:
        return self._control or self._settings().control

    def curve(self, endpoint: str) -> CurveKeys | None:
        """The CURVE keys for talking to `endpoint`, or None (not tcp://, or no keys and CURVE off).

        Keys given (flag or environment) are used; otherwise, when the config file
        says ``curve = true``, this user's ~/.config/dynbatchd/client.key_secret and the
        daemon's KEYS_DIR/server.key. A key that will not load is one line and exit 2.
        """
        if not endpoint.startswith("tcp://"):
            return None
        if self._keys is not None:
            return self._keys
        client, server = self._curve_key, self._server_key
        if client is None and server is None:
            if (self._endpoint and self._control) or not self._settings().curve:
                return None
        client = client or user_keys_dir() / "client.key_secret"
        server = server or cfgmod.server_public_key_file(self._settings())
        try:
            self._keys = CurveKeys.load(client, server)
        except cfgmod.KeyFileError as exc:
            raise fail(f"CURVE keys for {endpoint}: {exc} (--curve-key FILE and --server-key FILE; "
                       "dynbatchctl keygen makes a key pair)", 2) from None
        return self._keys

    def curve_args(self, endpoint: str) -> dict[str, Any]:
        """``{"curve": keys}`` where `endpoint` takes CURVE keys, else nothing (no argument at all)."""
        keys = self.curve(endpoint)
        return {"curve": keys} if keys is not None else {}

    def call(self, cmd: str, **args: Any) -> Any:
        """One control command on the control socket, with this client's CURVE keys where it takes them."""
        return self._control_call(self.control, cmd, **self.curve_args(self.control), **args)
