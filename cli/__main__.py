import sys

from sfguard.cli.main import main

sys.exit(main())
