import sys

from conformance.cli import main

sys.exit(main())
