import sys

from gdnviz.cli import main

sys.exit(main())
