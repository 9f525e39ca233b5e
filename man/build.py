#!/usr/bin/env python3
"""Build the man pages: man/NAME.SECTION.rst -> man/NAME.SECTION (roff).

The reStructuredText files are the source; the roff pages are generated and
committed, so installing or reading the pages never needs docutils. Only this
script does (``pip install docutils``)::

    python man/build.py           # rewrite every page whose source changed
    python man/build.py --check   # exit 1 if a committed page is stale

A docutils warning (a broken table, a bad reference) stops the build: a page
that renders with a visible "System Message" is worse than no page.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

MAN_DIR = Path(__file__).resolve().parent

_VERSION_LINE = re.compile(r"^\.\\\" by the Docutils (?P<version>\S+) manpage writer", re.MULTILINE)


def sources() -> list[Path]:
    """Every page source: ``NAME.SECTION.rst`` with a numeric section."""
    return sorted(p for p in MAN_DIR.glob("*.rst") if re.fullmatch(r"\d", p.stem.rsplit(".", 1)[-1]))


def target(source: Path) -> Path:
    """man/dynbatchd.8.rst -> man/dynbatchd.8"""
    return source.with_suffix("")


def render(source: Path) -> str:
    """The roff text of one page. Reproducible: no user config files, no timestamps."""
    from docutils.core import publish_string
    from docutils.writers import manpage

    return publish_string(
        source.read_text(encoding="utf-8"),
        source_path=str(source.name),
        writer=manpage.Writer(),
        settings_overrides={
            "_disable_config": True,      # ~/.docutils must not change the committed output
            "input_encoding": "utf-8",
            "output_encoding": "unicode",
            "halt_level": 2,              # warnings are errors
            "report_level": 2,
            "datestamp": None,
            "generator": None,
        },
    )


def docutils_version_of(roff: str) -> str | None:
    """The docutils version that wrote a generated page, from its header comment."""
    match = _VERSION_LINE.search(roff)
    return match["version"] if match else None


def stale() -> list[Path]:
    """Sources whose committed roff differs from what this docutils renders."""
    return [src for src in sources()
            if not target(src).exists() or target(src).read_text(encoding="utf-8") != render(src)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="report stale pages instead of writing them")
    args = parser.parse_args(argv)
    try:
        import docutils  # noqa: F401
    except ImportError:
        print("man/build.py needs docutils: pip install docutils", file=sys.stderr)
        return 2
    if args.check:
        out_of_date = stale()
        for src in out_of_date:
            print(f"{target(src).relative_to(MAN_DIR.parent)} is stale: run python man/build.py", file=sys.stderr)
        return 1 if out_of_date else 0
    for src in sources():
        text = render(src)
        dest = target(src)
        if not dest.exists() or dest.read_text(encoding="utf-8") != text:
            dest.write_text(text, encoding="utf-8")
            print(f"wrote {dest.relative_to(MAN_DIR.parent)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
