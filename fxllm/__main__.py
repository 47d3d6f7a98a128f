import sys

from fxllm.cli import main

sys.exit(main())
