import sys

from llmstack.cli.main import main

sys.exit(main())
