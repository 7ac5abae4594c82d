import not_a_real_module_anywhere  # noqa: F401
