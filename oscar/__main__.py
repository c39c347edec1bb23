"""`python -m oscar <verb> ...`"""

import sys

from oscar.cli import main

if __name__ == "__main__":
    sys.exit(main())
