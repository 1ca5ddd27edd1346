"""``python -m regatta ARGS``: the ``regatta`` command line, run from the binary this wheel
carries (``regatta/bin/regatta``), or else ``REGATTA_BIN`` or ``regatta`` on PATH."""

import os
import sys

from . import _binary


def main():
    binary = _binary()
    if binary is None:
        sys.exit("this regatta package carries no regatta binary (it was installed from source): set "
                 "REGATTA_BIN, put `regatta` on PATH, or install a wheel built by scripts/build-wheel.sh")
    os.execv(binary, [binary] + sys.argv[1:])


if __name__ == "__main__":
    main()
