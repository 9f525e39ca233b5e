"""The systemd units in systemd/: valid for systemd itself, documented, and saying what they do.

`systemd-analyze verify` checks every unit with the paths of this checkout put in (the venv's
scripts for /opt/dynbatchd/.venv/bin, etc/dynbatchd.toml for the config) and this checkout's man
pages on MANPATH, so it also proves every `Documentation=man:` page opens. Without
systemd-analyze that one test is skipped; the rest read the files.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import typer.main

from dynbatchd import config as cfgmod, systemd
from dynbatchd.cli import dynbatchctl

REPO = Path(__file__).resolve().parents[2]
UNIT_DIR = REPO / "systemd"
MAN = REPO / "man"
README = UNIT_DIR / "README.md"
UNIT_SUFFIXES = (".service", ".timer", ".socket", ".path", ".target")
UNITS = sorted(p.name for p in UNIT_DIR.iterdir() if p.suffix in UNIT_SUFFIXES)

INSTALLED_BIN = "/opt/dynbatchd/.venv/bin/"
INSTALLED_CONFIG = "/etc/dynbatchd/dynbatchd.toml"


def directives(unit: str) -> list[tuple[int, str, str, str]]:
    """(line number, section, key, value) of every directive of a unit."""
    out, section = [], ""
    for number, line in enumerate((UNIT_DIR / unit).read_text().splitlines(), 1):
        if line.startswith("["):
            section = line.strip("[] ")
        elif line and not line.startswith(("#", ";")) and "=" in line:
            key, _, value = line.partition("=")
            out.append((number, section, key.strip(), value.strip()))
    return out


def values(unit: str, key: str, section: str | None = None) -> list[str]:
    return [v for _, s, k, v in directives(unit) if k == key and section in (None, s)]


def last(unit: str, key: str) -> str:
    found = values(unit, key)
    assert found, f"{unit} has no {key}="
    return found[-1]


def seconds(span: str) -> float:
    """A systemd time span such as 30s, 30min, 1h 30min, or a bare number of seconds."""
    units = {"": 1, "s": 1, "sec": 1, "m": 60, "min": 60, "h": 3600, "hr": 3600, "ms": 1e-3, "us": 1e-6}
    parts = re.findall(r"(\d+(?:\.\d+)?)\s*([a-z]*)", span)
    assert parts and "".join(n + u for n, u in parts) == span.replace(" ", ""), f"not a time span: {span}"
    return sum(float(n) * units[u] for n, u in parts)


def test_there_are_the_units_the_readme_installs():
    assert {"dynbatchd.service", "dynbatchd-warmup.service", "dynbatchd-warmup.timer"} <= set(UNITS)
    readme = README.read_text()
    for unit in UNITS:
        assert f"`{unit}`" in readme or f"systemd/{unit}" in readme, f"systemd/README.md does not mention {unit}"


# ---------------------------------------------------------------------------
# systemd's own check
# ---------------------------------------------------------------------------

@pytest.fixture
def checkout_units(tmp_path):
    """Every unit, copied with this checkout's executables and config in place of the installed ones."""
    scripts = Path(sys.executable).parent
    for tool in ("dynbatchd", "dynbatchctl"):
        if not os.access(scripts / tool, os.X_OK):
            pytest.skip(f"{scripts / tool} is missing: run the tests from the venv that `make test` builds")
    out = tmp_path / "units"
    out.mkdir()
    for unit in UNITS:
        text = (UNIT_DIR / unit).read_text()
        text = text.replace(INSTALLED_BIN, f"{scripts}/").replace(INSTALLED_CONFIG, str(REPO / "etc" / "dynbatchd.toml"))
        assert "/opt/dynbatchd" not in text, f"{unit} names an installed path the test does not substitute"
        (out / unit).write_text(text)
    return out


@pytest.fixture
def checkout_manpath(tmp_path):
    """A MANPATH (manN/ folders) holding this checkout's pages, so `man PAGE(N)` finds them."""
    root = tmp_path / "man"
    for page in MAN.glob("*.[1-8]"):
        section = root / f"man{page.suffix[1:]}"
        section.mkdir(parents=True, exist_ok=True)
        (section / page.name).symlink_to(page)
    return root


