"""A plugin module that ends the process on import, as a careless ``sys.exit()`` would."""

import sys

sys.exit("exiting_plugin: refusing to load")
