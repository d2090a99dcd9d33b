"""The ``rankattn`` command: ``rankattn demo`` and ``rankattn explain <code or message>``."""

from __future__ import annotations

import argparse
import re
import sys

from rankattn import errors


def at_least_one(text: str) -> int:
    """argparse's type for a count: a whole number >= 1, else a usage error naming the value."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number >= 1; pass e.g. 4")
    return value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="rankattn", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="run candidate-isolation attention on a Phoenix-shaped batch")
    demo.add_argument("--batch", type=at_least_one, default=4, help="rows in the batch (default 4)")
    demo.add_argument("--repeats", type=at_least_one, default=5,
                      help="timed runs per implementation (default 5)")
    explain = sub.add_parser("explain", help="print the docs entry of an error code or message")
    explain.add_argument("query", nargs="*", help="an error code such as RA103, or a pasted message")
    explain.add_argument("--markdown", action="store_true",
                         help="print every entry as docs/errors.md instead")
    args = parser.parse_args(argv)

    if args.command == "explain":
        import rankattn  # noqa: F401  (registers every module's error codes)

        if args.markdown:
            if args.query:
                explain.error(f"--markdown prints every entry; leave out {' '.join(args.query)!r}")
            print(errors.render_markdown(), end="")
            return 0
        if not args.query:
            explain.error("give an error code such as RA103, a pasted message, or --markdown")
        query = " ".join(args.query)
        unknown = sorted({c for c in re.findall(r"\bRA\d{3}\b", query.upper())} - set(errors.CATALOG))
        if unknown:
            print(f"{', '.join(unknown)}: no such rankattn error code. Codes: "
                  + ", ".join(sorted(errors.CATALOG)), file=sys.stderr)
            return 1
        text = errors.explain(query)
        if text is None:
            print("No rankattn error matches that. Codes: " + ", ".join(sorted(errors.CATALOG)),
                  file=sys.stderr)
            return 1
        print(text, end="")
        return 0

    from rankattn import demo as demo_module

    return demo_module.run(batch=args.batch, repeats=args.repeats)


if __name__ == "__main__":
    sys.exit(main())
