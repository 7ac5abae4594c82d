"""Per-request modes behind one narrow interface (``base.RequestStrategy`` /
``base.StepMode``), chosen by name from the mode registry (``modes.Mode``). One home
per mode: ``sampling.py``, ``prompt_slot.py``, and a package for each mode with more
than one file (``beam/``, ``speculative/``, ``structured/``), whose plain data
(``SpeculativeConfig``, ``StructuredOutputsParams``) sits on core's data floor."""
