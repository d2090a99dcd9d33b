"""The ``rankattn`` command: ``rankattn demo`` and ``rankattn explain <code or message>``."""

from __future__ import annotations

import argparse
import sys

from rankattn import errors


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="rankattn", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="run candidate-isolation attention on a Phoenix-shaped batch")
    demo.add_argument("--batch", type=int, default=4, help="rows in the batch (default 4)")
    demo.add_argument("--repeats", type=int, default=5, help="timed runs per implementation")
    explain = sub.add_parser("explain", help="print the docs entry of an error code or message")
    explain.add_argument("query", nargs="*", help="an error code such as RA103, or a pasted message")
    explain.add_argument("--markdown", action="store_true",
                         help="print every entry as docs/errors.md instead")
    args = parser.parse_args(argv)

    if args.command == "explain":
        import rankattn  # noqa: F401  (registers every module's error codes)

        if args.markdown:
            print(errors.render_markdown(), end="")
            return 0
        text = errors.explain(" ".join(args.query))
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
