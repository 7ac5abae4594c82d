"""tandem's own model zoo, registered through the ``tandem.plugins`` entry point."""

from tandem.plugins.hookspecs import hookimpl
from tandem.model_zoo import _CONDITIONAL_GENERATION_MODELS


@hookimpl
def tandem_register_models(registry) -> None:
    for arch, (module, cls) in _CONDITIONAL_GENERATION_MODELS.items():
        registry.register_model(arch, f"tandem.model_zoo.{module}:{cls}")
