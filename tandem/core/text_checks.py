"""Text a caller gives (a prompt, a stop string) checked before a tokenizer or a matcher sees it.

A Python ``str`` can hold surrogate code points (U+D800..U+DFFF) that no UTF-8 text has: JSON's
``"\\ud800"`` escape without its pair decodes to one. A tokenizer refuses them with its own
library's message (``TextEncodeInput must be Union[...]``), which names neither the field nor
where the bad character is; a stop string holding one can never match decoded text.
"""

from __future__ import annotations

import re

_SURROGATE = re.compile("[\ud800-\udfff]")


def check_unicode(text: str, where: str) -> None:
    """A ``ValueError`` naming ``where`` and the position of the first surrogate code point in
    ``text``, if it holds one. One C-speed scan, no copy of ``text``."""
    found = _SURROGATE.search(text)
    if found is not None:
        raise ValueError(
            f"{where}: a lone surrogate U+{ord(found.group()):04X} at character {found.start()} (of "
            f"{len(text)}): text must be valid Unicode (a JSON \\u{ord(found.group()):04x} escape needs its "
            "surrogate pair)"
        )
