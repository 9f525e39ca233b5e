"""Faults a fuzzing pass over the control plane found on live daemons (subprocesses, real sockets):
commands interleaved with each other and with reloads while traffic flows, and the files they keep.

- A reload that removed the channel the running ``[cache] warmup_channel`` names (that table
  changes only at restart) was applied; the next warmup fed a channel that no longer existed and
  the pump raised at every step: no request was answered again. Now refused, naming the key.
- A tune acknowledged while a reload's risk assessment ran was undone by that reload (the running
  config and status lost it; the drop-in file still held it). The reload now plans again.
- Of two reloads at once, the one whose risk assessment ended last was applied last, though it
  had read an older file. Reloads now take turns; SIGHUPs that arrive while one waits for its
  turn join it (40 SIGHUPs were 40 reloads, each risk-assessed and logged).
- A tune or canary whose channel a reload removed after the command was checked and before (or
  while) it ran answered ``KeyError: 'realtime'`` and logged a traceback. Now one line naming it.
- A drop-in that could not be written (its name taken by a directory) left its temporary file in
  the state directory at each attempt.
- ``dynbatchctl warmup --wait`` waited an hour once ``forget`` had erased the inputs it waited for.
- ``tune --auto --candidate max_batch=abc`` printed int()'s message; ``window_ms=nan`` collected
  for 10 s and ended "cannot convert float NaN to integer". Now one line naming the key.
- ``tune --rollback`` of a change the config file had since taken over answered an empty success
  and logged "rollback to  (...)". Now refused: nothing to restore.
- ``forget tenant=`` of 500 kB wrote it to the log. Now at most 1,024 characters.
- A channel named like a canary's twin (``realtime~canary``): a canary of ``realtime`` was refused
  as "still draining" for ever; a reload adding it during the canary replaced the twin (the
  canary judged the file's settings) and the channel went with the twin.
- ``tune window=`` (and a canary's) of a bandit with 3,000 windows x 3,000 caps held the event loop
  8 s (6,000 x 6,000: 32 s; a dry run too): nothing was answered meanwhile. Now at most 256 values.
- ``warmup model=M`` of a model that failed to load queued its inputs, ran them to no effect and
  counted them as warmed. Now refused with the model's reason.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

from conftest import SIMULATED, start_daemon
from dynbatchd.client import Client, DynbatchdError
from helpers import codes, wait_until

CTL = [str(Path(sys.executable).with_name("dynbatchctl"))]

WARM_BODY = """
    [models.sim]
    runner = "simulated"
    options = {{ base_ms = {base_ms}, per_item_ms = 0.1 }}
    [channels.standard]
    max_batch = 16
    window_ms = 5
    deadline_ms = 5000
    [channels.warm]
    max_batch = 1
    window_ms = 0
    deadline_ms = 60000
    queue_limit = 2
    [routing]
    default = "standard"
    [cache]
    entries = 1000
    warmup_channel = "warm"
