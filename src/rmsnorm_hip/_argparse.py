"""The command line's argument parser: a bad argument is one line on stderr and exit status 2."""
import argparse


class Parser(argparse.ArgumentParser):
    """argparse, reporting a bad argument as one ``PROG: error: ...`` line (no usage block);
    subcommands' parsers are of this class too."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n")
