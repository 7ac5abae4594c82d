"""Plugin objects the plugin-manager tests point entry points at."""

from tandem import hookimpl


class ModelPlugin:
    def __init__(self, arch: str, target: str, override: bool = False) -> None:
        self.arch, self.target, self.override = arch, target, override

    @hookimpl
    def tandem_register_models(self, registry) -> None:
        registry.register_model(self.arch, self.target, override=self.override)


class BackendPlugin:
    def __init__(self, name: str, target: str) -> None:
        self.name, self.target = name, target

    @hookimpl
    def tandem_register_attention_backends(self, registry) -> None:
        registry.register_backend(self.name, self.target)


class Raising:
    @hookimpl
    def tandem_register_models(self, registry) -> None:
        raise KeyError("config key 'hidden' missing")


fancy = ModelPlugin("FancyModel", "tandem.model_zoo.bart:BartForConditionalGeneration")
fancy_again = ModelPlugin("FancyModel", "some_pkg.models:OtherFancy")
fancy_override = ModelPlugin("FancyModel", "some_pkg.models:OtherFancy", override=True)
backend = BackendPlugin("my_backend", "tandem.backends.torch_sdpa:TorchSDPABackend")
raising = Raising()


class Misspelled:
    @hookimpl
    def tandem_register_model(self, registry) -> None:  # missing the final "s"
        registry.register_model("Never", "x.y:Z")


misspelled = Misspelled()
missing_target = ModelPlugin("GhostModel", "no_such_package.models:Ghost")
