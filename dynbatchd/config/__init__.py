"""TOML configuration: parsed into frozen, typed settings.

Every error names the file, the key and the rule broken, e.g.
``etc/dynbatchd.toml: channels.realtime.max_batch: expected `int` >= 1, got `0```.
Unknown keys are errors, not silently ignored.

Split by job, each name importable from here as before:

- `dynbatchd.config.schema`: the structs, one per TOML table, and the bounds of every number;
- `dynbatchd.config.reading`: TOML to a table (`read_toml`), a table to a `Config` (`parse`,
  `load`, `convert`), checked copies (`with_channel`), and a plugin's keys of a shared table as
  its struct (`plugin_table`);
- `dynbatchd.config.rules`: the rules across settings (`check_references`), and which channels
  carry a tag (`channels_carrying`);
- `dynbatchd.config.shared`: the shared tables ``[routing]``, ``[compliance]`` and ``[cache]``,
  whose keys beyond the core's belong to plugins (`split`, `fold`, `table_of`, `PerConfig`);
- `dynbatchd.config.paths`: the config file's search order, the runtime and state directories;
- `dynbatchd.config.keys`: CURVE key files.

Tables and keys that plugins own are not here: ``[plugins.NAME]`` and the HTTP plugin's ``[http]``
are kept free-form, and the keys of ``[routing]``, ``[compliance]`` and ``[cache]`` that are not
the core's are set aside in ``Config.plugin_keys`` (the built-in routing plugin's ``rules``, the
compliance plugin's ``regulated_tags`` and ``banking_max_window_ms``, the lifecycle cache
policy's ``refresh_types`` and ``rare_users``); their plugins check them
(`dynbatchd.plugins.Plugins.check_tables`, at validation: `dynbatchd.validation.validate_config`),
and a key that no loaded plugin owns is refused there as unknown.

Errors are `dynbatchd.errors`': `ConfigError` carries `file`, `key` and `rule`.
"""

from __future__ import annotations

from dynbatchd.config.keys import (ADMINS_DIR, CLIENTS_DIR, SERVER_KEY_NAME, KeyFileError, admin_keys_dir,
                                   client_keys_dir, curve_endpoints, read_key_file, server_public_key_file,
                                   make_dirs_others_cannot_write, server_secret_key_file, writable_by_others,
                                   write_keypair)
from dynbatchd.config.paths import (CONFIG_ENV, CONTROL_SOCKET, DEFAULT_CONFIG_PATHS, DEFAULT_KEYS_DIR,
                                    SYSTEM_RUNTIME_DIR, SYSTEM_STATE_DIR, UnsafeDirectory, default_control,
                                    default_state_dir, ensure_private_dir, find_config, private_runtime_dir,
                                    runtime_dir, search_order_text, state_path)
from dynbatchd.config.reading import (check_channel_values, convert, load, parse, plugin_table, read_toml,
                                      to_dict, with_channel)
from dynbatchd.config.rules import channels_carrying, check_references, host_port_problem, is_loopback_host
from dynbatchd.config.schema import (DEVICE_NAME, MAX_BATCH, MAX_MS, MAX_PRIORITY, MAX_QUEUE, MAX_S,
                                     MAX_TOKENS, CacheSettings, ChannelSettings, ComplianceSettings, Config,
                                     DaemonSettings, DeviceSettings, Frozen, GigaBytes, InFlight,
                                     Millis, ModelSettings, NonNegative, PolicySettings, Priority, QuotaSettings,
                                     SHARED_TABLES, Rate, RaySettings, RoutingSettings, Seconds, TenantQuota,
                                     TopUsersSettings)
from dynbatchd.config.shared import PerConfig, plugin_keys_of, split_table, table_of
from dynbatchd.errors import ConfigError

__all__ = [
    "ADMINS_DIR", "CLIENTS_DIR", "CONFIG_ENV", "CONTROL_SOCKET", "DEFAULT_CONFIG_PATHS", "DEFAULT_KEYS_DIR",
    "DEVICE_NAME", "MAX_BATCH", "MAX_MS", "MAX_PRIORITY", "MAX_QUEUE", "MAX_S", "MAX_TOKENS", "SERVER_KEY_NAME",
    "SYSTEM_RUNTIME_DIR", "SYSTEM_STATE_DIR", "CacheSettings", "ChannelSettings", "ComplianceSettings", "Config",
    "ConfigError", "DaemonSettings", "DeviceSettings", "Frozen", "GigaBytes", "InFlight", "KeyFileError", "Millis",
    "ModelSettings", "NonNegative", "PerConfig", "PolicySettings", "Priority", "QuotaSettings", "Rate", "RaySettings",
    "RoutingSettings", "SHARED_TABLES", "Seconds", "TenantQuota", "TopUsersSettings", "UnsafeDirectory",
    "admin_keys_dir", "channels_carrying", "check_channel_values", "check_references", "client_keys_dir", "convert",
    "curve_endpoints", "default_control", "make_dirs_others_cannot_write", "default_state_dir", "ensure_private_dir", "find_config",
    "host_port_problem", "is_loopback_host", "load", "parse", "plugin_keys_of", "plugin_table", "private_runtime_dir", "read_key_file",
    "read_toml", "runtime_dir", "search_order_text", "server_public_key_file", "server_secret_key_file",
    "split_table", "state_path", "table_of", "to_dict", "with_channel", "writable_by_others", "write_keypair",
]
