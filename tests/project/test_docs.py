"""The documentation keeps up with the code.

Man pages name every command, option, error code and config key the code has,
and what the protocol page states of frames, ids, limits and outputs is what
the code and the wire do; the committed roff is what its reStructuredText
source builds to; every hook has a docstring, and the runner hook's describes
the Runner class; the shipped config comments every key. The systemd units
are checked in tests/daemon/test_systemd_units.py.

None of this needs docutils: the one check that does (rebuilding the roff) is
skipped without it.
"""

from __future__ import annotations

import importlib.util
import inspect
import json
import re
import textwrap
from pathlib import Path

import msgspec
import numpy as np
import pytest
import typer
import typer.main
import zmq

from dynbatchd import config as cfgmod, hookspecs, protocol, protocol as P
from dynbatchd.cli import dynbatchctl, dynbatchd as dynbatchd_cli
from dynbatchd.plugins import Plugins

REPO = Path(__file__).resolve().parents[2]
MAN = REPO / "man"
SHIPPED_CONFIG = REPO / "etc" / "dynbatchd.toml"


# ---------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------

def roff_text(page: str) -> str:
    """A roff page's words with the escapes undone, so `check\\-config` reads `check-config`."""
    text = (MAN / page).read_text(encoding="utf-8")
    text = re.sub(r"\\f[BIRP]|\\f\(..|\\f\[[A-Z]*\]", "", text)
    for escape, plain in ((r"\-", "-"), (r"\(aq", "'"), (r"\(dq", '"'), (r"\(ga", "`"), (r"\(ti", "~"),
                          (r"\(ha", "^"), (r"\e", "\\"), (r"\&", ""), (r"\ ", " "), (r"\(em", "--")):
        text = text.replace(escape, plain)
    return text


def rst_text(page: str) -> str:
    return (MAN / f"{page}.rst").read_text(encoding="utf-8")


def mentions(text: str, word: str) -> bool:
    """`word` appears on its own: not inside a longer name (`config` is not found in `--config`)."""
    return re.search(rf"(?<![\w\-.]){re.escape(word)}(?![\w\-])", text) is not None


def commands(app: typer.Typer) -> dict:
    return typer.main.get_command(app).commands


def long_options(command) -> list[str]:
    return [opt for param in command.params for opt in getattr(param, "opts", ()) if opt.startswith("--")]


