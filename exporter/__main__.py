"""The ``kvhit`` command (and ``python -m exporter``): exporter.cli's ``main``, imported inside it
so that a Ctrl-C while numpy and scipy load (the first ~0.7 s), or while the arguments are read,
ends as quietly as one later."""
import sys


def main() -> int:
    """Run the ``kvhit`` command line (exporter/cli.py ``main``); its exit code, 130 when
    interrupted while kvhit loads or reads its arguments (cli.main handles one in a command)."""
    try:
        from exporter.cli import main as cli_main
        return cli_main()
    except KeyboardInterrupt:
        print("kvhit: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
