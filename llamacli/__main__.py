try:
    from .cli import main
except KeyboardInterrupt:  # Ctrl-C while the CLI is still importing: the same one line and exit code as later
    import sys

    sys.stderr.write("error: interrupted\n")
    sys.exit(130)

main()
