"""tandem inside other frameworks (each subpackage needs its framework's extra)."""