def test_systemd_analyze_verify_passes_on_every_unit(checkout_units, checkout_manpath):
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is missing (Debian: apt-get install systemd); the units were not verified")
    man = "--man=yes" if shutil.which("man") else "--man=no"   # no man(1): the page check below is all there is
    env = {**os.environ, "MANPATH": str(checkout_manpath), "SYSTEMD_LOG_COLOR": "0", "SYSTEMD_PAGER": ""}
    result = subprocess.run([analyze, "verify", man, *(str(checkout_units / u) for u in UNITS)],
                            capture_output=True, text=True, env=env, timeout=120)
    said = (result.stdout + result.stderr).strip()
    # verify exits 0 on warnings such as an unknown key; a clean unit produces no output at all.
    assert result.returncode == 0 and not said, f"systemd-analyze verify {man}:\n{said}"


# ---------------------------------------------------------------------------
# what every unit must have
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("unit", UNITS)
def test_every_documentation_man_page_exists(unit):
    refs = [ref for value in values(unit, "Documentation", "Unit") for ref in value.split()]
    assert refs, f"{unit} has no Documentation="
    for ref in refs:
        match = re.fullmatch(r"man:([\w.\-]+)\((\d)\)", ref)
        assert match or re.match(r"https?://", ref), f"{unit}: Documentation={ref} is neither man: nor a URL"
        if match:
            assert (MAN / f"{match[1]}.{match[2]}").is_file(), f"{unit}: Documentation={ref}: no man/{match[1]}.{match[2]}"


def test_the_daemon_unit_points_at_every_page():
    pages = {f"{m[1]}.{m[2]}" for v in values("dynbatchd.service", "Documentation")
             for m in re.finditer(r"man:([\w.\-]+)\((\d)\)", v)}
    assert pages == {p.name for p in MAN.glob("*.[1-8]")}


@pytest.mark.parametrize("unit", UNITS)
def test_every_directive_carries_a_reason(unit):
    lines = (UNIT_DIR / unit).read_text().splitlines()
    bare = []
    for number, _, key, _ in directives(unit):
        above = lines[number - 2] if number >= 2 else ""
        same_key_above = above.partition("=")[0].strip() == key
        if not above.startswith("#") and not same_key_above:
            bare.append(f"line {number}: {key}")
    assert not bare, f"{unit}: directives without a comment above them: {bare}"


# ---------------------------------------------------------------------------
# the daemon's unit
# ---------------------------------------------------------------------------

UNIT = "dynbatchd.service"


def test_the_daemon_unit_keeps_what_notify_and_drain_need():
    single = {key: last(UNIT, key) for key in ("Type", "NotifyAccess", "KillMode", "KillSignal", "Restart")}
    assert single == {"Type": "notify", "NotifyAccess": "main", "KillMode": "mixed", "KillSignal": "SIGTERM",
                      "Restart": "on-failure"}
    assert any(re.fullmatch(r"/bin/kill -HUP \$MAINPID", v) for v in values(UNIT, "ExecReload"))
    assert re.search(r"\bdynbatchd start --config \S+", last(UNIT, "ExecStart"))
    assert seconds(last(UNIT, "TimeoutStopSec")) >= cfgmod.DaemonSettings().drain_timeout_s + 15, \
        "TimeoutStopSec must outlast a drain"
    assert "HF_HUB_OFFLINE=1" in values(UNIT, "Environment")


def test_the_daemon_unit_reaches_gpus_through_device_rules_not_by_dropping_hardening():
    assert values(UNIT, "PrivateDevices") in ([], ["no"]), "PrivateDevices=yes hides /dev/nvidia*"
    assert values(UNIT, "DevicePolicy") == ["closed"]
    allowed = {v.split()[0]: v.split()[1] for v in values(UNIT, "DeviceAllow")}
    # Major 195 (every /dev/nvidiaN) under both names drivers have used in /proc/devices; the
    # singletons by path, which resolves whatever their driver is called.
    for node in ("char-nvidia", "char-nvidia-frontend", "char-nvidia-caps", "/dev/nvidiactl", "/dev/nvidia-uvm"):
        assert allowed.get(node) == "rw", f"DeviceAllow={node} rw is missing"
    for node in allowed:
        assert node.startswith(("/dev/nvidia", "char-nvidia")), f"DeviceAllow={node}: not an NVIDIA device"
    assert "char-nvidiactl" not in allowed, "nvidiactl is a node of the nvidia driver, not a driver of its own"


