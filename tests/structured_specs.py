"""The structured-output specs the engine and server tests share.

Bounded everywhere (enums, booleans, ranged integers, short strings, short arrays), so
a random model can only finish them: every output must end by the grammar, not length.
"""

SCHEMA = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
        "pet": {"enum": ["cat", "dog", "eel"]},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
        "name": {"type": "string", "maxLength": 2},
    },
    "required": ["ok", "n", "pet", "tags", "name"],
}
REGEX = r"(ab|c)[0-9]{2,4}-(yes|no)"
CHOICES = ["cat", "dog", 'say "hi"', "tr\u00e9s"]
