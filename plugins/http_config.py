"""The ``[http]`` table, owned by the built-in HTTP plugin (`dynbatchd_config_tables`), not the core.

Spelled ``[http]`` at the top level, as configs always have (so existing ones keep loading): the
core keeps that one table free-form (`dynbatchd.config.schema.Config`), and this struct gives it
its shape and rules, checked with the whole config wherever it is validated (start, reload,
check-config, tune). Its own module so that the table is read without the door's I/O; errors
name the key (``http.listen``) and the rule, as a core table's do.
"""

from __future__ import annotations

import stat
from pathlib import Path
from typing import Annotated, Any, ClassVar

from msgspec import Meta

from dynbatchd.config import (MAX_QUEUE, Config, Frozen, convert, host_port_problem, is_loopback_host,
                              writable_by_others)
from dynbatchd.errors import OptionError
from dynbatchd.httpkeys import keys_dir
from dynbatchd.hookspecs import hookimpl

class HttpSettings(Frozen, kw_only=True):
    """The HTTP front door (`dynbatchd_plugins.http`): off while `listen` is empty.
    The limits bound what one client can make the door hold: inputs, requests, connections, head, time,
    and what all of them can together: the bodies being read (max_body_bytes)."""
    table_key: ClassVar[str] = "http"   # the top-level [http], not [plugins.http]

    listen: str = ""
    max_inputs: Annotated[int, Meta(ge=1, le=MAX_QUEUE)] = 2048             # per request; 413 beyond
    max_requests: Annotated[int, Meta(ge=1, le=1_000_000)] = 256            # in progress at once; 429 beyond
    max_connections: Annotated[int, Meta(ge=1, le=1_000_000)] = 1024        # open at once; 429 and closed beyond
                                                                            # (TLS: counted from accept, closed unanswered)
    max_headers: Annotated[int, Meta(ge=1, le=10_000)] = 100                # header lines; 431 beyond
    max_header_bytes: Annotated[int, Meta(ge=1024, le=1 << 20)] = 16_384    # a request's head; 431 beyond
    header_timeout_s: Annotated[float, Meta(gt=0, le=3600)] = 10.0          # for a request's head; 408 then
    body_timeout_s: Annotated[float, Meta(gt=0, le=3600)] = 30.0            # for its body, or its reply's sending
    max_body_bytes: Annotated[int, Meta(ge=1024, le=1 << 40)] = 64 << 20     # being read, all connections; 429 beyond
    keys: bool = False       # API keys required: hashes in KEYS_DIR/http/ (dynbatchctl keygen --http NAME)
    tls_cert: str = ""       # PEM certificate chain: HTTPS on the same listener (with tls_key)
    tls_key: str = ""        # PEM private key of tls_cert

    def check(self, config: Config) -> None:
        """The rules across keys and tables; OptionError(key within ``[http]``, rule)."""
        if self.listen and (problem := host_port_problem(self.listen)):
            raise OptionError("listen", problem)
        if bool(self.tls_cert) != bool(self.tls_key):
            raise OptionError("tls_key" if self.tls_cert else "tls_cert",
                              "tls_cert and tls_key go together: a certificate and its private key")
        if self.listen and self.keys and (problem := _keys_writable_by_others(config.daemon.keys_dir)):
            raise OptionError("keys", problem)
        if config.daemon.curve and self.listen and not self.keys:
            raise OptionError("keys", "daemon.curve is on and the HTTP door has no API keys: it would serve "
                              "clients whose keys the daemon refuses; set http.keys = true (dynbatchctl "
                              "http-key create NAME --tenant T) or leave http.listen empty")
        if self.listen and not is_loopback_host(self.listen.rpartition(":")[0]) and not (
                self.keys and self.tls_cert):
            raise OptionError("listen", f"{self.listen!r} is not a loopback address, and the HTTP door off "
                              "loopback needs API keys and TLS (http.keys = true, http.tls_cert and "
                              "http.tls_key): else anyone who reaches the port is served, in clear; listen on "
                              "127.0.0.1 (behind a proxy that authenticates) or set them")


def _keys_writable_by_others(keys_root: str) -> str | None:
    """Why the door would take no key from KEYS_DIR or KEYS_DIR/http (its group or others may write
    one: they could add a key of their own, for any tenant), or None. Said at check and start, not
    first as every key refused (`dynbatchd.httpkeys.KeyStore`)."""
    for directory in (Path(keys_root), keys_dir(keys_root)):
        if directory.is_dir() and writable_by_others(directory):
            mode = stat.S_IMODE(directory.stat().st_mode)
            return (f"{directory} is mode {mode:04o}: its group or others may write it, so they could add an "
                    f"API key of their own, and the door takes no key from it (chmod go-w {directory})")
    return None


def http_settings(config: Any) -> HttpSettings:
    """``[http]`` of a validated `config` as its struct (the defaults where the table is absent)."""
    return convert(config.http, HttpSettings, config.source, HttpSettings.table_key)


@hookimpl
def dynbatchd_config_tables() -> dict[str, type]:
    return {"http": HttpSettings}
