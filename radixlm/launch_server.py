"""``python -m radixlm.launch_server [options]``: the same as ``radixlm serve``."""

import sys

from radixlm.cli import main

if __name__ == "__main__":
    sys.exit(main(["serve", *sys.argv[1:]]))