def test_the_daemon_unit_has_a_watchdog_the_daemon_can_keep(monkeypatch):
    timeout = seconds(last(UNIT, "WatchdogSec"))
    assert 10 <= timeout <= 300
    monkeypatch.setenv("WATCHDOG_USEC", str(int(timeout * 1_000_000)))
    monkeypatch.delenv("WATCHDOG_PID", raising=False)
    interval = systemd.watchdog_interval_s()
    assert interval == timeout / 2
    lines = (UNIT_DIR / UNIT).read_text().splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("WatchdogSec="))
    comment = " ".join(line for line in lines[max(0, at - 6):at] if line.startswith("#"))
    assert f"every {interval:g} s" in comment, "the WatchdogSec= comment must say how often the daemon pings"
    assert "PYTHONFAULTHANDLER=1" in values(UNIT, "Environment"), "a watchdog abort should leave a traceback"


# ---------------------------------------------------------------------------
# the nightly warmup
# ---------------------------------------------------------------------------

SERVICE, TIMER = "dynbatchd-warmup.service", "dynbatchd-warmup.timer"


def warmup_command() -> list[str]:
    return last(SERVICE, "ExecStart").split()


def test_the_warmup_service_runs_dynbatchctl_warmup_against_a_running_daemon_only():
    assert last(SERVICE, "Type") == "oneshot"
    argv = warmup_command()
    assert Path(argv[0]).name == "dynbatchctl" and "warmup" in argv
    assert values(SERVICE, "Requisite") == ["dynbatchd.service"], "warmup must never start a stopped daemon"
    assert "dynbatchd.service" in last(SERVICE, "After")
    assert values(SERVICE, "WantedBy") == [], "the timer starts it; it has no [Install] of its own"
    # Every option it passes is one dynbatchctl has, at the level it is given.
    cli = typer.main.get_command(dynbatchctl.app)
    warmup = cli.commands["warmup"]
    top_level, _, sub = " ".join(argv[1:]).partition(" warmup")
    def opts(command):
        return {o for p in command.params for o in getattr(p, "opts", ())}
    assert {a for a in top_level.split() if a.startswith("-")} <= opts(cli)
    assert {a for a in sub.split() if a.startswith("-")} <= opts(warmup)


def test_the_warmup_timer_is_nightly_off_peak_persistent_and_spread():
    calendar = last(TIMER, "OnCalendar")
    match = re.fullmatch(r"\*-\*-\* (\d\d):(\d\d)(?::00)?", calendar)
    assert match, f"OnCalendar={calendar}: expected a daily time, *-*-* HH:MM:00"
    assert 1 <= int(match[1]) <= 5, f"OnCalendar={calendar} is not off-peak (01:00 to 05:59)"
    assert last(TIMER, "Persistent") in ("true", "yes"), "a night the host was off must be made up"
    assert 0 < seconds(last(TIMER, "RandomizedDelaySec")) <= 3600
    assert values(TIMER, "Unit") in ([], [SERVICE]) and (UNIT_DIR / SERVICE).is_file()
    assert values(TIMER, "WantedBy") == ["timers.target"]


def test_the_readme_cron_line_is_the_timer_and_the_service():
    blocks = re.findall(r"```cron\n(.*?)```", README.read_text(), re.DOTALL)
    assert len(blocks) == 1, "systemd/README.md should give exactly one cron block"
    (line,) = [l for l in blocks[0].splitlines() if l.strip() and not l.startswith("#")]
    minute, hour, dom, month, dow, user, *command = line.split()
    hh, mm = re.fullmatch(r"\*-\*-\* (\d\d):(\d\d)(?::00)?", last(TIMER, "OnCalendar")).groups()
    assert (int(minute), int(hour), dom, month, dow) == (int(mm), int(hh), "*", "*", "*"), \
        "the cron line runs at another time than the timer"
    assert user == "root" and command == warmup_command(), "the cron line runs another command than the service"
