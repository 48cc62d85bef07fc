import sys

try:  # Ctrl-C while the command line itself imports: the same one line as later on
    from k3bundle.cli.app import main
except KeyboardInterrupt:
    sys.stderr.write("aborted\n")
    sys.exit(130)

main()
