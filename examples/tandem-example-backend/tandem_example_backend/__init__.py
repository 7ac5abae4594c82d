"""An example attention-backend plugin for tandem.

Kept empty on purpose: tandem imports ``tandem_example_backend.plugin`` at
start-up; the backend and its operator load only when the backend is selected.
"""

__version__ = "0.1.0"
