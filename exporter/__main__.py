"""The ``kvhit`` command (and ``python -m exporter``): exporter.cli's ``main``, imported inside it
so that a Ctrl-C while numpy and scipy load (the first ~0.7 s) ends as quietly as one later."""
import sys


def main() -> int:
    """Run the ``kvhit`` command line (exporter/cli.py ``main``); its exit code, 130 when
    interrupted while kvhit loads."""
    try:
        from exporter.cli import main as cli_main
    except KeyboardInterrupt:
        print("kvhit: interrupted", file=sys.stderr)
        return 130
    return cli_main()


if __name__ == "__main__":
    sys.exit(main())
