"""``python -m hedgepub``: the same command line as the ``hedgepub`` script."""

from hedgepub.cli import main

if __name__ == "__main__":
    main(prog_name="hedgepub")