def load_build_script():
    spec = importlib.util.spec_from_file_location("man_build", MAN / "build.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


PAGES = sorted(p.name for p in MAN.glob("*.[1-8]"))


# ---------------------------------------------------------------------------
# the man pages and their sources
# ---------------------------------------------------------------------------

def test_every_page_has_a_source_and_every_source_a_page():
    assert PAGES, "no man pages in man/"
    assert sorted(p.name for p in MAN.glob("*.[1-8].rst")) == [f"{p}.rst" for p in PAGES]


@pytest.mark.parametrize("page", PAGES)
def test_roff_is_up_to_date_with_its_source(page):
    pytest.importorskip("docutils", reason="docutils not installed: rebuilding the roff needs it")
    import docutils

    build = load_build_script()
    committed = (MAN / page).read_text(encoding="utf-8")
    made_with = build.docutils_version_of(committed)
    if made_with != docutils.__version__:
        pytest.skip(f"{page} was built with docutils {made_with}, this is {docutils.__version__}; "
                    f"the output differs between versions")
    assert build.render(MAN / f"{page}.rst") == committed, f"man/{page} is stale: run python man/build.py"


@pytest.mark.parametrize("page, app", [("dynbatchd.8", dynbatchd_cli.app), ("dynbatchctl.1", dynbatchctl.app)])
def test_every_command_and_option_is_in_its_man_page(page, app):
    roff, rst = roff_text(page), rst_text(page)
    cli = typer.main.get_command(app)
    missing = []
    for name, command in commands(app).items():
        if f"**{name}**" not in rst or f"\\fB{name}\\fP" not in (MAN / page).read_text().replace("\\-", "-"):
            missing.append(f"command {name}")
        missing += [f"{name} {opt}" for opt in long_options(command) if opt != "--help" and not mentions(roff, opt)]
    missing += [f"global {opt}" for opt in long_options(cli) if opt != "--help" and not mentions(roff, opt)]
    assert not missing, f"man/{page} does not document: {', '.join(missing)}"


def test_dynbatchctl_page_names_its_environment_variables():
    roff = roff_text("dynbatchctl.1")
    for var in ("DYNBATCHD_ENDPOINT", "DYNBATCHD_CONTROL", "DYNBATCHD_CONFIG"):
        assert mentions(roff, var), var
    envvars = {p.envvar for p in typer.main.get_command(dynbatchctl.app).params if getattr(p, "envvar", None)}
    assert envvars <= {"DYNBATCHD_ENDPOINT", "DYNBATCHD_CONTROL", "DYNBATCHD_CONFIG"}, envvars


def test_every_error_code_is_in_the_protocol_page():
    roff, rst = roff_text("dynbatchd-protocol.7"), rst_text("dynbatchd-protocol.7")
    for code in protocol.ERROR_CODES:
        assert f"**{code}**" in rst and mentions(roff, code), f"error code {code} is not documented"


def test_every_wire_field_is_in_the_protocol_page():
    roff = roff_text("dynbatchd-protocol.7")
    for struct in (protocol.Request, protocol.Reply, protocol.TensorRef, protocol.Timing, protocol.ErrorInfo):
        for field in msgspec.structs.fields(struct):
            assert mentions(roff, field.encode_name), f"{struct.__name__}.{field.encode_name} is not documented"
    for dtype in protocol.DTYPES:
        assert mentions(roff, dtype), dtype
    assert f"protocol version {protocol.PROTOCOL_VERSION}" in " ".join(roff.split()).lower()


def test_every_control_command_is_in_the_protocol_page():
    from dynbatchd.control.commands import COMMANDS

    rst = rst_text("dynbatchd-protocol.7")
    missing = [name for name in COMMANDS if f"**{name}**" not in rst]
    assert not missing, f"control commands not in dynbatchd-protocol.7: {missing}"


# ---------------------------------------------------------------------------
# the protocol page's facts, checked against what the code does
# ---------------------------------------------------------------------------

def code_blocks(rst: str) -> list[tuple[str, str]]:
    """(the paragraph before it, the block's text) for every ``.. code-block::`` of a page."""
    blocks = []
    for match in re.finditer(r"(?s)((?:[^\n]+\n)+)\n\.\. code-block:: \w+\n\n((?:(?:   [^\n]*)?\n)+)", rst):
        blocks.append((" ".join(match[1].split()), textwrap.dedent(match[2]).strip()))
    return blocks


def hex_bytes(dump: str) -> bytes:
    """The bytes of a hex dump: the two-digit tokens of each line, up to its comment or `...`."""
    out = bytearray()
    for line in dump.splitlines():
        for token in line.split():
            if not re.fullmatch(r"[0-9a-f]{2}", token):
                break
            out.append(int(token, 16))
    return bytes(out)


def protocol_section(title: str) -> str:
    """One top-level section of dynbatchd-protocol.7.rst, without its heading."""
    match = re.search(rf"(?ms)^{re.escape(title)}\n=+\n(.*?)(?=^[A-Z][A-Z ]+\n=+\n|\Z)",
                      rst_text("dynbatchd-protocol.7"))
    assert match, f"no section {title}"
    return match[1]


def definition(section: str, term: str) -> str:
    """The text of one ``**term**`` entry of a definition list, joined into one line."""
    match = re.search(rf"(?ms)^\*\*{re.escape(term)}\*\*(?: \([^\n]*)?\n((?:   [^\n]*\n|\n)+?)(?=^\S|\Z)", section)
    assert match, f"no entry {term}"
    return " ".join(match[1].split())


def test_example_request_frame_is_what_msgpack_makes_and_as_long_as_the_page_says():
    blocks = code_blocks(rst_text("dynbatchd-protocol.7"))
    (_, request), (said, dump) = next((blocks[i], blocks[i + 1]) for i in range(len(blocks) - 1)
                                      if "single frame of" in blocks[i + 1][0])
    encoded = msgspec.msgpack.encode(json.loads(request))
    assert hex_bytes(dump) == encoded, "the hex dump is not the example request's encoding"
    stated = int(re.search(r"single frame of (\d+) bytes", said)[1])
    assert stated == len(encoded), f"the page says {stated} bytes, the frame is {len(encoded)}"
    assert P.decode_request(encoded).model == "minilm"


def test_example_error_reply_starts_as_the_daemon_encodes_it():
    rst = rst_text("dynbatchd-protocol.7")
    dump = next(block for said, block in code_blocks(rst) if said.endswith("instead gets one frame:"))
    shown = json.loads(" ".join(re.search(r"(?s)that is ``(\{.*?\})``", rst[rst.index("instead gets one frame:"):])[1].split()))
    reply = P.Reply(shown["id"], shown["ok"], error=P.ErrorInfo(**shown["error"]))
    assert P.encoder.encode(reply).startswith(hex_bytes(dump)) and len(hex_bytes(dump)) > 16


def test_socket_limits_in_the_page_are_the_sockets():
    from dynbatchd.control.server import ControlServer
    from dynbatchd.transport import FrontEnd

    text = " ".join(rst_text("dynbatchd-protocol.7").split())
    ctx = zmq.Context()
    try:
        small = FrontEnd(ctx, "inproc://docs-small", 1000, lambda *a: None)
        big = FrontEnd(ctx, "inproc://docs-big", 3 << 20, lambda *a: None)
        control = ControlServer(ctx, "inproc://docs-control", None)
        sock = big.io.sock
        rcv = int(re.search(r"up to (\d+) messages it has not read yet \(``ZMQ_RCVHWM``\)", text)[1])
        snd = int(re.search(r"up to (\d+) replies the client has not read yet \(``ZMQ_SNDHWM``\)", text)[1])
        assert (rcv, snd) == (sock.getsockopt(zmq.RCVHWM), sock.getsockopt(zmq.SNDHWM))
        assert f"let {snd} unread replies pile up" in text
        assert "four times that limit (and never less than 1 MiB" in text
        assert sock.getsockopt(zmq.MAXMSGSIZE) == 4 * (3 << 20)
        assert small.io.sock.getsockopt(zmq.MAXMSGSIZE) == 1 << 20
        assert "refuses a frame over 1 MiB" in text and control.io.sock.getsockopt(zmq.MAXMSGSIZE) == 1 << 20
        for part in (small, big, control):
            part.io.sock.close(0)
    finally:
        ctx.term()


def test_the_nesting_limit_in_the_page_is_the_decoders():
    text = " ".join(rst_text("dynbatchd-protocol.7").split())
    assert f"more than {P.MAX_NESTING} levels deep (its own array or map is level 1)" in text
    assert f"a **value** is nested deeper than {P.MAX_NESTING} levels" in text

    def header(depth):   # value = [[[...nil...]]], `depth` arrays deep
        return b"\x83\xa2id\x01\xa5model\xa1m\xa5value" + b"\x91" * depth + b"\xc0"
    assert P.decode_request(header(P.MAX_NESTING)).id == 1
    with pytest.raises(P.MalformedMessage):
        P.decode_request(header(P.MAX_NESTING + 1))
    assert P.guess_id(header(P.MAX_NESTING + 1)) == 1    # "the error reply carries it"


def test_a_tensor_sent_to_a_text_model_is_bad_request_in_the_page_and_in_the_worker():
    from dynbatchd.devices.runners import SentenceEmbeddingRunner
    from dynbatchd.devices.worker import execute

    errors = protocol_section("ERROR CODES")
    assert "tensor sent to a text model" in definition(errors, "bad_request")
    assert "tensor sent to a text model, is **bad_request**" in definition(errors, "model_error")
    assert "answers a tensor with **bad_request**" in definition(protocol_section("REQUEST"), "tensor")
    run = execute(SentenceEmbeddingRunner("cpu", {}), [np.zeros(4, np.float32)], [0], "minilm")
    assert list(run.rejected) == [0], "a refused input is what the daemon answers bad_request"


VALID_IDS = [0, 1, -1, -(2 ** 63), 2 ** 64 - 1, "", "abc", "ü-ñ"]
INVALID_IDS = [1.0, 2.5, b"\x01", True, False, None, [1], {"a": 1}]


def test_the_id_types_the_page_allows_are_what_the_decoder_allows():
    entry = definition(protocol_section("REQUEST"), "id")
    assert "from -2^63 to 2^64-1" in entry
    assert "a float (also ``1.0``), binary (MessagePack *bin*), a boolean, nil, an array or a map" in entry
    for rid in VALID_IDS:
        assert P.decode_request(msgspec.msgpack.encode({"id": rid, "model": "m", "text": "t"})).id == rid
    for rid in INVALID_IDS:
        header = msgspec.msgpack.encode({"id": rid, "model": "m", "text": "t"})
        with pytest.raises(P.MalformedMessage):
            P.decode_request(header)
        assert P.guess_id(header) is None, f"id {rid!r}: the reply's id must be nil"


def dealer(endpoint: str) -> zmq.Socket:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    return sock


def replies(sock: zmq.Socket, count: int) -> list[list[bytes]]:
    out = []
    while len(out) < count:
        assert sock.poll(20_000), f"{len(out)} of {count} replies within 20 s"
        out.append(sock.recv_multipart())
    return out


def test_what_the_page_says_of_ids_holds_on_the_wire(sim_daemon):
    sock = dealer(sim_daemon.endpoint)
    try:
        for rid in VALID_IDS:
            sock.send(msgspec.msgpack.encode({"id": rid, "model": "echo", "value": [rid]}))
            (header,), = replies(sock, 1)
            reply = msgspec.msgpack.decode(header)
            assert reply["ok"] and reply["id"] == rid and type(reply["id"]) is type(rid), reply
        for rid in INVALID_IDS:
            sock.send(msgspec.msgpack.encode({"id": rid, "model": "echo", "text": "x"}))
            (header,), = replies(sock, 1)
            reply = msgspec.msgpack.decode(header)
            assert reply["id"] is None and reply["error"]["code"] == "bad_request", (rid, reply)
    finally:
        sock.close()


def test_two_requests_with_one_id_are_both_served_and_both_replies_carry_it(sim_daemon):
    assert "two requests with the same id are served independently" in " ".join(rst_text("dynbatchd-protocol.7").split())
    sock = dealer(sim_daemon.endpoint)
    try:
        for text in ("first", "second"):
            sock.send(msgspec.msgpack.encode({"id": 7, "model": "echo", "text": text}))
        got = [msgspec.msgpack.decode(h) for (h,) in replies(sock, 2)]
        assert [r["id"] for r in got] == [7, 7] and all(r["ok"] for r in got)
        assert sorted(r["value"] for r in got) == ["first", "second"]
        assert not sock.poll(300), "more than one reply per request"
    finally:
        sock.close()


def test_a_dealer_that_sends_a_delimiter_gets_one_back(sim_daemon):
    sock = dealer(sim_daemon.endpoint)
    try:
        request = msgspec.msgpack.encode({"id": 3, "model": "echo", "text": "x"})
        sock.send(request)
        (plain,) = replies(sock, 1)
        assert len(plain) == 1 and msgspec.msgpack.decode(plain[0])["id"] == 3
        sock.send_multipart([b"", request])
        (delimited,) = replies(sock, 1)
        assert delimited[0] == b"" and msgspec.msgpack.decode(delimited[1])["id"] == 3
    finally:
        sock.close()


def test_a_callable_models_list_output_arrives_as_value(sim_daemon):
    assert "``callable`` runner's outputs arrive here, not in **tensor**" in \
        definition(protocol_section("REPLY"), "value")
    sock = dealer(sim_daemon.endpoint)
    try:
        sock.send(msgspec.msgpack.encode({"id": 1, "model": "echo", "value": [1.5, 2.5, [3]]}))
        sock.send_multipart([msgspec.msgpack.encode({"id": 2, "model": "echo",
                                                     "tensor": {"dtype": "float32", "shape": [2]}}),
                             np.array([1, 2], "<f4").tobytes()])
        got = {r["id"]: r for r in (msgspec.msgpack.decode(frames[0]) for frames in replies(sock, 2))}
        assert "tensor" not in got[1] and got[1]["value"] == [1.5, 2.5, [3]]
        assert "tensor" not in got[2] and got[2]["value"] == [1.0, 2.0]   # a numpy array as a list
    finally:
        sock.close()


NOT_IN_FILES = {"source", "plugin_keys"}   # fields of Config that parse sets, never a file's keys


def config_keys(typ=cfgmod.Config, path: str = "") -> list[tuple[str, str]]:
    """(dotted path, key) for every key of the config struct tree, by introspection."""
    found = []

    def walk(info, where):
        if isinstance(info, msgspec.inspect.StructType):
            for field in info.fields:
                if not where and info.cls is cfgmod.Config and field.name in NOT_IN_FILES:
                    continue
                found.append((f"{where}{field.encode_name}", field.encode_name))
                walk(field.type, f"{where}{field.encode_name}.")
        elif isinstance(info, msgspec.inspect.DictType):
            walk(info.value_type, f"{where}NAME.")
        elif isinstance(info, (msgspec.inspect.ListType, msgspec.inspect.TupleType, msgspec.inspect.VarTupleType)):
            walk(info.item_type, where.rstrip(".") + "[].")
        elif isinstance(info, msgspec.inspect.UnionType):
            for member in info.types:
                walk(member, where)
        elif isinstance(info, msgspec.inspect.Metadata):
            walk(info.type, where)

    walk(msgspec.inspect.type_info(typ), path)
    if typ is cfgmod.Config:   # and the tables plugins own: [http], [plugins.NAME] (dynbatchd_config_tables)
        for name, owned in Plugins.load().config_tables().items():
            key = getattr(owned, "table_key", "") or f"plugins.{name}"
            walk(msgspec.inspect.type_info(owned), f"{key}.")
    return found


def test_config_introspection_sees_the_whole_tree():
    paths = {p for p, _ in config_keys()}
    assert {"daemon.listen", "channels.NAME.window.policy", "routing.rules[].tokens_above",
            "compliance.banking_max_window_ms"} <= paths


def test_every_config_key_is_in_the_config_page():
    roff, rst = roff_text("dynbatchd.toml.5"), rst_text("dynbatchd.toml.5")
    headings = set(re.findall(r"^\[([\w.]+)\]$", rst, re.MULTILINE))  # [daemon], [models.NAME] ...
    missing = sorted({path for path, key in config_keys()
                      if not (path in headings or f"{path}.NAME" in headings)
                      and (f"``{key}``" not in rst or not mentions(roff, key))})
    assert not missing, f"config keys not in dynbatchd.toml.5: {missing}"


def test_compliance_rules_are_in_the_config_page():
    text = " ".join(roff_text("dynbatchd.toml.5").split())
    from dynbatchd_plugins.compliance_config import ComplianceRules

    assert f"default {ComplianceRules().banking_max_window_ms:g}" in text
    assert "isolated = true" in text


def test_pages_refer_to_each_other_by_their_real_names():
    names = {p.rsplit(".", 1)[0]: p.rsplit(".", 1)[1] for p in PAGES}
    for page in PAGES:
        for name, section in re.findall(r"\*\*([\w.\-]+)\*\*\\ \((\d)\)", rst_text(page)):
            if name in names:
                assert names[name] == section, f"{page} refers to {name}({section}), the page is {name}({names[name]})"


# ---------------------------------------------------------------------------
# hooks and the shipped config
# ---------------------------------------------------------------------------

def test_every_hookspec_has_a_docstring():
    hooks = {name: fn for name, fn in inspect.getmembers(hookspecs, inspect.isfunction)
             if name.startswith("dynbatchd_")}
    assert hooks, "no hookspecs found"
    for name, fn in hooks.items():
        assert hasattr(fn, f"{hookspecs.PROJECT}_spec"), f"{name} is not marked @hookspec"
        doc = inspect.getdoc(fn) or ""
        assert len(doc.split()) >= 5, f"hookspec {name} has no real docstring"


def documented_contract(doc: str) -> dict[str, list[str] | None]:
    """The members a docstring lists as ````name(args)```` or ````name```` lines: name -> arg names (None: attribute)."""
    found = {}
    for name, parens, args in re.findall(r"^``(\w+)(\(([^)]*)\))?[^`]*``$", doc, re.MULTILINE):
        found[name] = [a.strip() for a in args.split(",") if a.strip()] if parens else None
    return found


def public_contract(cls: type) -> dict[str, list[str] | None]:
    """A base class's public members (and __init__): name -> parameter names without self (None: attribute)."""
    out = {}
    for name, member in vars(cls).items():
        if name.startswith("_") and name != "__init__":
            continue
        if isinstance(member, classmethod):
            out[name] = [p for p in inspect.signature(member.__func__).parameters if p != "cls"]
        elif inspect.isfunction(member):
            out[name] = [p for p in inspect.signature(member).parameters if p != "self"]
        else:
            out[name] = None
    return out


def test_documented_contract_reads_methods_and_attributes():
    doc = "Intro.\n\n``load()``\n    x\n``run(a, b) -> list``\n    y\n``flag``\n    z\n"
    assert documented_contract(doc) == {"load": [], "run": ["a", "b"], "flag": None}


def test_the_runner_hookspec_documents_the_runner_class():
    from dynbatchd.devices.runners import Runner

    from dynbatchd.devices.runners import check_options

    doc = inspect.getdoc(hookspecs.dynbatchd_runners)
    assert documented_contract(doc) == public_contract(Runner), "dynbatchd_runners' docstring and Runner disagree"
    assert "dynbatchd.devices.runners.Runner" in doc
    # The optional class attributes the daemon reads from a runner class, all explained.
    optional = set(re.findall(r"getattr\(runner, \"(\w+)\"", inspect.getsource(check_options)))
    assert optional, "check_options reads no optional attribute: is this test still looking at the right code?"
    missing = sorted(name for name in optional if f"``{name}" not in doc)
    assert not missing, f"dynbatchd_runners' docstring does not explain the runner attributes {missing}"


def uncommented_keys(text: str) -> list[str]:
    """Keys of a TOML file that nothing explains, judged loosely.

    A key counts as commented when its nearest non-blank line above is a
    comment, when a comment anywhere in the file names it (a legend such as
    the one above the channels), or when a comment sits directly on top of its
    table's header or a parent table's header (``[[routing.rules]]`` is
    explained above ``[routing]``).
    """
    lines = text.splitlines()
    comments = " ".join(line for line in lines if line.lstrip().startswith("#"))
    headed: set[str] = set()
    table = ""
    bare = []
    for i, raw in enumerate(lines):
        line = raw.strip()
        header = re.fullmatch(r"\[\[?\s*([^\]]+?)\s*\]\]?", line)
        if header:
            table = header[1]
            if i and lines[i - 1].lstrip().startswith("#"):
                headed.add(table)
            continue
        key = re.match(r"([A-Za-z0-9_\-]+)\s*=", line)
        if not key:
            continue
        above = next((lines[j].strip() for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        parents = {table.rsplit(".", n)[0] for n in range(table.count(".") + 1)} | {table}
        if above.startswith("#") or mentions(comments, key[1]) or parents & headed:
            continue
        bare.append(f"{table}.{key[1]}" if table else key[1])
    return bare


def test_uncommented_key_check_flags_a_bare_key():
    assert uncommented_keys("# what a is\na = 1\nb = 2\n") == ["b"]
    assert uncommented_keys("[t]\n# x\nx = 1\n\n[u]\ny = 2\n") == ["u.y"]
    assert uncommented_keys("# rules of [r]\n[r]\nk = 1\n[[r.rules]]\nz = 2\n") == []


def test_shipped_config_comments_every_key():
    assert uncommented_keys(SHIPPED_CONFIG.read_text()) == []


def test_shipped_config_is_valid():
    cfg = cfgmod.load(SHIPPED_CONFIG)
    assert cfg.channels and cfg.models