"""


def control(daemon, cmd: str, timeout_s: float = 30, **args) -> tuple[bool, object]:
    """(True, result) or (False, the daemon's error line)."""
    try:
        return True, daemon.call(cmd, timeout_s=timeout_s, **args)
    except DynbatchdError as exc:
        return False, str(exc)


def in_background(daemon, cmd: str, **args) -> tuple[threading.Thread, list]:
    """Send `cmd` from a thread; the list gets (ok, result) once answered."""
    answer: list = []
    thread = threading.Thread(target=lambda: answer.append(control(daemon, cmd, **args)))
    thread.start()
    return thread, answer


def urgent_traffic(daemon, batches: int) -> None:
    """Enough realtime traffic that a change of that channel is risk-assessed (which takes a while)."""
    with Client(daemon.endpoint, timeout=30) as client:
        while daemon.status()["channels"]["realtime"]["batches"] < batches:
            assert set(codes([client.submit("sim", f"u{i}", tags=["urgent"]) for i in range(40)])) == {"ok"}


def test_a_reload_removing_the_channel_the_running_warmup_channel_names_is_refused(tmp_path):
    daemon = start_daemon(tmp_path, WARM_BODY.format(base_ms=2.0), cpu_threads=1)
    try:
        text = daemon.config.read_text()
        daemon.config.write_text(text.replace("[channels.warm]", "[channels.warm2]")
                                 .replace('warmup_channel = "warm"', 'warmup_channel = "warm2"'))
        ok, error = control(daemon, "reload")
        assert not ok and "cache.warmup_channel" in error and "'warm'" in error and "restart" in error, error
        assert "warm" in daemon.status()["channels"]
        with Client(daemon.endpoint, timeout=10) as client:
            assert set(codes([client.submit("sim", f"text {i}", user=f"u{i}") for i in range(5)])) == {"ok"}
            assert daemon.call("warmup", top_users=10)["channel"] == "warm"
            assert codes([client.submit("sim", "after the warmup")]) == ["ok"]
        assert "Traceback" not in daemon.logs()
    finally:
        daemon.stop()


def test_a_tune_acknowledged_during_a_reload_is_kept_by_it(tmp_path):
    daemon = start_daemon(tmp_path, SIMULATED, cpu_threads=1)
    try:
        urgent_traffic(daemon, batches=200)
        text, interleaved = daemon.config.read_text(), 0
        for attempt in range(5):
            max_batch = 2 + attempt
            daemon.config.write_text(text.replace("window_ms = 1\n", f"window_ms = {2 + attempt % 2}\n"))
            reload, reloaded = in_background(daemon, "reload", force=True)
            ok, tuned = control(daemon, "tune", channel="vault", max_batch=max_batch)   # not assessed: at once
            assert ok, tuned
            interleaved += not reloaded   # the tune was answered while the reload was still planning
            reload.join(60)
            assert reloaded and reloaded[0][0], reloaded
            running = daemon.call("config")["channels"]["vault"]["max_batch"]
            shown = daemon.status()["overrides"].get("vault", {}).get("max_batch", {}).get("value")
            assert running == shown == max_batch, (attempt, running, shown)
        assert interleaved, "no tune landed during a reload: nothing was tested"
    finally:
        daemon.stop()


def write_atomically(path: Path, text: str) -> None:
    """As an operator's editor does: the daemon reads the old file or the new one, never half of one."""
    new = path.with_name(path.name + ".new")
    new.write_text(text)
    os.replace(new, path)


def test_of_two_reloads_at_once_the_later_file_is_the_one_that_runs(tmp_path):
    daemon = start_daemon(tmp_path, SIMULATED, cpu_threads=1)
    try:
        urgent_traffic(daemon, batches=200)
        text = daemon.config.read_text()
        slow = text.replace("window_ms = 1\n", "window_ms = 2\n")   # realtime has traffic: assessed, slowly
        latest = text.replace('tag = "banking"', 'tag = "bank"')     # no channel setting: nothing to assess
        for attempt in range(5):
            write_atomically(daemon.config, slow)
            first, first_answer = in_background(daemon, "reload", force=True)
            wait_until(lambda: daemon.ping()["state"] == "serving", 5)
            write_atomically(daemon.config, latest)
            ok, second = control(daemon, "reload", force=True)
            first.join(60)
            assert ok and first_answer and first_answer[0][0], (second, first_answer)
            if "realtime" in first_answer[0][1]["changes"]:   # the first one read the older file
                break
            write_atomically(daemon.config, text)
            assert control(daemon, "reload", force=True)[0]
        else:
            raise AssertionError("the first reload never read the older file: nothing was tested")
        running = daemon.call("config")
        assert running["channels"]["realtime"]["window_ms"] == 1   # as the latest file says
        assert [r["tag"] for r in running["routing"]["rules"]] == ["urgent", "bank"]
    finally:
        daemon.stop()


def test_a_storm_of_sighups_is_a_few_reloads_not_one_each(tmp_path):
    daemon = start_daemon(tmp_path, SIMULATED, cpu_threads=1)
    try:
        urgent_traffic(daemon, batches=200)
        write_atomically(daemon.config, daemon.config.read_text().replace("window_ms = 1\n", "window_ms = 2\n"))
        for _ in range(40):   # each reload assesses realtime's change (tens of ms): they would queue up
            os.kill(daemon.pid, signal.SIGHUP)
            wait_until(lambda: daemon.ping()["state"] == "serving", 5)   # delivered, and the daemon is up
        lines = []

        def settled() -> bool:   # no new reload line between two looks
            lines.append(sum("reload" in line for line in daemon.log_lines()))
            return len(lines) > 2 and lines[-1] == lines[-2] > 0
        wait_until(settled, 30, 0.5)
        assert lines[-1] <= 10, f"{lines[-1]} reloads for 40 SIGHUPs"
        assert "Traceback" not in daemon.logs()
    finally:
        daemon.stop()


def test_a_canary_whose_channel_a_reload_removes_during_its_assessment_is_refused_in_one_line(tmp_path):
    daemon = start_daemon(tmp_path, SIMULATED, cpu_threads=1)
    try:
        urgent_traffic(daemon, batches=200)
        text = daemon.config.read_text()
        daemon.config.write_text(text.replace("[channels.realtime]", "[channels.fast]")
                                 .replace('channel = "realtime"', 'channel = "fast"'))
        canary, started = in_background(daemon, "canary", action="start", channel="realtime", max_batch=4,
                                        force=True)
        ok, reloaded = control(daemon, "reload")   # removes a channel: nothing to assess, quick
        assert ok and reloaded["removed"]["channels"] == ["realtime"], reloaded
        canary.join(60)
        ok, answer = started[0]
        if ok:   # the canary's assessment won the race: the reload stopped it, saying why
            assert "realtime" not in daemon.call("canary")["running"]
        else:
            assert answer == "refused: channels.realtime: no such channel: a reload removed it while the command waited", \
                answer
        assert daemon.call("canary")["running"] == {}
        assert "Traceback" not in daemon.logs()
    finally:
        daemon.stop()


def test_a_drop_in_that_cannot_be_written_leaves_no_temporary_file(tmp_path):
    daemon = start_daemon(tmp_path, SIMULATED, cpu_threads=1)
    try:
        state = tmp_path / "state"
        (state / "overrides.toml").mkdir()
        for max_batch in (4, 5):
            ok, error = control(daemon, "tune", channel="vault", max_batch=max_batch)
            assert not ok and error.startswith("the tuning drop-in could not be written"), error
        assert sorted(p.name for p in state.iterdir() if "overrides" in p.name) == ["overrides.toml"]
        assert daemon.call("config")["channels"]["vault"]["max_batch"] == 8   # nothing changed
        assert daemon.status()["overrides"] == {}
    finally:
        daemon.stop()


def test_warmup_wait_ends_once_forget_has_erased_the_inputs_it_waited_for(tmp_path):
    body = WARM_BODY.format(base_ms=300.0)   # a warmup input takes 0.3 s: the backlog stays a while
    daemon = start_daemon(tmp_path, body, cpu_threads=1)
    users = [f"u{i}" for i in range(12)]
    with Client(daemon.endpoint, timeout=30) as client:
        assert set(codes([client.submit("sim", f"text of {u}", user=u) for u in users])) == {"ok"}
    daemon.stop()   # the sketch is saved; the new daemon's cache starts empty
    daemon = start_daemon(tmp_path, body, cpu_threads=1)
    cli = None
    try:
        env = {**os.environ, "DYNBATCHD_CONTROL": daemon.control}
        cli = subprocess.Popen([*CTL, "warmup", "--top-users", "100", "--wait"], env=env, text=True,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        wait_until(lambda: daemon.status()["cache"]["warmup_backlog"] >= 5, 30, message="no backlog")
        for user in users:
            daemon.call("forget", user=user)
        assert daemon.status()["cache"]["warmup_backlog"] == 0
        output, _ = cli.communicate(timeout=30)
        assert cli.returncode == 0, output
        warmed = [line for line in output.splitlines() if line.startswith("warmed ") and " of " in line]
        assert warmed and warmed[-1].endswith(f"of {len(users)} inputs") and warmed[-1] != \
            f"warmed {len(users)} of {len(users)} inputs", output
    finally:
        if cli is not None and cli.poll() is None:
            cli.kill()
            cli.wait()
        daemon.stop()


def test_tune_auto_refuses_a_candidate_value_that_is_no_number_naming_it_before_asking_the_daemon(tmp_path):
    daemon = start_daemon(tmp_path, SIMULATED, cpu_threads=1)
    try:
        env = {**os.environ, "DYNBATCHD_CONTROL": daemon.control}
        for candidate, error in (("max_batch=abc,window_ms=5", "error: --candidate max_batch is a whole number, not 'abc'"),
                                 ("max_batch=4,window_ms=nan", "error: --candidate window_ms is a finite number of ms, "
                                                               "not 'nan'"),
                                 ("max_batch=4,window_ms=inf", "error: --candidate window_ms is a finite number of ms, "
                                                               "not 'inf'")):
            done = subprocess.run([*CTL, "tune", "standard", "--auto", "--candidate", candidate], env=env, text=True,
                                  capture_output=True, timeout=60)
            assert done.returncode == 2 and done.stderr.strip() == error, (done.returncode, done.stdout, done.stderr)
        assert not any(word in daemon.logs() for word in ("tune of channel", "canary of channel"))   # nothing was sent
    finally:
        daemon.stop()


def test_a_rollback_of_a_tune_the_config_file_took_over_is_refused_not_an_empty_success(tmp_path):
    daemon = start_daemon(tmp_path, SIMULATED, cpu_threads=1)
    try:
        assert daemon.call("tune", channel="vault", max_batch=4)["applied"]
        text = daemon.config.read_text()
        changed = text.replace("max_batch = 8\nwindow_ms = 5\nisolated", "max_batch = 6\nwindow_ms = 5\nisolated")
        assert changed != text
        write_atomically(daemon.config, changed)
        assert daemon.call("reload")["dropped_overrides"] == ["channels.vault.max_batch"]
        trail = (tmp_path / "state" / "overrides.toml").read_text()
        ok, error = control(daemon, "tune", channel="vault", rollback=True)
        assert not ok and error.startswith("no change of channel 'vault' to roll back"), error
        assert daemon.call("config")["channels"]["vault"]["max_batch"] == 6   # the file's, as before
        assert (tmp_path / "state" / "overrides.toml").read_text() == trail   # no empty step in the trail
        assert "rollback to  (" not in daemon.logs()
    finally:
        daemon.stop()


def test_forget_refuses_a_tenant_of_megabytes_instead_of_writing_it_to_the_log(tmp_path):
    daemon = start_daemon(tmp_path, SIMULATED, cpu_threads=1)
    try:
        before = len(daemon.logs())
        ok, error = control(daemon, "forget", user="u", tenant="t" * 500_000)
        assert not ok and error.startswith("tenant is a tenant name of at most 1024 characters, not 'ttt"), error
        assert len(error) < 200
        assert daemon.call("forget", user="u", tenant="t" * 1024)["sketch_users"] == 0   # a long name still works
        assert len(daemon.logs()) - before < 5_000   # one line for the erasure that ran, none for the refusal
    finally:
        daemon.stop()


def test_a_reload_may_not_add_a_channel_named_like_a_running_canarys_twin(tmp_path):
    daemon = start_daemon(tmp_path, SIMULATED, cpu_threads=1)
    try:
        assert "standard" in daemon.call("canary", action="start", channel="standard", max_batch=2, seconds=60,
                                          force=True)["running"]
        text = daemon.config.read_text()
        write_atomically(daemon.config, text + '\n[channels."standard~canary"]\nmax_batch = 64\nwindow_ms = 3\n')
        ok, error = control(daemon, "reload", force=True)
        assert not ok and "channels.standard~canary: a channel name may not contain '~'" in error, error
        assert daemon.status()["channels"]["standard~canary"]["max_batch"] == 2   # the candidate's, not the file's
        daemon.call("canary", action="stop", channel="standard")
        assert "Traceback" not in daemon.logs()
    finally:
        daemon.stop()


def test_warmup_of_a_model_that_failed_to_load_is_refused_not_counted_as_warmed(tmp_path):
    good = '\n[models.e2]\nrunner = "callable"\noptions = { target = "helpers:echo_or_fail" }\n'
    body = SIMULATED + "\n    [cache]\n    entries = 100\n"
    daemon = start_daemon(tmp_path, body + textwrap.indent(good, "    "), cpu_threads=1)
    try:
        with Client(daemon.endpoint, timeout=10) as client:   # the sketch learns e2's users
            assert set(codes([client.submit("e2", f"text {i}", user=f"u{i}") for i in range(10)])) == {"ok"}
        text = daemon.config.read_text()
        without = text.replace(good, "")
        assert without != text
        write_atomically(daemon.config, without)
        assert daemon.call("reload")["removed"]["models"] == ["e2"]
        wait_until(lambda: not daemon.status()["models"]["unloading"], 30, message="e2 never unloaded")
        write_atomically(daemon.config, without + good.replace("echo_or_fail", "no_such_function"))
        assert daemon.call("reload")["added"]["models"] == ["e2"]
        wait_until(lambda: "e2" in daemon.status()["models"]["failed"], 30, message="e2 never shown failed")
        ok, error = control(daemon, "warmup", model="e2", top_users=10)
        assert not ok and error.startswith("model 'e2' failed to load: ") and \
            error.endswith(": nothing to warm it up on"), error
        status = daemon.status()
        assert status["cache"]["warmup_backlog"] == 0
        assert status["channels"]["standard"]["warmup"]["items"] == 0
    finally:
        daemon.stop()


def test_a_tune_whose_channel_a_reload_removes_before_it_runs_is_refused_in_one_line(tmp_path):
    """The command checks the channel when it comes; its coroutine runs a moment later, after a
    reload may have removed it: that was a KeyError traceback. Tunes are kept in flight while
    reloads remove and add the channel until one lands in that moment."""
    import msgspec
    import zmq

    daemon = start_daemon(tmp_path, SIMULATED, cpu_threads=1)
    try:
        text = daemon.config.read_text()
        without = text.replace('[channels.vault]\nmax_batch = 8\nwindow_ms = 5\nisolated = true\n', "") \
                      .replace('[[routing.rules]]\ntag = "banking"\nchannel = "vault"\n', "")
        assert "vault" not in without
        answers: dict[str, int] = {}
        done = threading.Event()

        def flood() -> None:
            sock = zmq.Context.instance().socket(zmq.DEALER)
            sock.connect(daemon.control)
            tune = msgspec.msgpack.encode({"cmd": "tune", "args": {"channel": "vault", "max_batch": 4, "dry_run": True}})
            in_flight = 0
            try:
                while not done.is_set() or in_flight:
                    while not done.is_set() and in_flight < 20:
                        sock.send(tune)
                        in_flight += 1
                    assert sock.poll(10_000), "a tune was not answered"
                    reply = msgspec.msgpack.decode(sock.recv())
                    in_flight -= 1
                    key = "ok" if reply["ok"] else reply["error"]
                    answers[key] = answers.get(key, 0) + 1
            finally:
                sock.close(0)

        sender = threading.Thread(target=flood)
        sender.start()
        waited = "refused: channels.vault: no such channel: a reload removed it while the command waited"
        try:
            for n in range(2_000):
                if waited in answers or any("KeyError" in k for k in answers):
                    break
                write_atomically(daemon.config, without if n % 2 == 0 else text)
                assert daemon.call("reload", force=True)["applied"]
        finally:
            done.set()
            sender.join(30)
        unexpected = {k: v for k, v in answers.items() if k not in ("ok", "no channel named 'vault'", waited)}
        assert not unexpected, unexpected
        assert waited in answers, f"no tune came in between: nothing was tested ({answers})"
        assert "Traceback" not in daemon.logs()
    finally:
        daemon.stop()


def test_a_window_table_of_thousands_of_values_is_refused_before_the_event_loop_builds_it(tmp_path):
    daemon = start_daemon(tmp_path, SIMULATED, cpu_threads=1)
    try:
        fractions = [i / 3000 for i in range(3000)]   # 3,000 x 3,000 bandit arms: 8 s of the event loop each
        bandit = {"policy": "bandit", "options": {"windows": fractions, "caps": fractions}}
        for cmd, args in (("tune", {"channel": "standard", "window": bandit, "dry_run": True}),
                          ("canary", {"action": "start", "channel": "standard", "window": bandit})):
            ok, error = control(daemon, cmd, timeout_s=60, **args)
            assert not ok and error == ("window is a policy and its options, at most 256 values in all; "
                                        "not a larger table"), error
        small = {"policy": "bandit", "options": {"windows": [0.0, 0.5, 1.0], "caps": [0.5, 1.0]}}
        assert daemon.call("tune", channel="standard", window=small, dry_run=True)["after"]["window"] == small
        assert daemon.call("canary")["running"] == {}
    finally:
        daemon.stop()


def test_a_dry_run_of_a_bad_file_is_one_info_line_not_a_refused_reload_and_booleans_are_no_seconds(tmp_path):
    daemon = start_daemon(tmp_path, SIMULATED, cpu_threads=1)
    try:
        write_atomically(daemon.config, daemon.config.read_text() + "\n[[[not toml")
        ok, error = control(daemon, "reload", dry_run=True)
        assert not ok and "not valid TOML" in error, error
        lines = [line for line in daemon.log_lines() if "not valid TOML" in line]
        assert len(lines) == 1 and " INFO configuration checked by local (dry run): refused: " in lines[0], lines
        for args, error in (({"seconds": True}, "seconds is between 1 and 86400, not True"),
                            ({"share": True}, "share is above 0 and at most 0.5 (the incumbent keeps most of the "
                                              "traffic), not True")):
            ok, answer = control(daemon, "canary", action="start", channel="standard", max_batch=4, **args)
            assert not ok and answer == error, answer
        assert daemon.call("canary")["running"] == {}
    finally:
        daemon.stop()
