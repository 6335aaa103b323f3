"""``six.moves``: Python 3's ``urllib`` under six's name."""

import urllib
import urllib.request

__all__ = ["urllib"]
