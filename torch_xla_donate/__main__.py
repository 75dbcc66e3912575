"""``python -m torch_xla_donate advise script.py [args...]``: runs the script inside ``tdx.advise()``
and prints the dead step inputs it found, largest first, with the line that first read each."""

import os
import runpy
import sys

USAGE = "usage: python -m torch_xla_donate advise script.py [args...]"


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) < 2 or argv[0] != "advise":
        print(USAGE, file=sys.stderr)
        return 2
    import torch_xla_donate as tdx

    script, sys.argv = argv[1], argv[1:]
    # As `python script.py` would: the script's directory, not ours, is first on the path.
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    with tdx.advise() as advice:
        try:
            runpy.run_path(script, run_name="__main__")
        finally:
            print(advice, file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
